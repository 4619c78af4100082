"""Summaries, the markdown section for RESULTS.md, the step-time plot, and appending results.

Per workload and arm: time summed over the timed steps, speedup against arm 1, trained
tokens/s (true tokens over the same steps, from TrainedTokenMeter), padding fraction, the
autotuning arm's retuning seconds, expert slots computed per routed (token, expert) pair (the
MoE's padding to the most loaded expert: 1.0 would be perfect balance), and the largest
per-step loss difference to arm 1. The loss check passes when every step's losses agree
within `loss_tolerance` across all arms.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TITLE = "End-to-end padding ablation on one GPU (issue 6)"


def summarize(workload: dict[str, Any], timed_from: int, tolerance: float) -> dict[str, Any]:
    """Add `summary` rows and `loss_check` to a workload record (returns it)."""
    done = workload["steps_done"]
    arms = [a for a in workload["arms"] if len(a["losses"]) >= done and a.get("error") is None]
    if not arms:
        workload.update(summary=[], loss_check={"tolerance": tolerance, "max_spread": float("nan"), "per_step_spread": [], "passed": False},
                        expected_min_speedup_arm4=float("nan"))  # fmt: skip
        return workload
    t0 = min(timed_from, done) - 1
    base = next((a for a in arms if a["number"] == 1), arms[0])
    base_total = sum(base["step_times_s"][t0:done])
    flops = workload.get("flops_per_step", {})
    useful = flops.get("4", flops.get(str(arms[-1]["number"]), {})).get("total", float("nan"))
    rows = []
    for a in arms:
        total = sum(a["step_times_s"][t0:done])
        tokens = sum(a["num_tokens"][t0:done])
        padded_all, tokens_all = sum(a["padded_tokens"][:done]), sum(a["num_tokens"][:done])
        slots, pairs = sum(a["expert_slots"][t0:done]), sum(a["expert_pairs"][t0:done])
        diffs = [abs(x - y) for x, y in zip(a["losses"][:done], base["losses"][:done], strict=True)]
        rows.append({
            "arm": a["number"], "label": a["label"], "total_s": total, "base_arm": base["number"],
            "speedup_vs_arm1": base_total / total if total else float("nan"),
            "trained_tokens_per_s": tokens / total if total else float("nan"),
            "useful_tflops": useful * (done - t0) / total / 1e12 if total else float("nan"),
            "padding_fraction": (padded_all - tokens_all) / padded_all if padded_all else 0.0,
            "retune_s": sum(a["tune_times_s"][t0:done]), "expert_slots_per_pair": slots / pairs if pairs else float("nan"),
            "max_loss_diff_vs_arm1": max(diffs) if diffs else 0.0,
        })  # fmt: skip
    steps = done
    spread = [
        max(a["losses"][i] for a in arms) - min(a["losses"][i] for a in arms) for i in range(steps)
    ]
    workload["summary"] = rows
    workload["loss_check"] = {"tolerance": tolerance, "max_spread": max(spread) if spread else 0.0,
                              "per_step_spread": spread, "passed": all(s <= tolerance for s in spread)}  # fmt: skip
    pad1 = rows[0]["padding_fraction"]
    workload["expected_min_speedup_arm4"] = 1.0 / (1.0 - pad1) if pad1 < 1 else float("inf")
    return workload


def _fmt(x: float, spec: str) -> str:
    return format(x, spec) if x == x else "n/a"


def _flops_line(w: dict[str, Any]) -> str:
    """Model FLOPs per step executed by each arm (flops.py: padding included where it runs)."""
    parts = []
    for arm, f in sorted(w.get("flops_per_step", {}).items()):
        parts.append(
            f"arm {arm} {f['total'] / 1e12:.4g} T (LM head {f['lm_head'] / 1e12:.4g}, dense {f['dense'] / 1e12:.4g}, "
            f"indexer {f['indexer'] / 1e12:.4g}, sparse attention {f['sparse_attention'] / 1e12:.4g})"
        )
    return "Model FLOPs per step: " + "; ".join(parts) + "." if parts else ""


def workload_markdown(w: dict[str, Any], timed_from: int, steps: int) -> str:
    from benchmarks._results import markdown_table

    if not w["summary"]:
        errors = "; ".join(f"arm {a['number']}: {a.get('error')}" for a in w["arms"])
        return f"### {w['name']}\n\nNo arm completed: {errors}"
    base = w["summary"][0]["base_arm"]
    last = min(steps, w["steps_done"])
    headers = ["arm", f"time s (steps {min(timed_from, last)}-{last})", f"speedup vs arm {base}", "trained tok/s", "useful TFLOP/s",
               "padding", "retune s", "expert slots / routed pair", f"max |Δloss| vs arm {base}"]  # fmt: skip
    table = [
        [r["label"], _fmt(r["total_s"], ".2f"), _fmt(r["speedup_vs_arm1"], ".3f") + "x", _fmt(r["trained_tokens_per_s"], ",.0f"),
         _fmt(r["useful_tflops"], ".1f"), f"{r['padding_fraction']:.2%}", _fmt(r["retune_s"], ".2f"),
         _fmt(r["expert_slots_per_pair"], ".2f"), f"{r['max_loss_diff_vs_arm1']:.1e}"]
        for r in w["summary"]
    ]  # fmt: skip
    failed = [a for a in w["arms"] if a.get("error")]
    lc = w["loss_check"]
    info = w.get("data", {})
    lines = [
        f"### {w['name']}: {info.get('description', '')}".rstrip(": "),
        "",
        f"{info.get('rows', '?')} rows used ({w['rows_per_step']} per step), {info.get('samples', '?')} samples packed by "
        f"{info.get('packer', '?')}; padding to seq_len {w['summary'][0]['padding_fraction']:.2%}, so the bound for arm 4 over "
        f"arm 1 is {w['expected_min_speedup_arm4']:.3f}x; measured for arm {w['summary'][-1]['arm']}: {w['summary'][-1]['speedup_vs_arm1']:.3f}x."
        + (" **Stopped early at the deadline.**" if w.get("stopped_early") else ""),
        "",
        markdown_table(headers, table),
        *([""] + [f"Arm {a['number']} FAILED: {a['error']}" for a in failed] if failed else []),
        "",
        _flops_line(w),
        "",
        f"Loss agreement: largest per-step spread across arms {lc['max_spread']:.2e} "
        f"({'within' if lc['passed'] else 'OUTSIDE'} {lc['tolerance']:.0e}).",
        "",
        markdown_table(
            ["step"] + [f"arm {a['number']} loss" for a in w["arms"]],
            [
                [i + 1]
                + [f"{a['losses'][i]:.6f}" if i < len(a["losses"]) else "-" for a in w["arms"]]
                for i in range(last)
            ],
        ),
    ]
    return "\n".join(lines)


def results_markdown(result: dict[str, Any]) -> str:
    run = result["run"]
    head = [
        f"Model: {result['model_summary']}. seq_len {run['seq_len']}, pad multiple {run['pad_multiple']} (cp 8), "
        f"{run['rows_per_step']} rows per step, {run['steps']} AdamW steps per arm, time summed over steps "
        f"{run['timed_from']}-{run['steps']}, arms interleaved step by step. Sparse attention: {result['attention_impl']}. "
        f"Arm 3's indexer: {result['indexers'].get('autotuned', 'n/a')}.",
        "",
        f"Plot: `{result.get('plot', 'e2e_step_times.png')}` (step times per arm). Self-checks: "
        + "; ".join(f"{k}: {v}" for k, v in result.get("self_checks", {}).items()),
    ]
    body = "\n".join(head)
    for w in result["workloads"]:
        body += "\n\n" + workload_markdown(w, run["timed_from"], run["steps"])
    if result.get("notes"):
        body += "\n\nNotes:\n" + "\n".join(f"- {n}" for n in result["notes"])
    return body


def plot_step_times(result: dict[str, Any], path: Path) -> None:
    """One panel per workload: step time of every arm against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = result["workloads"]
    fig, axes = plt.subplots(1, max(1, len(ws)), figsize=(6 * max(1, len(ws)), 4.2), squeeze=False)
    timed_from = result["run"]["timed_from"]
    for ax, w in zip(axes[0], ws, strict=False):
        for a in w["arms"]:
            times = a["step_times_s"]
            ax.plot(range(1, len(times) + 1), times, marker="o", ms=3, label=a["label"])
        ax.axvspan(0.5, timed_from - 0.5, color="0.9", label="warm-up (not timed)")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (s)")
        pad = w["summary"][0]["padding_fraction"] if w["summary"] else float("nan")
        ax.set_title(f"{w['name']}: padding to seq_len {pad:.1%}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"packshard e2e ablation, {result.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict[str, Any]) -> None:
    for w in result["workloads"]:
        print(
            workload_markdown(w, result["run"]["timed_from"], result["run"]["steps"]).split(
                "\n\nLoss agreement"
            )[0]
        )
        print(
            f"loss spread max {w['loss_check']['max_spread']:.2e} -> {'PASS' if w['loss_check']['passed'] else 'FAIL'}\n"
        )


def append_results_file(path: Path) -> str:
    """Append a GPU run's results (its e2e_results.json) to benchmarks/RESULTS.md."""
    from benchmarks._results import append_result

    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path}: cannot read an e2e results file ({e}); pass the e2e_results.json the GPU run wrote"
        ) from e
    for key in ("markdown", "command", "machine"):
        if key not in result:
            raise ValueError(
                f"{path}: no {key!r} key; this is not an e2e_results.json written by run.py"
            )
    append_result(TITLE, result["markdown"], command=result["command"], machine=result["machine"])
    return result["markdown"]
