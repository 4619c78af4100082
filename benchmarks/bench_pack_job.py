"""The whole pack job against the tokenize-only floor, its serial part, and where it scales to.

Data: the shared mix (GSM8K train, OASST, Glaive tool calls, Alpaca, Gutenberg, SWE-agent
trajectories: 9,201 samples, 2.78M Qwen2.5 tokens), seq_len 131072, cp 8, at two sizes: 1x,
and Kx (`--scale K`, default 4: every input given K times, on both sides). At 1x the job takes
~5 s of tokenizing a worker, so its fixed start-up costs weigh; Kx shows the job as it runs on
real data.

Threads. The fast tokenizer batch-encodes on a Rayon thread pool: unpinned, "1 worker" uses
~1.6 cores of 2 on either side. Both sides run pinned to one thread a process
(``TOKENIZERS_PARALLELISM=false``, ``RAYON_NUM_THREADS=1``, set before anything tokenizes; the
job's Ray workers pin themselves the same way by default), so W workers are W cores.

The floor (tokenize only). The same fast tokenizer over the same samples, doing only what
tokenization needs: render each chat with `apply_chat_template(tokenize=False)`, one batched
`tokenizer(texts)` call per 1000 samples (text documents: `tokenizer(texts)` + EOS), through
`datasets.Dataset.map(batched=True)`. No masks, no packing, nothing written; the samples are
in memory and the tokenizer loaded before the clock starts. With n processes (forked inside the
clock, each with its share in memory beforehand) every process gets an equal share of the
tokens with the same mix of kinds (samples dealt in order to the lightest share);
`datasets.map(num_proc=2)` cuts the rows into halves of 0.97M and 1.80M tokens instead. The
floor at W workers is the best median over n = 1..W processes.

Ours. `pipeline.pack.main` in this process on a fresh local Ray of W CPUs (fresh worker
processes, as every submitted job gets): counting, reading, validating, rendering and masking,
tokenizing, packing, writing and verifying the shards, committing index and manifest, printing
the summary. "job" is the job on a running Ray (as under `ray job submit`; the driver's
imports are done, and its tokenizer comes from packshard's tokenizer cache, which the untimed
reference run fills, as any earlier run with the tokenizer does); "+ start" adds the local
Ray's start, which `packshard pack` on a laptop pays too. Both sides tokenize the same samples into the same tokens (checked).

The serial part. The same samples pre-tokenized (the tokens and loss masks of our own output,
parquet `input_ids` + `loss_mask`), packed with ``--kind input_ids`` on W_max workers at 1x and
16x (`--serial-scale`; 44M tokens, two shards, so the per-token part stands out of the ~2.5 s
of fixed cost): the job without tokenizing (driver, counting, planning, reading, packing, writing,
verifying, commit). The two sizes split it into a fixed cost C and a rate R (tokens/s):
serial(N) = C + N / R. R / floor(1 worker) must be >= 16 so that 16 workers stay
tokenizer-bound.

Amdahl. The 1-worker job at the two sizes gives its time per token t1; the parallel part per
token is p = t1 - 1 / R; the job at W workers then takes T(W, N) = C + N / R + N p / W.
Projected tokens/s at 1, 2, 16, 64 workers for the Kx data and for 1000x it, against W x the
1-worker floor, plotted to `benchmarks/plots/bench_pack_job.png`.

Bytecode. packshard's modules are compiled to bytecode before the runs, as pip compiles an
installed package: this machine sets ``PYTHONDONTWRITEBYTECODE=1``, under which every fresh Ray
worker of an editable install would compile the packshard modules it imports (~50 ms a worker).

Every repeat runs ours, the floors and the serial runs interleaved; the tables give medians and
the load average (1 min) at the start of the runs. `--append-results` records the run
(RESULTS.md section `bench_pack_job`, a history line).

Usage: `.venv/bin/python benchmarks/bench_pack_job.py --repeats 3 --workers 1,2 --scale 4
--append-results` (needs ../shared; ~10 min on an idle 2-core machine, ~12 at load 4).
"""

from __future__ import annotations

# Thread pinning precedes every import that could start a Rayon pool.
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse
import compileall
import json
import logging
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import packshard
from benchmarks._results import markdown_table, record_result

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
INPUTS = [
    "gsm8k/train.jsonl",
    "chat/oasst_en_100_threads.messages.jsonl",
    "chat/glaive_toolcall_en_demo.messages.jsonl",
    "chat/alpaca_en_demo.messages.jsonl",
    "long_context/gutenberg/long_docs.jsonl",
    "long_context/agent_trajectories/swe_agent_trajectories.messages.jsonl",
]
TOKENIZER = "tokenizers/qwen2.5-instruct"
JOB_FLAGS = ["--seq-len", "131072", "--cp", "8", "--no-progress"]
PLOT = Path(__file__).resolve().parent / "plots" / "bench_pack_job.png"
TARGET_JOB, TARGET_SERIAL = 0.9, 16.0
PROJECT_WORKERS = (1, 2, 16, 64)
med = statistics.median


# ---- the floor ------------------------------------------------------------------------------


def samples(shared: Path) -> list[dict[str, Any]]:
    """The benchmark's samples as the floor sees them: a chat (messages, tools) or a text."""
    out = []
    for rel in INPUTS:
        with open(shared / rel) as f:
            for line in f:
                r = json.loads(line)
                row = {"kind": "chat", "messages": "null", "tools": "null", "text": ""}
                if "question" in r:
                    msgs = [
                        {"role": "user", "content": r["question"]},
                        {"role": "assistant", "content": r["answer"]},
                    ]
                    row["messages"] = json.dumps(msgs)
                elif "messages" in r:
                    row["messages"], row["tools"] = (
                        json.dumps(r["messages"]),
                        json.dumps(r.get("tools")),
                    )
                else:
                    row["kind"], row["text"] = "text", r["text"]
                out.append(row)
    return out


def floor_map(batch: dict[str, list], tokenizer: Any) -> dict[str, list]:
    """Render chats, then one batched tokenizer call per kind (what a user's map would do)."""
    chat_idx = [i for i, k in enumerate(batch["kind"]) if k == "chat"]
    text_idx = [i for i, k in enumerate(batch["kind"]) if k == "text"]
    rendered = [
        tokenizer.apply_chat_template(
            json.loads(batch["messages"][i]), tools=json.loads(batch["tools"][i]), tokenize=False
        )
        for i in chat_idx
    ]
    ids: list[list[int]] = [[] for _ in batch["kind"]]
    if chat_idx:
        encoded = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        for i, row in zip(chat_idx, encoded, strict=True):
            ids[i] = row
    if text_idx:
        texts = [batch["text"][i] for i in text_idx]
        for i, row in zip(text_idx, tokenizer(texts)["input_ids"], strict=True):
            ids[i] = [*row, tokenizer.eos_token_id]
    return {"input_ids": ids}


def equal_shares(lengths: np.ndarray, n: int) -> list[list[int]]:
    """Sample indices for n shares of equal tokens and the same mix: each sample, in input
    order, goes to the share with the fewest tokens so far (ties: the lowest share)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    load = np.zeros(n, np.int64)
    for i, length in enumerate(lengths.tolist()):
        k = int(np.argmin(load))
        shares[k].append(i)
        load[k] += length
    return shares


_FLOOR: dict[str, Any] = {}  # the shares and tokenizer the forked floor processes inherit


def _floor_process(k: int) -> int:
    share = _FLOOR["shares"][k]
    out = share.map(
        floor_map,
        batched=True,
        batch_size=1000,
        fn_kwargs={"tokenizer": _FLOOR["tokenizer"]},
        remove_columns=share.column_names,
        keep_in_memory=True,
        load_from_cache_file=False,
    )
    return int(sum(len(x) for x in out["input_ids"]))


def run_floor(shares: list[Any], tokenizer: Any) -> tuple[float, int]:
    """Tokenize each share in its own forked process (the fork inside the clock)."""
    _FLOOR.update(shares=shares, tokenizer=tokenizer)
    t0 = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(len(shares)) as pool:
        tokens = sum(pool.map(_floor_process, range(len(shares))))
    return time.perf_counter() - t0, tokens


# ---- ours ----------------------------------------------------------------------------------


def raw_args(shared: Path, scale: int = 1) -> list[str]:
    args = []
    for _ in range(scale):
        for rel in INPUTS:
            args += ["--input", str(shared / rel)]
    return [*args, "--tokenizer", str(shared / TOKENIZER), "--columns",
            "prompt=question,completion=answer"]  # fmt: skip


def run_ours(args: list[str], out: Path, workers: int) -> tuple[float, float, int]:
    """(Ray start-up s, job s, tokens) of one fresh job on a fresh local Ray of W CPUs."""
    import ray

    from packshard.pipeline.pack import main, start_local_ray
    from packshard.pipeline.tokenizer_loading import load_located, load_tokenizer

    shutil.rmtree(out, ignore_errors=True)  # a fresh job every time (a rerun would be a no-op)
    load_tokenizer.cache_clear()  # no tokenizer held in this process from an earlier job (the
    load_located.cache_clear()  # driver reads the checked payload from the tokenizer cache)
    t0 = time.perf_counter()
    start_local_ray(workers)
    started = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        rc = main([*args, "--output", str(out), *JOB_FLAGS, "--num-workers", str(workers)])
        seconds = time.perf_counter() - t0
    finally:
        ray.shutdown()
    if rc != 0:
        raise SystemExit(f"pack job failed with exit status {rc}")
    m = json.loads((out / "manifest.json").read_text())
    return started, seconds, int(m["totals"]["num_tokens"] + m["totals"]["truncated_tokens"])


def write_pretokenized(dataset_dir: Path, dest: Path, copies: int) -> tuple[np.ndarray, int]:
    """Our own output's documents (tokens and loss masks) as parquet `input_ids` + `loss_mask`
    in sample order, `copies` files of it under `dest`; returns (tokens per sample, tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packshard.packers import ShardDataset

    docs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    with ShardDataset.open(str(dataset_dir)) as ds:
        for s in range(len(ds.shards)):
            for batch in ds.iter_shard(s):
                for row in batch.to_pylist():
                    ids, mask = np.asarray(row["input_ids"], np.int32), np.asarray(row["loss_mask"])
                    pos = 0
                    for sid, n in zip(row["sample_ids"], row["doc_lens"], strict=True):
                        docs[sid] = (ids[pos : pos + n], mask[pos : pos + n])
                        pos += n
    order = sorted(docs)
    if order != list(range(len(order))):
        raise SystemExit("the reference dataset does not hold every sample once (truncation?)")
    lengths = np.asarray([docs[i][0].size for i in order], np.int64)
    table = pa.table(
        {
            "input_ids": pa.array([docs[i][0] for i in order], pa.list_(pa.int32())),
            "loss_mask": pa.array([docs[i][1] for i in order], pa.list_(pa.bool_())),
        }
    )
    dest.mkdir(parents=True, exist_ok=True)
    for c in range(copies):
        pq.write_table(table, dest / f"part-{c:02d}.parquet", row_group_size=1024)
    return lengths, int(lengths.sum())


# ---- the runs --------------------------------------------------------------------------------


@dataclass
class Runs:
    """Seconds of every run, keyed by (size, workers or processes), and the loads."""

    job: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    start: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    floor: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    serial: dict[int, list[float]] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)

    def add(self, table: dict, key: Any, seconds: float) -> None:
        table.setdefault(key, []).append(seconds)

    def floor_best(self, size: int, workers: int) -> tuple[float, int]:
        """(median s, processes) of the fastest floor with 1..workers processes."""
        return min((med(self.floor[size, n]), n) for n in range(1, workers + 1))


def measure(args: argparse.Namespace, workers: list[int], tmp: Path) -> tuple[Runs, int]:
    import datasets
    from transformers import AutoTokenizer

    wmax, sizes = max(workers), sorted({1, args.scale})
    # Untimed: a reference run gives every sample's tokens (equal floor shares, the
    # pre-tokenized input) and warms the page cache.
    _, _, tokens = run_ours(raw_args(args.shared), tmp / "ref", wmax)
    lengths, n_pre = write_pretokenized(tmp / "ref", tmp / "pre", args.serial_scale)
    if n_pre != tokens:
        raise SystemExit(f"pre-tokenized {n_pre} tokens, the job {tokens}")
    rows = samples(args.shared)
    if len(rows) != lengths.size:
        raise SystemExit(f"{len(rows)} floor samples, {lengths.size} in the job")
    whole = datasets.Dataset.from_list(rows)
    shares = {}
    for size in sizes:
        data = datasets.concatenate_datasets([whole] * size)
        for n in range(1, wmax + 1):
            parts = equal_shares(np.tile(lengths, size), n)
            shares[size, n] = [data.select(ix).flatten_indices() for ix in parts]
    tokenizer = AutoTokenizer.from_pretrained(str(args.shared / TOKENIZER))
    pre_flags = ["--kind", "input_ids", "--tokenizer", str(args.shared / TOKENIZER)]
    runs = Runs()
    for rep in range(args.repeats):
        for size in sizes:
            for w in workers:
                runs.loads.append(os.getloadavg()[0])
                s, t, n = run_ours(raw_args(args.shared, size), tmp / "out", w)
                runs.add(runs.start, (size, w), s)
                runs.add(runs.job, (size, w), t)
                if n != size * tokens:
                    raise SystemExit(f"the job tokenized {n} tokens, not {size} x {tokens}")
            for n_proc in range(1, wmax + 1):
                runs.loads.append(os.getloadavg()[0])
                t, n = run_floor(shares[size, n_proc], tokenizer)
                runs.add(runs.floor, (size, n_proc), t)
                if n != size * tokens:
                    raise SystemExit(f"the floor tokenized {n} tokens, not {size} x {tokens}")
        for size in sorted({1, args.serial_scale}):
            runs.loads.append(os.getloadavg()[0])
            pre = [
                a
                for c in range(size)
                for a in ("--input", str(tmp / "pre" / f"part-{c:02d}.parquet"))
            ]
            _, t, n = run_ours([*pre, *pre_flags], tmp / "pre_out", wmax)
            runs.add(runs.serial, size, t)
            if n != size * tokens:
                raise SystemExit(f"the pre-tokenized job packed {n} tokens, not {size} x {tokens}")
        print(
            f"repeat {rep}: job { ({k: round(v[-1], 2) for k, v in runs.job.items()}) } s, floor "
            f"{ ({k: round(v[-1], 2) for k, v in runs.floor.items()}) } s, serial "
            f"{ ({k: round(v[-1], 2) for k, v in runs.serial.items()}) } s, load {runs.loads[-1]:.1f}",
            flush=True,
        )
    return runs, tokens


# ---- analysis --------------------------------------------------------------------------------


def fit(n_small: int, t_small: float, n_large: int, t_large: float) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of t = fixed + n x per_token through two points."""
    per_token = max((t_large - t_small) / (n_large - n_small), 1e-12)
    return t_small - n_small * per_token, per_token


@dataclass(frozen=True)
class Model:
    """T(W, N) = fixed + N x serial + N x parallel / W (seconds; per-token terms in s/token)."""

    fixed: float
    serial: float
    parallel: float

    def seconds(self, workers: int, tokens: float) -> float:
        return self.fixed + tokens * (self.serial + self.parallel / workers)


def plot(path: Path, floor_rate: float, measured: dict[str, dict[int, float]],
         model: dict[str, Callable[[int], float]]) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = np.unique(np.round(np.logspace(0, 6, 61, base=2)).astype(int))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(ws, ws * floor_rate, "k--", lw=1, label="floor, ideal (W x the 1-process floor)")
    for name, fn in model.items():
        ax.plot(ws, [fn(int(w)) for w in ws], lw=1.5, label=name)
    for name, pts in measured.items():
        ax.plot(list(pts), list(pts.values()), "o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="workers (one core each)", ylabel="tokens/s")
    ax.set_xticks([1, 2, 4, 8, 16, 32, 64], labels=["1", "2", "4", "8", "16", "32", "64"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("pack job: measured (points), Amdahl projection (lines)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(
    runs: Runs, tokens: int, workers: list[int], scale: int, serial_scale: int, plot_path: Path
) -> tuple[str, dict]:
    sizes = sorted({1, scale})
    job_rows, floor_rows = [], []
    for size in sizes:
        n = size * tokens
        for w in workers:
            f, best = runs.floor_best(size, w)
            o, s = med(runs.job[size, w]), med(runs.start[size, w])
            job_rows.append(
                [f"{size}x", w, f"{n / 1e6:.2f}M", f"{f:.2f} ({best} proc)", f"{o:.2f}",
                 f"{n / o / 1e3:,.0f}k", f"**{f / o:.2f}x**", f"{s:.2f}", f"{f / (o + s):.2f}x"]
            )  # fmt: skip
        for p in range(1, max(workers) + 1):
            t = runs.floor[size, p]
            floor_rows.append([f"{size}x", p, ", ".join(f"{x:.2f}" for x in t), f"{med(t):.2f}",
                               f"{n / med(t) / 1e3:,.0f}k"])  # fmt: skip
    big = scale if scale > 1 else 1
    floor_rate = big * tokens / med(runs.floor[big, 1])  # tokens/s of one process
    sbig = serial_scale
    serial_fixed, serial_per_token = (
        fit(tokens, med(runs.serial[1]), sbig * tokens, med(runs.serial[sbig]))
        if sbig > 1
        else (0.0, med(runs.serial[1]) / tokens)
    )
    serial_rows = [
        [f"{size}x", f"{size * tokens:,}", ", ".join(f"{x:.2f}" for x in runs.serial[size]),
         f"{med(runs.serial[size]):.2f}", f"{size * tokens / med(runs.serial[size]) / 1e6:.2f}M",
         f"{size * tokens / med(runs.serial[size]) / floor_rate:.1f}x"]
        for size in sorted({1, sbig})
    ]  # fmt: skip
    if sbig > 1:
        rate = 1 / serial_per_token
        serial_rows.append(["fit C + N / R", "", "", f"C = {serial_fixed:.2f} s",
                            f"R = {rate / 1e6:.2f}M", f"**{rate / floor_rate:.1f}x**"])  # fmt: skip
    job_fixed, job_per_token = (
        fit(tokens, med(runs.job[1, 1]), big * tokens, med(runs.job[big, 1]))
        if big > 1
        else (0.0, med(runs.job[1, 1]) / tokens)
    )
    # the job's own fixed cost; of its per-token time, what the serial part does not take
    # shrinks with the workers
    model = Model(max(job_fixed, 0.0), serial_per_token, max(job_per_token - serial_per_token, 0))
    curves = {
        f"ours projected, {big}x data ({big * tokens / 1e6:.1f}M tokens)": lambda w: (
            big * tokens / model.seconds(w, big * tokens)
        ),
        f"ours projected, 1000x data ({tokens * 1e3 / 1e9:.1f}B tokens)": lambda w: (
            1000 * tokens / model.seconds(w, 1000 * tokens)
        ),
    }
    fixed_text = []
    if big > 1:  # each side's fixed cost and time per token, through its 1x and Kx medians
        fixed_rows = []
        for w in workers:
            jf, jt = fit(tokens, med(runs.job[1, w]), big * tokens, med(runs.job[big, w]))
            ff, ft = fit(tokens, runs.floor_best(1, w)[0], big * tokens, runs.floor_best(big, w)[0])
            fixed_rows.append([w, f"{jf:.2f}", f"{jt * 1e6:.3f}", f"{ff:.2f}", f"{ft * 1e6:.3f}",
                               f"{ft / jt:.2f}x"])  # fmt: skip
        fixed_text = [
            f"Each side's fixed cost (start-up and tail) and time per token, fitted through its "
            f"1x and {big}x medians (job = the job on a running Ray: fresh worker processes, "
            f"each rebuilding the tokenizer; floor = forks that inherit the loaded tokenizer):",
            markdown_table(
                [
                    "workers",
                    "job fixed s",
                    "job us/token",
                    "floor fixed s",
                    "floor us/token",
                    "floor / job per token",
                ],
                fixed_rows,
            ),
        ]
    proj_rows = []
    for w in PROJECT_WORKERS:
        ideal = w * floor_rate
        proj_rows.append(
            [w, f"{ideal / 1e6:.2f}M"]
            + [f"{fn(w) / 1e6:.2f}M ({fn(w) / ideal:.2f}x)" for fn in curves.values()]
        )
    measured = {
        f"ours, {size}x data": {w: size * tokens / med(runs.job[size, w]) for w in workers}
        for size in sizes
    } | {
        f"floor, {size}x data": {w: size * tokens / runs.floor_best(size, w)[0] for w in workers}
        for size in sizes
    }
    plot(plot_path, floor_rate, measured, curves)
    loads = runs.loads
    note = (
        f"9,201 samples, {tokens:,} tokens a copy (GSM8K train, OASST, Glaive tool calls, "
        f"Alpaca, Gutenberg, SWE-agent trajectories), Qwen2.5 tokenizer, seq_len 131072, cp 8; "
        f"tokenizer threads pinned to 1 a process on both sides; medians of "
        f"{len(runs.serial[1])} interleaved repeats. Load average (1 min) at the runs' starts: "
        f"median {med(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f} (2 cores; other work "
        f"shares them)."
    )
    body = "\n\n".join(
        [
            note,
            f"Whole job vs the floor (target: job / floor >= {TARGET_JOB} at 1 and 2 workers; "
            f"job = on a running Ray, + start = with the local Ray's start-up):",
            markdown_table(
                [
                    "data",
                    "workers",
                    "tokens",
                    "floor s (best n)",
                    "job s",
                    "job tok/s",
                    "job / floor",
                    "Ray start s",
                    "(job + start) / floor",
                ],
                job_rows,
            ),
            *fixed_text,
            "The floor by process count (each process an equal share of the tokens):",
            markdown_table(["data", "processes", "runs s", "median s", "tok/s"], floor_rows),
            f"Serial part: the same tokens pre-tokenized (`--kind input_ids`), {max(workers)} "
            f"workers (target: R >= {TARGET_SERIAL:.0f}x the 1-process floor's "
            f"{floor_rate / 1e3:,.0f}k tok/s):",
            markdown_table(
                ["data", "tokens", "runs s", "median s", "tok/s", "/ floor(1)"], serial_rows
            ),
            f"Amdahl projection: T(W, N) = {model.fixed:.2f} s + N x "
            f"({model.serial * 1e6:.3f} + {model.parallel * 1e6:.3f} / W) us; "
            f"[plots/bench_pack_job.png](plots/bench_pack_job.png):",
            markdown_table(["workers", "floor, ideal", *curves], proj_rows),
        ]
    )
    data = {
        "tokens": tokens,
        "scale": scale,
        "serial_scale": serial_scale,
        "job": {f"{k[0]}x/{k[1]}": v for k, v in runs.job.items()},
        "start": {f"{k[0]}x/{k[1]}": v for k, v in runs.start.items()},
        "floor": {f"{k[0]}x/{k[1]}": v for k, v in runs.floor.items()},
        "serial": {f"{k}x": v for k, v in runs.serial.items()},
        "loads": loads,
        "model": {"fixed_s": model.fixed, "serial_s_per_token": model.serial,
                  "parallel_s_per_token": model.parallel},
    }  # fmt: skip
    return body, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2", help="worker counts for ours and the floor")
    parser.add_argument("--scale", type=int, default=4, help="K: the job's large size, K copies")
    parser.add_argument(
        "--serial-scale", type=int, default=16, help="the serial part's large size, in copies"
    )
    parser.add_argument("--shared", type=Path, default=SHARED)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--append-results", action="store_true", help="record in RESULTS.md")
    args = parser.parse_args()
    workers = sorted({int(w) for w in args.workers.split(",")})
    if min(args.scale, args.serial_scale, args.repeats) < 1 or 1 not in workers:
        parser.error("--scale, --serial-scale, --repeats must be >= 1; --workers must include 1")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("packshard").setLevel(logging.WARNING)
    os.environ.setdefault("PACKSHARD_NO_PROGRESS", "1")
    import datasets

    datasets.disable_progress_bars()
    compileall.compile_dir(Path(packshard.__file__).parent, quiet=1)  # see "Bytecode" above
    tmp = Path(tempfile.mkdtemp(prefix="bench_pack_job_"))
    os.environ["PACKSHARD_CACHE_DIR"] = str(tmp / "cache")  # filled by the reference run
    try:
        runs, tokens = measure(args, workers, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    body, data = report(runs, tokens, workers, args.scale, args.serial_scale, args.plot)
    print(body)
    if args.append_results:
        record_result(
            "bench_pack_job",
            "Pack job: whole job vs the tokenize-only floor, serial part, scaling",
            body,
            data=data,
        )


if __name__ == "__main__":
    main()
