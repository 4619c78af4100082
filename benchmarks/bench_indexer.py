"""Benchmark the fixed-config fp8 indexer (issue 5) on the GPU; prints tables, records them.

    python benchmarks/bench_indexer.py [--out DIR] [--quick] [--no-append]
    python benchmarks/bench_indexer.py --final --out DIR [--budget-s 125]   # benchmarks/indexer_final.py
    python benchmarks/bench_indexer.py --append-results DIR/indexer_final.json   # no GPU needed
    python benchmarks/bench_indexer.py --append-results DIR   # a plain run's --out folder

A plain run is RESULTS.md's `bench_indexer` section, a --final run `bench_indexer_final`
(benchmarks/_results.py: the latest in RESULTS.md, every run in benchmarks/history/).

One run measures, for S in {4K..128K}, H in {64, 32}, D = 128, topk = 2048, and two rows (one
causal document; a packed row of six documents):
- TFLOP/s of the logits kernel, counted as 2*H*D*(valid (query, key) pairs);
- logits ms, top-k ms (select kernel + stable sort + fallback; each on one stream), end-to-end
  ms (quantize, checks, every chunk; wall clock from the host, synchronised) with the fixed
  config, and with the other chunk-overlap mode (the fixed config runs one stream: "priority");
- fixed / best: the fixed config's logits time over the best of `SWEEP_CONFIGS` (the wider
  sweep, benchmarks/indexer_peers.py) at that shape, both measured in the same loop;
plus torch.topk over full logits at S=32K for scale, and the varied-row test: ten packed rows
of 16K-32K tokens through the fixed config and through the autotuned-per-length peer, tuning
included.

Kernels are compiled up front in parallel worker processes (each a tiny launch that fills
Triton's on-disk cache), so compile time does not pollute the timings and a lease is not spent
compiling serially. Absolute times are only meaningful from the GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import markdown_table, record_result, record_saved, run_stamp
from benchmarks.indexer_peers import SWEEP_CONFIGS, autotuned_indexer_topk, fresh_autotuned_launcher
from packshard.kernels.fp8_indexer import (
    FIXED_CONFIG,
    IndexerConfig,
    PreparedInputs,
    fp8_indexer_logits,
    fp8_indexer_topk,
    indexer_topk_prepared,
    plan_chunks,
    prepare_inputs,
)
from packshard.kernels.logits import WS_LAUNCH, LogitsConfig, launch_logits, triton_launch
from packshard.kernels.topk import TopkWorkspace

PROCESS_START = time.monotonic()  # --final's budget counts from here (after the imports)
D = 128
TOPK = 2048
SIZES = [4096, 8192, 16384, 32768, 65536, 131072]
HEADS = [64, 32]
DOC_FRACTIONS = [0.30, 0.05, 0.20, 0.10, 0.25, 0.10]  # the packed row: six documents
BENCH_TITLE = "fp8 indexer (issue 5): fixed config vs sweep, top-k, varied rows"


# ----------------------------------------------------------------------------- inputs
def row_ranges(s: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ks/ke of one row of s tokens: one causal document, or DOC_FRACTIONS of s back to back."""
    if packed:
        lens = [int(f * s) // 8 * 8 for f in DOC_FRACTIONS]
        lens[-1] = s - sum(lens[:-1])
    else:
        lens = [s]
    ks = np.concatenate([np.full(n, sum(lens[:i])) for i, n in enumerate(lens)])
    ke = np.arange(1, s + 1)
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


def count_pairs(ks: torch.Tensor, ke: torch.Tensor) -> int:
    """Valid (query, key) pairs of a row: the scores its flops are counted on (2 H D each)."""
    return int((ke - ks).clamp_min(0).sum())


def random_row(s: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(s, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(s, h, device="cuda", generator=g) / h**0.5
    return q, k, w


# ----------------------------------------------------------------------------- timing
def wall_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median host wall time of fn() with the device synchronised before and after."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def batch_size(fn, min_sample_ms: float) -> int:
    """Back-to-back calls of fn() (async launches only) that cover min_sample_ms of device time."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return max(1, math.ceil(min_sample_ms / max(a.elapsed_time(b), 1e-3)))


def event_ms(fn, reps: int, warmup: int = 1, min_sample_ms: float = 3.0) -> float:
    """Median device ms of one fn() call (async launches only), from `max(reps, 3)` samples.

    A sample times n back-to-back calls between two CUDA events, n chosen so that it covers
    min_sample_ms: the host's launch latency between an idle GPU and the first kernel is paid
    once a sample, not once a call. Timing single calls put ~0.07 ms of it on every 0.15 ms
    logits launch at 4K in the 2026-12-03 main runs (0.22 ms against 0.15 in the final runs).
    """
    for _ in range(warmup):
        fn()
    n = batch_size(fn, min_sample_ms)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(max(reps, 3)):
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times)


def chunk_plan(p: PreparedInputs) -> list[tuple[int, int, int, int]]:
    """The chunks (row0, row1, col0, width) a topk call with the fixed config runs for p."""
    extra = TopkWorkspace.bytes_per_row(TOPK, FIXED_CONFIG.topk)
    return plan_chunks(p.ks_host, p.ke_host, p.k8.shape[0], extra, FIXED_CONFIG.max_chunk_bytes)


def logits_runner(
    p: PreparedInputs,
    cfg: LogitsConfig,
    buf: torch.Tensor | None = None,
    chunks: list[tuple[int, int, int, int]] | None = None,
):
    """All chunks' logits launches of a topk call, for timing one logits config alone.

    `buf` (from `logits_buffer(p)`) lets several runners share one chunk buffer (up to 8 GiB);
    `chunks` replaces the fixed config's plan (`chunk_plan(p)`).
    """
    if chunks is None:
        chunks = chunk_plan(p)
    if buf is None:
        buf = logits_buffer(p, chunks)

    def run() -> None:
        for r0, r1, col0, width in chunks:
            out = buf[: (r1 - r0) * width].view(r1 - r0, width)
            launch_logits(
                p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, out,
                heads=p.heads, row0=r0, n_rows=r1 - r0, col0=col0, config=cfg,
            )  # fmt: skip

    return run


def launch_identity(p: PreparedInputs, cfg: LogitsConfig) -> tuple:
    """What `logits_runner(p, cfg)` launches, chunk by chunk, decided as `launch_logits` decides:
    the warp-specialised kernel, or the Triton kernel's constexprs, launch options and grid.
    Configs with equal identities run the same binaries with the same arguments (at H = 32 the
    fixed config's pairing, cap and relu do not apply, so it runs n128/k64/w4/s3's kernel): a
    benchmark times them once instead of reporting noise between identical launches."""
    kinds = []
    for r0, r1, col0, _ in chunk_plan(p):
        n = r1 - r0
        if cfg.runs_warp_specialised(p.q8, p.k8, p.heads, n, col0):
            kinds.append(("ws", *sorted(WS_LAUNCH[p.heads].items())))
            continue
        grid, meta, options = triton_launch(cfg, p.heads, n, p.k8.shape[0])
        kinds.append(("triton", grid, *sorted(meta.items()), *sorted(options.items())))
    return tuple(kinds)


def logits_buffer(
    p: PreparedInputs, chunks: list[tuple[int, int, int, int]] | None = None
) -> torch.Tensor:
    """A buffer for the largest chunk of `logits_runner(p, ...)` (of `chunks` if given)."""
    if chunks is None:
        chunks = chunk_plan(p)
    size = max((r1 - r0) * w for r0, r1, _, w in chunks)
    return torch.empty(size, dtype=torch.float32, device=p.q8.device)


# ----------------------------------------------------------------------------- compile up front
def _warm_one(job: tuple) -> tuple[str, float]:
    """Worker: compile one kernel config by a tiny launch (fills the shared on-disk cache)."""
    kind, h, cfg = job
    t0 = time.perf_counter()
    ks, ke = row_ranges(256, packed=False)
    q, k, w = random_row(256, h, seed=0)
    ks, ke = ks.cuda(), ke.cuda()
    regs = ""
    if kind == "logits":
        p = prepare_inputs(q, k, w, ks, ke)
        out = torch.empty((256, p.k8.shape[0]), dtype=torch.float32, device=q.device)
        # a config with group_min_scores runs its one-block form at this size: both binaries,
        # the registers of the large launches' one
        large = dataclasses.replace(cfg, group_min_scores=None)
        for c in dict.fromkeys([cfg.for_launch(256, p.k8.shape[0]), large]):
            kern = launch_logits(
                p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, out,
                heads=p.heads, row0=0, n_rows=256, col0=0, config=c,
            )  # fmt: skip
        regs = f" (registers {kern.n_regs}, spills {kern.n_spills})"
    else:
        fp8_indexer_topk(q, k, w, ks, ke, TOPK, config=dataclasses.replace(FIXED_CONFIG, topk=cfg))
    torch.cuda.synchronize()
    name = cfg.label if kind == "logits" else str(cfg)
    return f"{kind} H={h} {name}{regs}", time.perf_counter() - t0


def warm_compile(workers: int) -> list[tuple[str, float]]:
    jobs = [("logits", h, c) for h in HEADS for c in SWEEP_CONFIGS]
    jobs += [("topk", 64, FIXED_CONFIG.topk)]
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        return list(ex.map(_warm_one, jobs))


# ----------------------------------------------------------------------------- the shape table
def bench_shape(s: int, h: int, packed: bool, reps: int, sweep: bool, cfg: IndexerConfig) -> dict:
    ks, ke = row_ranges(s, packed)
    pairs = count_pairs(ks, ke)
    q, k, w = random_row(s, h, seed=s + h + packed)
    ks, ke = ks.cuda(), ke.cuda()
    flops = 2 * h * D * pairs
    p = prepare_inputs(q, k, w, ks, ke)
    res: dict = {"S": s, "H": h, "row": "packed x6" if packed else "causal", "pairs": pairs}

    serial = dataclasses.replace(cfg, overlap="none")
    other = dataclasses.replace(cfg, overlap="priority" if cfg.overlap == "none" else "none")
    res["e2e_ms"] = wall_ms(lambda: fp8_indexer_topk(q, k, w, ks, ke, TOPK, config=cfg), reps)
    res["other_overlap"] = other.overlap
    res["e2e_other_ms"] = wall_ms(
        lambda: fp8_indexer_topk(q, k, w, ks, ke, TOPK, config=other), reps
    )
    stage = []  # the stage split on one stream: each kernel's own time, not contended
    for _ in range(reps):
        st = {"timing": True}
        indexer_topk_prepared(p, TOPK, serial, stats=st)
        stage.append(st)
    for key in ("logits_ms", "select_ms", "order_ms", "topk_ms"):
        res[key] = statistics.median(x[key] for x in stage)
    res["fallback_rows"] = stage[-1]["fallback_rows"]
    res["chunks"] = stage[-1]["chunks"]
    res["prepare_ms"] = wall_ms(lambda: prepare_inputs(q, k, w, ks, ke), reps)
    fixed = cfg.logits
    res["fixed_logits_ms"] = event_ms(logits_runner(p, fixed), reps)
    res["tflops"] = flops / (res["fixed_logits_ms"] * 1e9)
    if sweep:
        cfg_ms = {}
        for cfg in SWEEP_CONFIGS:
            if cfg.block_n >= h:
                cfg_ms[label(cfg)] = event_ms(logits_runner(p, cfg), max(2, reps - 1))
        best = min(cfg_ms, key=cfg_ms.get)
        res["sweep_ms"] = cfg_ms
        res["best_config"] = best
        res["best_ms"] = cfg_ms[best]
        res["fixed_over_best"] = cfg_ms[label(fixed)] / cfg_ms[best]
    return res


def torch_topk_reference(s: int, reps: int) -> float:
    """torch.topk(sorted) over the full [S, S] logits (-inf masked): the issue's baseline."""
    ks, ke = row_ranges(s, packed=False)
    q, k, w = random_row(s, 64, seed=9)
    logits = fp8_indexer_logits(q, k, w, ks.cuda(), ke.cuda())
    return event_ms(lambda: torch.topk(logits, TOPK, dim=1), reps)


# ----------------------------------------------------------------------------- varied rows
def bench_varied_rows(cfg: IndexerConfig, h: int = 64) -> dict:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(16384 // 8, 32768 // 8 + 1, size=10) * 8]
    rows = []
    for i, s in enumerate(lengths):
        ks, ke = row_ranges(s, packed=True)
        q, k, w = random_row(s, h, seed=100 + i)
        rows.append((q, k, w, ks.cuda(), ke.cuda()))

    def run_all(fn) -> list[float]:
        out = []
        for q, k, w, ks, ke in rows:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(q, k, w, ks, ke, TOPK)
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    fixed = run_all(lambda *a: fp8_indexer_topk(*a, config=cfg))
    launcher = fresh_autotuned_launcher()
    peer_cold = run_all(lambda *a: autotuned_indexer_topk(*a, launcher=launcher, config=cfg))
    peer_warm = run_all(lambda *a: autotuned_indexer_topk(*a, launcher=launcher, config=cfg))
    # the peer autotunes the Triton kernel: its indices are compared with the fixed config's
    # Triton form (the fixed config runs the warp-specialised kernel from 2^28 scores on sm_90,
    # whose scores differ in fp32 rounding)
    triton_cfg = dataclasses.replace(
        cfg, logits=dataclasses.replace(cfg.logits, ws_min_scores=None)
    )
    same = all(
        torch.equal(
            fp8_indexer_topk(*r, TOPK, config=triton_cfg),
            autotuned_indexer_topk(*r, TOPK, launcher=launcher, config=cfg),
        )
        for r in rows[:2]
    )
    return {
        "lengths": lengths,
        "fixed_s": sum(fixed),
        "peer_cold_s": sum(peer_cold),
        "peer_warm_s": sum(peer_warm),
        "fixed_rows_s": fixed,
        "peer_cold_rows_s": peer_cold,
        "same_indices": same,
        "peer_configs": {str(k): v for k, v in launcher.best_configs().items()},
    }


# ----------------------------------------------------------------------------- report
def label(c: LogitsConfig) -> str:
    return c.label


def guarded(name: str, fn):
    """Run one section; a failure is printed with its traceback and named in the output, and the
    remaining sections still run (a lease is too short to lose the rest to one broken shape)."""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        print(f"SECTION FAILED: {name}: {exc!r}", flush=True)
        return None


def shape_table(results: list[dict]) -> str:
    other = results[0].get("other_overlap", "none") if results else "none"
    headers = ["H", "row", "S", "valid pairs", "logits ms", "TFLOP/s", "top-k ms (select + order)",
               "total ms", f"total ms, overlap {other}", "fixed/best", "best of sweep",
               "fallback rows"]  # fmt: skip
    rows = [
        [
            r["H"],
            r["row"],
            f"{r['S'] // 1024}K",
            f"{r['pairs']:.3e}",
            f"{r['fixed_logits_ms']:.2f}",
            f"{r['tflops']:.0f}",
            f"{r['topk_ms']:.2f} ({r['select_ms']:.2f} + {r['order_ms']:.2f})",
            f"{r['e2e_ms']:.2f}",
            f"{r['e2e_other_ms']:.2f}" if "e2e_other_ms" in r else "-",
            f"{r.get('fixed_over_best', float('nan')):.3f}",
            r.get("best_config", "-"),
            r["fallback_rows"],
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


def parse_shapes(text: str) -> tuple[tuple[int, int, bool], ...]:
    """`--shapes` (`--final`): comma-separated H:S:causal|packed, e.g.
    "64:4096:packed,32:8192:causal"; H 32 or 64 (the fixed path's head counts), S a positive
    multiple of 1024 (shapes are named by S // 1024)."""
    shapes = []
    for item in text.split(","):
        try:
            h, s, kind = item.strip().split(":")
            if kind not in ("causal", "packed") or int(h) not in (32, 64):
                raise ValueError(item)
            if int(s) <= 0 or int(s) % 1024:
                raise ValueError(item)
            shapes.append((int(h), int(s), kind == "packed"))
        except ValueError:
            raise SystemExit(
                f"--shapes: {item!r} is not H:S:causal|packed with H 32 or 64 and S a positive "
                "multiple of 1024"
            ) from None
    return tuple(shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for markdown + json")
    ap.add_argument("--quick", action="store_true", help="S <= 16K, no sweep, no varied rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--no-append", action="store_true", help="do not record in RESULTS.md")
    ap.add_argument("--skip-varied", action="store_true", help="no varied-row test")
    ap.add_argument(
        "--final",
        action="store_true",
        help="the final candidates run (benchmarks/indexer_final.py): end to end at 64K, the "
        "logits sweep + candidates at the target shapes, inside --budget-s",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=125.0,
        help="--final: seconds from the process start; shapes that would end later are skipped",
    )
    ap.add_argument(
        "--shapes",
        default="",
        help="--final: H:S:causal|packed,... instead of its shape list (the end to end runs too)",
    )
    ap.add_argument(
        "--append-results",
        type=Path,
        metavar="FILE",
        help="record a --final run's indexer_final.json, or a plain run's --out folder, as the "
        "latest bench_indexer_final / bench_indexer result (no GPU needed)",
    )
    args = ap.parse_args()
    if args.append_results is not None:
        if args.append_results.is_dir():
            print(append_bench_results(args.append_results))
            return
        from benchmarks.indexer_final import append_final_results

        print(append_final_results(args.append_results))
        return
    if args.shapes and not args.final:
        sys.exit("bench_indexer.py: --shapes is for --final runs")
    shapes = parse_shapes(args.shapes) if args.shapes else None
    if not torch.cuda.is_available():
        sys.exit("bench_indexer.py needs a CUDA GPU (run it through the device tool)")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if args.final:
        from benchmarks.indexer_final import run_final

        run_final(out, args.budget_s, args.workers, PROCESS_START, shapes)
        return
    sizes = [s for s in SIZES if s <= 16384] if args.quick else SIZES

    t0 = time.perf_counter()
    compiled = guarded("parallel compile", lambda: warm_compile(args.workers)) or []
    print(
        f"compiled {len(compiled)} kernels in {time.perf_counter() - t0:.1f} s (parallel)",
        flush=True,
    )

    cfg = FIXED_CONFIG  # every table below measures the committed fixed config
    body = ""
    results = []
    for h in HEADS:
        for s in sizes:
            for packed in (False, True):
                r = guarded(
                    f"shape S={s} H={h} packed={packed}",
                    lambda s=s, h=h, packed=packed: bench_shape(
                        s, h, packed, args.reps, not args.quick, cfg
                    ),
                )
                if r is None:
                    continue
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "sweep_ms"}), flush=True)
                if out:
                    (out / "indexer_shapes.json").write_text(json.dumps(results, indent=1))
    body += (
        f"### Fixed config {label(cfg.logits)}, top-k {cfg.topk.label}, chunk overlap "
        f"{cfg.overlap}; topk {TOPK}, D 128\n\n"
        "total = wall clock of `fp8_indexer_topk` (quantize, checks, every chunk); the next column "
        "the same with the other chunk-overlap mode; logits and top-k columns are each kernel's "
        "own time on one stream\n\n"
    )
    body += shape_table(results) + "\n"
    extra: dict = {"topk_config": cfg.topk.label}
    if not args.quick:
        ref = guarded("torch.topk", lambda: torch_topk_reference(32768, args.reps))
        if ref is not None:
            extra["torch_topk_32k_ms"] = ref
            body += f"\ntorch.topk(sorted) over the full 32K x 32K logits: {ref:.2f} ms\n"
    if not args.quick and not args.skip_varied:
        v = guarded("varied rows", lambda: bench_varied_rows(cfg))
    else:
        v = None
    if v:
        extra["varied"] = v
        body += "\n### Varied rows: 10 packed rows of " + ", ".join(
            f"{x / 1024:.1f}K" for x in v["lengths"]
        )
        body += " tokens (H=64)\n\n" + markdown_table(
            ["indexer", "10 rows, s", "per row, ms"],
            [
                ["fixed config", f"{v['fixed_s']:.3f}", f"{1e3 * v['fixed_s'] / 10:.1f}"],
                ["autotuned per length, tuning included", f"{v['peer_cold_s']:.3f}", f"{1e3 * v['peer_cold_s'] / 10:.1f}"],
                ["autotuned, second pass (tuned)", f"{v['peer_warm_s']:.3f}", f"{1e3 * v['peer_warm_s'] / 10:.1f}"],
            ],
        )  # fmt: skip
        body += (
            f"\n\nratio autotuned (with tuning) / fixed: {v['peer_cold_s'] / v['fixed_s']:.1f}x; "
        )
        body += f"indices identical to the fixed config's Triton kernel's: {v['same_indices']}\n"
    print("\n" + body)
    if out:
        (out / "indexer_bench.md").write_text(body)
        (out / "indexer_extra.json").write_text(json.dumps(extra, indent=1, default=str))
        (out / "indexer_compile.json").write_text(json.dumps(compiled, indent=1))
        (out / "indexer_meta.json").write_text(json.dumps(run_stamp()))
    if not args.no_append:
        record_result("bench_indexer", BENCH_TITLE, body, data={"shapes": results, **extra})


def append_bench_results(folder: Path) -> str:
    """Record a device run's tables (DIR/indexer_bench.md + indexer_meta.json) as
    bench_indexer's latest result."""
    try:
        body = (folder / "indexer_bench.md").read_text()
        meta = json.loads((folder / "indexer_meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{folder}: no readable indexer_bench.md + indexer_meta.json ({e}); pass the --out "
            "folder of a `bench_indexer.py` run"
        ) from e
    return record_saved(
        {**meta, "markdown": body}, "bench_indexer", BENCH_TITLE,
        f"{folder / 'indexer_meta.json'}: not a bench_indexer.py run's",
    )  # fmt: skip


if __name__ == "__main__":
    main()
