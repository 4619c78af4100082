"""Launch the DP x CP measurement under torchrun and write its report (issue 8).

    # 8 H200s: dp 4 x cp 2, the long-trajectory mix at 32K (carry .bench/multigpu_data)
    benchmarks/multigpu/launch.sh --nproc 8 --cp 2 --out $OUT
    # CPU proxy: gloo, dp 2 x cp 2, tiny model, its own small long mix
    benchmarks/multigpu/launch.sh --cpu --out .bench/multigpu_cpu [--append]
    # afterwards, here: append a fetched GPU result to benchmarks/RESULTS.md
    .venv/bin/python benchmarks/multigpu/launch.py --append-results /path/to/multigpu_results.json

It sets the NVLink-multicast variables (`run.MULTICAST_OFF`) in its own environment, which every
rank inherits (the ranks also check them on the GPU), runs
`python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/multigpu/run.py ...`
with all arms (padseq, count, cost: one process group, interleaved), then adds the summary and
the markdown to `multigpu_results.json` and writes `multigpu_results.md` and
`multigpu_run.log` beside it. `--append` (or `--append-results FILE`) appends the section to
benchmarks/RESULTS.md through benchmarks/_results.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.multigpu.run import MULTICAST_OFF, RESULTS_JSON  # noqa: E402

DEFAULT_GPU_DATA = REPO / ".bench" / "multigpu_data" / "long_greedy"
CPU_SEQ_LEN = 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cpu", action="store_true", help="the gloo proxy: preset cpu, 4 ranks, its own small mix"
    )
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; --cpu: 4)")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--cp-layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder with pad8/ and padseq/ (GPU default: .bench/multigpu_data/long_greedy)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"])
        if os.environ.get("OUT")
        else REPO / ".bench" / "multigpu_out",
    )
    p.add_argument("--arms", default="padseq,count,cost")
    p.add_argument("--steps", type=int, default=None, help="default: GPU 10, CPU 8")
    p.add_argument("--warmup", type=int, default=None, help="default: GPU 2, CPU 1")
    p.add_argument("--rows-per-rank", type=int, default=4)
    p.add_argument("--check-steps", default="0,-1")
    p.add_argument("--seq-len", type=int, default=CPU_SEQ_LEN, help="--cpu: the mix's seq_len")
    p.add_argument("--deadline-s", type=float, default=480.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--append", action="store_true", help="append the section to benchmarks/RESULTS.md"
    )
    p.add_argument(
        "--append-results", type=Path, metavar="JSON", help="only append a finished run's results"
    )
    return p.parse_args(argv)


def rank_env(cpu: bool) -> dict[str, str]:
    """This process's environment plus what every rank must see."""
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    if cpu:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def finish(out: Path, extra: dict[str, object] | None = None) -> dict:
    """Add the summary and markdown to the rank-0 JSON; write the .md; print the table."""
    from benchmarks.multigpu.report import markdown, summarize

    path = out / RESULTS_JSON
    result = json.loads(path.read_text())
    result.update(extra or {})
    result["summary"] = summarize(result)
    result["markdown"] = markdown(result)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "multigpu_results.md").write_text(result["markdown"] + "\n")
    print(result["markdown"])
    return result


def append(result: dict) -> None:
    """Record a run's multigpu_results.json as the multigpu benchmark's latest result."""
    from benchmarks._results import record_saved
    from benchmarks.multigpu.report import TITLE_CPU, TITLE_GPU

    title = TITLE_CPU if result.get("device") == "cpu" else TITLE_GPU
    # the command a user retypes is the launcher's, not the per-rank script's
    saved = {**result, "command": result.get("launch_command", result.get("command"))}
    record_saved(saved, "multigpu", title, "not a multigpu_results.json written by run.py")
    print(f"\nrecorded in {REPO / 'benchmarks' / 'RESULTS.md'} and benchmarks/history/")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.append_results is not None:
        append(json.loads(args.append_results.read_text()))
        return 0
    os.environ.update(MULTICAST_OFF)  # this process too (and so torchrun and every rank)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps if args.steps is not None else (8 if args.cpu else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 2)
    if args.cpu:
        nproc = args.nproc or 4
        data = args.data
        if data is None:
            from benchmarks.e2e_ablation.config import PRESETS
            from benchmarks.multigpu.data import prepare_cpu_mix

            data = out / "data"
            rows = steps * args.rows_per_rank * (nproc // args.cp)
            info = prepare_cpu_mix(
                data, seq_len=args.seq_len, rows=rows, vocab_size=PRESETS["smoke"].model.vocab_size
            )
            print(
                f"CPU long mix: {info['pad8']['rows']} rows, padseq padding {info['padseq']['padding_fraction']:.1%}"
            )
    else:
        import torch

        nproc = args.nproc or torch.cuda.device_count()
        data = args.data or DEFAULT_GPU_DATA
        if nproc < 1:
            raise SystemExit("no CUDA device: use --cpu for the gloo proxy")
    if not (data / "pad8").is_dir():
        raise SystemExit(f"{data}/pad8 is missing: see benchmarks/multigpu/README.md (data)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "benchmarks" / "multigpu" / "run.py"), "--data", str(data), "--preset", "cpu" if args.cpu else "h200",
           "--cp", str(args.cp), "--cp-layout", args.cp_layout, "--arms", args.arms, "--steps", str(steps),
           "--warmup", str(warmup), "--rows-per-rank", str(args.rows_per_rank), "--check-steps", args.check_steps,
           "--seed", str(args.seed), "--deadline-s", str(args.deadline_s), "--out", str(out)]  # fmt: skip
    uptime = _uptime()
    print("running:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with open(out / "multigpu_run.log", "w") as logf, subprocess.Popen(
        cmd, env=rank_env(args.cpu), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    ) as proc:  # fmt: skip
        for line in proc.stdout or ():
            sys.stdout.write(line)
            logf.write(line)
        rc = proc.wait()
    if not (out / RESULTS_JSON).is_file():
        print(
            f"torchrun exited {rc} and wrote no {RESULTS_JSON}; see {out / 'multigpu_run.log'}",
            file=sys.stderr,
        )
        return rc or 1
    extra = {"uptime": f"{uptime} before, {_uptime()} after", "launch_wall_s": time.monotonic() - t0,
             "launch_command": "benchmarks/multigpu/launch.py " + " ".join(sys.argv[1:] if argv is None else argv),
             "torchrun_rc": rc}  # fmt: skip
    if args.cpu:
        extra["seq_len"] = args.seq_len
    result = finish(out, extra)
    if args.append:
        append(result)
    return rc


def _uptime() -> str:
    try:
        return "load average " + ", ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
