"""Small synthetic shard datasets for tests, examples and benchmarks (packers only).

`write_synthetic_dataset(url, lengths=...)` packs documents of the given lengths (random token
ids, a prompt with loss off then a completion with loss on, like chat SFT) with the
foundation's `pack_table` and writes them with `DatasetWriter`: the same code path and format
as the Ray pipeline, without Ray or a tokenizer. Deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from packshard.packers import DatasetWriter, pack_table


def synthetic_table(
    lengths: Sequence[int] | np.ndarray,
    *,
    vocab_size: int = 1000,
    seed: int = 0,
    prompt_fraction: float = 0.3,
) -> pa.Table:
    """Samples of these lengths: random ids in [1, vocab_size), loss off on the first
    `prompt_fraction` of each sample (at least its first token) and on after."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = rng.integers(1, vocab_size, int(offsets[-1]), dtype=np.int32)
    within = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    prompt = np.maximum(1, (lengths * prompt_fraction).astype(np.int64))
    mask = within >= np.repeat(prompt, lengths)
    off32 = pa.array(offsets.astype(np.int32))
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(off32, pa.array(tokens, type=pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(off32, pa.array(mask, type=pa.bool_())),
        }
    )


def write_synthetic_dataset(
    url: str,
    *,
    lengths: Sequence[int] | np.ndarray,
    seq_len: int,
    pad_multiple: int,
    cp: int | None = None,
    pad_token_id: int = 0,
    vocab_size: int = 1000,
    seed: int = 0,
    max_rows_per_shard: int = 64,
    rows_per_batch: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Pack documents of `lengths` into a committed dataset at `url`; returns the manifest."""
    table = synthetic_table(lengths, vocab_size=vocab_size, seed=seed)
    batch, _report = pack_table(
        table,
        seq_len=seq_len,
        pad_multiple=pad_multiple,
        pad_token_id=pad_token_id,
        overlong="truncate",
    )
    config = {
        "seq_len": seq_len,
        "cp": cp if cp is not None else pad_multiple,
        "pad_multiple": pad_multiple,
        "pad_token_id": pad_token_id,
        "packing": {"algorithm": "bfd", "window": len(lengths)},
        "overlong": "truncate",
        "seed": seed,
        "inputs": ["synthetic"],
        "tokenizer": {"name": "synthetic", "fingerprint": f"vocab{vocab_size}"},
    }
    writer = DatasetWriter(
        url,
        config,
        max_rows=max_rows_per_shard,
        rows_per_batch=rows_per_batch,
        storage_options=storage_options,
    )
    writer.write(batch)
    n = len(lengths)
    return writer.close({"samples_in": n, "samples_kept": n, "dropped": {}})


def main(argv: list[str] | None = None) -> int:
    """``python -m packshard.trainer_shim.synthetic OUT``: a small dataset to try the example
    on. OUT must not hold a dataset already (a synthetic one is no reason to overwrite)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m packshard.trainer_shim.synthetic",
        description="Write a small synthetic packshard dataset.",
    )
    p.add_argument("out", help="dataset URL to write")
    p.add_argument("--num-samples", type=int, default=400)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--pad-multiple", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from packshard.packers.format import MANIFEST_NAME
    from packshard.packers.writer import url_to_fs

    fs, root = url_to_fs(args.out, None)
    if fs.exists(f"{root}/{MANIFEST_NAME}"):
        p.error(f"{args.out} already holds a dataset; choose another OUT or delete it first")
    lengths = np.random.default_rng(args.seed).integers(
        args.min_len, args.max_len + 1, args.num_samples
    )
    try:
        m = write_synthetic_dataset(
            args.out,
            lengths=lengths,
            seq_len=args.seq_len,
            pad_multiple=args.pad_multiple,
            seed=args.seed,
        )
    except ValueError as e:
        p.error(str(e))
    print(
        f"{args.out}: {m['totals']['rows']} rows, {m['totals']['num_tokens']} tokens, {len(m['shards'])} shards"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
