"""Bin planning: exactly-once, capacity, determinism, canonical order, fill quality."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packshard.packers import ALGORITHMS, lower_bound_rows, plan_bins

ALGOS = sorted(ALGORITHMS)

lengths_and_capacity = st.integers(1, 300).flatmap(
    lambda cap: st.tuples(st.lists(st.integers(1, cap), min_size=0, max_size=300), st.just(cap))
)


def _check_plan(bins: list[np.ndarray], lengths: list[int], capacity: int) -> None:
    arr = np.asarray(lengths, dtype=np.int64)
    flat = np.concatenate(bins) if bins else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(flat), np.arange(len(lengths))), "every index exactly once"
    for b in bins:
        assert b.size > 0, "no empty rows"
        assert arr[b].sum() <= capacity, "no row over capacity"
        assert np.all(np.diff(b) > 0), "indices ascending inside a row"
    firsts = [int(b[0]) for b in bins]
    assert firsts == sorted(firsts), "rows ordered by their smallest index"


@pytest.mark.parametrize("algorithm", ALGOS)
@settings(max_examples=150, deadline=None)
@given(data=lengths_and_capacity)
def test_plan_invariants(algorithm, data):
    lengths, capacity = data
    bins = plan_bins(lengths, capacity, algorithm)
    _check_plan(bins, lengths, capacity)
    again = plan_bins(list(lengths), capacity, algorithm)
    assert len(again) == len(bins) and all(
        np.array_equal(a, b) for a, b in zip(again, bins, strict=False)
    ), "deterministic"


@settings(max_examples=150, deadline=None)
@given(data=lengths_and_capacity)
def test_bfd_is_best_fit(data):
    """Replay the plan: each sample (decreasing length, ties by index) went to the open row with
    the least room that fits it, or opened a row only when none fitted."""
    lengths, capacity = data
    bins = plan_bins(lengths, capacity, "bfd")
    row_of = {int(i): r for r, b in enumerate(bins) for i in b}
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room: dict[int, int] = {}
    for i in order:
        fitting = [r for r, left in room.items() if left >= lengths[i]]
        r = row_of[i]
        if fitting:
            best = min(room[f] for f in fitting)
            assert r in room and room[r] == best, f"sample {i} did not go to a best-fitting row"
        else:
            assert r not in room, f"sample {i} opened no new row although nothing fitted"
            room[r] = capacity
        room[r] -= lengths[i]


def test_greedy_preserves_order_and_starts_rows_only_when_full():
    lengths = [5, 5, 3, 9, 1, 1, 10]
    bins = plan_bins(lengths, 10, "greedy")
    assert [b.tolist() for b in bins] == [[0, 1], [2], [3, 4], [5], [6]]


def test_known_small_case():
    # capacity 10: BFD puts 6+4, 5+5, 3
    assert [b.tolist() for b in plan_bins([6, 5, 5, 4, 3], 10, "bfd")] == [[0, 3], [1, 2], [4]]


@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])
def test_fill_within_half_percent_of_lower_bound_lognormal(algorithm):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 1.0, 50_000).astype(np.int64), 1, 8192)
    rows = len(plan_bins(lengths, 8192, algorithm))
    assert rows <= lower_bound_rows(lengths, 8192) * 1.005


def test_greedy_is_worse_than_bfd_on_skewed_mix():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(7.0, 1.2, 5_000).astype(np.int64), 1, 8192)
    assert len(plan_bins(lengths, 8192, "greedy")) > 1.02 * len(plan_bins(lengths, 8192, "bfd"))


@pytest.mark.parametrize(
    "lengths, capacity, match",
    [
        ([1, 0, 3], 10, r"lengths\[1\] = 0"),
        ([1, 11], 10, r"lengths\[1\] = 11 .*overlong"),
        ([[1, 2]], 10, "1-D"),
        ([1.5], 10, "integers"),
        ([1], 0, "capacity"),
    ],
)
def test_bad_input_is_named(lengths, capacity, match):
    with pytest.raises(ValueError, match=match):
        plan_bins(lengths, capacity)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="choose one of"):
        plan_bins([1], 10, "nope")  # type: ignore[arg-type]


def test_empty():
    assert plan_bins([], 10) == []
