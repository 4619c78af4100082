"""Packed datasets of real chats (GSM8K, OASST, tool calls) for the Hugging Face adapter tests,
tokenized with the shared Qwen3 tokenizer by the pipeline's encoder and written with the
foundation's packer and writer (no Ray), and a tiny random-init Qwen3 over that vocabulary."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packshard.packers import DatasetWriter, pack_table

CHAT_FILES = (
    "gsm8k/train.jsonl",
    "chat/oasst_en_100_threads.messages.jsonl",
    "chat/glaive_toolcall_en_demo.messages.jsonl",
)


def load_chats(shared_data: Path, per_file: int) -> list[dict[str, Any]]:
    """The first `per_file` records of each file as {"messages": [...], "tools": ...}."""
    out = []
    for name in CHAT_FILES:
        with open(shared_data / name) as f:
            for line, _ in zip(f, range(per_file), strict=False):
                rec = json.loads(line)
                if "question" in rec:
                    rec = {"messages": [{"role": "user", "content": rec["question"]},
                                        {"role": "assistant", "content": rec["answer"]}]}  # fmt: skip
                out.append({"messages": rec["messages"], "tools": rec.get("tools")})
    return out


def write_packed_chats(
    shared_data: Path, out: Path, *, per_file: int = 24, seq_len: int = 1024, pad_multiple: int = 8
) -> dict[str, Any]:
    """Tokenize chats (assistant-only loss) and pack them into a committed dataset at `out`."""
    from packshard.pipeline.samples import Chat
    from packshard.pipeline.tokenization import SampleEncoder, load_tokenizer, pad_token_id_of

    tok = load_tokenizer(str(shared_data / "tokenizers" / "qwen3"))
    enc = SampleEncoder(tok)
    chats = load_chats(shared_data, per_file)
    encoded = enc.encode([Chat(c["messages"], c["tools"]) for c in chats])
    kept = [e for e in encoded if hasattr(e, "ids")]
    assert len(kept) == len(chats), [e for e in encoded if not hasattr(e, "ids")][:1]
    table = pa.table(
        {
            "input_ids": pa.array([e.ids for e in kept], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([e.mask for e in kept], type=pa.list_(pa.bool_())),
        }
    )
    pad = pad_token_id_of(tok)
    batch, _ = pack_table(table, seq_len=seq_len, pad_multiple=pad_multiple, pad_token_id=pad)
    config = {
        "seq_len": seq_len, "cp": 1, "pad_multiple": pad_multiple, "pad_token_id": pad,
        "packing": {"algorithm": "bfd", "window": len(kept)}, "overlong": "truncate", "seed": 0,
        "inputs": list(CHAT_FILES), "tokenizer": {"name": "qwen3", "fingerprint": "shared-qwen3"},
    }  # fmt: skip
    writer = DatasetWriter(str(out), config, max_rows=8, rows_per_batch=4)
    writer.write(batch)
    return writer.close({"samples_in": len(chats), "samples_kept": len(kept), "dropped": {}})


def tiny_qwen3(attn: str = "sdpa", seed: int = 0, vocab_size: int = 151936) -> Any:
    """A 2-layer random-init Qwen3 (fp32) with the Qwen3 vocabulary."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
        tie_word_embeddings=True, attn_implementation=attn, initializer_range=0.2,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).float()


def doc_spans(cu_seqlens: np.ndarray, num_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a row (the padding segment excluded)."""
    cu = np.asarray(cu_seqlens)
    return [(int(a), int(b)) for a, b in itertools.pairwise(cu) if a < num_tokens]
