"""What the run should show, from index.arrow alone: the shim's step plans and a time model.

    .venv/bin/python benchmarks/multigpu/predict.py --data .bench/multigpu_data/long_greedy --dp 4

For each arm, the rows each DP rank gets at every step come from `trainer_shim.StepPlanner`
(the very plan the ranks follow: same seed, rows_per_step, balance). A rank's step time is
modelled as what its rows run through the model:

    time(row) = positions + attn_weight x sum(L^2)

positions = the row's padded length (padseq: seq_len), sum(L^2) over its documents (padseq: the
padding is one more document, so + pad^2). With attn_weight = the preset's cost model (the H200
fit of the e2e ablation, or the CPU measurement) this is the balance cost model applied to the
positions actually run. A synchronous step takes the slowest DP rank's time, so the prediction
of an arm's speedup over padseq is sum over steps of max-rank time (padseq) / (arm), and
`slowest/mean` is the factor by which that max exceeds the average rank's work. It leaves out
what does not scale with a row (the constant per micro-batch, the all-reduce, the optimizer),
so measured speedups should fall a little below these.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def predict(
    data: Path, *, dp: int, rows_per_rank: int, steps: int, warmup: int, attn_weight: float, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Per-arm modelled sums over the timed steps (module docstring)."""
    from packshard.packers import CostModel, ShardDataset
    from packshard.trainer_shim import Position, StepPlanner

    ds = ShardDataset.open(str(data / "pad8"))
    try:
        n_tok = np.asarray(ds.index_column("num_tokens"), dtype=np.float64)
        attn = np.asarray(ds.index_column("attn_cost"), dtype=np.float64)
        padded = np.asarray(ds.index_column("padded_len"), dtype=np.float64)
        seq_len = int(ds.config["seq_len"])
    finally:
        ds.close()
    costs = CostModel(1.0, attn_weight).row_costs(n_tok, attn)
    time_of = {
        "padseq": seq_len + attn_weight * (attn + (seq_len - n_tok) ** 2),
        "count": padded + attn_weight * attn,
        "cost": padded + attn_weight * attn,
    }
    out: dict[str, Any] = {
        "dp": dp,
        "rows_per_rank": rows_per_rank,
        "attn_weight": attn_weight,
        "arms": {},
    }
    for arm, balance in (("padseq", "count"), ("count", "count"), ("cost", "cost")):
        planner = StepPlanner(costs, dp_size=dp, rows_per_step=rows_per_rank * dp, seed=seed, shuffle=True,
                              epochs=1, balance=balance)  # fmt: skip
        pos, smax, smean, n = Position(0, 0, 0), 0.0, 0.0, 0
        for step in range(min(steps, planner.steps_in_epoch())):
            plan = planner.plan(pos)
            pos = plan.next_position(n_tok.size)
            if step < warmup:
                continue
            loads = np.array([time_of[arm][r[r >= 0]].sum() for r in plan.rows])
            smax, smean, n = smax + loads.max(), smean + loads.mean(), n + 1
        out["arms"][arm] = {
            "steps": n,
            "max_sum": smax,
            "mean_sum": smean,
            "slowest_over_mean": smax / smean,
        }
    base = out["arms"]["padseq"]
    for s in out["arms"].values():
        s["speedup_vs_padseq"] = base["max_sum"] / s["max_sum"]
        s["mean_work_ratio"] = base["mean_sum"] / s["mean_sum"]
    out["cost_over_count"] = out["arms"]["count"]["max_sum"] / out["arms"]["cost"]["max_sum"]
    out["padding_predicts"] = float(seq_len * n_tok.size / padded.sum())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--rows-per-rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--attn-weight", type=float, default=None, help="default: the H200 value of run.py"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from benchmarks.multigpu.run import H200_ATTN_WEIGHT

    res = predict(args.data, dp=args.dp, rows_per_rank=args.rows_per_rank, steps=args.steps, warmup=args.warmup,
                  attn_weight=H200_ATTN_WEIGHT if args.attn_weight is None else args.attn_weight, seed=args.seed)  # fmt: skip
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
