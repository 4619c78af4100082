"""Summaries, the markdown section for RESULTS.md, the step-time plot, and appending results.

Per workload and arm: time summed over the timed steps, speedup against arm 1, trained
tokens/s (true tokens over the same steps, from TrainedTokenMeter), padding fraction, the
autotuning arm's retuning seconds, expert slots computed per routed (token, expert) pair (the
MoE's padding to the most loaded expert: 1.0 would be perfect balance), the real tokens'
balance (busiest expert / mean, over real tokens only), and the largest per-step loss
difference to arm 4.

Loss agreement is judged against two references, because bf16 training is not bitwise
reproducible (the sparse attention adds dK/dV with fp32 atomics in whatever order the SMs
reach them) and a 20-step AdamW run from scratch amplifies any difference:
- the control (arm 4', arm 4 run again from the same init on the same rows): the run-to-run
  spread of one and the same computation;
- `same_weights`: one model (arm 4's, after its last step) evaluated on every arm's rows of
  that step: the arms' data computes the same function to rounding, or it does not.
`passed` is the issue's criterion (every step within `tolerance` across arms 1-4).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TITLE = "End-to-end padding ablation on one GPU (issue 6)"
REFERENCE_ARM = 4


def _nan() -> float:
    return float("nan")


def _loss_check(
    arms: list[dict[str, Any]], done: int, tolerance: float, workload: dict[str, Any]
) -> dict[str, Any]:
    ref = next((a for a in arms if a["number"] == REFERENCE_ARM), arms[0])
    deltas = {
        str(a["number"]): [
            abs(x - y) for x, y in zip(a["losses"][:done], ref["losses"][:done], strict=True)
        ]
        for a in arms
        if a is not ref
    }
    control = [a for a in arms if a.get("control_of") == ref["number"]]
    cross = [a for a in arms if a is not ref and a.get("control_of") is None]
    spread = [
        max(a["losses"][i] for a in [ref, *cross]) - min(a["losses"][i] for a in [ref, *cross])
        for i in range(done)
    ]
    ctrl = deltas[str(control[0]["number"])] if control else []
    cross_max = max((max(deltas[str(a["number"])], default=0.0) for a in cross), default=0.0)
    same = workload.get("same_weights") or {}
    same_vals = list(same.get("losses", {}).values())
    return {
        "tolerance": tolerance,
        "reference_arm": ref["number"],
        "per_step_abs_diff": deltas,
        "per_step_spread": spread,
        "max_spread": max(spread) if spread else 0.0,
        "first_step_spread": spread[0] if spread else 0.0,
        "control_max": max(ctrl) if ctrl else _nan(),
        "cross_arm_max": cross_max,
        "same_weights_spread": (max(same_vals) - min(same_vals)) if same_vals else _nan(),
        "passed": all(s <= tolerance for s in spread),
    }  # fmt: skip


def summarize(workload: dict[str, Any], timed_from: int, tolerance: float) -> dict[str, Any]:
    """Add `summary` rows and `loss_check` to a workload record (returns it)."""
    done = workload["steps_done"]
    arms = [a for a in workload["arms"] if len(a["losses"]) >= done and a.get("error") is None]
    if not arms or done < 1:
        workload.update(summary=[], loss_check={"tolerance": tolerance, "max_spread": _nan(), "per_step_spread": [],
                                                "passed": False}, expected_min_speedup_arm4=_nan())  # fmt: skip
        return workload
    t0 = min(timed_from, done) - 1
    base = next((a for a in arms if a["number"] == 1), arms[0])
    base_total = sum(base["step_times_s"][t0:done])
    flops = workload.get("flops_per_step", {})
    ref = next((a for a in arms if a["number"] == REFERENCE_ARM), arms[-1])
    rows = []
    for a in arms:
        total = sum(a["step_times_s"][t0:done])
        tokens = sum(a["num_tokens"][t0:done])
        padded_all, tokens_all = sum(a["padded_tokens"][:done]), sum(a["num_tokens"][:done])
        slots, pairs = sum(a["expert_slots"][t0:done]), sum(a["expert_pairs"][t0:done])
        imb = [max(x) for x in a.get("moe_real_imbalance", [])[t0:done]]
        useful = flops.get(str(REFERENCE_ARM), {}).get("total", _nan())
        diffs = [abs(x - y) for x, y in zip(a["losses"][:done], ref["losses"][:done], strict=True)]
        rows.append({
            "arm": a["number"], "label": a["label"], "control_of": a.get("control_of"), "total_s": total,
            "base_arm": base["number"], "speedup_vs_arm1": base_total / total if total else _nan(),
            "trained_tokens_per_s": tokens / total if total else _nan(),
            "useful_tflops": useful * (done - t0) / total / 1e12 if total else _nan(),
            "padding_fraction": (padded_all - tokens_all) / padded_all if padded_all else 0.0,
            "retune_s": sum(a["tune_times_s"][t0:done]), "expert_slots_per_pair": slots / pairs if pairs else _nan(),
            "real_imbalance": sum(imb) / len(imb) if imb else _nan(),
            "max_loss_diff_vs_arm4": max(diffs) if diffs else 0.0,
        })  # fmt: skip
    workload["summary"] = rows
    workload["loss_check"] = _loss_check(arms, done, tolerance, workload)
    pad1 = next((r["padding_fraction"] for r in rows if r["arm"] == 1), rows[0]["padding_fraction"])
    workload["expected_min_speedup_arm4"] = 1.0 / (1.0 - pad1) if pad1 < 1 else float("inf")
    return workload


def _fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if x is not None and x == x else "n/a"


def _flops_line(w: dict[str, Any]) -> str:
    """Model FLOPs per step executed by each arm (flops.py: padding included where it runs)."""
    parts = []
    for arm, f in sorted(w.get("flops_per_step", {}).items()):
        parts.append(
            f"arm {arm} {f['total'] / 1e12:.4g} T (LM head {f['lm_head'] / 1e12:.4g}, dense {f['dense'] / 1e12:.4g}, "
            f"indexer {f['indexer'] / 1e12:.4g}, sparse attention {f['sparse_attention'] / 1e12:.4g})"
        )
    return "Model FLOPs per step: " + "; ".join(parts) + "." if parts else ""


def loss_agreement_text(w: dict[str, Any]) -> str:
    """The loss-agreement paragraph: the criterion, the control, the same-weights check."""
    lc = w["loss_check"]
    ref = lc.get("reference_arm", REFERENCE_ARM)
    same = w.get("same_weights") or {}
    parts = [
        f"Loss agreement (issue target: every step within {lc['tolerance']:.0e} across arms 1-4): largest per-step "
        f"spread {lc['max_spread']:.2e} -> **{'PASS' if lc['passed'] else 'FAIL'}**. Step 1 (same weights in every arm) "
        f"spread {lc.get('first_step_spread', _nan()):.1e}.",
    ]
    ctrl = lc.get("control_max", _nan())
    if ctrl == ctrl:
        ratio = (
            f" ({lc['cross_arm_max'] / ctrl:.1f}x the control)"
            if ctrl > 0
            else " (the control is bitwise identical)"
        )
        parts.append(
            f"Control: arm {ref} run twice (4 and 4', same init, rows and code) differs by up to {ctrl:.2e}; "
            f"arms 1-3 differ from arm {ref} by up to {lc['cross_arm_max']:.2e}{ratio}."
        )
    if same.get("losses"):
        vals = ", ".join(f"arm {k} {v:.6f}" for k, v in sorted(same["losses"].items()))
        parts.append(
            f"Same weights (arm {same.get('model_arm', ref)}'s model after step {same.get('step')}, every arm's rows of that "
            f"step, forward only): {vals}; spread {lc['same_weights_spread']:.1e}."
        )
    return " ".join(parts)


def workload_markdown(w: dict[str, Any], timed_from: int, steps: int) -> str:
    from benchmarks._results import markdown_table

    if not w["summary"]:
        errors = "; ".join(f"arm {a['number']}: {a.get('error')}" for a in w["arms"])
        return f"### {w['name']}\n\nNo arm completed: {errors}"
    base = w["summary"][0]["base_arm"]
    last = min(steps, w["steps_done"])
    headers = ["arm", f"time s (steps {min(timed_from, last)}-{last})", f"speedup vs arm {base}", "trained tok/s",
               "useful TFLOP/s", "padding", "retune s", "expert slots / routed pair", "real-token max/mean load",
               f"max \\|Δloss\\| vs arm {REFERENCE_ARM}"]  # fmt: skip
    table = [
        [r["label"], _fmt(r["total_s"], ".2f"), _fmt(r["speedup_vs_arm1"], ".3f") + "x", _fmt(r["trained_tokens_per_s"], ",.0f"),
         _fmt(r["useful_tflops"], ".1f"), f"{r['padding_fraction']:.2%}", _fmt(r["retune_s"], ".2f"),
         _fmt(r["expert_slots_per_pair"], ".2f"), _fmt(r["real_imbalance"], ".2f"), f"{r['max_loss_diff_vs_arm4']:.1e}"]
        for r in w["summary"]
    ]  # fmt: skip
    failed = [a for a in w["arms"] if a.get("error")]
    lc = w["loss_check"]
    info = w.get("data", {})
    arm4 = next((r for r in w["summary"] if r["arm"] == REFERENCE_ARM), w["summary"][-1])
    order = [a for a in w["arms"] if a["number"] != lc.get("reference_arm", REFERENCE_ARM)]
    ref_arm = next((a for a in w["arms"] if a["number"] == lc.get("reference_arm")), None)
    loss_rows = []
    for i in range(last):
        row: list[object] = [
            i + 1,
            f"{ref_arm['losses'][i]:.6f}" if ref_arm and i < len(ref_arm["losses"]) else "-",
        ]
        for a in order:
            d = lc.get("per_step_abs_diff", {}).get(str(a["number"]), [])
            row.append(f"{d[i]:.1e}" if i < len(d) else "-")
        loss_rows.append(row)
    lines = [
        f"### {w['name']}: {info.get('description', '')}".rstrip(": "),
        "",
        f"{info.get('rows', '?')} rows used ({w['rows_per_step']} per step), {info.get('samples', '?')} samples packed by "
        f"{info.get('packer', '?')}; padding to seq_len {w['summary'][0]['padding_fraction']:.2%}, so the bound for arm 4 over "
        f"arm 1 is {w['expected_min_speedup_arm4']:.3f}x; measured: {arm4['speedup_vs_arm1']:.3f}x."
        + (
            f" **Stopped early at the deadline after {w['steps_done']} steps.**"
            if w.get("stopped_early")
            else ""
        ),
        "",
        markdown_table(headers, table),
        *([""] + [f"Arm {a['number']} FAILED: {a['error']}" for a in failed] if failed else []),
        "",
        _flops_line(w),
        "",
        loss_agreement_text(w),
        "",
        markdown_table(
            ["step", f"arm {lc.get('reference_arm', REFERENCE_ARM)} loss"]
            + [f"\\|Δ\\| arm {a['label'].split(':')[0]}" for a in order],
            loss_rows,
        ),
    ]
    return "\n".join(lines)


def results_markdown(result: dict[str, Any]) -> str:
    run = result["run"]
    head = [
        f"Model: {result['model_summary']}. seq_len {run['seq_len']}, pad multiple {run['pad_multiple']} (cp 8), "
        f"{run['rows_per_step']} rows per step, {run['steps']} AdamW steps per arm (lr {run['lr']:g}), time summed over steps "
        f"{run['timed_from']}-{run['steps']}, arms interleaved step by step. Sparse attention: {result['attention_impl']}; "
        f"cross entropy: {result.get('ce_impl', 'torch')}. Arm 3's indexer: {result['indexers'].get('autotuned', 'n/a')}.",
        "",
        f"Plot: `{result.get('plot', 'e2e_step_times.png')}` (step times and |Δloss| per arm). Self-checks: "
        + "; ".join(f"{k}: {v}" for k, v in result.get("self_checks", {}).items()),
    ]
    if "elapsed_s" in result:
        head.append(
            f"\nWall time of the whole run: {result['elapsed_s']:.0f} s (deadline {run.get('deadline_s', 'none')})."
        )
    body = "\n".join(head)
    for w in result["workloads"]:
        body += "\n\n" + workload_markdown(w, run["timed_from"], run["steps"])
    if result.get("components_ms"):
        c = result["components_ms"]
        body += (
            "\n\nComponent times on one row of the first workload (ms, CUDA events, median of 3): "
            + ", ".join(f"{k} {v:g}" for k, v in c.items())
            + " (indexer, attention and MoE are per layer; a step runs them layers x rows times)."
        )
    if result.get("notes"):
        body += "\n\nNotes:\n" + "\n".join(f"- {n}" for n in result["notes"])
    return body


def plot_step_times(result: dict[str, Any], path: Path) -> None:
    """Per workload: step time of every arm (top), |loss - arm 4's| per step (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = result["workloads"]
    n = max(1, len(ws))
    fig, axes = plt.subplots(2, n, figsize=(6 * n, 8), squeeze=False)
    timed_from = result["run"]["timed_from"]
    for col, w in enumerate(ws):
        ax, bx = axes[0][col], axes[1][col]
        for a in w["arms"]:
            times = a["step_times_s"]
            ax.plot(range(1, len(times) + 1), times, marker="o", ms=3, label=a["label"])
        ax.axvspan(0.5, timed_from - 0.5, color="0.9", label="warm-up (not timed)")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (s)")
        pad = w["summary"][0]["padding_fraction"] if w["summary"] else _nan()
        ax.set_title(f"{w['name']}: padding to seq_len {pad:.1%}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        diffs = w.get("loss_check", {}).get("per_step_abs_diff", {})
        for a in w["arms"]:
            d = diffs.get(str(a["number"]))
            if d:
                bx.plot(
                    range(1, len(d) + 1),
                    [max(x, 1e-7) for x in d],
                    marker="o",
                    ms=3,
                    label=a["label"],
                )
        bx.axhline(
            w.get("loss_check", {}).get("tolerance", 1e-3), color="k", ls="--", lw=1, label="target"
        )
        bx.set_yscale("log")
        bx.set_xlabel("step")
        bx.set_ylabel(f"|loss - arm {REFERENCE_ARM} loss| (floor 1e-7)")
        bx.grid(True, which="both", alpha=0.3)
        bx.legend(fontsize=7)
    fig.suptitle(f"packshard e2e ablation, {result.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict[str, Any]) -> None:
    for w in result["workloads"]:
        print(
            workload_markdown(w, result["run"]["timed_from"], result["run"]["steps"]).split(
                "\n\nLoss agreement"
            )[0]
        )
        if w["summary"]:
            print(loss_agreement_text(w) + "\n")


def append_results_file(path: Path) -> str:
    """Record a GPU run's results (its e2e_results.json) as e2e_ablation's latest result."""
    from benchmarks._results import record_saved_result

    return record_saved_result(
        path, "e2e_ablation", TITLE, "e2e_results.json that benchmarks/e2e_ablation/run.py wrote"
    )
