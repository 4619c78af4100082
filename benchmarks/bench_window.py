"""How big must the pack job's packing window be? Rows from windowed BFD vs one global BFD.

The pack job packs consecutive windows of samples (`pipeline.planning.plan_shard_rows`), each
holding `window x seq_len` tokens, and carries a window's least-filled row into the next. This
script measures the rows that costs against a single BFD over the whole mix, on the shared data
mixes: real Qwen2.5 chat-template lengths of

- math: GSM8K train+test (question/answer chats) + OpenMathReasoning (problem/solution chats)
- chat: OASST threads + Glaive tool-call chats (with tools) + Alpaca
- long: SWE-agent trajectories + Gutenberg long documents + Wikipedia articles (text + EOS)
- all:  everything above

each resampled (seeded, with replacement) to `--tokens` tokens in a random order, overlong
samples truncated to seq_len. Reports rows above global BFD in % for each window and carry
setting; the planning module's docstring quotes this table.

Usage: `.venv/bin/python benchmarks/bench_window.py [--tokens 100000000] [--append-results]`
(needs ../shared; `--append-results` records the run as RESULTS.md's `bench_window` section).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import markdown_table, record_result
from packshard.packers import plan_bins
from packshard.pipeline.planning import plan_shard_rows

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
WINDOWS = (16, 32, 64, 128, 256)
SEQ_LENS = (8192, 32768, 131072)


def shared_lengths(shared: Path) -> dict[str, np.ndarray]:
    """Token length of every shared sample, by source (Qwen2.5 tokenizer, chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shared / "tokenizers/qwen2.5-instruct"))
    backend = tok.backend_tokenizer

    def chats(convs: list, tools: list | None = None) -> np.ndarray:
        texts = [
            tok.apply_chat_template(c, tools=t, tokenize=False)
            for c, t in zip(convs, tools or [None] * len(convs), strict=True)
        ]
        return np.array([len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)])

    def texts(docs: list[str]) -> np.ndarray:
        return np.array(
            [len(e.ids) + 1 for e in backend.encode_batch(docs, add_special_tokens=True)]
        )

    def jsonl(rel: str) -> list[dict]:
        with open(shared / rel) as f:
            return [json.loads(line) for line in f]

    qa = lambda q, a: [{"role": "user", "content": q}, {"role": "assistant", "content": a}]  # noqa: E731
    gsm = jsonl("gsm8k/train.jsonl") + jsonl("gsm8k/test.jsonl")
    reasoning = pq.read_table(
        shared / "reasoning/openmathreasoning_cot-00000-of-00144_filtered.parquet"
    ).to_pylist()
    glaive = jsonl("chat/glaive_toolcall_en_demo.messages.jsonl")
    with open(shared / "long_context/wikipedia/wiki_demo.txt") as f:
        wiki = [line.rstrip("\n") for line in f if line.strip()]
    return {
        "gsm8k": chats([qa(r["question"], r["answer"]) for r in gsm]),
        "reasoning": chats([qa(r["problem"], r["generated_solution"]) for r in reasoning]),
        "oasst": chats([r["messages"] for r in jsonl("chat/oasst_en_100_threads.messages.jsonl")]),
        "glaive": chats([r["messages"] for r in glaive], [r.get("tools") for r in glaive]),
        "alpaca": chats([r["messages"] for r in jsonl("chat/alpaca_en_demo.messages.jsonl")]),
        "swe": chats(
            [
                r["messages"]
                for r in jsonl(
                    "long_context/agent_trajectories/swe_agent_trajectories.messages.jsonl"
                )
            ]
        ),
        "gutenberg": texts([r["text"] for r in jsonl("long_context/gutenberg/long_docs.jsonl")]),
        "wiki": texts(wiki),
    }


def mixes(lengths: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    pick = lambda *names: np.concatenate([lengths[n] for n in names])  # noqa: E731
    return {
        "math": pick("gsm8k", "reasoning"),
        "chat": pick("oasst", "glaive", "alpaca"),
        "long": pick("swe", "gutenberg", "wiki"),
        "all": pick(*lengths),
    }


def windowed_rows(lengths: np.ndarray, seq_len: int, window_rows: int, carry: int) -> int:
    """Rows of the pack job's planning over one shard holding everything."""
    cut = np.minimum(lengths, seq_len)
    bounds = (
        np.searchsorted(
            np.cumsum(cut),
            np.arange(1, cut.sum() // (window_rows * seq_len) + 1) * window_rows * seq_len,
            side="left",
        )
        + 1
    )
    edges = np.unique(np.concatenate(([0], np.minimum(bounds, lengths.size), [lengths.size])))
    plan = plan_shard_rows(
        lengths,
        np.diff(edges).tolist(),
        seq_len=seq_len,
        overlong="truncate",
        algorithm="bfd",
        carry_rows=carry,
    )
    return len(plan.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000, help="tokens per resampled mix")
    parser.add_argument("--shared", type=Path, default=SHARED)
    parser.add_argument("--append-results", action="store_true", help="record in RESULTS.md")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows_out: list[list[object]] = []
    worst: dict[tuple[int, int], float] = {}
    for name, base in mixes(shared_lengths(args.shared)).items():
        lengths = rng.choice(base, int(args.tokens / base.mean()))
        for seq_len in SEQ_LENS:
            best = len(plan_bins(np.minimum(lengths, seq_len), seq_len))
            cells: list[object] = [name, f"{lengths.size:,}", f"{seq_len:,}", f"{best:,}"]
            for carry in (0, 1):
                for w in WINDOWS:
                    extra = 100 * (windowed_rows(lengths, seq_len, w, carry) - best) / best
                    worst[(carry, w)] = max(worst.get((carry, w), -1e9), extra)
                    cells.append(f"{extra:+.2f}%")
            rows_out.append(cells)
            print(" | ".join(str(c) for c in cells), flush=True)
    headers = ["mix", "samples", "seq_len", "global BFD rows"]
    headers += [f"w{w} c{c}" for c in (0, 1) for w in WINDOWS]
    table = markdown_table(headers, rows_out)
    summary = "worst over mixes and seq_lens, carry 1: " + ", ".join(
        f"window {w}: {worst[(1, w)]:+.2f}%" for w in WINDOWS
    )
    print(table)
    print(summary)
    if args.append_results:
        body = (
            f"Rows above one global BFD over each mix (wN cC: window of N rows' worth of tokens, carrying C "
            f"least-filled rows to the next window); {args.tokens:,} tokens per mix.\n\n"
            f"{table}\n\n{summary}\n"
        )
        record_result(
            "bench_window", "Pack job: packing window vs global BFD (bench_window.py)", body,
            data={"tokens": args.tokens, "worst_carry1": {str(w): worst[(1, w)] for w in WINDOWS}},
        )  # fmt: skip


if __name__ == "__main__":
    main()
