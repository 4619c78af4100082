"""The radix order step's PTX (`kernels.order.radix_order_asm`), executed on CPU.

The asm sorts one staging row (key32, index) per warp with a stable LSD radix sort in shared
memory and stores the first topk indices. Here `tests/kernels/_ptx.py` runs the generated text
for a whole warp over rows built to hit every path: distinct keys, long runs of equal keys
(stability is the contract's tie rule), padding slots, signed keys around zero and the int32
extremes, and passes skipped because one digit holds every entry. The GPU runs the same text
against the torch order in tests/kernels/test_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from packshard.kernels.order import RADIX_MAX_K2, radix_order_asm
from tests.kernels._ptx import LANES, Memory, Warp

INT32_MIN = np.iinfo(np.int32).min


def _stable_order(key: np.ndarray, idx: np.ndarray, topk: int) -> np.ndarray:
    """The torch order step: stable sort by key descending, indices of the first topk."""
    perm = np.argsort(-key.astype(np.int64), kind="stable")
    return idx[perm][:topk]


def _run_asm(key: np.ndarray, idx: np.ndarray, topk: int) -> tuple[np.ndarray, int]:
    """The asm on one row; returns (out[:topk], instructions executed by the warp)."""
    k2 = len(key)
    mem = Memory()
    kp = mem.add(key.astype(np.int32))
    ip = mem.add(idx.astype(np.int32))
    sentinel_fill = np.full(k2 + 32, -7, dtype=np.int32)  # past topk must stay untouched
    op = mem.add(sentinel_fill)
    warp = Warp(radix_order_asm(k2), mem)
    lane = np.zeros(LANES)
    (dummy,) = warp.run([None, lane + kp, lane + ip, lane + op, lane + topk])
    assert not dummy.any()
    out = mem.array(op).view(np.int32)
    assert np.all(out[topk:] == -7), "stored past topk"
    return out[:topk].copy(), warp.executed


def _row(rng: np.random.Generator, k2: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A staging row: winners in index order, then padding (INT32_MIN, sentinel)."""
    n = {"padded": int(rng.integers(1, k2)), "few": k2 // 8}.get(kind, k2)
    if kind in ("distinct", "padded", "few"):
        key = rng.integers(INT32_MIN + 1, 2**31 - 1, size=n, dtype=np.int64)
    elif kind == "ties":  # few distinct keys: long runs of equal keys in every digit
        key = rng.choice(np.array([-(2**31) + 1, -5, -1, 0, 1, 7, 2**24, 2**31 - 1]), size=n)
    elif kind == "equal":  # every pass skipped
        key = np.full(n, 12345)
    elif kind == "high_equal":  # the top three digits equal: three passes skipped
        key = 0x3F000000 + rng.integers(0, 256, size=n)
    elif kind == "mostly_equal":  # one digit value holds most entries in every pass, not all
        key = np.full(n, 0x01020304)
        few = rng.random(n) < 0.1
        byte = rng.integers(0, 4, size=n)
        key[few] ^= (rng.integers(1, 256, size=n) << (8 * byte))[few]
    else:
        raise AssertionError(kind)
    idx = np.sort(rng.choice(1 << 20, size=n, replace=False))
    key = np.concatenate([key, np.full(k2 - n, INT32_MIN)])
    idx = np.concatenate([idx, np.full(k2 - n, 1 << 20)])  # the sentinel S_k
    return key.astype(np.int32), idx.astype(np.int32)


@pytest.mark.parametrize(
    ("k2", "topk", "kind"),
    [
        (32, 32, "ties"),
        (64, 40, "ties"),
        (64, 64, "padded"),
        (128, 100, "distinct"),
        (256, 256, "equal"),
        (256, 200, "high_equal"),
        (512, 300, "padded"),
        (256, 256, "few"),
        (512, 512, "mostly_equal"),
    ],
)
def test_radix_asm_is_the_stable_order(k2: int, topk: int, kind: str) -> None:
    rng = np.random.default_rng(k2 + topk)
    key, idx = _row(rng, k2, kind)
    got, _ = _run_asm(key, idx, topk)
    np.testing.assert_array_equal(got, _stable_order(key, idx, topk))


def test_radix_asm_full_width_row() -> None:
    """The indexer's shape: 2048 slots, ties and padding; the skipped passes run less code."""
    rng = np.random.default_rng(7)
    key, idx = _row(rng, RADIX_MAX_K2, "padded")
    key[: RADIX_MAX_K2 // 4] = key[0]  # a long run of equal keys among distinct ones
    got, steps = _run_asm(key, idx, 2048)
    np.testing.assert_array_equal(got, _stable_order(key, idx, 2048))
    equal = np.full(RADIX_MAX_K2, 99, dtype=np.int32)
    got, skipped_steps = _run_asm(equal, idx, 2000)
    np.testing.assert_array_equal(got, idx[:2000])
    assert skipped_steps < steps / 3


@pytest.mark.parametrize("k2", [16, 48, 4096])
def test_radix_asm_rejects_unsupported_rows(k2: int) -> None:
    with pytest.raises(ValueError, match="radix_order_asm"):
        radix_order_asm(k2)
