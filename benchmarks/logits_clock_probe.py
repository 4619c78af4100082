"""Does the logits kernel's rate depend on how long it has been running? (issue 5 diagnostic; GPU only)

    PYTHONPATH=. python3 benchmarks/logits_clock_probe.py --out $OUT/clocks

The H200 runs of 2026-12-03 timed the fixed logits config at S = 64K, H = 64, causal at 37.9 ms
(928 TFLOP/s) in the logits sweep, where it runs back to back with the other configs, and at
34.6 ms (1019 TFLOP/s) inside the end-to-end call, where each chunk's logits follow a select
and a sort that load the tensor cores far less. This probe times the same launches in three
regimes while `nvidia-smi` samples the SM clock, the power draw and the active clock-event
(throttle) reasons every 100 ms:

1. cold: one call after 2 s idle, five times;
2. sustained: back to back for ~10 s (the sweep's regime), the median of the last 5 s;
3. interleaved: each logits call followed by the top-k of its chunks (the end-to-end regime).

Since v9 it runs the three regimes for the fixed config (two query blocks a program share each
key tile at H = 64; since v10 with relu as x + |x|), then for v9's fixed config (relu as
max(x, 0)) and v8's one-block kernel, and reports the energy a flop of each (board power x
time / counted flops).

Writes logits_clock_probe.json and .md under --out; `--append-results FILE` appends the
markdown to benchmarks/RESULTS.md here afterwards.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
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
from benchmarks.bench_indexer import TOPK, D, count_pairs, logits_runner, random_row, row_ranges
from benchmarks.indexer_peers import V8_LOGITS_CONFIG, V9_LOGITS_CONFIG
from packshard.kernels.fp8_indexer import FIXED_CONFIG, indexer_topk_prepared, prepare_inputs
from packshard.kernels.logits import FIXED_LOGITS_CONFIG, LogitsConfig

TITLE = "fp8 indexer (issue 5): logits rate against clock and power"
S, H = 65536, 64
FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# The fixed config (since v9: two 2-query blocks a program share each key tile at H = 64; since
# v10 with relu as x + |x|), v9's (relu as max) and v8's one-block kernel, each through all
# three regimes: the energy a flop of each
CONFIGS: tuple[LogitsConfig, ...] = (
    FIXED_LOGITS_CONFIG,
    V9_LOGITS_CONFIG,
    V8_LOGITS_CONFIG,
)


class Sampler:
    """`nvidia-smi` in the background, one CSV line every 100 ms, into a file.

    Not a pipe: nobody reads it until `stop`, and a full pipe (64 KB, ~90 s of lines) blocks
    nvidia-smi, which then stops sampling; the 16:52 run of 2026-12-03 lost its last ~10 s that
    way. `stdbuf -oL` (where present) flushes each line, so stopping loses none."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in stop)
        cmd = [
            "nvidia-smi",
            f"--query-gpu={FIELDS}",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
        ]
        if shutil.which("stdbuf"):
            cmd = ["stdbuf", "-oL", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=self.log, text=True)

    def stop(self) -> list[dict]:
        time.sleep(0.3)  # the samples of the last call's end
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.seek(0)
        out = self.log.read()
        self.log.close()
        rows = []
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 5:
                continue
            try:
                stamp = _dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append(
                    {"t": stamp, "sm_mhz": float(parts[1]), "power_w": float(parts[2]),
                     "temp_c": float(parts[3]), "reasons": parts[4]}
                )  # fmt: skip
            except ValueError:
                continue
        return rows


def window(samples: list[dict], spans: list[tuple[float, float]], pad: float = 0.15) -> dict:
    """Clock, power and reasons over the samples inside any of the spans (widened by pad s:
    a 35 ms call may fall between two 100 ms samples)."""
    inside = [s for s in samples if any(t0 - pad <= s["t"] <= t1 + pad for t0, t1 in spans)]
    if not inside:
        return {"sm_mhz": float("nan"), "power_w": float("nan"), "reasons": "-", "n": 0}
    reasons = sorted({s["reasons"] for s in inside})
    return {
        "sm_mhz": statistics.median(s["sm_mhz"] for s in inside),
        "power_w": statistics.median(s["power_w"] for s in inside),
        "temp_c": max(s["temp_c"] for s in inside),
        "reasons": " ".join(reasons),
        "n": len(inside),
    }


def timed(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _regimes(p, cfg: LogitsConfig) -> list[tuple[str, list[tuple[float, float, float]]]]:
    """(regime, [(logits ms, start, end)]) of the three regimes for one logits config."""
    run = logits_runner(p, cfg)
    icfg = dataclasses.replace(FIXED_CONFIG, logits=cfg)
    run()
    indexer_topk_prepared(p, TOPK, icfg)
    torch.cuda.synchronize()
    regimes = []
    time.sleep(2.0)
    cold = []
    for _ in range(5):
        time.sleep(2.0)
        t0 = time.time()
        cold.append((timed(run), t0, time.time()))
    regimes.append(("cold (one call after 2 s idle)", cold))

    time.sleep(2.0)
    sustained = []
    t_start = time.time()
    while time.time() - t_start < 10.0:
        t0 = time.time()
        sustained.append((timed(run), t0, time.time()))
    regimes.append(
        ("sustained (back to back, last 5 s)", [x for x in sustained if x[1] >= t_start + 5])
    )

    time.sleep(2.0)
    inter = []
    t_start = time.time()
    while time.time() - t_start < 10.0:
        stats = {"timing": True}
        t0 = time.time()
        indexer_topk_prepared(p, TOPK, icfg, stats=stats)
        inter.append((stats["logits_ms"], t0, time.time()))
    regimes.append(
        (
            "interleaved with the top-k (end to end, last 5 s)",
            [x for x in inter if x[1] >= t_start + 5],
        )
    )
    return regimes


def probe(out: Path | None) -> dict:
    ks, ke = row_ranges(S, packed=False)
    flops = 2 * H * D * count_pairs(ks, ke)
    q, k, w = random_row(S, H, seed=1)
    p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
    sampler = Sampler()
    measured = [(cfg, _regimes(p, cfg)) for cfg in CONFIGS]
    samples = sampler.stop()

    res: dict = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "command": command_line(),
        "regimes": [],
        "samples": samples,
    }
    for cfg, regimes in measured:
        for name, xs in regimes:
            ms = statistics.median(x[0] for x in xs)
            clk = window(samples, [(x[1], x[2]) for x in xs])
            # joules a PFLOP: the board's power over the call's time, per 1e15 counted flops;
            # not for the cold calls, whose 100 ms samples mostly see the idle card around them
            cold = name.startswith("cold")
            energy = float("nan") if cold else clk["power_w"] * ms * 1e-3 / (flops * 1e-15)
            res["regimes"].append(
                {"config": cfg.label, "regime": name, "calls": len(xs), "logits_ms": ms,
                 "tflops": flops / (ms * 1e9), "j_per_pflop": energy} | clk
            )  # fmt: skip
            print(json.dumps(res["regimes"][-1]), flush=True)
    res["markdown"] = markdown(res)
    return save_probe(out, "logits_clock_probe", res)


def _num(x: float) -> str:
    return "-" if x != x else f"{x:.0f}"  # NaN: not measured


def markdown(res: dict) -> str:
    head = [
        "logits config",
        "regime",
        "calls",
        "logits ms (median)",
        "TFLOP/s",
        "SM MHz (median)",
        "power W (median)",
        "J / PFLOP",
        "max temp C",
        "clock-event reasons seen",
    ]
    body = [
        [r.get("config", "-"), r["regime"], r["calls"],
         f"{r['logits_ms']:.2f}", f"{r['tflops']:.0f}", f"{r['sm_mhz']:.0f}",
         f"{r['power_w']:.0f}", _num(r.get("j_per_pflop", float("nan"))),
         r.get("temp_c", "-"), r["reasons"]]
        for r in res["regimes"]
    ]  # fmt: skip
    return (
        f"Measured {res['date']}. Logits at S = {S // 1024}K, H = {H}, causal (all chunks of one "
        "call); nvidia-smi sampled every 100 ms; J / PFLOP = median board power x the call's "
        "time / its counted flops.\n\n" + markdown_table(head, body) + "\n"
    )


def main() -> None:
    probe_main(__doc__, TITLE, "logits_clock_probe.py", "logits_clock_probe.json", probe)


if __name__ == "__main__":
    main()
