"""The head-to-head's two arms train on the same tokens: packshard's offline pack of the mix
(`benchmarks/hf_trainer/data.py`, the pipeline's chat renderer) holds, sample for sample, the
token ids TRL's SFTTrainer makes from the same jsonl (loaded by 🤗 datasets, which fills missing
message keys with nulls, then `apply_chat_template(messages, tools=...)`, as its tokenize step
does), for samples of every source: tool calls, tool results, long pieces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
from benchmarks.hf_trainer import data as mix
from packshard.packers import ShardDataset

pytestmark = pytest.mark.shared


def test_packshard_and_trl_tokenize_the_mix_alike(shared_data: Path, tmp_path: Path):
    from datasets import load_dataset
    from transformers import AutoTokenizer

    records = mix.build_mix(shared_data, repeats=1)
    assert len(records) * 2 >= 20_000  # the benchmark repeats the mix twice
    pick = [i for i, r in enumerate(records) if r["tools"]][:4]  # Glaive tools
    pick += [i for i, r in enumerate(records) if any("tool_calls" in m for m in r["messages"])][
        -3:
    ]  # SWE
    pick += [i for i, r in enumerate(records) if "<think>" in r["messages"][-1]["content"]][
        :2
    ]  # OpenMath
    pick += [
        i for i, r in enumerate(records) if r["messages"][0]["content"] == "Continue the text."
    ][::20]
    pick += [0, 8792, 9791, 9800]  # GSM8K, Alpaca, OASST
    sample = [records[i] for i in sorted(set(pick))]
    jsonl = tmp_path / "mix.jsonl"
    mix.write_jsonl(sample, jsonl)
    tok_dir = str(shared_data / "tokenizers" / "qwen3")
    totals = mix.pack(jsonl, tok_dir, tmp_path / "packed", seq_len=32768)
    ds = ShardDataset.open(str(tmp_path / "packed"))
    ours: dict[int, np.ndarray] = {}
    for r in range(ds.num_rows):
        row = ds.read_row(r)
        starts = np.concatenate(([0], np.cumsum(row["doc_lens"])))
        for s, a, b in zip(row["sample_ids"], starts[:-1], starts[1:], strict=True):
            ours[int(s)] = row["input_ids"][a:b]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    trl_side = load_dataset(
        "json", data_files=str(jsonl), split="train", cache_dir=str(tmp_path / "c")
    )
    assert len(trl_side) == len(sample) == len(ours) and totals["truncated"] == 0
    for i, ex in enumerate(trl_side):
        tools = json.loads(ex["tools"]) if ex["tools"] else None
        ids = tok.apply_chat_template(ex["messages"], tools=tools, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        assert ours[i].tolist() == list(ids), i
