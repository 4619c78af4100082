"""The pack job's pure planning: order, windows, shards, rows with carry-over."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packshard.packers import plan_bins
from packshard.pipeline.planning import (
    block_spans,
    contributions,
    plan_shard_rows,
    plan_shards,
    sample_order,
    window_sizes_for,
)


def _stream(contrib: np.ndarray, cuts: list[int], **kw: int) -> list:
    plans, frontier, number = [], 0, 0
    for cut in [*cuts, len(contrib)]:
        if cut <= frontier:
            continue
        got = plan_shards(
            contrib[frontier:cut],
            first_number=number,
            first_position=frontier,
            complete=cut == len(contrib),
            **kw,
        )
        plans += got
        if got:
            frontier, number = got[-1].stop, got[-1].number + 1
    return plans


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 900), min_size=1, max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=8),
    window=st.integers(1, 3000),
    shard_windows=st.integers(1, 6),
)
def test_plan_shards_streaming_equals_one_shot_and_covers_everything(
    lengths, cuts, window, shard_windows
):
    contrib = np.asarray(lengths, dtype=np.int64)
    kw = {"window_tokens": window, "shard_tokens": window * shard_windows}
    one = plan_shards(contrib, first_number=0, first_position=0, complete=True, **kw)
    assert _stream(contrib, sorted(cuts), **kw) == one  # whatever order the lengths arrive in
    # shards tile [0, n) in order, numbered 0..k-1, windows tile each shard
    assert [p.number for p in one] == list(range(len(one)))
    assert one[0].start == 0 and one[-1].stop == len(contrib)
    for a, b in itertools.pairwise(one):
        assert a.stop == b.start
    cum = np.concatenate(([0], np.cumsum(contrib)))
    for p in one:
        assert p.window_ends[-1] == p.stop and list(p.window_ends) == sorted(set(p.window_ends))
        starts = (p.start, *p.window_ends[:-1])
        full = [cum[e] - cum[s] >= window for s, e in zip(starts, p.window_ends, strict=True)]
        assert all(full[:-1]), "only a shard's last window may be short"
        if p is not one[-1]:
            assert cum[p.stop] - cum[p.start] >= kw["shard_tokens"]
            assert cum[p.stop] > cum[p.start]  # no weightless shard except a lone one
    if cum[-1] > 0:
        assert all(cum[p.stop] > cum[p.start] for p in one)


def test_plan_shards_zero_weight_tail_joins_the_last_shard():
    contrib = np.array([5, 5, 5, 5, 0, 0, 0])
    plans = plan_shards(
        contrib, first_number=0, first_position=10, window_tokens=5, shard_tokens=10, complete=True
    )
    assert [(p.start, p.stop) for p in plans] == [(10, 12), (12, 17)]
    # before the input is complete, the shard that the zero tail may join is not emitted yet
    partial = plan_shards(
        contrib, first_number=0, first_position=10, window_tokens=5, shard_tokens=10, complete=False
    )
    assert [(p.start, p.stop) for p in partial] == [(10, 12)]


def test_plan_shards_refuses_bad_sizes():
    with pytest.raises(ValueError, match="window_tokens"):
        plan_shards(
            np.ones(3),
            first_number=0,
            first_position=0,
            window_tokens=0,
            shard_tokens=1,
            complete=True,
        )


def test_contributions_follow_the_overlong_policy():
    lengths = np.array([0, 10, 30])
    assert contributions(lengths, 20, "truncate").tolist() == [0, 10, 20]
    assert contributions(lengths, 20, "drop").tolist() == [0, 10, 0]
    assert contributions(lengths, 20, "split").tolist() == [0, 10, 30]


def test_sample_order_is_seeded_and_a_permutation():
    assert sample_order(10, shuffle=False, seed=3) is None
    a, b = sample_order(1000, shuffle=True, seed=3), sample_order(1000, shuffle=True, seed=3)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, sample_order(1000, shuffle=True, seed=4))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=200),
    nwin=st.integers(1, 6),
    carry=st.integers(0, 2),
    policy=st.sampled_from(["truncate", "split", "drop"]),
    algorithm=st.sampled_from(["bfd", "ffd", "greedy"]),
)
def test_plan_shard_rows_every_piece_once_and_within_capacity(
    lengths, nwin, carry, policy, algorithm
):
    lengths = np.asarray(lengths)
    edges = np.linspace(0, lengths.size, nwin + 1).round().astype(int)
    sizes = np.diff(edges).tolist()
    plan = plan_shard_rows(
        lengths, sizes, seq_len=64, overlong=policy, algorithm=algorithm, carry_rows=carry
    )
    pieces = plan.pieces
    placed = np.sort(np.concatenate(plan.rows)) if plan.rows else np.zeros(0, int)
    assert placed.tolist() == list(range(pieces.num_pieces))
    assert all(pieces.length[r].sum() <= 64 for r in plan.rows)
    again = plan_shard_rows(
        lengths, sizes, seq_len=64, overlong=policy, algorithm=algorithm, carry_rows=carry
    )
    assert [r.tolist() for r in again.rows] == [r.tolist() for r in plan.rows]


def test_carry_over_reaches_global_bfd_where_plain_windows_lose_a_row_each():
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 400, 20_000)
    sizes = [1000] * 20
    no_carry = plan_shard_rows(
        lengths, sizes, seq_len=4096, overlong="truncate", algorithm="bfd", carry_rows=0
    )
    carry = plan_shard_rows(
        lengths, sizes, seq_len=4096, overlong="truncate", algorithm="bfd", carry_rows=1
    )
    best = len(plan_bins(lengths, 4096))
    assert len(no_carry.rows) >= best + 5  # about half a row lost per window
    assert len(carry.rows) <= best + 1


def test_window_sizes_count_kept_samples_per_window():
    kept = np.array([10, 11, 13, 17, 18])
    assert window_sizes_for((12, 15, 20), 10, kept) == [2, 1, 2]


def _check_spans(spans: list[tuple[int, int, int]], records: list[int]) -> None:
    """Every record of every file once, in input order."""
    covered = [0] * len(records)
    for fi, start, stop in spans:
        assert start == covered[fi] and stop > start
        covered[fi] = stop
    assert covered == records
    assert [s[0] for s in spans] == sorted(s[0] for s in spans)


def test_block_spans_shrink_towards_the_end_and_cover_every_record_once():
    records, sizes = [10_000, 7, 0, 300], [5_000_000, 2_000_000, 0, 150_000]
    for workers in (1, 2, 8):
        spans = block_spans(records, sizes, workers)
        _check_spans(spans, records)
        first = [b - a for f, a, b in spans if f == 0]
        assert first == sorted(first, reverse=True) and first[0] > first[-1]
        assert len(spans) >= 2 * workers
    # a file of few huge records: a block holds at least one record
    assert all(b - a >= 1 for _, a, b in block_spans([3], [30 << 20], 4))
    # the last blocks hold about min_bytes: here 64 KiB of 500-byte records
    assert (
        block_spans([100_000], [50_000_000], 2)[-1][2]
        - block_spans([100_000], [50_000_000], 2)[-1][1]
        <= 132
    )


def test_block_spans_of_a_big_job_are_capped_whole_strides():
    spans = block_spans([10_000_000], [10 << 30], 8)
    _check_spans(spans, [10_000_000])
    big = [b - a for _, a, b in spans[:-1] if b - a >= 1024]
    assert big and all(n % 1024 == 0 for n in big)
    assert max(big) * 1074 <= (8 << 20) + 1024 * 1074  # ~8 MiB at 1074 bytes a record
    assert all(a % 1024 == 0 for _, a, b in spans if b - a >= 1024)
    assert block_spans([0], [0], 1) == []
