"""Build the ablation's two workloads on CPU (here), small enough to travel with the working tree.

Each workload is packed twice from the same tokenized samples, with the same plan (so the same
rows in the same order): `pad8/` (rows padded to a multiple of 8, packshard's way: arms 3 and
4) and `padseq/` (rows padded to seq_len with token 0: arms 1 and 2). Only as many samples as
give `rows` rows are packed (~6 MB per dataset at 32K, ~24 MB for the four).

Workloads (Qwen2.5 tokenizer from ../shared/data, chat template, loss on assistant turns):

- `math`: GSM8K train chats (user = question, assistant = answer), in file order, 95-567
  tokens each: a packed 32K row holds ~160 of them.
- `long`: long multi-turn agent trajectories. ../shared/data has 22 real SWE-agent
  trajectories (1.9K-15.3K tokens, 175K in all: 5 rows), too few, so `synthesize_trajectories`
  builds more in their image: the real SWE-agent system prompt, a task (a Wikipedia
  paragraph), then rounds of a real SWE-agent assistant message (thought + command) and a
  tool observation cut from the Gutenberg books, Wikipedia articles or real SWE-agent tool
  output, until a target length drawn log-normal (median 20K tokens, sigma 0.35, clipped to
  [4K, 31K]) is reached: a 32K-context agent run whose trajectories mostly exceed half the
  context, so BFD cannot pair them (shorter mixes pack much tighter: at median 10K BFD leaves
  ~3% padding). The 22 real trajectories are mixed in.

Packing: `python -m packshard.pipeline.pack` (the Ray job) when it exists; otherwise the same thing in
process — ChatML rendering with `apply_chat_template`, loss on assistant spans found in the
rendered text, `packers.pack_table` (BFD) and `packers.DatasetWriter` — and the manifest's
`extra.e2e_packer` says which one made it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
TOKENIZER_DIR = SHARED / "tokenizers" / "qwen2.5-instruct"
CHARS_PER_TOKEN = 3.6  # rough, for synthesis targets only; real lengths come from the tokenizer
WORKLOADS = ("long", "math", "long_greedy")


def gsm8k_records(limit: int) -> list[dict[str, Any]]:
    path = SHARED / "gsm8k" / "train.jsonl"
    out = []
    with path.open() as f:
        for line in f:
            r = json.loads(line)
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": r["question"]},
                        {"role": "assistant", "content": r["answer"]},
                    ]
                }
            )
            if len(out) >= limit:
                break
    return out


def _plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SWE-agent messages as plain role/content turns (tool calls written into the text)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            content += f"\n<tool_call>{fn.get('name', '')} {fn.get('arguments', '')}</tool_call>"
        out.append({"role": m["role"], "content": content})
    return out


def _text_sources() -> tuple[list[str], str, list[str], list[str]]:
    lc = SHARED / "long_context"
    swe = [
        json.loads(line)
        for line in (lc / "agent_trajectories" / "swe_agent_trajectories.messages.jsonl").open()
    ]
    system = next(m["content"] for m in swe[0]["messages"] if m["role"] == "system")
    assistant = [
        m["content"]
        for r in swe
        for m in r["messages"]
        if m["role"] == "assistant" and m.get("content")
    ]
    tool_out = [
        m["content"]
        for r in swe
        for m in r["messages"]
        if m["role"] in ("tool", "user") and len(m.get("content") or "") > 400
    ]
    books = [json.loads(line)["text"] for line in (lc / "gutenberg" / "long_docs.jsonl").open()]
    wiki = [line.strip() for line in (lc / "wikipedia" / "wiki_demo.txt").open() if line.strip()]
    corpus = books + wiki + tool_out
    return corpus, system, assistant, wiki


def synthesize_trajectories(
    n: int, tokenizer: Any, *, seed: int = 0, median: float = 20_000, sigma: float = 0.35
) -> list[dict[str, Any]]:
    """`n` synthetic agent trajectories (module docstring), deterministic for a seed. Turns are
    added while the token count (measured with `tokenizer`, +5 per turn for the template)
    stays under the target, so no trajectory exceeds 31K tokens."""
    rng = np.random.default_rng(seed)
    corpus, system, assistant, wiki = _text_sources()

    def ntok(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 5

    assistant_tokens = [ntok(a) for a in assistant]
    targets = np.clip(np.exp(rng.normal(np.log(median), sigma, n)), 4_000, 31_000).astype(int)
    out = []
    for i, target in enumerate(targets):
        task = wiki[int(rng.integers(len(wiki)))]
        t0 = int(rng.integers(max(1, len(task) - 1500)))
        messages = [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": "We need to act on the following report. Investigate and fix it.\n\n"
                + task[t0 : t0 + 1500],
            },
        ]
        used = sum(ntok(m["content"]) for m in messages) + 20
        while True:
            r = int(rng.integers(len(assistant)))
            src = corpus[int(rng.integers(len(corpus)))]
            size = int(min(len(src), rng.integers(1_500, 12_000)))
            start = int(rng.integers(max(1, len(src) - size)))
            obs = src[start : start + size]
            cost = assistant_tokens[r] + ntok(obs)
            if used + cost + max(assistant_tokens) > target:
                break
            messages += [
                {"role": "assistant", "content": assistant[r]},
                {"role": "tool", "content": obs},
            ]
            used += cost
        messages.append(
            {"role": "assistant", "content": assistant[int(rng.integers(len(assistant)))]}
        )
        out.append({"id": f"synthetic-trajectory-{i:04d}", "messages": messages})
    return out


def long_records(n_synthetic: int, tokenizer: Any, seed: int = 0) -> list[dict[str, Any]]:
    path = SHARED / "long_context" / "agent_trajectories" / "swe_agent_trajectories.messages.jsonl"
    real = [
        {"id": r["id"], "messages": _plain_messages(r["messages"])}
        for r in map(json.loads, path.open())
    ]
    mixed = real + synthesize_trajectories(n_synthetic, tokenizer, seed=seed)
    order = np.random.default_rng(seed + 1).permutation(len(mixed))
    return [mixed[i] for i in order]


_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def tokenize_chatml(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask (assistant content and its <|im_end|>) of one ChatML chat."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span(1) for m in _ASSISTANT.finditer(text)]
    starts = np.array([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return list(enc["input_ids"]), mask.tolist()


def pack_in_process(
    records: list[dict[str, Any]],
    out: Path,
    *,
    seq_len: int,
    pad_multiple: int,
    pad_token_id: int | None,
    algorithm: str = "bfd",
) -> dict[str, Any]:
    """Tokenize + pack + write without Ray (the fallback; module docstring). The pad token is
    `pad_token_id`, else the tokenizer's pad token, as the pipeline does."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    from packshard.packers import DatasetWriter, pack_table

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    if pad_token_id is None:
        pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    ids, masks = zip(*(tokenize_chatml(tok, r["messages"]) for r in records), strict=True)
    table = pa.table(
        {
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.bool_())),
        }
    )
    batch, report = pack_table(
        table,
        seq_len=seq_len,
        pad_multiple=pad_multiple,
        pad_token_id=pad_token_id,
        overlong="truncate",
        algorithm=algorithm,  # type: ignore[arg-type]
    )
    config = {
        "seq_len": seq_len, "cp": math.gcd(8, pad_multiple), "pad_multiple": pad_multiple, "pad_token_id": pad_token_id,
        "packing": {"algorithm": algorithm, "window": len(records)}, "overlong": "truncate", "seed": 0,
        "inputs": ["e2e_ablation records"], "tokenizer": {"name": str(TOKENIZER_DIR), "fingerprint": "qwen2.5-instruct"},
    }  # fmt: skip
    writer = DatasetWriter(str(out), config, max_rows=64)
    writer.write(batch)
    n = len(records)
    dropped = (
        {"truncated_samples": report.overlong.truncated_samples}
        if report.overlong.truncated_samples
        else {}
    )
    return writer.close(
        {"samples_in": n, "samples_kept": n, "dropped": dropped},
        extra={"e2e_packer": "in-process fallback"},
    )


def pack_with_pipeline(
    inputs: Path,
    out: Path,
    *,
    seq_len: int,
    pad_multiple: int,
    pad_token_id: int | None,
    algorithm: str = "bfd",
) -> None:
    """`python -m packshard.pipeline.pack` on 2 local CPUs (raises CalledProcessError if the job fails)."""
    cmd = [
        sys.executable, "-m", "packshard.pipeline.pack", "--input", str(inputs), "--output", str(out),
        "--tokenizer", str(TOKENIZER_DIR), "--seq-len", str(seq_len), "--cp", "8", "--pad-multiple", str(pad_multiple),
        "--algorithm", algorithm, "--num-cpus", "2", "--overwrite", "--no-progress",
    ]  # fmt: skip
    if pad_token_id is not None:
        cmd += ["--pad-token-id", str(pad_token_id)]
    log.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=REPO)


def _prefix_for_rows(lengths: np.ndarray, rows: int, seq_len: int, algorithm: str = "bfd") -> int:
    """Smallest prefix of the samples whose packing gives at least `rows` rows (or all)."""
    from packshard.packers import plan_bins

    lengths = np.minimum(lengths, seq_len)
    k = max(1, int(rows * seq_len / max(1.0, float(lengths.mean()))) // 2)
    while k < lengths.size and len(plan_bins(lengths[:k], seq_len, algorithm)) < rows:  # type: ignore[arg-type]
        k += max(1, k // 50)
    return min(k, lengths.size)


def build_records(workload: str, rows: int, seq_len: int) -> list[dict[str, Any]]:
    """The workload's records, as few as give at least `rows` packed rows (module docstring)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    if workload == "math":
        recs = gsm8k_records(10**9)
    elif workload in ("long", "long_greedy"):
        recs = long_records(max(8, 3 * rows * seq_len // (2 * 20_000)), tok)
    else:
        raise ValueError(f"workload {workload!r}: choose one of {WORKLOADS}")
    lengths = np.array([len(tokenize_chatml(tok, r["messages"])[0]) for r in recs])
    k = _prefix_for_rows(lengths, rows, seq_len, "greedy" if workload == "long_greedy" else "bfd")
    if k == len(recs) and workload == "math":
        log.warning("math: all %d GSM8K samples give fewer than %d rows; using them all", k, rows)
    return recs[:k]


def _pack_pair(
    raw: Path,
    recs: list[dict[str, Any]],
    wdir: Path,
    *,
    seq_len: int,
    pad_multiple: int,
    algorithm: str,
    pipeline: bool,
) -> str:
    """Pack `wdir/pad8` and `wdir/padseq` with one packer (the pipeline if it runs, else in
    process for both, so the two hold the same rows); returns the packer's description."""
    pairs = (("pad8", pad_multiple, None), ("padseq", seq_len, 0))
    if pipeline:
        try:
            for sub, pm, pad_id in pairs:
                pack_with_pipeline(
                    raw,
                    wdir / sub,
                    seq_len=seq_len,
                    pad_multiple=pm,
                    pad_token_id=pad_id,
                    algorithm=algorithm,
                )
            return f"packshard.pipeline.pack (--algorithm {algorithm})"
        except subprocess.CalledProcessError as e:
            log.warning(
                "packshard.pipeline.pack failed (%s); packing %s in process instead (both datasets)",
                e,
                wdir.name,
            )
    for sub, pm, pad_id in pairs:
        pack_in_process(
            recs,
            wdir / sub,
            seq_len=seq_len,
            pad_multiple=pm,
            pad_token_id=pad_id,
            algorithm=algorithm,
        )
    return f"in-process packers.pack_table ({algorithm}) after the same ChatML tokenization"


def prepare(
    out_dir: Path,
    *,
    seq_len: int,
    pad_multiple: int,
    rows: int,
    workloads: tuple[str, ...] = WORKLOADS,
    pipeline: bool = True,
) -> dict[str, Any]:
    """Write <out_dir>/<workload>/{pad8,padseq} and <out_dir>/data_info.json; returns the info.
    `pipeline=False` packs in process even where packshard.pipeline.pack exists."""
    if not TOKENIZER_DIR.is_dir():
        raise FileNotFoundError(
            f"{TOKENIZER_DIR} is missing: data preparation needs ../shared/data beside the checkout"
        )
    from packshard.packers import ShardDataset

    use_pipeline = pipeline and (REPO / "packshard" / "pipeline" / "pack.py").is_file()
    info_path = out_dir / "data_info.json"
    info: dict[str, Any] = {
        "seq_len": seq_len,
        "pad_multiple": pad_multiple,
        "rows_target": rows,
        "workloads": {},
    }
    if info_path.is_file():  # preparing some workloads again keeps the others' records
        previous = json.loads(info_path.read_text())
        if (previous.get("seq_len"), previous.get("pad_multiple")) == (seq_len, pad_multiple):
            info["workloads"] = previous.get("workloads", {})
    for name in workloads:
        recs = build_records(name, rows, seq_len)
        algorithm = "greedy" if name == "long_greedy" else "bfd"
        wdir = out_dir / name
        wdir.mkdir(parents=True, exist_ok=True)
        raw = wdir / "records.jsonl"
        raw.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in recs))
        packer = _pack_pair(
            raw,
            recs,
            wdir,
            seq_len=seq_len,
            pad_multiple=pad_multiple,
            algorithm=algorithm,
            pipeline=use_pipeline,
        )
        stats = {}
        for sub in ("pad8", "padseq"):
            ds = ShardDataset.open(str(wdir / sub))
            stats[sub] = ds.manifest["totals"]
            ds.close()
        raw.unlink()  # reproducible from the seed; only the shards travel
        info["workloads"][name] = {"samples": len(recs), "packer": packer, **stats}
        log.info(
            "%s: %d samples -> %d rows, padding to seq_len %.2f%%, to x%d %.3f%%", name, len(recs), stats["pad8"]["rows"],
            100 * stats["padseq"]["padding_fraction"], pad_multiple, 100 * stats["pad8"]["padding_fraction"],
        )  # fmt: skip
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info
