"""Summaries of a multi-GPU (or CPU proxy) run: per arm, over the timed steps, and why.

How to read the numbers (all sums run over the timed steps, step >= warmup):

- `s/step`: the median step time (TrainedTokenMeter: from the all-reduce that lines the ranks
  up before the step to the all-gather after the optimizer step: the step as the job sees it).
- `trained tok/s`: true tokens / summed step time (padding never counts).
- `vs padseq`: padseq's summed step time / this arm's. The arms train the same rows at every
  step, so this is the speedup in trained tokens/s.
- `padding predicts`: padseq's positions / this arm's, i.e. 1 / (1 - the share of positions
  removed): what removing the padding would give if time followed positions and nothing else
  changed (the seed observation's "19.7% of tokens removed predicts 1.25x").
- `mean-rank work`: padseq's summed mean-DP-rank compute / this arm's: what removing the
  padding bought in compute, before anyone waits for anyone.
- `slowest / mean rank`: summed max-over-DP-ranks compute / summed mean (a rank's compute is
  the max over its CP ranks). A synchronous step waits for the slowest DP rank, so this is the
  factor by which the step exceeds the average rank's work; padseq rows all have the same
  length, so padseq's is the baseline noise.
- `meter imbalance`: the meter's cost-model max/mean of the DP ranks' row costs (mean over
  steps): the imbalance the planner sees, with no timing noise.
- `waiting`: 1 - mean-rank compute / step time: the share of the step the average rank spends
  not computing (waiting for the slowest, the gradient all-reduce, the optimizer).

So `vs padseq` ~ `mean-rank work` x (padseq's `slowest / mean` / this arm's) x (overhead
ratio), and the seed observation (1.25x predicted, 1.13x measured) is the middle factor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks._results import markdown_table

TITLE_GPU = "Multi-GPU DP x CP: count vs cost balance on the long-trajectory mix (issue 8)"
TITLE_CPU = "Multi-GPU DP x CP balance (issue 8): CPU/gloo PROXY at toy scale, not a GPU number"


def _timed(result: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    w = int(result.get("warmup", 0))
    return [r for r in result["records"] if r["arm"] == arm and r["step"] >= w]


def basis_key(result: dict[str, Any]) -> str:
    """Which per-DP-rank compute the summary uses: CUDA-event time on the GPU; on the CPU the
    rank's thread CPU time (4 ranks share the cores with other work, so wall time mixes in
    the scheduler; CPU time is what a dedicated core would take)."""
    return "dp_cpu_s" if result.get("device") == "cpu" else "dp_compute_s"


def summarize_arm(records: list[dict[str, Any]], basis: str = "dp_compute_s") -> dict[str, Any]:
    if not records:
        return {"steps": 0}
    step_s = np.array([r["step_time_s"] for r in records])
    dp = [np.array(r[basis]) for r in records]
    cmax = float(sum(c.max() for c in dp))
    cmean = float(sum(c.mean() for c in dp))
    wall = [np.array(r["dp_compute_s"]) for r in records]
    tokens = int(sum(r["num_tokens"] for r in records))
    padded = int(sum(r["padded_tokens"] for r in records))
    checks = [c for r in records for v in r.get("topk_checks", []) for c in v["checks"]]
    return {
        "steps": len(records),
        "step_s_median": float(np.median(step_s)),
        "step_s_sum": float(step_s.sum()),
        "tokens": tokens,
        "padded_tokens": padded,
        "padding_fraction": 1 - tokens / padded if padded else 0.0,
        "tokens_per_s": tokens / float(step_s.sum()),
        "compute_max_sum_s": cmax,
        "compute_mean_sum_s": cmean,
        "slowest_over_mean": cmax / cmean if cmean else float("nan"),
        "compute_imbalance_mean": float(np.mean([c.max() / c.mean() for c in dp])),
        "meter_imbalance_mean": float(np.mean([r["meter_imbalance"] for r in records])),
        "waiting_share": 1 - float(sum(c.mean() for c in wall)) / float(step_s.sum()),
        "overhead_s_per_step": (float(step_s.sum()) - cmax) / len(records),
        "expert_slots_per_pair": float(sum(r["expert_slots"] for r in records))
        / max(1, sum(r["expert_pairs"] for r in records)),
    } | ({"topk_calls": len(checks)} if checks else {})


def _all_checks(result: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    return [
        c
        for r in result["records"]
        if r["arm"] == arm
        for v in r.get("topk_checks", [])
        for c in v["checks"]
    ]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per-arm summaries plus the comparisons against padseq and count (module docstring)."""
    basis = basis_key(result)
    arms = {a: summarize_arm(_timed(result, a), basis) for a in result["arms"]}
    for a, s in arms.items():
        checks = _all_checks(result, a)
        s["topk_checked_calls"] = len(checks)
        s["topk_identical"] = (
            all(c["same_keys"] and c["split_equals_whole"] and c["ranks_agree"] for c in checks)
            if checks
            else None
        )
        s["topk_diff_rows"] = int(sum(c["diff_rows"] for c in checks))
    base = arms.get("padseq")
    for s in arms.values():
        if not s.get("steps") or not base or not base.get("steps"):
            continue
        if s["steps"] != base["steps"]:
            continue
        s["speedup_vs_padseq"] = base["step_s_sum"] / s["step_s_sum"]
        s["slowest_rank_speedup_vs_padseq"] = base["compute_max_sum_s"] / s["compute_max_sum_s"]
        s["padding_predicts"] = base["padded_tokens"] / s["padded_tokens"]
        s["mean_rank_work_ratio"] = base["compute_mean_sum_s"] / s["compute_mean_sum_s"]
        s["balance_factor"] = base["slowest_over_mean"] / s["slowest_over_mean"]
        s["overhead_factor"] = s["speedup_vs_padseq"] / (
            s["mean_rank_work_ratio"] * s["balance_factor"]
        )
    if arms.get("count", {}).get("steps") and arms.get("cost", {}).get("steps"):
        arms["cost"]["speedup_vs_count"] = arms["count"]["step_s_sum"] / arms["cost"]["step_s_sum"]
        arms["cost"]["slowest_rank_speedup_vs_count"] = (
            arms["count"]["compute_max_sum_s"] / arms["cost"]["compute_max_sum_s"]
        )
    losses: dict[str, dict[int, float]] = {}
    for r in result["records"]:
        losses.setdefault(r["arm"], {})[r["step"]] = r["loss"]
    ref = losses.get("cost") or next(iter(losses.values()), {})
    loss_diff = {
        a: max((abs(v - ref[s]) for s, v in d.items() if s in ref), default=0.0)
        for a, d in losses.items()
    }
    return {
        "arms": arms,
        "basis": basis,
        "loss_max_abs_diff_vs_cost": loss_diff,
        "fit": cost_fit(result),
    }


def cost_fit(result: dict[str, Any]) -> dict[str, float] | None:
    """Least squares over every timed (rank, step): compute = a x positions + b x sum(L^2) + c
    per rank (positions and sum(L^2) of its rows / cp: the share each CP rank holds). b / a
    is the measured attn_weight of packers.CostModel (the run balanced with `attn_weight`)."""
    key = "rank_cpu_s" if result.get("device") == "cpu" else "rank_compute_s"
    cp = int(result["topology"]["cp"])
    w = int(result.get("warmup", 0))
    xs, ys = [], []
    for r in result["records"]:
        if r["step"] < w:
            continue
        for t, pos, attn in zip(r[key], r["rank_padded"], r["rank_attn"], strict=True):
            xs.append([pos / cp, attn / cp, 1.0])
            ys.append(t)
    if len(ys) < 6:
        return None
    x, y = np.array(xs), np.array(ys)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    ss = float(((y - y.mean()) ** 2).sum())
    return {
        "s_per_position": float(coef[0]),
        "s_per_attn_unit": float(coef[1]),
        "s_constant": float(coef[2]),
        "attn_weight_measured": float(coef[1] / coef[0]) if coef[0] > 0 else float("nan"),
        "r2": 1 - float(((y - pred) ** 2).sum()) / ss if ss else float("nan"),
        "points": len(ys),
    }


def _f(x: Any, spec: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return format(x, spec) + suffix


BASIS_TEXT = {
    "dp_compute_s": "CUDA-event time of forward + backward, max over the DP rank's CP ranks",
    "dp_cpu_s": "thread CPU time of forward + backward, max over the DP rank's CP ranks",
}


def markdown(result: dict[str, Any]) -> str:
    """The RESULTS.md body: context, the table, the explanation, the checks."""
    summary = result.get("summary") or summarize(result)
    topo = result["topology"]
    cpu = result.get("device") == "cpu"
    lines = []
    if cpu:
        lines += [
            f"**CPU/gloo proxy, not a GPU measurement**: {topo['world']} processes share this machine's "
            f"cores (load: {result.get('uptime', 'n/a')}); the e2e smoke preset's tiny model, seq_len "
            f"{result.get('seq_len', '?')}, the kernels' torch reference indexer. Rank compute is thread "
            "CPU time (what a dedicated core would take); the 'slowest rank' columns model a synchronous "
            "step as the max over DP ranks. It shows the mechanism, not H200 magnitudes.",
            "",
        ]
    m = result["model"]
    lines.append(
        f"- device: {result['device']} x {topo['world']} ({result['backend']}), dp {topo['dp']} x cp {topo['cp']} "
        f"({topo['cp_layout']}); {result['rows_per_rank']} rows per DP rank per step "
        f"({result['rows_per_step']} per step); {result.get('steps_planned')} steps, the first {result['warmup']} "
        "not timed; arms interleaved step by step, each with its own model copy (same init)"
    )
    lines.append(
        f"- model: e2e DSA MoE, {m['n_layers']} layers, d_model {m['d_model']}, indexer {m['index_heads']}x"
        f"{m['index_dim']} top-{m['index_topk']} on every rank over the CP-gathered keys, "
        f"{m['n_experts']} experts top-{m['expert_topk']}, {result['dtype']}; attention "
        f"{result['self_checks'].get('attention_impl')}, CE {result['self_checks'].get('ce_impl')}"
    )
    lines.append(
        f"- data: `{result['data_dir']}`; balance cost model: tokens + {result['attn_weight']:.3g} x sum(L^2); "
        f"rank compute: {BASIS_TEXT[summary['basis']]}; multicast env {result['multicast_env']}"
    )
    lines.append("")
    headers = ["arm", "padding", "s/step (median)", "trained tok/s", "vs padseq: step time", "vs padseq: slowest rank",
               "padding predicts", "mean-rank work", "slowest/mean rank", "meter imbalance", "waiting",
               "expert slots/pair", "top-k identical"]  # fmt: skip
    rows = []
    for a, s in summary["arms"].items():
        if not s.get("steps"):
            rows.append([a] + ["-"] * (len(headers) - 1))
            continue
        ident = s.get("topk_identical")
        label = {
            "count": "count (round-robin)",
            "cost": "cost (balanced)",
            "padseq": "padseq (pad to seq_len)",
        }
        rows.append(
            [
                label.get(a, a),
                f"{s['padding_fraction']:.1%}",
                f"{s['step_s_median']:.3f}",
                f"{s['tokens_per_s']:,.0f}",
                _f(s.get("speedup_vs_padseq"), ".3f", "x"),
                _f(s.get("slowest_rank_speedup_vs_padseq"), ".3f", "x"),
                _f(s.get("padding_predicts"), ".3f", "x"),
                _f(s.get("mean_rank_work_ratio"), ".3f", "x"),
                f"{s['slowest_over_mean']:.3f}",
                f"{s['meter_imbalance_mean']:.3f}",
                f"{s['waiting_share']:.1%}",
                f"{s['expert_slots_per_pair']:.2f}",
                "-"
                if ident is None
                else ("yes" if ident else f"NO ({s['topk_diff_rows']} rows differ)")
                + f", {s['topk_checked_calls']} calls",
            ]
        )
    lines.append(markdown_table(headers, rows))
    lines.append("")
    lines += explanation(summary)
    fit = summary.get("fit")
    if fit:
        lines.append(
            f"- measured cost model (least squares over {fit['points']} rank-steps, R^2 {fit['r2']:.3f}): "
            f"{fit['s_per_position'] * 1e6:.3g} us per position + {fit['s_per_attn_unit'] * 1e12:.3g} ps per unit of "
            f"sum(L^2) + {fit['s_constant'] * 1e3:.3g} ms: attn_weight {fit['attn_weight_measured']:.3g} "
            f"(the run balanced with {result['attn_weight']:.3g})"
        )
    if not result.get("same_rows_per_step", True):
        lines.append(
            "- WARNING: the arms' steps did not hold the same rows; comparisons are not like for like."
        )
    lines.append(
        "- losses (same rows per step, separate model copies): max |loss - cost arm's| over all steps: "
        + ", ".join(f"{a} {d:.2e}" for a, d in summary["loss_max_abs_diff_vs_cost"].items())
    )
    lines.append(
        "- meter imbalance is the cost model's max/mean over the DP ranks' true tokens: for padseq it "
        "ignores the padding the ranks also run (the rows are all seq_len long)."
    )
    for note in result.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines)


def explanation(summary: dict[str, Any]) -> list[str]:
    """Sentences that decompose each arm's speedup over padseq (module docstring)."""
    out = []
    arms = summary["arms"]
    for a in ("count", "cost"):
        s = arms.get(a, {})
        if "speedup_vs_padseq" not in s:
            continue
        out.append(
            f"- {a}: removing {1 - 1 / s['padding_predicts']:.1%} of the positions predicts "
            f"{s['padding_predicts']:.3f}x; the mean DP rank's compute fell {s['mean_rank_work_ratio']:.3f}x, "
            f"and the slowest rank ran {s['slowest_over_mean']:.3f}x the mean (padseq: "
            f"{arms['padseq']['slowest_over_mean']:.3f}), a balance factor of {s['balance_factor']:.3f}: "
            f"{s['slowest_rank_speedup_vs_padseq']:.3f}x for a step that waits for the slowest rank; the "
            f"measured step time (with all-reduce, optimizer, sync: x{s['overhead_factor']:.3f}) gave "
            f"{s['speedup_vs_padseq']:.3f}x."
        )
    cost = arms.get("cost", {})
    if "speedup_vs_count" in cost:
        out.append(
            f"- cost over count (same rows, same model, only the DP split differs): slowest rank "
            f"{cost['slowest_rank_speedup_vs_count']:.3f}x, measured step time {cost['speedup_vs_count']:.3f}x."
        )
    return out
