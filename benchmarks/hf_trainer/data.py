"""The head-to-head's data: the shared chat, math, agent and long-context sets as one list of
chats (the form TRL's SFTTrainer reads from jsonl), and packshard's offline pack of the same
chats (the pipeline's encoder, BFD packing and the shard writer, in one process: no Ray).

The mix, from `../shared/data` (or the carried copy `prepare.sh` makes), repeated `repeats`
times (default 2: 22,270 samples, 7.7M Qwen3 tokens):
- GSM8K train + test (8,792): user = question, assistant = answer;
- Alpaca (999), OASST threads (400), Glaive tool calls (300, with their tools), SWE-agent
  trajectories (22, tool calls), OpenMathReasoning (505: problem, <think> solution);
- long documents: the 30 Wikipedia articles and 7 Gutenberg parts, cut at paragraph breaks
  into 117 pieces of at most `LONG_CHARS` characters (~6K tokens), each a chat whose assistant
  turn is the piece ("Continue the text." as the user turn), so no side truncates them.
Tool-call arguments are JSON strings and tools a JSON string, so that 🤗 datasets (TRL's side)
keeps them as they are (it unifies dicts into structs with nulls) and both sides render the same
text. Loss is on every token, as SFTTrainer trains a conversational dataset by default (its
assistant-only loss needs ``{% generation %}`` tags, which the Qwen3 template lacks).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

CHAT_FILES = (
    "chat/alpaca_en_demo.messages.jsonl",
    "chat/oasst_en_100_threads.messages.jsonl",
    "chat/glaive_toolcall_en_demo.messages.jsonl",
    "long_context/agent_trajectories/swe_agent_trajectories.messages.jsonl",
)
LONG_CHARS = 24_000
DATA_FILES = (
    "gsm8k/train.jsonl",
    "gsm8k/test.jsonl",
    *CHAT_FILES,
    "reasoning/openmathreasoning_cot-00000-of-00144_filtered.parquet",
    "long_context/wikipedia/wiki_demo.txt",
    "long_context/gutenberg/long_docs.jsonl",
)


def _lines(path: Path) -> list[str]:
    with open(path) as f:
        return f.readlines()


def _chat(user: str, assistant: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    }


def _normalise(rec: dict[str, Any]) -> dict[str, Any]:
    msgs = []
    for m in rec["messages"]:
        m = {k: m[k] for k in ("role", "content", "tool_calls") if m.get(k) is not None}
        m["content"] = m.get("content") or ""
        if "tool_calls" in m:
            m["tool_calls"] = [
                {"type": "function", "function": {"name": c["function"]["name"], "arguments": (
                    a if isinstance(a := c["function"]["arguments"], str) else json.dumps(a, ensure_ascii=False))}}
                for c in m["tool_calls"]
            ]  # fmt: skip
        msgs.append(m)
    tools = rec.get("tools")
    return {"messages": msgs, "tools": json.dumps(tools, ensure_ascii=False) if tools else None}


def _pieces(text: str) -> list[str]:
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) + 2 > LONG_CHARS:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    return [*out, cur] if cur else out


def build_mix(data: Path, *, repeats: int = 2, limit: int | None = None) -> list[dict[str, Any]]:
    """The chats of the module docstring (`limit`: the first that many, for a tiny run)."""
    import pyarrow.parquet as pq

    base: list[dict[str, Any]] = []
    for name in ("gsm8k/train.jsonl", "gsm8k/test.jsonl"):
        for line in _lines(data / name):
            r = json.loads(line)
            base.append(_chat(r["question"], r["answer"]))
    for name in CHAT_FILES:
        base += [json.loads(line) for line in _lines(data / name)]
    t = pq.read_table(data / DATA_FILES[-3], columns=["problem", "generated_solution"]).to_pylist()
    base += [_chat(r["problem"], r["generated_solution"]) for r in t]
    texts = [line for line in _lines(data / "long_context/wikipedia/wiki_demo.txt") if line.strip()]
    texts += [
        json.loads(line)["text"] for line in _lines(data / "long_context/gutenberg/long_docs.jsonl")
    ]
    base += [_chat("Continue the text.", p) for text in texts for p in _pieces(text)]
    base = [_normalise(r) for r in base]
    if limit is not None:
        rng = np.random.default_rng(0)  # a tiny run keeps a bit of every source
        base = [
            base[i]
            for i in sorted(rng.choice(len(base), size=min(limit, len(base)), replace=False))
        ]
    return base * repeats


def write_jsonl(records: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def pack(
    jsonl: Path, tokenizer: str, out: Path, *, seq_len: int, pad_multiple: int = 1
) -> dict[str, Any]:
    """packshard's offline pack of the jsonl: encode (every token a loss token), BFD-pack at
    `seq_len` (overlong samples truncated, keeping their start, as TRL's BFD does), write the
    shards. Returns the manifest's totals with ``pack_s``, ``encode_s`` and ``write_s``."""
    import pyarrow as pa

    from packshard.packers import DatasetWriter, pack_table
    from packshard.pipeline.samples import BadRecord, Chat
    from packshard.pipeline.tokenization import SampleEncoder, load_tokenizer, pad_token_id_of

    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    enc = SampleEncoder(tok)
    records = [json.loads(line) for line in _lines(jsonl)]
    samples = [
        Chat(r["messages"], json.loads(r["tools"]) if r.get("tools") else None) for r in records
    ]
    encoded = []
    for i in range(0, len(samples), 4096):
        encoded += enc.encode(samples[i : i + 4096])
    bad = [(i, e) for i, e in enumerate(encoded) if isinstance(e, BadRecord)]
    if bad:
        raise ValueError(
            f"{jsonl}: record {bad[0][0]} could not be encoded: {bad[0][1]} ({len(bad)} in all)"
        )
    t1 = time.perf_counter()
    table = pa.table({"input_ids": pa.array([e.ids for e in encoded], type=pa.list_(pa.int32()))})
    pad = pad_token_id_of(tok)
    batch, report = pack_table(table, seq_len=seq_len, pad_multiple=pad_multiple, pad_token_id=pad)
    config = {
        "seq_len": seq_len, "cp": 1, "pad_multiple": pad_multiple, "pad_token_id": pad,
        "packing": {"algorithm": "bfd", "window": len(encoded)}, "overlong": "truncate", "seed": 0,
        "inputs": [str(jsonl.name)], "tokenizer": {"name": "qwen3", "fingerprint": "shared-qwen3"},
    }  # fmt: skip
    writer = DatasetWriter(str(out), config)
    writer.write(batch)
    manifest = writer.close(
        {"samples_in": len(records), "samples_kept": len(encoded), "dropped": {}}
    )
    t2 = time.perf_counter()
    return {**manifest["totals"], "encode_s": t1 - t0, "write_s": t2 - t1, "pack_s": t2 - t0,
            "truncated": int((report.overlong.length < np.asarray([e.ids.size for e in encoded])[report.overlong.sample]).sum())}  # fmt: skip
