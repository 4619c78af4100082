"""Query chunks of an indexer call: which rows share a logits buffer, over which key window.

The fp32 logits are materialised one chunk of queries at a time, each chunk holding rows x
(its key window, padded to 16) floats plus the top-k workspace of its rows, under a memory
bound (`IndexerConfig.max_chunk_bytes`, 8 GiB by default). `plan_chunks` is a pure function of
the ranges (numpy, no torch): a 128K-token row takes 7 chunks of 8K-29K queries causal, 5
packed; 256K, 23 and 10.
"""

from __future__ import annotations

import numpy as np

COL_ALIGN = 16  # chunk key windows start and end on multiples of this (16-float rows)


def plan_chunks(
    ks: np.ndarray,
    ke: np.ndarray,
    s_kp: int,
    extra_per_row: int,
    max_chunk_bytes: int,
    align: int = 64,
) -> list[tuple[int, int, int, int]]:
    """Query chunks (row0, row1, col0, width) whose logits + workspace fit max_chunk_bytes.

    Pure function of the ranges: a chunk's key window is [col0, col0 + width), col0 the smallest
    ks of its non-empty rows rounded down to 16 and width padded to 16. The chunks tile the rows
    in order, each a multiple of `align` rows (whole query blocks) but the last, at least
    `align` even if that exceeds the bound. Sized by their windows, not by all s_kp keys: every
    chunk holds at most R rows, and the largest chunk's logits (rows x width floats) plus R
    rows of workspace (`extra_per_row` bytes each: what the buffers, reused across chunks,
    take) fit the bound. R is the rows that s_kp-wide rows fit (every chunk's window then fits)
    or a power-of-two multiple of it, whichever plans the fewest chunks (the smallest on a tie):
    fewer, larger launches leave fewer idle last waves (the 128K packed row on the H200: 981
    TFLOP/s in 10 chunks of all keys, 1031 in 3 under a 32 GiB bound;
    1003 in the 5 chunks of its windows under the default 8 GiB).
    """
    # Planned in int64 whatever the ranges' dtype (the shim's `ks_host` is int32): the empty-row
    # sentinel below is int64's max, which an int32 array can neither hold nor compare against.
    ks, ke = np.asarray(ks, dtype=np.int64), np.asarray(ke, dtype=np.int64)
    n = len(ks)
    if n == 0:
        return []
    starts = np.arange(0, n, align)
    live = ke > ks  # empty rows do not widen a chunk's key window
    none = np.iinfo(np.int64).max
    if live.all():  # the common case: two reductions, no masked copies
        lo, hi = np.minimum.reduceat(ks, starts), np.maximum.reduceat(ke, starts)
    else:
        lo = np.minimum.reduceat(np.where(live, ks, none), starts)
        hi = np.maximum.reduceat(np.where(live, ke, -1), starts)
    ends = np.minimum(starts + align, n)
    r0 = max(align, (max_chunk_bytes // (4 * s_kp + extra_per_row)) // align * align)
    best = _plan_greedy(lo, hi, starts, ends, r0, extra_per_row, max_chunk_bytes, none, n)
    cap = r0 * 2
    while len(best) > 1 and cap < 2 * n and 2 * cap * extra_per_row <= max_chunk_bytes:
        plan = _plan_greedy(
            lo, hi, starts, ends, cap, extra_per_row, max_chunk_bytes, none, len(best) - 1
        )
        if plan is not None:
            best = plan
        cap *= 2
    return best


def _plan_greedy(
    lo: np.ndarray,
    hi: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    cap: int,
    extra_per_row: int,
    max_chunk_bytes: int,
    none: int,
    limit: int,
) -> list[tuple[int, int, int, int]] | None:
    """`plan_chunks` at a row cap: from each block, as many blocks as keep the chunk within
    `cap` rows and its logits within the bound less `cap` rows of workspace; None past `limit`
    chunks."""
    logits_bytes = max_chunk_bytes - cap * extra_per_row
    chunks: list[tuple[int, int, int, int]] = []
    i, nb = 0, len(starts)
    while i < nb:
        if len(chunks) == limit:
            return None
        j = int(np.searchsorted(ends, starts[i] + cap, side="right"))  # blocks within the cap
        j = max(j, i + 1)
        a = np.minimum.accumulate(lo[i:j])
        b = np.maximum.accumulate(hi[i:j])
        col0 = np.where(a == none, 0, a // COL_ALIGN * COL_ALIGN)
        width = np.where(a == none, COL_ALIGN, -(-(b - col0) // COL_ALIGN) * COL_ALIGN)
        need = 4 * (ends[i:j] - starts[i]) * width  # nondecreasing along the blocks
        m = max(1, int(np.searchsorted(need, logits_bytes, side="right")))
        chunks.append((int(starts[i]), int(ends[i + m - 1]), int(col0[m - 1]), int(width[m - 1])))
        i += m
    return chunks


def _chunk_work(
    ks: np.ndarray, ke: np.ndarray, chunks: list[tuple[int, int, int, int]]
) -> list[int]:
    """In-range (query, key) pairs of each chunk (rows [r0, r1)): what its logits and its
    select cost. The chunks tile the rows in order (`plan_chunks`)."""
    if not chunks:
        return []
    starts = np.array([c[0] for c in chunks])
    return np.add.reduceat(np.maximum(ke - ks, 0), starts, dtype=np.int64).tolist()
