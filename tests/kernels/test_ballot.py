"""The ballot compaction's PTX (`kernels.ballot.ballot_asm`), checked on CPU by executing it;
the exact select's early exit against the full 32-round search.

The GPU runs the PTX itself (tests/kernels/test_gpu.py pins it against the prefix sum on the
H200, and the compiled select against the exact torch path). Here a small executor runs the
generated text for a whole warp (32 lanes in lockstep, the only way vote.sync can run) over
the layout the asm assumes, so a wrong builder fails without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from packshard.kernels import TopkConfig
from packshard.kernels.ballot import BALLOT_BLOCKS, ballot_asm, ballot_constraints
from packshard.kernels.select_kernel import _kth_largest_zeroed
from tests.kernels._ptx import Warp

_LANES = 32


def _run_warp(asm: str, inputs: np.ndarray, n_out: int) -> np.ndarray:
    """Execute the asm for 32 lanes; inputs [32, n_in] uint32 -> outputs [32, n_out] uint32."""
    outs = Warp(asm).run([None] * n_out + list(inputs.T))
    assert len(outs) == n_out, "the asm leaves outputs unwritten"
    return np.stack(outs, axis=1)


@pytest.mark.parametrize("block", BALLOT_BLOCKS)
def test_ballot_asm_gives_the_prefix_sum_positions(block: int) -> None:
    per = block // _LANES
    n_cons = ballot_constraints(per).split(",")
    assert n_cons.count("=r") == 2 * per and n_cons.count("r") == 2 * per
    asm = ballot_asm(per)
    rng = np.random.default_rng(block)
    cols = np.arange(block)
    # lane L holds the 4-wide runs at columns r * 128 + 4 L + j, in (r, j) order
    lane_cols = np.array(
        [[r * 128 + 4 * lane + j for r in range(per // 4) for j in range(4)] for lane in range(32)]
    )
    assert sorted(lane_cols.ravel().tolist()) == cols.tolist()
    for density in (0.0, 0.03, 0.5, 1.0):
        sel = (rng.random(block) < density).astype(np.uint32)
        sel[rng.integers(block)] = 1  # at least one, and sometimes the last column
        base = 1000 + int(rng.integers(1000))
        inputs = np.concatenate([sel[lane_cols], np.full((32, per), base, dtype=np.uint32)], axis=1)
        out = _run_warp(asm, inputs, 2 * per)
        want = np.where(sel == 1, base + np.cumsum(sel) - 1, 2**31 - 1).astype(np.uint32)
        assert np.array_equal(out[:, :per], want[lane_cols]), density
        assert np.all(out[:, per:] == base + int(sel.sum()))


def test_ballot_asm_needs_whole_runs() -> None:
    with pytest.raises(ValueError, match="multiple of vec"):
        ballot_asm(6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compact": "ballot", "block": 64}, "ballot compaction takes"),
        ({"compact": "ballot", "block": 512, "rows_per_program": 2}, "one row a one-warp"),
        ({"compact": "prefix"}, "must be one of"),
    ],
)
def test_ballot_config_is_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TopkConfig(**kwargs)


@triton.jit
def _kth_probe_kernel(u_ptr, k_ptr, out_ptr, M: tl.constexpr, EARLY: tl.constexpr):
    r = tl.arange(0, 4)
    u = tl.load(u_ptr + r[:, None] * M + tl.arange(0, M)[None, :]).to(tl.uint32, bitcast=True)
    tl.store(
        out_ptr + r, _kth_largest_zeroed(u, tl.load(k_ptr + r), EARLY).to(tl.int32, bitcast=True)
    )


def _winners(u: np.ndarray, t: int, k: int) -> list[int]:
    """All u > t, then the lowest-index u == t until k: the exact select's rule."""
    gt = [i for i in range(len(u)) if u[i] > t]
    eq = [i for i in range(len(u)) if u[i] == t]
    return sorted(gt + eq[: k - len(gt)])


def test_early_exit_selects_the_same_winners(device: str) -> None:
    # rows: distinct keys, a tie straddling the k-th place, zero-filled slots, k = 0 / k = all
    rng = np.random.default_rng(5)
    m = 64
    u = rng.integers(1, 2**32, size=(4, m), dtype=np.uint64)
    u[1, :10] = u[1, 20]  # 11 equal keys
    u[2, 40:] = 0  # empty slots
    rows_k = [(0, 17), (1, int((u[1] > u[1, 20]).sum()) + 3), (2, 40), (3, 0)]
    k = np.array([kk for _, kk in rows_k], dtype=np.int32)
    got = {}
    for early in (False, True):
        out = torch.empty(4, dtype=torch.int32, device=device)
        _kth_probe_kernel[(1,)](
            torch.from_numpy(u.astype(np.uint32).view(np.int32)).to(device),
            torch.from_numpy(k).to(device), out, M=m, EARLY=early,
        )  # fmt: skip
        got[early] = out.cpu().numpy().view(np.uint32).astype(np.uint64)
    for row, kk in rows_k:
        exact = _winners(u[row], int(got[False][row]), kk)
        assert len(exact) == kk
        assert _winners(u[row], int(got[True][row]), kk) == exact, row
