"""The warp-specialised (Gluon) logits kernel against the fixed Triton config (issue 5; GPU only).

    PYTHONPATH=. python3 benchmarks/logits_ws_probe.py --out $OUT/ws

`kernels.logits_ws` runs four warpgroups a CTA over shared TMA key tiles, with mbarriers
instead of the Triton kernel's per-tile CTA barrier (16 warps an SM instead of 12). At each
shape, all chunks of a topk call's logits launches, interleaved (shuffled rounds) with the fixed
config's Triton kernel (`time_interleaved`, medians), for variants of the fixed path's WS
launch (`WS_VARIANTS`). Before timing, each variant's scores are compared with the Triton
kernel's chunk by chunk: the same positions written (and some written), the largest difference
relative to the row's largest score, bitwise equality with the first variant, and two runs of
the variant bitwise equal. Writes logits_ws_probe.json and .md under --out;
`--append-results FILE` appends the markdown to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
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
from benchmarks.bench_indexer import (
    D,
    chunk_plan,
    count_pairs,
    logits_buffer,
    logits_runner,
    parse_shapes,
    random_row,
    row_ranges,
)
from benchmarks.indexer_final import shape_name, time_interleaved
from benchmarks.indexer_peers import V11_LOGITS_CONFIG
from packshard.kernels.fp8_indexer import prepare_inputs
from packshard.kernels.logits import WS_LAUNCH, launch_logits

# the fixed config's Triton kernel: the fixed config itself runs the warp-specialised kernel
# for H = 64 launches from 2^28 scores on sm_90 (v13)
TRITON_FIXED = V11_LOGITS_CONFIG

TITLE = "fp8 indexer (issue 5): the warp-specialised logits kernel against the fixed config"
FIXED_NAME = f"fixed, Triton ({TRITON_FIXED.label})"
# each variant: launch_logits_ws keyword arguments over the fixed path's WS launch at the shape's
# head count (`kernels.logits.WS_LAUNCH`): {} is the fixed path's own launch (v14c); then
# without the early key tiles, and v14's launch (neither v14c option)
WS_VARIANTS = ({}, {"early_tiles": False}, {"uniform_ranges": False, "early_tiles": False})
SHAPES = (
    (64, 16384, False),
    (64, 32768, False),
    (64, 65536, False),
    (64, 131072, False),
    (64, 16384, True),
    (64, 32768, True),
    (64, 65536, True),
    (64, 131072, True),
    (64, 8192, False),
    (64, 8192, True),
    (64, 4096, False),
    (64, 4096, True),
    (32, 16384, False),
    (32, 16384, True),
    (32, 65536, False),
    (32, 131072, True),
    # below the fixed path's WS threshold (2^28 scores): would the WS kernel serve H = 32's
    # small launches (target 1's one miss is H = 32 4K causal)?
    (32, 4096, False),
    (32, 4096, True),
    (32, 8192, False),
)
ROUNDS = 7
# a variant that sums in another order than the fixed config (banks) differs from it by fp32
# rounding: the largest difference allowed, relative to the row's largest score
MAX_REL_DIFF = 1e-5


def ws_name(v: dict) -> str:
    return "ws, fixed launch" + "".join(f"/{k}={val}" for k, val in v.items())


def ws_launch(p, out, r0: int, r1: int, col0: int, v: dict) -> None:
    from packshard.kernels.logits_ws import launch_logits_ws

    launch_logits_ws(
        p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, out,
        heads=p.heads, row0=r0, n_rows=r1 - r0, col0=col0, **{**WS_LAUNCH[p.heads], **v},
    )  # fmt: skip


def fixed_launch(p, out, r0: int, r1: int, col0: int) -> None:
    launch_logits(
        p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, out,
        heads=p.heads, row0=r0, n_rows=r1 - r0, col0=col0, config=TRITON_FIXED,
    )  # fmt: skip


def ws_runner(p, buf, v: dict):
    """All chunks' launches of a topk call with the WS kernel (as `logits_runner`)."""
    chunks = chunk_plan(p)

    def run() -> None:
        for r0, r1, col0, width in chunks:
            out = buf[: (r1 - r0) * width].view(r1 - r0, width)
            ws_launch(p, out, r0, r1, col0, v)

    return run


def compare(p) -> dict[str, dict]:
    """Each WS variant against the fixed config, chunk by chunk (each chunk's scores into a
    NaN-filled buffer, the fixed config's first, then the variant's twice): the positions
    written (`written` counts the fixed config's: a check over nothing cannot pass), the
    largest difference relative to the row's largest score, bitwise equality (with the fixed
    config and with the first variant) and repeatability."""
    buf = logits_buffer(p)
    res = {
        ws_name(v): {"same_written": True, "max_rel_diff": 0.0, "deterministic": True,
                      "bitwise_equal_fixed": True, "bitwise_equal_first_variant": True,
                      "written": 0}
        for v in WS_VARIANTS
    }  # fmt: skip
    for r0, r1, col0, width in chunk_plan(p):
        out = buf[: (r1 - r0) * width].view(r1 - r0, width)
        out.fill_(float("nan"))
        fixed_launch(p, out, r0, r1, col0)
        want = out.clone()
        written = ~torch.isnan(want)
        scale = want.nan_to_num(0.0).abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        first = None
        for v in WS_VARIANTS:
            got = []
            for _ in range(2):
                out.fill_(float("nan"))
                ws_launch(p, out, r0, r1, col0, v)
                got.append(out.clone())
            c = res[ws_name(v)]
            c["written"] += int(written.sum())
            c["same_written"] &= bool(torch.equal(written, ~torch.isnan(got[0])))
            diff = ((got[0] - want).abs() / scale).nan_to_num(0.0).amax().item()
            c["max_rel_diff"] = max(c["max_rel_diff"], diff)
            bits = [g.view(torch.int32) for g in got]
            c["deterministic"] &= bool(torch.equal(bits[0], bits[1]))
            c["bitwise_equal_fixed"] &= bool(torch.equal(bits[0], want.view(torch.int32)))
            first = bits[0] if first is None else first
            c["bitwise_equal_first_variant"] &= bool(torch.equal(bits[0], first))
    return res


def add_options(ap) -> None:
    ap.add_argument(
        "--shapes", default="", help="H:S:causal|packed,... instead of the default SHAPES"
    )


def host_ms(fn, calls: int = 20) -> float:
    """Host ms a call of `fn` (its launches, nothing synchronised inside): after a
    synchronise, so the GPU's queue is empty and no launch waits for a slot; the GPU runs
    behind and the host's time is what a caller cannot hide when the launches are shorter."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e3 / calls


def gpu_only_ms(fn, host: float, calls: int = 20, rounds: int = 5) -> float:
    """Median device ms a call of `fn` with the host's time hidden: each sample's calls are
    queued behind a GPU sleep that outlasts their launching (`host` ms a call, `host_ms`), so
    the GPU runs them back to back. What the kernels cost when the host runs ahead."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep_ms = 2 * calls * host + 2.0
    samples = []
    while len(samples) < rounds:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * 2e6))  # cycles at <= 2 GHz: slower clocks wait longer
        a.record()
        for _ in range(calls):
            fn()
        queued_ahead = not a.query()  # the sleep still ran when the last call was queued
        b.record()
        b.synchronize()
        if not queued_ahead:  # the GPU waited for the host: not a GPU-only sample
            if sleep_ms > 1000:
                raise RuntimeError("gpu_only_ms: the host cannot queue the calls ahead")
            sleep_ms *= 2
            continue
        samples.append(a.elapsed_time(b) / calls)
    return statistics.median(samples)


# GPU-only times only where the host can matter: launches of a call under this many ms
GPU_ONLY_MAX_MS = 1.0


def host_breakdown(heads: int) -> dict[str, float]:
    """Host us of a WS launch's parts at 4K packed rows (`heads`), against the Triton config's
    whole launch: the launch's constexprs (`kernel_meta`), its argument checks, its two TMA
    descriptors, the kernel call with descriptors made beforehand, and `launch_logits_ws`
    whole. Each part is called 1000 times in a row; the kernel calls launch, and their GPU time
    (30-45 us at 4K packed rows) is close to their host time, so a few dozen launches queue at
    most."""
    from packshard.kernels import logits_ws as ws

    ks, ke = row_ranges(4096, True)
    q, k, w = random_row(4096, heads, seed=5)
    p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
    buf = logits_buffer(p)
    ((r0, r1, col0, width),) = chunk_plan(p)
    out = buf[: (r1 - r0) * width].view(r1 - r0, width)
    kw = {"start_align": 16, **WS_LAUNCH[heads]}
    qbox, meta = ws.kernel_meta(heads, **kw)
    dq, dk = ws._desc(p.q8, [qbox, 128]), ws._desc(p.k8, [ws.BLOCK_K, 128])
    args = (p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, out)
    parts = {
        "kernel_meta": lambda: ws.kernel_meta(heads, **kw),
        "argument checks": lambda: ws._check_launch(
            *args, heads, r0, r1 - r0, col0, kw["stages"], kw["lag"]
        ),
        "two TMA descriptors": lambda: (
            ws._desc(p.q8, [qbox, 128]),
            ws._desc(p.k8, [ws.BLOCK_K, 128]),
        ),
        "kernel call (descriptors made before)": lambda: ws.run_kernel(
            dq, dk, p.k_scale, p.wq, p.ks, p.ke, out, r0, r1 - r0, col0, meta
        ),
        "launch_logits_ws": lambda: ws.launch_logits_ws(
            *args, heads=heads, row0=r0, n_rows=r1 - r0, col0=col0, **WS_LAUNCH[heads]
        ),
        FIXED_NAME: logits_runner(p, TRITON_FIXED, buf),
    }
    res = {}
    for name, fn in parts.items():
        fn()
        res[name] = host_ms(fn, calls=1000) * 1e3
    return res


def probe(out: Path | None, args=None) -> dict:
    shapes = parse_shapes(args.shapes) if args is not None and args.shapes else SHAPES
    res: dict = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "command": command_line(),
        "shapes": [],
    }
    for h, s, packed in shapes:
        ks, ke = row_ranges(s, packed)
        flops = 2 * h * D * count_pairs(ks, ke)
        q, k, w = random_row(s, h, seed=s + h + packed)
        p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
        shape = shape_name(h, s, packed)
        try:
            check = compare(p)
        except Exception as exc:  # report, keep timing the rest
            check = {"error": repr(exc)[:400]}
        print(shape, json.dumps(check), flush=True)
        buf = logits_buffer(p)
        runners = {FIXED_NAME: logits_runner(p, TRITON_FIXED, buf)}
        for v in WS_VARIANTS:
            runners[ws_name(v)] = ws_runner(p, buf, v)
        ms = time_interleaved(runners, ROUNDS)
        host = {name: host_ms(fn) for name, fn in runners.items()}
        gpu = {}  # every runner or none, so each has the fixed config's to compare with
        if min(ms.values()) < GPU_ONLY_MAX_MS:
            gpu = {name: gpu_only_ms(fn, host[name]) for name, fn in runners.items()}
        res["shapes"].append(
            {
                "shape": shape,
                "ms": ms,
                "host_ms": host,
                "gpu_only_ms": gpu,
                "tflops": {n: flops / (v * 1e9) for n, v in ms.items()},
                "check": check,
            }
        )
        print(shape, json.dumps({n: round(v, 4) for n, v in ms.items()}), flush=True)
        del p, buf, q, k, w
        torch.cuda.empty_cache()
    try:
        res["host_breakdown_us"] = {h: host_breakdown(h) for h in (64, 32)}
    except Exception as exc:  # the timed shapes above are still saved
        res["host_breakdown_error"] = repr(exc)[:400]
    res["markdown"] = markdown(res)
    return save_probe(out, "logits_ws_probe", res)


def markdown(res: dict) -> str:
    shapes = res["shapes"]
    names = list(shapes[0]["ms"])  # the fixed config first, then the run's variants
    head = ["kernel", *(r["shape"] for r in shapes)]
    body = []
    for name in names:
        row: list[object] = [name]
        for r in shapes:
            if name not in r["ms"]:
                row.append("-")
                continue
            base = r["ms"][FIXED_NAME]
            row.append(f"{r['ms'][name]:.3f} ({r['ms'][name] / base:.3f}), {r['tflops'][name]:.0f}")
        body.append(row)
    good = {"same_written": True, "deterministic": True}
    bad = [
        f"{r['shape']} {name}: {json.dumps(c)}"
        for r in shapes
        for name, c in r["check"].items()
        if not isinstance(c, dict)
        or any(c.get(k) != v for k, v in good.items())
        or not c.get("max_rel_diff", 1.0) <= MAX_REL_DIFF
        or c.get("written", 1) <= 0
    ]
    bitwise = all(
        isinstance(c, dict) and c.get("bitwise_equal_fixed")
        for r in shapes
        for c in r["check"].values()
    )
    same_first = all(
        isinstance(c, dict) and c.get("bitwise_equal_first_variant")
        for r in shapes
        for c in r["check"].values()
    )
    checks = (
        "at every shape, every variant wrote the fixed config's positions, its scores are "
        + ("bitwise equal to the fixed config's" if bitwise else "within fp32 rounding of them")
        + (
            ", every variant's bitwise equal to the first's"
            if same_first
            else ", NOT every variant's bitwise equal to the first's"
        )
        + " and two runs of it are bitwise equal"
        if not bad
        else "; ".join(bad)
    )
    host_body = [
        [name, *(f"{r['host_ms'][name] * 1e3:.0f}" if name in r.get("host_ms", {}) else "-"
                 for r in shapes)]
        for name in names
    ]  # fmt: skip
    gpu_shapes = [r for r in shapes if r.get("gpu_only_ms")]
    gpu_md = ""
    if gpu_shapes:

        def gpu_cell(r: dict, name: str) -> str:
            if name not in r["gpu_only_ms"] or FIXED_NAME not in r["gpu_only_ms"]:
                return "-"
            v, base = r["gpu_only_ms"][name], r["gpu_only_ms"][FIXED_NAME]
            return f"{v:.4f} ({v / base:.3f})"

        gpu_md = (
            f"\n\nGPU-only ms (ratio to the fixed config) where a call's launches take under "
            f"{GPU_ONLY_MAX_MS} ms (`gpu_only_ms`: each sample's calls queued behind a GPU "
            "sleep, so the host's time is hidden; medians of 5):\n\n"
            + markdown_table(
                ["kernel", *(r["shape"] for r in gpu_shapes)],
                [[name, *(gpu_cell(r, name) for r in gpu_shapes)] for name in names],
            )
        )
    breakdown = res.get("host_breakdown_us") or {}
    breakdown_md = ""
    if breakdown:
        parts = list(next(iter(breakdown.values())))
        breakdown_md = (
            "\n\nHost µs of one launch's parts at 4K packed rows (`host_breakdown`, 1000 "
            "calls each):\n\n"
            + markdown_table(
                ["part", *(f"H={h}" for h in breakdown)],
                [[part, *(f"{b[part]:.1f}" for b in breakdown.values())] for part in parts],
            )
        )
    return (
        f"Measured {res['date']}. Logits ms (ratio to the fixed config), TFLOP/s; all chunks "
        f"of a topk call, interleaved, {ROUNDS} rounds, medians.\n\n"
        + markdown_table(head, body)
        + "\n\nHost µs a topk call's launches (`host_ms`: the host's own time, the GPU idle "
        "at the start; a launch shorter than this leaves the GPU waiting for the host):\n\n"
        + markdown_table(head, host_body)
        + gpu_md
        + breakdown_md
        + f"\n\nScores against the fixed config's, every chunk: {checks}.\n"
    )


def profile(which: str) -> None:
    """Two launches at 16K causal, H = 64 of the fixed config or `ws` (s4/lag1/convert) or
    `banks` (the fixed path's WS launch), for
    `ncu --launch-skip 1 --launch-count 1`."""
    ks, ke = row_ranges(16384, packed=False)
    q, k, w = random_row(16384, 64, seed=1)
    p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
    buf = logits_buffer(p)
    if which == "fixed":
        run = logits_runner(p, TRITON_FIXED, buf)
    else:
        run = ws_runner(p, buf, {"epilogue": "convert"} if which == "ws" else {})
    for _ in range(2):
        run()
    torch.cuda.synchronize()


def main() -> None:
    if sys.argv[1:2] == ["--profile"]:
        if sys.argv[2:] not in (["fixed"], ["ws"], ["banks"]):
            sys.exit("usage: logits_ws_probe.py --profile fixed|ws|banks")
        profile(sys.argv[2])
        return
    probe_main(__doc__, TITLE, "logits_ws_probe.py", "logits_ws_probe.json", probe, add_options)


if __name__ == "__main__":
    main()
