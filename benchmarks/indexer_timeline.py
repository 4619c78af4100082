"""Where one end-to-end indexer call spends its wall time (issue 5 diagnostic; GPU only).

    PYTHONPATH=. python3 benchmarks/indexer_timeline.py --out $OUT/timeline

`fp8_indexer_topk` at S = 64K, H = 64, causal, topk 2048 took 49.0-49.6 ms of wall time on the
H200 (2026-12-03) while its logits, select and order kernels added up to ~47.3 ms: this probe
records one warm call under `torch.profiler` and lists every GPU kernel and copy in time order
with its start (from the call's first GPU activity), duration and the idle gap before it, then
sums kernel time, idle time and the time before the first and after the last GPU activity
(host-only work: checks, chunk planning, the result's return). Writes indexer_timeline.json
and .md under --out; `--append-results FILE` appends the markdown to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import (
    command_line,
    machine_description,
    markdown_table,
    probe_main,
    save_probe,
)
from benchmarks.bench_indexer import TOPK, random_row, row_ranges
from packshard.kernels import fp8_indexer_topk

TITLE = "fp8 indexer (issue 5): one end-to-end call's timeline"
S, H = 65536, 64
GAP_US = 20.0  # idle gaps shorter than this are not listed one by one


def gpu_events(prof) -> list[dict]:
    """Kernels and memcpy/memset of a profile: name, start and end in us, sorted by start."""
    out = []
    for e in prof.events():
        kind = str(getattr(e, "device_type", ""))
        if "CUDA" not in kind:
            continue
        start = e.time_range.start
        end = e.time_range.end
        out.append({"name": e.name, "start": start, "end": end})
    return sorted(out, key=lambda x: x["start"])


def timeline(events: list[dict], wall_us: float) -> dict:
    """Merged busy intervals, idle gaps and the per-kernel list, relative to the first event."""
    t0 = events[0]["start"]
    rows, busy_until, idle, gaps = [], t0, 0.0, []
    for ev in events:
        gap = max(0.0, ev["start"] - busy_until)
        idle += gap
        if gap >= GAP_US:
            gaps.append({"before": ev["name"][:60], "at_us": ev["start"] - t0, "gap_us": gap})
        rows.append(
            {
                "name": ev["name"][:80],
                "start_us": ev["start"] - t0,
                "us": ev["end"] - ev["start"],
                "gap_us": gap,
            }
        )
        busy_until = max(busy_until, ev["end"])
    span = busy_until - t0
    return {
        "wall_us": wall_us,
        "gpu_span_us": span,
        "gpu_idle_inside_us": idle,
        "outside_gpu_span_us": wall_us - span,
        "kernels": rows,
        "gaps": gaps,
    }


def run(out: Path | None) -> dict:
    ks, ke = row_ranges(S, packed=False)
    q, k, w = random_row(S, H, seed=0)
    ks, ke = ks.cuda(), ke.cuda()
    for _ in range(2):  # compile and warm the allocator
        fp8_indexer_topk(q, k, w, ks, ke, TOPK)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        fp8_indexer_topk(q, k, w, ks, ke, TOPK)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t) * 1e6
    res = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "command": command_line(),
        **timeline(gpu_events(prof), wall_us),
    }
    res["markdown"] = markdown(res)
    return save_probe(out, "indexer_timeline", res)


def markdown(res: dict) -> str:
    lines = [
        f"Measured {res['date']}. One warm `fp8_indexer_topk` call, S = {S // 1024}K, H = {H}, "
        f"causal, topk {TOPK}, under torch.profiler (which adds a little host time).\n",
        markdown_table(
            ["wall ms", "GPU span ms", "GPU idle inside the span ms", "wall outside the span ms"],
            [
                [
                    f"{res['wall_us'] / 1e3:.2f}",
                    f"{res['gpu_span_us'] / 1e3:.2f}",
                    f"{res['gpu_idle_inside_us'] / 1e3:.2f}",
                    f"{res['outside_gpu_span_us'] / 1e3:.2f}",
                ]
            ],
        ),
        "\nGPU work in time order:\n",
        markdown_table(
            ["start ms", "ms", "idle before us", "kernel"],
            [
                [
                    f"{r['start_us'] / 1e3:.3f}",
                    f"{r['us'] / 1e3:.3f}",
                    f"{r['gap_us']:.0f}",
                    r["name"],
                ]
                for r in res["kernels"]
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    probe_main(__doc__, TITLE, "indexer_timeline.py", "indexer_timeline.json", run)


if __name__ == "__main__":
    main()
