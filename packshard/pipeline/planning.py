"""The pack job's plan, as pure functions over integer arrays (no I/O, no Ray).

Order. Samples have ids 0..N-1 in input order. The job visits them in a fixed global order:
the ids themselves, or with `--shuffle` a seeded permutation (`sample_order`). A sample's
*position* is its place in that order; shards are contiguous ranges of positions.

Windows. Positions are cut into windows of consecutive samples holding `window_tokens` tokens
(after the overlong policy; bad and dropped samples weigh nothing), and each window is packed
with `packers.plan_bins` (BFD by default). The least-filled row of a window is not written but
carried into the next window of the same shard, so only a shard's last window leaves a
partly-filled row behind. Measured on the shared data mixes (real Qwen2.5 chat-template
lengths of GSM8K + OpenMathReasoning ("math"), OASST + Glaive + Alpaca ("chat"), SWE-agent
trajectories + Gutenberg + Wikipedia ("long"), and all of them, each resampled to 100M tokens;
overlong truncated), rows beyond a global BFD over the whole mix:

    window (rows of seq_len)       16      32      64     128     256
    no carry, worst mix / seq_len  +4.98%  +2.82%  +1.48%  +0.72%  +0.36%   (~half a row per window)
    carry 1,  seq_len 8192         +0.92%  +0.63%  +0.39%  +0.20%  +0.10%   (worst mix: "long")
    carry 1,  seq_len 32768        +0.27%  +0.09%  +0.05%  +0.05%  +0.00%
    carry 1,  seq_len 131072       +0.00%  +0.00%  +0.00%  +0.00%  +0.00%

(math / chat / all stay within +0.05% at every window with carry; windowed BFD even beats the
global one by a row here and there.) The default window is 128 rows (``window_tokens = 128 *
seq_len``): within 0.20% of global BFD on every mix and seq_len above, while a window holds at
most 128 x seq_len tokens (84 MB at seq_len 131072). The table plans one shard; with the job's
shard cuts (default `shard_tokens` 2^25; a shard's last window carries nothing) the worst case
on the same resamples is +0.26% ("all" at seq_len 131072, 3 shards), +0.18% at 8192, +0.09% at
32768. Measured 2026-12-02 on 100M-token resamples; `benchmarks/bench_window.py` reproduces the
table.

Shards. A shard is a run of whole windows holding at least `shard_tokens` tokens (the last shard
may hold fewer). Window and shard boundaries depend only on the order, the token lengths and the
config, never on how many workers ran, so the shards are byte-identical whatever the cluster.
Cutting restarts at every shard start, so a resumed job replans the missing shards from the
lengths of their own samples alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from packshard.packers import Algorithm, OverlongPolicy, OverlongResult, apply_overlong, plan_bins

DEFAULT_WINDOW_ROWS = 128
DEFAULT_CARRY_ROWS = 1
DEFAULT_SHARD_TOKENS = 1 << 25  # ~33.5M tokens: ~140 MB shard files (at most one window more)


def sample_order(num_samples: int, *, shuffle: bool, seed: int) -> np.ndarray | None:
    """The sample id at each position, or None for the identity order."""
    if not shuffle:
        return None
    return np.random.default_rng(seed).permutation(num_samples).astype(np.int64)


def contributions(lengths: np.ndarray, seq_len: int, overlong: OverlongPolicy) -> np.ndarray:
    """Tokens each sample adds to the rows (0 for a bad sample, whose length is 0)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if overlong == "truncate":
        return np.minimum(lengths, seq_len)
    if overlong == "drop":
        return np.where(lengths > seq_len, 0, lengths)
    return lengths.copy()


@dataclass(frozen=True)
class ShardPlan:
    """Shard `number` holds positions [start, stop); windows end at `window_ends` (absolute)."""

    number: int
    start: int
    stop: int
    window_ends: tuple[int, ...]


def plan_shards(
    contrib: np.ndarray,
    *,
    first_number: int,
    first_position: int,
    window_tokens: int,
    shard_tokens: int,
    complete: bool,
) -> list[ShardPlan]:
    """Cut the positions whose contributions are known (`contrib[i]` is position
    `first_position + i`) into windows and shards. Without `complete`, only shards whose end is
    already decided are returned (the caller plans the rest once more lengths are known)."""
    if window_tokens < 1 or shard_tokens < 1:
        raise ValueError(
            f"window_tokens ({window_tokens}) and shard_tokens ({shard_tokens}) must be >= 1"
        )
    cum = np.concatenate(([0], np.cumsum(np.asarray(contrib, dtype=np.int64))))
    n = cum.size - 1
    plans: list[ShardPlan] = []
    shard_start = 0
    number = first_number
    while shard_start < n:
        ends: list[int] = []
        pos = shard_start
        shard_done = False
        while pos < n:
            # first index j > pos with cum[j] - cum[pos] >= window_tokens
            j = int(np.searchsorted(cum, cum[pos] + window_tokens, side="left"))
            if j > n:  # window incomplete with the known positions
                break
            ends.append(j)
            pos = j
            if cum[j] - cum[shard_start] >= shard_tokens:
                shard_done = True
                break
        if not shard_done:
            if not complete:
                break
            if pos < n or not ends:
                ends.append(n)
        elif cum[n] == cum[ends[-1]]:
            # Nothing but weightless samples (bad, dropped) known after this shard: they join
            # it when the input is complete; otherwise wait until a later sample decides.
            if not complete:
                break
            ends[-1] = n
        stop = ends[-1]
        plans.append(
            ShardPlan(
                number,
                first_position + shard_start,
                first_position + stop,
                tuple(first_position + e for e in ends),
            )
        )
        number += 1
        shard_start = stop
    return plans


@dataclass
class PackedPlan:
    """Rows of one shard over its pieces (see `plan_shard_rows`)."""

    pieces: OverlongResult  # .sample indexes the shard's *kept* samples
    rows: list[np.ndarray] = field(default_factory=list)  # piece indices per row, in write order


def plan_shard_rows(
    lengths: np.ndarray,
    window_sizes: list[int],
    *,
    seq_len: int,
    overlong: OverlongPolicy,
    algorithm: Algorithm,
    carry_rows: int = DEFAULT_CARRY_ROWS,
) -> PackedPlan:
    """Rows for one shard's kept samples (`lengths`, in position order; bad samples already
    removed), cut into windows of `window_sizes` kept samples each. Each window is planned with
    `plan_bins`; all but the last carry their `carry_rows` least-filled rows into the next."""
    if sum(window_sizes) != len(lengths):
        raise ValueError(
            f"window sizes sum to {sum(window_sizes)}, there are {len(lengths)} samples"
        )
    pieces = apply_overlong(lengths, seq_len, overlong)
    piece_window = np.searchsorted(np.cumsum(window_sizes), pieces.sample, side="right")
    bounds = np.searchsorted(piece_window, np.arange(len(window_sizes) + 1), side="left")
    plan = PackedPlan(pieces)
    carried = np.zeros(0, dtype=np.int64)
    for w in range(len(window_sizes)):
        members = np.concatenate([carried, np.arange(bounds[w], bounds[w + 1], dtype=np.int64)])
        if members.size == 0:
            continue
        bins = [members[b] for b in plan_bins(pieces.length[members], seq_len, algorithm)]
        if w < len(window_sizes) - 1 and carry_rows > 0 and len(bins) > 1:
            fill = np.array([pieces.length[b].sum() for b in bins])
            keep = np.sort(np.argsort(fill, kind="stable")[carry_rows:])
            carry = np.sort(np.argsort(fill, kind="stable")[:carry_rows])
            carried = np.sort(np.concatenate([bins[j] for j in carry]))
            bins = [bins[j] for j in keep]
        else:
            carried = np.zeros(0, dtype=np.int64)
        plan.rows.extend(bins)
    return plan


def window_sizes_for(
    window_ends: tuple[int, ...], start: int, kept_positions: np.ndarray
) -> list[int]:
    """Kept samples per window, given the absolute window ends of a shard starting at `start`
    and the absolute positions of its kept samples (sorted)."""
    edges = np.searchsorted(kept_positions, np.asarray((start, *window_ends)), side="left")
    return np.diff(edges).tolist()


def block_spans(
    records: list[int],
    sizes: list[int],
    workers: int,
    *,
    max_bytes: int = 8 << 20,
    min_bytes: int = 64 << 10,
    stride: int = 1024,
) -> list[tuple[int, int, int]]:
    """Tokenization blocks as (file, start record, stop record), in input order, for files of
    `records` records and `sizes` bytes.

    Guided sizes: a block holds about 1 / (2 x workers) of the input bytes still after it,
    within [`min_bytes`, `max_bytes`] (a block never crosses a file and holds one record at
    least). The first blocks are large (few tasks), the last ones small, so the workers run
    out of work within one small block of each other: on the benchmark's 10 MB mix at 2
    workers, equal 1.25 MB blocks left one worker idle ~0.7 s at the end (half a block);
    guided blocks end within ~0.05 s. Blocks of `stride` records or more are whole strides
    (a block then starts at a seek checkpoint). Blocks only split the work: they never change
    the output.
    """
    if len(records) != len(sizes):
        raise ValueError(f"{len(records)} record counts for {len(sizes)} file sizes")
    remaining = float(sum(max(0, s) for s in sizes))
    spans: list[tuple[int, int, int]] = []
    for fi, (n, size) in enumerate(zip(records, sizes, strict=True)):
        per_record = max(size, 1) / n if n > 0 else 0.0
        start = 0
        while start < n:
            target = min(max_bytes, max(min_bytes, remaining / (2 * max(1, workers))))
            count = max(1, round(target / per_record))
            if count >= stride:
                count = round(count / stride) * stride
            stop = min(n, start + count)
            spans.append((fi, start, stop))
            remaining -= (stop - start) * per_record
            start = stop
    return spans
