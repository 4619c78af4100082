"""The whole pack job against the tokenization floor, on the shared data with Qwen2.5.

Ours: `pipeline.pack.main` on a local Ray of W CPUs, already running (as under `ray job
submit`; the cluster's start-up is reported separately): counting, reading, validating,
rendering chat templates and computing loss masks, tokenizing, packing, writing and verifying
the shards, committing index and manifest. W = 1 and 2 (`--num-workers W`).

The floor: Hugging Face `datasets.Dataset.map(batched=True, num_proc=W)` with the same fast
tokenizer over the same samples, doing only what tokenization needs: render each chat with
`apply_chat_template(tokenize=False)`, then one batched `tokenizer(texts)` call per batch
(text documents: `tokenizer(texts)` + EOS). No masks, no packing, nothing written. The samples
are prepared in memory before the clock starts (JSON strings, so Arrow does not rewrite the
tool-call dicts); `keep_in_memory=True`, no cache.

Both sides tokenize exactly the same samples into the same number of tokens (checked);
tokens/s = that count / wall time. Runs alternate ours / floor inside every repeat; the table
gives medians and the ratio ours / floor (target >= 0.9).

Usage: `python benchmarks/bench_pack_job.py [--repeats 3] [--workers 1,2] [--no-append]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import append_result, markdown_table

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
INPUTS = [
    "gsm8k/train.jsonl",
    "chat/oasst_en_100_threads.messages.jsonl",
    "chat/glaive_toolcall_en_demo.messages.jsonl",
    "chat/alpaca_en_demo.messages.jsonl",
    "long_context/gutenberg/long_docs.jsonl",
    "long_context/agent_trajectories/swe_agent_trajectories.messages.jsonl",
]
TOKENIZER = "tokenizers/qwen2.5-instruct"


def samples(shared: Path) -> list[dict[str, Any]]:
    """The benchmark's samples as the floor sees them: a chat (messages, tools) or a text."""
    out = []
    for rel in INPUTS:
        with open(shared / rel) as f:
            for line in f:
                r = json.loads(line)
                if "question" in r:
                    msgs = [
                        {"role": "user", "content": r["question"]},
                        {"role": "assistant", "content": r["answer"]},
                    ]
                    out.append(
                        {"kind": "chat", "messages": json.dumps(msgs), "tools": "null", "text": ""}
                    )
                elif "messages" in r:
                    out.append(
                        {
                            "kind": "chat",
                            "messages": json.dumps(r["messages"]),
                            "tools": json.dumps(r.get("tools")),
                            "text": "",
                        }
                    )
                else:
                    out.append(
                        {"kind": "text", "messages": "null", "tools": "null", "text": r["text"]}
                    )
    return out


def floor_map(batch: dict[str, list], tokenizer: Any) -> dict[str, list]:
    """Render chats, then one batched tokenizer call per kind (what a user's map would do)."""
    chat_idx = [i for i, k in enumerate(batch["kind"]) if k == "chat"]
    text_idx = [i for i, k in enumerate(batch["kind"]) if k == "text"]
    rendered = [
        tokenizer.apply_chat_template(
            json.loads(batch["messages"][i]), tools=json.loads(batch["tools"][i]), tokenize=False
        )
        for i in chat_idx
    ]
    ids: list[list[int]] = [[] for _ in batch["kind"]]
    if chat_idx:
        for i, row in zip(
            chat_idx, tokenizer(rendered, add_special_tokens=False)["input_ids"], strict=True
        ):
            ids[i] = row
    if text_idx:
        texts = [batch["text"][i] for i in text_idx]
        for i, row in zip(text_idx, tokenizer(texts)["input_ids"], strict=True):
            ids[i] = [*row, tokenizer.eos_token_id]
    return {"input_ids": ids}


def run_floor(dataset: Any, tokenizer: Any, workers: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = dataset.map(
        floor_map,
        batched=True,
        batch_size=1000,
        num_proc=workers if workers > 1 else None,
        fn_kwargs={"tokenizer": tokenizer},
        remove_columns=dataset.column_names,
        keep_in_memory=True,
        load_from_cache_file=False,
        desc=None,
    )
    seconds = time.perf_counter() - t0
    tokens = int(sum(len(x) for x in out["input_ids"]))
    return seconds, tokens


def run_ours(shared: Path, out: Path, workers: int) -> tuple[float, int]:
    from packshard.pipeline.pack import main

    args = []
    for rel in INPUTS:
        args += ["--input", str(shared / rel)]
    args += [
        "--output", str(out), "--tokenizer", str(shared / TOKENIZER), "--columns", "prompt=question,completion=answer",
        "--seq-len", "131072", "--cp", "8", "--num-workers", str(workers), "--no-progress",
    ]  # fmt: skip
    shutil.rmtree(
        out, ignore_errors=True
    )  # a fresh job every time (a rerun would find it complete)
    t0 = time.perf_counter()
    rc = main(args)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"pack job failed with exit status {rc}")
    m = json.loads((out / "manifest.json").read_text())
    return seconds, int(m["totals"]["num_tokens"] + m["totals"]["truncated_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--shared", type=Path, default=SHARED)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("PACKSHARD_NO_PROGRESS", "1")
    import datasets
    import ray
    from transformers import AutoTokenizer

    from packshard.pipeline.pack import start_local_ray

    datasets.disable_progress_bars()
    logging.getLogger("packshard.pipeline").setLevel(logging.WARNING)
    from packshard.pipeline.tokenization import load_tokenizer

    dataset = datasets.Dataset.from_list(samples(args.shared))
    tmp = Path(tempfile.mkdtemp(prefix="bench_pack_job_"))
    rows: list[list[object]] = []
    load_before = os.getloadavg()
    try:
        for workers in [int(w) for w in args.workers.split(",")]:
            ours, floor, starts, tokens = [], [], [], set()
            for rep in range(args.repeats):
                # ours: a fresh local Ray (fresh worker processes, as every submitted job gets)
                # and a fresh driver tokenizer; the cluster's start-up is not counted
                load_tokenizer.cache_clear()
                t0 = time.perf_counter()
                start_local_ray(workers)
                starts.append(time.perf_counter() - t0)
                s, n = run_ours(args.shared, tmp / f"w{workers}", workers)
                ray.shutdown()
                ours.append(s)
                tokens.add(n)
                # the floor: a fresh tokenizer (loaded before the clock starts)
                tokenizer = AutoTokenizer.from_pretrained(str(args.shared / TOKENIZER))
                s, n = run_floor(dataset, tokenizer, workers)
                floor.append(s)
                tokens.add(n)
                print(
                    f"workers {workers} repeat {rep}: ours {ours[-1]:.2f} s, floor {floor[-1]:.2f} s",
                    flush=True,
                )
            if len(tokens) != 1:
                raise SystemExit(f"the two sides tokenized different token counts: {tokens}")
            n = tokens.pop()
            o, f = statistics.median(ours), statistics.median(floor)
            rows.append(
                [workers, f"{n:,}", f"{o:.2f}", f"{n / o / 1e3:,.0f}k", f"{f:.2f}", f"{n / f / 1e3:,.0f}k", f"{f / o:.2f}x",
                 f"{statistics.median(starts):.1f}"]
            )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    headers = [
        "workers",
        "tokens",
        "ours s",
        "ours tok/s",
        "floor s",
        "floor tok/s",
        "ours / floor",
        "Ray start s (not counted)",
    ]
    table = markdown_table(headers, rows)
    print(table)
    note = (
        f"{len(dataset):,} samples (GSM8K train, OASST, Glaive tool calls, Alpaca, Gutenberg, SWE-agent "
        f"trajectories), Qwen2.5 tokenizer, seq_len 131072, cp 8; medians of {args.repeats} interleaved runs. "
        f"Load average before / after: {load_before[0]:.1f} / {load_after[0]:.1f} (other work shares the CPUs)."
    )
    print(note)
    if not args.no_append:
        append_result(
            "Pack job: whole job vs the tokenization floor (bench_pack_job.py)",
            f"{note}\n\n{table}\n",
        )


if __name__ == "__main__":
    main()
