"""Context-parallel chunking of one packed row: which positions each CP rank holds.

All CP ranks of a DP group receive the same row; each keeps a chunk of its positions. Two
layouts, chosen by name from `CP_LAYOUTS`:

- ``contiguous``: the row is cut into `cp` equal chunks and rank r holds chunk r. Simple, and
  what ring attention without load balancing expects; under causal attention the last rank does
  ~(2·cp-1)x the attention work of the first (cp=8: 15x).
- ``zigzag``: the row is cut into 2·cp equal chunks and rank r holds chunks r and 2·cp-1-r, in
  that order (the layout of Megatron-LM's and torchtitan's load-balanced CP). Under causal
  attention over a single document every rank does the same work.

Rows must divide exactly: a row of length L needs L % cp == 0 (contiguous) or L % (2·cp) == 0
(zigzag). packshard pads rows to `pad_multiple`, so pack with ``--pad-multiple 2·cp`` for
zigzag; `check_layout` refuses a dataset whose pad_multiple cannot work, with that advice.

Everything here is a pure function of integers; the positions returned are indices into the
whole row ("global" positions), which is also the coordinate system of cu_seqlens and ks/ke.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import numpy as np

CpLayout = Literal["contiguous", "zigzag"]


def _contiguous(length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    chunk = length // cp_size
    return np.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=np.int64)


def _zigzag(length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    chunk = length // (2 * cp_size)
    back = 2 * cp_size - 1 - cp_rank
    return np.concatenate(
        (
            np.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=np.int64),
            np.arange(back * chunk, (back + 1) * chunk, dtype=np.int64),
        )
    )


#: layout name -> (chunks per CP rank, function(length, cp_size, cp_rank) -> global positions)
CP_LAYOUTS: dict[str, tuple[int, Callable[[int, int, int], np.ndarray]]] = {
    "contiguous": (1, _contiguous),
    "zigzag": (2, _zigzag),
}
assert set(CP_LAYOUTS) == set(get_args(CpLayout))


def _check_topology(cp_size: int, cp_rank: int, layout: str) -> None:
    if layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout={layout!r} is not known; choose one of {sorted(CP_LAYOUTS)}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")


def row_divisor(cp_size: int, layout: CpLayout) -> int:
    """What every row length must be a multiple of under this layout (cp or 2·cp; 1 without CP,
    whatever the layout: one rank holds the whole row)."""
    _check_topology(cp_size, 0, layout)
    return 1 if cp_size == 1 else CP_LAYOUTS[layout][0] * cp_size


def check_layout(
    pad_multiple: int,
    cp_size: int,
    layout: CpLayout,
    *,
    where: str = "dataset",
    seq_len: int | None = None,
) -> None:
    """Refuse a dataset whose rows cannot be cut for this CP layout, saying how to re-pack."""
    divisor = row_divisor(cp_size, layout)
    if cp_size > 1 and pad_multiple % divisor:
        raise ValueError(
            f"{where}: rows are padded to a multiple of {pad_multiple}, but cp_size={cp_size} with "
            f"cp_layout={layout!r} needs a multiple of {divisor}; {repack_advice(divisor, seq_len)}"
            + (
                " (or use cp_layout='contiguous')"
                if layout == "zigzag" and pad_multiple % cp_size == 0
                else ""
            )
        )


def repack_advice(divisor: int, seq_len: int | None) -> str:
    """How to re-pack so that every row is a multiple of `divisor` (seq_len must be one too)."""
    advice = f"re-pack with `--pad-multiple {divisor}`"
    if seq_len is not None and seq_len % divisor:
        advice += (
            f" and a --seq-len that is a multiple of it (seq_len {seq_len} is not; e.g. "
            f"--seq-len {seq_len - seq_len % divisor or divisor})"
        )
    return advice


def cp_positions(
    length: int,
    cp_size: int,
    cp_rank: int,
    layout: CpLayout = "contiguous",
    *,
    row: int | None = None,
) -> np.ndarray:
    """Global positions (int64, in the order this rank holds them) of CP rank `cp_rank`'s chunk
    of a row of `length` tokens. Raises ValueError when the row does not divide."""
    _check_topology(cp_size, cp_rank, layout)
    if cp_size == 1:
        return np.arange(length, dtype=np.int64)
    divisor = row_divisor(cp_size, layout)
    if length % divisor:
        what = f"row {row}" if row is not None else "a row"
        raise ValueError(
            f"{what} has {length} tokens, not a multiple of {divisor} (cp_size={cp_size}, cp_layout={layout!r}); "
            f"re-pack the dataset with `--pad-multiple {2 * cp_size}`"
        )
    return CP_LAYOUTS[layout][1](length, cp_size, cp_rank)


def cp_slices(
    length: int,
    cp_size: int,
    cp_rank: int,
    layout: CpLayout = "contiguous",
    *,
    row: int | None = None,
) -> list[slice]:
    """The same chunk as `cp_positions`, as one or two slices of the row (cheap to apply)."""
    _check_topology(cp_size, cp_rank, layout)
    if cp_size == 1:
        return [slice(0, length)]
    chunks = CP_LAYOUTS[layout][0]
    if length % row_divisor(cp_size, layout):
        cp_positions(length, cp_size, cp_rank, layout, row=row)  # raises the error
    size = length // (chunks * cp_size)
    firsts = [cp_rank, 2 * cp_size - 1 - cp_rank][:chunks]
    return [slice(c * size, (c + 1) * size) for c in firsts]


def reassemble(
    chunks: list[np.ndarray], length: int, layout: CpLayout = "contiguous"
) -> np.ndarray:
    """Inverse of the split: the whole row from every CP rank's chunk (rank order). For tests
    and for gathering outputs."""
    cp_size = len(chunks)
    first = np.asarray(chunks[0])
    out = np.empty((length, *first.shape[1:]), dtype=first.dtype)
    for r, c in enumerate(chunks):
        out[cp_positions(length, cp_size, r, layout)] = c
    return out
