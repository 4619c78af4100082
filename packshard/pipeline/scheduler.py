"""The driver's side of the pack job: Ray tasks submitted in order, with bounded work in flight.

Flow. Inputs are counted (one task per file), cut into tokenization blocks (ranges of records
of one file, large first and small last so the workers finish together: `planning.block_spans`;
a block only splits work, it never changes the output), and tokenized by tasks
that return a small `BlockMeta` to the driver and leave the token data in the object store. As
the lengths of consecutive samples become known, the driver plans shards
(`planning.plan_shards`, pure) and submits one `pack_shard` task per shard, handing it the
object refs of exactly the blocks that hold its samples.

Bounds. At most `workers` tokenize tasks run at once. Without `--shuffle`, a new block is
tokenized only while the tokens held in the store for unwritten shards stay under
`memory_tokens` (three shards' worth by default), unless no shard is packing (the next shard
needs more samples before it can be planned, so waiting would deadlock); blocks are released
as soon as every shard that reads them is written. Memory therefore stays flat however large
the input. With `--shuffle` a shard may draw samples from every block, so all tokenized blocks
are kept until the last shard is written (Ray spills them to disk beyond its store size).

Resume. Shards kept from an interrupted run split the positions into intervals still to do; each
interval is planned on its own (planning restarts at shard starts, so it reproduces the original
shards) and only the blocks overlapping one are tokenized (all of them under `--shuffle`).

Errors. Without `--skip-bad-records` the job fails naming the first bad record in input order,
whatever the worker count and the order tasks finish in: the driver notes the earliest error
seen, submits no further blocks (none can hold an earlier record), waits for the blocks before
it (submitted first, so in flight or known) and raises. A failed tokenize task counts as an
error at its block's first record.

Retries: every task is retried by Ray on worker death (`max_retries`), and a shard whose bytes
read back wrong is rewritten; blocks lost with a node are recomputed from their lineage (a
test kills one of three nodes mid-job). A stop request (SIGTERM from `ray job stop`, Ctrl-C)
raises `Interrupted`, and the tasks in flight end (the driver disconnects, or under a caller's
Ray they are cancelled: see `StopFlag`); what was committed stays, and a rerun completes it.
The nodes that ran tasks go into the manifest's ``job.nodes``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np
import ray

from packshard.packers.format import describe_error
from packshard.packers.manifest import OVERLONG_COUNTS
from packshard.pipeline.inputs import InputFile
from packshard.pipeline.planning import ShardPlan, block_spans, contributions, plan_shards
from packshard.pipeline.readers import count_records
from packshard.pipeline.samples import CANONICAL_FIELDS, POLICY_DROPS
from packshard.pipeline.tasks import (
    BlockData,
    BlockMeta,
    ShardResult,
    ShardVerifyError,
    WorkSpec,
    check_shard,
    pack_shard,
    tokenize_block,
    warm_up,
)

log = logging.getLogger(__name__)


P = ParamSpec("P")
R = TypeVar("R")


def picklable_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` as a Ray task body whose errors pickle. Ray prints an error that does not pickle
    whole, traceback and message as they are, into the worker's log (and often the driver's
    console): a storage library's error (aiohttp's quotes the URL it read, a signed URL's
    signature included) would be shown unredacted. Such an error is raised as a RuntimeError
    carrying its first line, redacted; the others pass as they are."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            try:
                ray.cloudpickle.dumps(e)
            except Exception:
                raise RuntimeError(describe_error(e)) from None
            raise

    return run


count_remote = ray.remote(num_cpus=1, max_retries=3)(picklable_errors(count_records))
tokenize_remote = ray.remote(num_cpus=1, max_retries=3, num_returns=2)(
    picklable_errors(tokenize_block)
)
# Ray retries on the exception types listed in retry_exceptions; its stubs type that as a bool only.
pack_remote = ray.remote(  # type: ignore[call-overload]
    num_cpus=1, max_retries=3, retry_exceptions=[ShardVerifyError]
)(picklable_errors(pack_shard))
check_remote = ray.remote(num_cpus=1, max_retries=3)(picklable_errors(check_shard))
warm_remote = ray.remote(num_cpus=1, max_retries=0)(warm_up)

WAIT_S = 0.25
NOMINAL_RECORD_BYTES = 1024  # block sizing of inputs without a byte size (demo://)


class JobError(RuntimeError):
    """The job cannot finish; the message is for the user (names the record / file / shard)."""


class Interrupted(BaseException):
    """A stop request (SIGTERM / SIGINT) arrived; everything committed so far is kept."""


@dataclass(frozen=True)
class Block:
    """Records [start, stop) of input `file`, whose first sample id is `first_id`."""

    index: int
    file: int
    start: int
    stop: int
    first_id: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def end_id(self) -> int:
        return self.first_id + self.size


def plan_blocks(files: list[InputFile], workers: int) -> list[Block]:
    """Tokenization blocks: runs of records of one file, large first and small last
    (`planning.block_spans`)."""
    sizes = [f.size or NOMINAL_RECORD_BYTES * f.records for f in files]  # demo:// has no size
    blocks: list[Block] = []
    firsts = np.concatenate(([0], np.cumsum([max(f.records, 0) for f in files])))
    for fi, start, stop in block_spans([f.records for f in files], sizes, workers):
        blocks.append(Block(len(blocks), fi, start, stop, int(firsts[fi]) + start))
    return blocks


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {cause}" if not isinstance(cause, ValueError) else str(cause)


def _get(ref: Any, what: str) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        raise JobError(f"{what} failed: {_cause(e)}") from None
    except (
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.ObjectLostError,
    ) as e:
        raise JobError(f"{what} failed after retries: {type(e).__name__}: {e}") from None


def cancel_running(refs: list[Any]) -> None:
    """Cancel the tasks of `refs` that have not finished. Ray 2.60's driver aborts ("Check
    failed: it != submissible_tasks_.end() Tried to complete task that was not pending") when
    a cancel races with a task's completion; a task already done is never cancelled, which
    leaves only one finishing between this check and its cancel exposed."""
    if not refs:
        return
    _, running = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for ref in running:
        ray.cancel(ref, force=True)


class StopFlag:
    """Set from a signal handler; checked by the driver loops.

    With `cancel_tasks` false (the job's driver connected to or started Ray itself, and
    disconnects when the job ends, which ends the job's tasks: measured, a task stops within
    its 0.1 s tick), nothing is cancelled: `cancel_running` can abort the driver (Ray 2.60's
    "Tried to complete task that was not pending", seen on `ray job stop` of a 1-worker job in
    a full CI run: exit 1 and a stack trace instead of 143). A caller's own Ray stays connected
    after the job, so its tasks are cancelled then."""

    def __init__(self, *, cancel_tasks: bool = True) -> None:
        self.event = threading.Event()
        self.signal_name = ""
        self.cancel_tasks = cancel_tasks

    def set(self, name: str) -> None:
        self.signal_name = name
        self.event.set()

    def check(self, refs: list[Any]) -> None:
        if self.event.is_set():
            if self.cancel_tasks:
                cancel_running(refs)
            raise Interrupted(self.signal_name)


class InputCounter:
    """Counts the input files on Ray (one task per file, at most `max_in_flight` at once).
    Counting needs no tokenizer, so the driver starts it as soon as it is connected to Ray and
    loads the tokenizer meanwhile. With `warm_workers`, that many `warm_up` tasks go first, so
    as many worker processes import the tokenizing code while the driver is still busy (on a
    fresh Ray at 2 workers, ~0.3-0.6 s of each worker's first block)."""

    def __init__(
        self,
        files: list[InputFile],
        storage_options: Any,
        max_in_flight: int,
        warm_workers: int = 0,
        sample_fields: Sequence[str] = CANONICAL_FIELDS,
    ) -> None:
        self.files = list(files)
        self.storage_options = storage_options
        self.sample_fields = list(sample_fields)
        self.max_in_flight = max(1, max_in_flight)
        self.todo = [i for i, f in enumerate(files) if f.records < 0]
        self.pending: dict[Any, int] = {}
        for _ in range(warm_workers):  # runs whatever becomes of its ref; never cancelled
            warm_remote.remote()
        self._submit()

    def _submit(self) -> None:
        while self.todo and len(self.pending) < self.max_in_flight:
            i = self.todo.pop(0)
            self.pending[
                count_remote.remote(self.files[i], self.storage_options, self.sample_fields)
            ] = i

    def result(self, stop: StopFlag) -> list[InputFile]:
        """The files with their record counts (already-counted files pass through)."""
        while self.todo or self.pending:
            self._submit()
            stop.check(list(self.pending))
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=WAIT_S)
            for ref in ready:
                i = self.pending.pop(ref)
                self.files[i] = _get(ref, f"reading {self.files[i].url}")
        return self.files

    def cancel(self, *, tasks: bool = True) -> None:
        """Stop counting (the job ended early): counts still running are cancelled
        (`cancel_running`; not with `tasks` false, see `StopFlag`), warm-ups never. A warm-up
        (~0.1 s, early in every job) would otherwise race its completion with the cancel at the
        end of a job that fails within its first second; left alone, it finishes on its own."""
        if tasks:
            cancel_running(list(self.pending))
        self.pending.clear()
        self.todo.clear()


def check_kept(
    markers: dict[int, dict[str, Any]], spec: WorkSpec, stop: StopFlag
) -> dict[int, ShardResult]:
    """Markers of an interrupted run -> the shards that verify (the others are redone)."""
    refs = {check_remote.remote(spec, m): n for n, m in markers.items()}
    kept: dict[int, ShardResult] = {}
    while refs:
        stop.check(list(refs))
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=WAIT_S)
        for ref in ready:
            n = refs.pop(ref)
            result = _get(ref, f"checking kept shard {n}")
            if isinstance(result, str):
                log.warning("shard %d of the interrupted run is redone: %s", n, result)
            else:
                kept[n] = result
    return kept


@dataclass
class Interval:
    """Positions [frontier, end) still to plan; shards numbered from `next_number`; for a gap
    between kept shards, `last_number` is the number of the kept shard that follows."""

    frontier: int
    end: int
    next_number: int
    last_number: int | None
    cursor: int = 0  # block scan cursor (identity order)


def open_intervals(num_samples: int, kept: dict[int, ShardResult]) -> list[Interval]:
    """The position ranges not covered by kept shards (kept shards are contiguous runs)."""
    intervals: list[Interval] = []
    pos, number = 0, 0
    for n in sorted(kept):
        plan = kept[n].plan
        if plan.start < pos or n < number:
            raise JobError(f"kept shard {n} overlaps the shards before it; rerun with --overwrite")
        if plan.start > pos or n > number:
            if plan.start == pos or n == number:
                raise JobError(
                    f"kept shard {n} does not line up with the shards before it; rerun with --overwrite"
                )
            intervals.append(Interval(pos, plan.start, number, n))
        pos, number = plan.stop, n + 1
    if pos < num_samples:
        intervals.append(Interval(pos, num_samples, number, None))
    return intervals


class Scheduler:
    """Tokenize blocks, plan and pack shards, until every interval is written."""

    def __init__(
        self,
        *,
        spec: WorkSpec,
        files: list[InputFile],
        blocks: list[Block],
        order: np.ndarray | None,
        kept: dict[int, ShardResult],
        window_tokens: int,
        shard_tokens: int,
        workers: int,
        stop: StopFlag,
        progress: Any,
        memory_tokens: int | None = None,
    ) -> None:
        self.spec, self.files, self.blocks, self.order = spec, files, blocks, order
        self.results: dict[int, ShardResult] = dict(kept)
        self.window_tokens, self.shard_tokens = window_tokens, shard_tokens
        self.workers, self.stop, self.progress = workers, stop, progress
        self.memory_tokens = memory_tokens or 3 * shard_tokens + window_tokens
        self.num_samples = blocks[-1].end_id if blocks else 0
        self.block_firsts = np.asarray([b.first_id for b in blocks], np.int64)
        self.contrib = np.full(self.num_samples, -1, np.int64)
        self.known = np.zeros(len(blocks), np.bool_)
        self.data: dict[int, Any] = {}  # block -> data ref, until released
        self.held_tokens: dict[int, int] = {}
        self.pending_tok: dict[Any, tuple[int, Any]] = {}  # meta ref -> (block, data ref)
        self.pending_pack: dict[Any, ShardPlan] = {}
        self.intervals = open_intervals(self.num_samples, kept)
        for iv in self.intervals:
            iv.cursor = self._block_of(iv.frontier)
        self.todo = self._blocks_to_tokenize()
        self.error: tuple[int, str, bool] | None = None  # sample id, message, skippable
        self.nodes: dict[str, dict[str, int]] = {}  # node id -> tasks run there, by kind
        for result in kept.values():
            self._ran(result.node, "check")

    # ---- helpers -----------------------------------------------------------------------

    def _ran(self, node: str, kind: str) -> None:
        counts = self.nodes.setdefault(node, {"tokenize": 0, "pack": 0, "check": 0})
        counts[kind] += 1

    def node_summary(self) -> list[dict[str, Any]]:
        """The nodes that ran this job's tasks (the manifest's ``job.nodes``): node id, its
        address and name as the cluster knows them, and how many tasks of each kind ran there."""
        known = {n["NodeID"]: n for n in ray.nodes()} if ray.is_initialized() else {}
        return [
            {
                "node_id": node,
                "address": known.get(node, {}).get("NodeManagerAddress", ""),
                "name": known.get(node, {}).get("NodeName", ""),
                "tasks": dict(counts),
            }
            for node, counts in sorted(self.nodes.items())
        ]

    def _block_of(self, sample_id: int) -> int:
        return int(np.searchsorted(self.block_firsts, sample_id, side="right") - 1)

    def _blocks_to_tokenize(self) -> list[int]:
        if not self.intervals:
            return []
        if self.order is not None:
            return list(range(len(self.blocks)))
        need: set[int] = set()
        for iv in self.intervals:
            need.update(range(self._block_of(iv.frontier), self._block_of(iv.end - 1) + 1))
        return sorted(need)

    @property
    def samples_to_tokenize(self) -> int:
        return sum(self.blocks[b].size for b in self.todo)

    def _submit_tokenize(self) -> None:
        if self.error is not None:  # blocks after a bad record cannot hold an earlier one
            return
        while self.todo and len(self.pending_tok) < self.workers:
            if (
                self.order is None
                and self.pending_pack
                and sum(self.held_tokens.values()) >= self.memory_tokens
            ):
                return
            b = self.todo.pop(0)
            blk = self.blocks[b]
            # num_returns=2: one ref per returned value (Ray's stubs type it as a single ref)
            meta_ref: ray.ObjectRef[BlockMeta]
            data_ref: ray.ObjectRef[BlockData]
            meta_ref, data_ref = tokenize_remote.remote(  # type: ignore[misc]
                self.spec, self.files[blk.file], blk.start, blk.stop, blk.first_id
            )
            self.pending_tok[meta_ref] = (b, data_ref)

    def _fail_at(self, sample_id: int, message: str, *, skippable: bool = False) -> None:
        """Note an error at `sample_id`; the earliest one in input order is the one raised.
        A `skippable` one (a bad record) is raised with the flags that skip it (`_failure`)."""
        if self.error is None or sample_id < self.error[0]:
            self.error = (sample_id, message, skippable)

    def _failure(self) -> JobError:
        """The noted error; for a bad record, the way past it: --skip-bad-records, and
        --overwrite too once shards were written (packed without skipping, they belong to this
        config: a rerun with another is refused without --overwrite)."""
        assert self.error is not None
        _, message, skippable = self.error
        if skippable:
            message += (
                "\n(pass --skip-bad-records to skip such records and count them in the manifest"
            )
            if self.results:
                message += (
                    f"; this job has {len(self.results)} verified shard(s) packed without it, so "
                    "add --overwrite to start over"
                )
            message += ")"
        return JobError(message)

    def _error_is_first(self) -> bool:
        """True once no block still tokenizing can hold a record before the noted error (the
        blocks before it were submitted first, so they are either known or in flight)."""
        assert self.error is not None
        sid = self.error[0]
        return all(self.blocks[b].first_id >= sid for b, _ in self.pending_tok.values())

    def _on_meta(self, b: int, meta: BlockMeta, data_ref: Any) -> None:
        blk = self.blocks[b]
        self._ran(meta.node, "tokenize")
        bad = [e for e in meta.examples if e[2] not in POLICY_DROPS]
        if bad and not self.spec.skip_bad_records:
            sid, location, reason, detail = bad[0]
            self._fail_at(sid, f"{location}: {reason}: {detail}", skippable=True)
        self.contrib[blk.first_id : blk.end_id] = contributions(
            meta.lengths, self.spec.seq_len, self.spec.overlong
        )
        self.known[b] = True
        self.data[b] = data_ref
        self.held_tokens[b] = meta.tokens
        self.progress.tokenized(blk.size, meta.tokens)
        self.progress.skipped(meta.status, meta.examples)

    def _known_end(self, iv: Interval) -> int:
        if self.order is not None:
            return iv.end if self.known.all() else iv.frontier
        while iv.cursor < len(self.blocks) and self.known[iv.cursor]:
            iv.cursor += 1
        reach = (
            self.blocks[iv.cursor].first_id if iv.cursor < len(self.blocks) else self.num_samples
        )
        return min(reach, iv.end)

    def _plan(self) -> None:
        for iv in list(self.intervals):
            end = self._known_end(iv)
            if end <= iv.frontier:
                continue
            ids = (
                np.arange(iv.frontier, end) if self.order is None else self.order[iv.frontier : end]
            )
            complete = end == iv.end
            if (
                complete
                and not self.results
                and len(self.intervals) == 1
                and iv.frontier == 0
                and not self.contrib[ids].any()
            ):
                raise JobError(
                    f"nothing to pack: all {self.num_samples:,} samples were dropped: "
                    + self.progress.drop_reasons(self.spec.overlong)
                )
            plans = plan_shards(
                self.contrib[ids],
                first_number=iv.next_number,
                first_position=iv.frontier,
                window_tokens=self.window_tokens,
                shard_tokens=self.shard_tokens,
                complete=complete,
            )
            for plan in plans:
                if iv.last_number is not None and plan.number >= iv.last_number:
                    raise JobError(
                        f"replanning before kept shard {iv.last_number} gives more shards than before; rerun with --overwrite"
                    )
                self._submit_pack(plan)
            if plans:
                iv.frontier, iv.next_number = plans[-1].stop, plans[-1].number + 1
            if iv.frontier >= iv.end:
                if iv.last_number is not None and iv.next_number != iv.last_number:
                    raise JobError(
                        f"replanning before kept shard {iv.last_number} gives fewer shards than before; rerun with --overwrite"
                    )
                self.intervals.remove(iv)

    def _submit_pack(self, plan: ShardPlan) -> None:
        if self.order is None:
            blocks = list(range(self._block_of(plan.start), self._block_of(plan.stop - 1) + 1))
            ids = None
        else:
            ids = self.order[plan.start : plan.stop]
            blocks = np.unique(np.searchsorted(self.block_firsts, ids, side="right") - 1).tolist()
        refs = [self.data[b] for b in blocks]
        firsts = [self.blocks[b].first_id for b in blocks]
        ref = pack_remote.remote(self.spec, plan, ids, firsts, *refs)
        self.pending_pack[ref] = plan

    def _release(self) -> None:
        if self.order is not None:
            if not self.intervals and not self.pending_pack:
                self.data.clear()
                self.held_tokens.clear()
            return
        marks = [iv.frontier for iv in self.intervals] + [
            p.start for p in self.pending_pack.values()
        ]
        low = min(marks) if marks else self.num_samples
        for b in [b for b in self.data if self.blocks[b].end_id <= low]:
            del self.data[b]
            self.held_tokens.pop(b, None)

    # ---- loop --------------------------------------------------------------------------

    def run(self) -> dict[int, ShardResult]:
        try:
            return self._run()
        except BaseException:
            self._abort()  # tasks in flight are no longer wanted (a stop request cancelled them already)
            raise

    def _run(self) -> dict[int, ShardResult]:
        while self.intervals or self.pending_pack or self.pending_tok:
            self._submit_tokenize()
            refs = list(self.pending_tok) + list(self.pending_pack)
            self.stop.check(refs)
            if not refs:
                raise JobError("internal: nothing in flight but shards left to plan")
            ready, _ = ray.wait(refs, num_returns=1, timeout=WAIT_S)
            for ref in ready:
                if ref in self.pending_tok:
                    b, data_ref = self.pending_tok.pop(ref)
                    blk = self.blocks[b]
                    try:
                        meta = _get(
                            ref,
                            f"tokenizing {self.files[blk.file].url} records {blk.start + 1}-{blk.stop}",
                        )
                    except JobError as e:  # raised once no earlier block can hold a bad record
                        self._fail_at(blk.first_id, str(e))
                        continue
                    self._on_meta(b, meta, data_ref)
                else:
                    plan = self.pending_pack.pop(ref)
                    result = _get(ref, f"writing shard {plan.number}")
                    self.results[plan.number] = result
                    self._ran(result.node, "pack")
                    self.progress.written(result)
            if self.error is not None:
                # The first bad record in input order, whatever the timing: wait for the blocks
                # before it (no new work is started meanwhile), then raise.
                if self._error_is_first():
                    raise self._failure()
                continue
            if ready:
                self._plan()
                self._release()
            self.progress.refresh()
        return self.results

    def _abort(self) -> None:
        if self.stop.cancel_tasks:  # see StopFlag
            cancel_running(list(self.pending_tok) + list(self.pending_pack))


def merge_counters(results: list[ShardResult]) -> dict[str, Any]:
    """Job totals from per-shard counters (the manifest's sample totals)."""
    summed = ("samples_in", "samples_kept", *OVERLONG_COUNTS)
    totals: dict[str, Any] = {"samples_in": 0, "samples_kept": 0, "dropped": {}}
    totals.update(dict.fromkeys(OVERLONG_COUNTS, 0))
    examples: list[list[Any]] = []
    for r in results:
        c = r.counters
        for key in summed:
            totals[key] += int(c.get(key, 0))
        for reason, n in c.get("dropped", {}).items():
            totals["dropped"][reason] = totals["dropped"].get(reason, 0) + int(n)
        examples += c.get("examples", [])
    totals["dropped"] = dict(sorted(totals["dropped"].items()))
    examples.sort(key=lambda e: e[0])
    return {"totals": totals, "examples": examples[:20]}
