"""Datasets for the trainer_shim tests, written with the foundation's writer (module-scoped)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from packshard.trainer_shim.synthetic import write_synthetic_dataset


def skewed_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Mostly short chat-like samples with a few long trajectories (a skewed row-cost mix)."""
    rng = np.random.default_rng(seed)
    short = rng.integers(8, 120, n)
    long = rng.integers(200, 500, n)
    return np.where(rng.random(n) < 0.15, long, short)


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~60 rows of seq_len 512 in 4 shards, pad_multiple 4 (cp 2 zigzag or cp 4 contiguous)."""
    out = tmp_path_factory.mktemp("shim") / "small"
    write_synthetic_dataset(
        str(out),
        lengths=skewed_lengths(240),
        seq_len=512,
        pad_multiple=4,
        max_rows_per_shard=16,
        rows_per_batch=4,
    )
    return out
