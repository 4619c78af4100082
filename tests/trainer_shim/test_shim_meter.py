"""TrainedTokenMeter in one process (the multi-process count is in tests/integration) and the
FLOPs model."""

from __future__ import annotations

import numpy as np
import pytest

from packshard.packers import CostModel
from packshard.trainer_shim import FlopsModel, Topology, TrainedTokenMeter


def mb(tokens: int, padded: int, docs: list[int], loss: int, row: int = 0) -> dict:
    return {
        "num_tokens": tokens,
        "padded_len": padded,
        "attn_cost": sum(d * d for d in docs),
        "num_loss_tokens": loss,
        "row": row,
    }


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_step_numbers():
    clock = Clock()
    fm = FlopsModel(num_params=1000, num_layers=2, attn_dim=8)
    meter = TrainedTokenMeter(num_gpus=4, flops_model=fm, peak_flops_per_gpu=1e9, clock=clock)
    meter.update(mb(100, 104, [60, 40], 80))
    meter.update(mb(0, 8, [], 0, row=-1))  # a filler: padding, no tokens
    clock.t += 0.5
    st = meter.step()
    assert (st.step, st.num_tokens, st.num_loss_tokens, st.padded_tokens, st.rows, st.fillers) == (
        0,
        100,
        80,
        112,
        1,
        1,
    )
    assert st.step_time_s == pytest.approx(0.5)
    assert st.tokens_per_s == pytest.approx(200) and st.tokens_per_s_per_gpu == pytest.approx(50)
    assert st.loss_tokens_per_s == pytest.approx(160)
    assert st.padding_fraction == pytest.approx(12 / 112)
    assert st.flops == pytest.approx(6 * 1000 * 100 + 6 * 2 * 8 * (60**2 + 40**2))
    assert st.mfu == pytest.approx(st.flops / (0.5 * 4 * 1e9))
    assert st.imbalance == 1.0
    assert "200 tok/s" in st.format() and "MFU" in st.format()
    clock.t += 1.0
    st2 = meter.step()  # counters were reset
    assert st2.num_tokens == 0 and st2.step == 1
    assert meter.total_tokens == 100 and meter.mean_tokens_per_s == pytest.approx(100 / 1.5)


def test_flops_count_attention_per_document_not_seq_len_squared():
    fm = FlopsModel(num_params=0, num_layers=1, attn_dim=1)
    many_short = fm.row_flops(32768, 100 * 320**2 + 768**2)
    one_long = fm.row_flops(32768, 32768**2)
    assert one_long / many_short > 90


def test_meter_cost_model_and_errors():
    with pytest.raises(ValueError, match="peak_flops_per_gpu needs a flops_model"):
        TrainedTokenMeter(peak_flops_per_gpu=1e15)
    with pytest.raises(ValueError, match="num_layers must be >= 0"):
        FlopsModel(1, -1, 1)


def _two_dp_ranks(meter: TrainedTokenMeter, other: TrainedTokenMeter) -> None:
    """`meter.step()` gathers its own counts and `other`'s (DP rank 1) twice, as from two CP
    ranks of one DP rank: each DP rank counts once."""

    def gather() -> np.ndarray:
        vectors = []
        for m in (meter, other, other):
            v = m._acc.copy()
            v[0] = m.dp_rank
            vectors.append(v)
        return np.stack(vectors)

    meter._gather = gather  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "cost_model, cost",
    [
        (CostModel(token_weight=1.0, attn_weight=0.0), lambda n, attn: n),
        (CostModel(token_weight=0.0, attn_weight=1.0), lambda n, attn: attn),
        (None, lambda n, attn: n + attn / (12 * 4096)),  # the default
    ],
)
def test_imbalance_is_max_over_mean_cost_of_the_dp_ranks(cost_model, cost):
    kw = {} if cost_model is None else {"cost_model": cost_model}
    meter, other = TrainedTokenMeter(dp_rank=0, **kw), TrainedTokenMeter(dp_rank=1, **kw)
    _two_dp_ranks(meter, other)
    meter.update(mb(1000, 1000, [1000], 9))  # cost: tokens 1000, attention 1000^2
    other.update(mb(3000, 3000, [3000], 9))  # tokens 3000, attention 3000^2
    costs = [cost(1000, 1000**2), cost(3000, 3000**2)]  # max / mean: 1.5, 1.8, 1.515
    st = meter.step()
    assert st.imbalance == pytest.approx(max(costs) / np.mean(costs))
    assert st.num_tokens == 4000 and st.rows == 2  # DP rank 1 counted once


def test_topology_helpers():
    t = Topology.from_rank(5, 8, cp_size=2)
    assert (t.dp_rank, t.dp_size, t.cp_rank, t.cp_size, t.rank) == (2, 4, 1, 2, 5)
    assert t.cp_group_ranks()[2] == [4, 5] and t.dp_group_ranks()[1] == [1, 3, 5, 7]
    assert Topology.from_env(cp_size=2, env={"RANK": "3", "WORLD_SIZE": "4"}) == Topology(
        1, 2, 1, 2
    )
    assert Topology.from_env(env={}) == Topology(0, 1)
    with pytest.raises(ValueError, match="world_size 6 is not a multiple of cp_size 4"):
        Topology.from_rank(0, 6, cp_size=4)
    with pytest.raises(ValueError, match="dp_rank must be in"):
        Topology(2, 2)
