"""Packing benchmark: packshard's packers against TRL's `pack_dataset(strategy="bfd")`.

The task, the same for every packer: one in-memory Arrow table of tokenized samples
(`input_ids` list<int32>) in, materialised packed rows out.

- ours: `packers.pack_table` (overlong policy "truncate", `plan_bins`, rows built and padded to
  `--pad-multiple`, with loss_mask / doc_lens / sample_ids / counts), for `bfd` (our default),
  `ffd` (reference) and `greedy` (order-preserving concatenation: the naive baseline).
- TRL: `trl.data_utils.pack_dataset(ds, seq_len, strategy="bfd")` on a `datasets.Dataset` that
  wraps the same Arrow table (zero-copy, built before the clock starts). TRL's "bfd" truncates a
  sample longer than seq_len to its first seq_len tokens and discards the rest (its
  "bfd_split" would split it instead); ours runs with overlong="truncate", so both sides see
  exactly the same kept tokens. `pack_dataset` goes through `Dataset.map(batched=True)`, which is
  eager: on an in-memory dataset the packed table is written into an in-memory Arrow buffer
  before the call returns (`cache_files == []`, an `InMemoryTable`), so the timed call includes
  all of its work. `map`'s default batch_size of 1000 means TRL packs each window of 1000
  samples on its own ("TRL bfd" below, what users get by default); "TRL bfd whole" passes
  `map_kwargs={"batch_size": None}` so it plans over the whole table like ours (better fill).
  TRL's rows are not padded at all (variable length, no loss mask); ours are padded to the
  multiple, which is strictly more work.

Reported per packer: median wall and CPU time over `--repeats` interleaved runs (ours and TRL's
alternate inside every repeat), samples/s, rows against the lower bound ceil(total/seq_len),
and fill = true tokens / (rows * seq_len). Then planning alone (`plan_bins`) for 1M samples.
Our output is checked in the run: every sample exactly once, rows within seq_len, the format
invariants (`packers.row_problems`) on slices of rows, and a few rows' tokens against the source;
TRL's output is checked to hold the same tokens and rows within seq_len.

Lengths come from a seeded two-component lognormal mix per scenario (short chats plus long
trajectories, shaped like the demo data); tokens are uniform random ids in [1, 151643).
(a) 200K samples, 147M tokens, seq_len 8192; (b) 20K samples, 142M tokens, seq_len 131072.
Timings are wall time plus this process's user and system CPU time: on the shared 2-core CI
machine (load 5-8) wall time is ~2-3x CPU time and swings 2x between repeats, so compare the
CPU columns; system time is mostly page faults on freshly allocated memory.

Rows are planned in numpy and built with one copy per document into pooled buffers (pure
Python and numpy: the C planners and the threaded copy of earlier runs are gone, as the pack job
did not gain from them). The latest result is RESULTS.md's `bench_packers` section; earlier runs,
with the C path, are in `history/bench_packers.jsonl`.

Usage: `python benchmarks/bench_packers.py` (all scenarios, appends to RESULTS.md);
`--quick` for a small smoke run; `--scenarios a,b,plan`; `--no-append`. A partial run
(`--quick`, `--skip-trl`, fewer scenarios) only prints: RESULTS.md keeps full runs.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import markdown_table, record_result
from packshard.packers import (
    apply_overlong,
    build_rows,
    lower_bound_rows,
    pack_table,
    plan_bins,
    row_problems,
)

log = logging.getLogger("bench_packers")

PAD_TOKEN_ID = 0
VOCAB = 151_643
TRL_INSTALL = (
    "TRL is not installed. It is the `bench` extra peer; install it into the venv with\n"
    "  .venv/bin/uv pip install --python .venv/bin/python -c .venv/constraints.txt trl\n"
    "(or `pip install 'packshard[bench]'`), or run with --skip-trl to measure ours only."
)

# (weight, median length, sigma of log length) per component
Mix = list[tuple[float, float, float]]


@dataclass(frozen=True)
class Scenario:
    name: str
    samples: int
    seq_len: int
    mix: Mix


SCENARIOS = {
    "a": Scenario("a", 200_000, 8192, [(0.85, 300.0, 0.7), (0.15, 2000.0, 0.8)]),
    "b": Scenario("b", 20_000, 131_072, [(0.75, 1000.0, 0.8), (0.25, 16_000.0, 0.9)]),
}
PLAN_SAMPLES = 1_000_000
PLAN_SEQ_LEN = 8192


def mix_lengths(n: int, mix: Mix, rng: np.random.Generator) -> np.ndarray:
    """n sample lengths (int64, >= 1) from a lognormal mixture."""
    weights = np.array([w for w, _, _ in mix])
    comp = rng.choice(len(mix), size=n, p=weights / weights.sum())
    medians = np.array([m for _, m, _ in mix])[comp]
    sigmas = np.array([s for _, _, s in mix])[comp]
    return np.maximum(1, np.rint(medians * np.exp(sigmas * rng.standard_normal(n)))).astype(
        np.int64
    )


def make_table(
    lengths: np.ndarray, rng: np.random.Generator, *, loss_mask: bool = False
) -> pa.Table:
    """An Arrow table with `input_ids` (list<int32>) of the given lengths and, if asked, a
    `loss_mask` (list<bool>, ~70% true) with the same offsets."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    if offsets[-1] >= 2**31:
        raise ValueError(f"{offsets[-1]} tokens do not fit a list<int32> column; use fewer samples")
    tokens = rng.integers(1, VOCAB, size=int(offsets[-1]), dtype=np.int32)
    off = pa.array(offsets.astype(np.int32))
    cols = {"input_ids": pa.ListArray.from_arrays(off, pa.array(tokens))}
    if loss_mask:
        cols["loss_mask"] = pa.ListArray.from_arrays(off, pa.array(rng.random(tokens.size) < 0.7))
    return pa.table(cols)


@dataclass
class Outcome:
    rows: int
    tokens: int


Lap = tuple[float, float, float]  # wall, user CPU, system CPU seconds (this process)


class Stopwatch:
    """Wall time plus this process's user and system CPU time (os.times), from creation."""

    def __init__(self) -> None:
        self.t0, self.c0 = time.perf_counter(), os.times()

    def lap(self) -> Lap:
        c = os.times()
        return time.perf_counter() - self.t0, c.user - self.c0.user, c.system - self.c0.system


@dataclass
class Timings:
    laps: list[Lap] = field(default_factory=list)

    def med(self, i: int) -> float:
        return statistics.median(lap[i] for lap in self.laps)

    @property
    def wall_med(self) -> float:
        return self.med(0)

    @property
    def cpu_med(self) -> float:
        return statistics.median(lap[1] + lap[2] for lap in self.laps)

    def cpu_text(self) -> str:
        """'total (user+sys)' medians; sys is mostly page faults on fresh memory."""
        return f"{self.cpu_med:.2f} ({self.med(1):.2f}+{self.med(2):.2f})"


# ---------------------------------------------------------------- correctness checks


def check_ours(batch: pa.RecordBatch, table: pa.Table, sc: Scenario, pad_multiple: int) -> Outcome:
    """Every sample exactly once, rows within seq_len, format invariants on slices, tokens."""
    n = table.num_rows
    sids = batch.column("sample_ids").values.to_numpy()
    if sids.size != n or not np.array_equal(np.sort(sids), np.arange(n)):
        raise RuntimeError(
            f"ours: sample ids are not every sample exactly once ({sids.size} for {n})"
        )
    padded = np.diff(batch.column("input_ids").offsets.to_numpy())
    if padded.max() > sc.seq_len:
        raise RuntimeError(f"ours: a row of {padded.max()} tokens exceeds seq_len {sc.seq_len}")
    k = min(500, batch.num_rows)
    for start in sorted({0, (batch.num_rows - k) // 2, batch.num_rows - k}):
        # a compact copy: row_problems sums doc_lens with reduceat to the end of the values
        # buffer, which over-counts the last row of a zero-copy slice (batch.slice)
        part = batch.take(pa.array(np.arange(start, start + k)))
        probs = row_problems(
            part,
            seq_len=sc.seq_len,
            pad_multiple=pad_multiple,
            pad_token_id=PAD_TOKEN_ID,
            first_row=start,
        )
        if probs:
            raise RuntimeError("ours: " + "; ".join(probs))
    src = table.column("input_ids").chunk(0)
    src_off, src_tok = src.offsets.to_numpy(), src.values.to_numpy()
    ids_col, doc_col, sid_col = (batch.column(c) for c in ("input_ids", "doc_lens", "sample_ids"))
    pick = np.random.default_rng(1).choice(
        batch.num_rows, size=min(20, batch.num_rows), replace=False
    )
    for r in pick.tolist():
        row = ids_col[r].values.to_numpy()
        pos = 0
        for d, s in zip(doc_col[r].as_py(), sid_col[r].as_py(), strict=True):
            if not np.array_equal(row[pos : pos + d], src_tok[src_off[s] : src_off[s] + d]):
                raise RuntimeError(f"ours: row {r} document of sample {s} differs from the source")
            pos += d
    num_tokens = int(pc.sum(batch.column("num_tokens")).as_py())
    return Outcome(rows=batch.num_rows, tokens=num_tokens)


def check_trl(packed: Any, kept_tokens: int, seq_len: int) -> Outcome:
    """TRL's rows hold the same (truncated) tokens as ours and none exceeds seq_len."""
    ids = packed.data.table.column("input_ids").combine_chunks()
    lens = np.diff(ids.offsets.to_numpy())
    if lens.sum() != kept_tokens or lens.max() > seq_len:
        raise RuntimeError(
            f"TRL: {lens.sum()} tokens (expected {kept_tokens}), longest row {lens.max()}"
        )
    return Outcome(rows=packed.num_rows, tokens=int(lens.sum()))


# ---------------------------------------------------------------- runners

Run = tuple[Lap, Any]


def run_ours(table: pa.Table, sc: Scenario, algorithm: str, pad_multiple: int) -> Run:
    watch = Stopwatch()
    batch, _ = pack_table(
        table,
        seq_len=sc.seq_len,
        pad_multiple=pad_multiple,
        pad_token_id=PAD_TOKEN_ID,
        algorithm=algorithm,
        overlong="truncate",
    )  # type: ignore[arg-type]
    return watch.lap(), batch


def run_trl(ds: Any, sc: Scenario, whole: bool) -> Run:
    from trl.data_utils import pack_dataset

    kwargs = {"map_kwargs": {"batch_size": None}} if whole else {}
    watch = Stopwatch()
    packed = pack_dataset(ds, sc.seq_len, strategy="bfd", **kwargs)
    _ = packed.data.table.num_rows  # map is eager: the packed table already exists in memory
    lap = watch.lap()
    if packed.cache_files:
        raise RuntimeError(
            f"TRL wrote cache files {packed.cache_files}; the timing would include disk"
        )
    return lap, packed


def stage_times(table: pa.Table, sc: Scenario, pad_multiple: int) -> dict[str, Lap]:
    """Wall/user/sys seconds of each stage of our path (bfd): the calls pack_table makes."""
    watch = Stopwatch()
    t = [watch.lap()]
    col = table.column("input_ids").combine_chunks()
    offsets = col.offsets.to_numpy().astype(np.int64)
    tokens = col.values.to_numpy()
    if "loss_mask" in table.column_names:
        mask = table.column("loss_mask").combine_chunks().values.to_numpy(zero_copy_only=False)
    else:
        mask = np.ones(tokens.size, dtype=np.bool_)
    t.append(watch.lap())
    res = apply_overlong(np.diff(offsets), sc.seq_len, "truncate")
    t.append(watch.lap())
    bins = plan_bins(res.length, sc.seq_len, "bfd")
    t.append(watch.lap())
    build_rows(
        tokens,
        mask,
        offsets[:-1][res.sample] + res.start,
        res.length,
        res.sample,
        bins,
        pad_multiple=pad_multiple,
        pad_token_id=PAD_TOKEN_ID,
    )
    t.append(watch.lap())
    names = ["arrow->numpy (+mask)", "apply_overlong", "plan_bins", "build_rows"]
    return {
        k: tuple(b - a for a, b in zip(t[i], t[i + 1], strict=True)) for i, k in enumerate(names)
    }  # type: ignore[misc]


# ---------------------------------------------------------------- scenarios


def lap_text(lap: Lap) -> str:
    return f"wall {lap[0]:7.3f} s  user {lap[1]:6.2f} s  sys {lap[2]:6.2f} s"


def ratio(ref: Timings | None, this: Timings, attr: str) -> str:
    """ref / this as "2.0x"; "n/a" without a peer or when this one is below the clock's
    resolution (a --quick run's CPU time can read 0.00 s)."""
    if ref is None or getattr(this, attr) <= 0:
        return "n/a"
    return f"{getattr(ref, attr) / getattr(this, attr):.1f}x"


def bench_scenario(
    sc: Scenario, args: argparse.Namespace, rng: np.random.Generator
) -> tuple[str, list[list[object]]]:
    lengths = mix_lengths(sc.samples, sc.mix, rng)
    table = make_table(lengths, rng, loss_mask=args.loss_mask)
    kept = np.minimum(lengths, sc.seq_len)
    kept_tokens = int(kept.sum())
    lb = lower_bound_rows(kept, sc.seq_len)
    print(
        f"\n[{sc.name}] {sc.samples:,} samples, seq_len {sc.seq_len}: {int(lengths.sum()):,} tokens, "
        f"{int((lengths > sc.seq_len).sum())} longer than seq_len (truncated by both sides), "
        f"lower bound {lb:,} rows",
        flush=True,
    )

    runners: dict[str, Callable[[], Run]] = {
        f"ours {a}": (lambda a=a: run_ours(table, sc, a, args.pad_multiple))
        for a in ("bfd", "greedy", "ffd")
    }
    if not args.skip_trl:
        import datasets
        from datasets.table import InMemoryTable

        datasets.disable_progress_bars()
        ds = datasets.Dataset(InMemoryTable(table))  # zero-copy, outside the clock
        runners["TRL bfd"] = lambda: run_trl(ds, sc, whole=False)
        runners["TRL bfd whole"] = lambda: run_trl(ds, sc, whole=True)
    # interleaved: every repeat runs each packer once; the order rotates between repeats
    names = list(runners)
    timings = {k: Timings() for k in names}
    outcomes: dict[str, Outcome] = {}
    for rep in range(args.repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            gc.collect()
            lap, out = runners[name]()
            timings[name].laps.append(lap)
            if name not in outcomes:
                if name.startswith("ours"):
                    outcomes[name] = check_ours(out, table, sc, args.pad_multiple)
                else:
                    outcomes[name] = check_trl(out, kept_tokens, sc.seq_len)
            del out
            print(f"  rep {rep + 1}/{args.repeats} {name:14s} {lap_text(lap)}", flush=True)
    gc.collect()
    stages = stage_times(table, sc, args.pad_multiple)
    stage_line = f"({sc.name}) ours bfd stages, one run: " + "; ".join(
        f"{k} {v[0]:.3f} s wall ({v[1]:.2f} user + {v[2]:.2f} sys)" for k, v in stages.items()
    )
    print("  " + stage_line)

    ref = timings.get("TRL bfd")
    out_rows: list[list[object]] = []
    for name in names:
        t, o = timings[name], outcomes[name]
        out_rows.append(
            [
                f"({sc.name}) {sc.samples // 1000}K @ {sc.seq_len}",
                name,
                f"{t.wall_med:.3f}",
                t.cpu_text(),
                f"{sc.samples / t.wall_med:,.0f}",
                ratio(ref, t, "wall_med"),
                ratio(ref, t, "cpu_med"),
                f"{o.rows:,}",
                f"{lb:,}",
                f"{100 * (o.rows / lb - 1):+.2f}%",
                f"{100 * o.tokens / (o.rows * sc.seq_len):.2f}%",
            ]
        )
    return stage_line, out_rows


def bench_planning(args: argparse.Namespace, rng: np.random.Generator) -> list[list[object]]:
    lengths = np.minimum(mix_lengths(args.plan_samples, SCENARIOS["a"].mix, rng), PLAN_SEQ_LEN)
    lb = lower_bound_rows(lengths, PLAN_SEQ_LEN)
    print(
        f"\n[plan] {args.plan_samples:,} samples, capacity {PLAN_SEQ_LEN}, lower bound {lb:,} rows",
        flush=True,
    )
    algs = ["bfd", "ffd", "greedy"]
    timings = {a: Timings() for a in algs}
    rows: dict[str, int] = {}
    for rep in range(args.repeats):
        for a in algs[rep % 3 :] + algs[: rep % 3]:
            gc.collect()
            watch = Stopwatch()
            bins = plan_bins(lengths, PLAN_SEQ_LEN, a)  # type: ignore[arg-type]
            timings[a].laps.append(watch.lap())
            rows[a] = len(bins)
            del bins
            print(
                f"  rep {rep + 1}/{args.repeats} plan {a:7s} {lap_text(timings[a].laps[-1])}  "
                f"{rows[a]:,} rows",
                flush=True,
            )
    return [
        [
            f"plan {args.plan_samples // 1000}K @ {PLAN_SEQ_LEN}",
            f"plan_bins {a}",
            f"{t.wall_med:.3f}",
            t.cpu_text(),
            f"{args.plan_samples / t.wall_med:,.0f}",
            "",
            "",
            f"{rows[a]:,}",
            f"{lb:,}",
            f"{100 * (rows[a] / lb - 1):+.3f}%",
            f"{100 * lengths.sum() / (rows[a] * PLAN_SEQ_LEN):.2f}%",
        ]
        for a, t in timings.items()
    ]


HEADERS = [
    "task",
    "packer",
    "wall s (median)",
    "CPU s (user+sys)",
    "samples/s (wall)",
    "vs TRL bfd, wall",
    "vs TRL bfd, CPU",
    "rows",
    "lower bound",
    "rows over LB",
    "fill",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--scenarios", default="a,b,plan", help="comma list of a, b, plan (default: all)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pad-multiple", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan-samples", type=int, default=PLAN_SAMPLES)
    p.add_argument(
        "--loss-mask",
        action="store_true",
        help="add a loss_mask list<bool> column (TRL packs it as a second column)",
    )
    p.add_argument("--quick", action="store_true", help="10x fewer samples everywhere (smoke run)")
    p.add_argument("--skip-trl", action="store_true", help="measure ours only")
    p.add_argument(
        "--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    if not args.skip_trl:
        try:
            import trl.data_utils
        except ImportError:
            print(TRL_INSTALL, file=sys.stderr)
            return 2
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(chosen) - {"a", "b", "plan"}
    if unknown:
        print(f"--scenarios: unknown {sorted(unknown)}; choose from a, b, plan", file=sys.stderr)
        return 2
    if args.quick:
        args.plan_samples //= 10
    load_before = os.getloadavg()
    rows: list[list[object]] = []
    notes: list[str] = []
    for i, name in enumerate(chosen):
        rng = np.random.default_rng([args.seed, i])
        if name == "plan":
            rows += bench_planning(args, rng)
            continue
        sc = SCENARIOS[name]
        if args.quick:
            sc = Scenario(sc.name, sc.samples // 10, sc.seq_len, sc.mix)
        stage_line, r = bench_scenario(sc, args, rng)
        rows += r
        notes.append(stage_line)
    load_after = os.getloadavg()
    peer = "not run"
    if not args.skip_trl:
        import datasets
        import trl

        peer = f"trl {trl.__version__}, datasets {datasets.__version__}"
    body = "\n".join(
        [
            f"Ours (packers.pack_table, overlong=truncate, pad_multiple={args.pad_multiple}) vs TRL "
            f"pack_dataset(strategy='bfd') ({peer}); input columns: "
            f"{'input_ids + loss_mask' if args.loss_mask else 'input_ids'}. Medians of {args.repeats} "
            "interleaved repeats; 'vs TRL bfd' = TRL bfd's median / this one's (higher is faster); CPU = "
            "this process's user + system CPU time (less disturbed than wall time on a shared "
            "machine; system time is mostly page faults on freshly allocated memory). 'TRL bfd' is "
            "TRL's default (map batch_size 1000: each 1000-sample window packed alone); 'TRL bfd whole' "
            "plans the whole table at once (map batch_size=None). Fill = true tokens / (rows * seq_len). "
            "Our output was checked in the run (each sample once, row_problems, tokens vs source).",
            f"Load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
            f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} ({os.cpu_count()} cores).",
            "",
            markdown_table(HEADERS, rows),
            "",
            *[f"- {n}" for n in notes],
        ]
    )
    print("\n" + body)
    partial = [
        flag
        for flag, on in (
            ("--quick", args.quick),
            ("--skip-trl", args.skip_trl),
            ("--scenarios", set(chosen) != {"a", "b", "plan"}),
        )
        if on
    ]
    if partial:  # RESULTS.md keeps the maintained benchmark's full run only
        print(f"\nnot recorded in RESULTS.md: a partial run ({', '.join(partial)})")
    elif not args.no_append:
        record_result(
            "bench_packers",
            "Packing: packers.pack_table vs TRL pack_dataset(bfd)",
            body,
            data={"headers": HEADERS, "rows": rows, "load_before": load_before},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
