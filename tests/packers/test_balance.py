"""Balanced partition: equal counts, deterministic, and better than round-robin on skewed costs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packshard.packers import (
    CostModel,
    imbalance,
    part_loads,
    partition_balanced,
    partition_round_robin,
)


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 8),
    per=st.integers(1, 12),
    costs=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=96, max_size=96),
)
def test_equal_counts_and_never_worse_than_round_robin(k, per, costs):
    c = np.asarray(costs[: k * per])
    part = partition_balanced(c, k)
    assert np.array_equal(np.bincount(part, minlength=k), np.full(k, per))
    assert (
        part_loads(c, part, k).max()
        <= part_loads(c, partition_round_robin(c.size, k), k).max() + 1e-6
    )
    assert np.array_equal(part, partition_balanced(c.copy(), k)), "deterministic"


def test_skewed_mix_beats_round_robin():
    rng = np.random.default_rng(0)
    tokens = rng.choice([2_000, 30_000, 120_000], size=64, p=[0.6, 0.3, 0.1])
    costs = CostModel().row_costs(tokens, tokens.astype(np.int64) ** 2 // 3)
    rr, bal = partition_round_robin(64, 4), partition_balanced(costs, 4)
    assert imbalance(costs, bal, 4) < 1.02
    assert imbalance(costs, bal, 4) < imbalance(costs, rr, 4) - 0.05


def test_lower_bound_reached_when_possible():
    # 4 parts x 2 items: {10, 1} per part is the only perfect split
    costs = [10, 10, 10, 10, 1, 1, 1, 1]
    part = partition_balanced(costs, 4)
    assert part_loads(costs, part, 4).tolist() == [11.0] * 4


def test_swaps_fix_what_lpt_gets_wrong():
    # the best equal-count split is {8, 7, 1} | {6, 5, 4}: max 16
    costs = [8, 7, 6, 5, 4, 1]
    part = partition_balanced(costs, 2)
    assert part_loads(costs, part, 2).max() == pytest.approx(16.0)


@pytest.mark.parametrize(
    "costs, k, match",
    [([1, 2, 3], 2, "equal parts"), ([1.0], 0, "num_parts"), ([np.nan, 1.0], 2, "finite")],
)
def test_bad_input(costs, k, match):
    with pytest.raises(ValueError, match=match):
        partition_balanced(costs, k)


def test_cost_model_validation_and_weights():
    with pytest.raises(ValueError, match="attn_weight"):
        CostModel(attn_weight=-1)
    m = CostModel.for_hidden_size(1024)
    assert m.row_costs(np.array([100]), np.array([12 * 1024 * 5])).tolist() == [105.0]
