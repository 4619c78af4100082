"""`PackedShardStream`: one per rank; yields this rank's micro-batches of a shard dataset.

    stream = PackedShardStream("s3://bucket/sft-v3", dp_rank=dp_rank, dp_size=dp_size,
                               cp_rank=cp_rank, cp_size=cp_size, rows_per_step=64,
                               cp_layout="zigzag", device="cuda", cache_dir="/local/cache")
    for mb in stream:            # mb["input_ids"], mb["labels"], mb["ks"], ... (microbatch.py)
        ...                      # mb["micro_step"] == mb["num_micro_steps"] - 1: optimizer step
    state = stream.state_dict()  # with the checkpoint; stream.load_state_dict(state) resumes

What happens, per rank:
1. At construction: manifest.json and index.arrow are read (no token data) and checked
   (packers.manifest), then against the stream's configuration (seq_len, the CP layout's
   divisibility), and turned into row costs. Nothing else is read until iteration (~3 ms).
2. The step plan (`planning.py`, identical on every rank) is walked from the current position
   and this rank's rows are read a window at a time: grouped by shard (one
   `ShardDataset.read_rows_arrays` per shard, shards in parallel over `read_threads` threads),
   every row checked against its checksum. Remote shards are read by byte ranges of only the
   rows' tokens (a window holds `read_ahead_bytes` of rows, so nearby rows share a request) or,
   with a `cache_dir`, downloaded whole once, verified, and memory-mapped (`reading.py`,
   `cache.py`); a background thread reads them two windows ahead of the trainer and does the
   waiting (requests, downloads), not the CPU work. Local shards are memory-mapped and read by
   the iterating thread itself when it needs the next window (`prefetch_thread`): a read is a
   checksum over pages the OS reads ahead, ~15 µs a row at 8K tokens, and a second thread would
   only take turns with the trainer on the GIL (13-17% slower epochs on 2 cores).
3. The iterator builds each micro-batch from its row when asked (labels, position ids,
   cu_seqlens, ks/ke, the CP chunk: `microbatch.py`; ~27 µs at 8K tokens) as CPU tensors,
   pinned when the device is CUDA (`ks_host` / `ke_host` keep the ranges' host copies, for the
   indexer), and copies them to the device with ``non_blocking=True``, so the copy overlaps the
   previous micro-step's compute. Building in the prefetch thread instead cost twice the CPU:
   two CPU-bound Python threads take turns on the GIL, and nothing overlaps.

Errors in reading (a corrupted row, a missing shard, a network failure) are raised by the
iterator, in order: micro-batches read before the failure are still delivered first.
Throughput: benchmarks/RESULTS.md (bench_stream.py, against a tuned MosaicML streaming).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packshard._extras import require
from packshard.packers import CostModel, FormatError, ShardDataset, StorageError
from packshard.packers.urls import dataset_url, redact_url
from packshard.trainer_shim.cache import ShardCache
from packshard.trainer_shim.cp import (
    CP_LAYOUTS,
    CpLayout,
    check_layout,
    repack_advice,
    row_divisor,
)
from packshard.trainer_shim.microbatch import TENSOR_KEYS, build_microbatch, filler_microbatch
from packshard.trainer_shim.planning import BALANCES, Balance, Position, StepPlan, StepPlanner
from packshard.trainer_shim.reading import Row, RowReader
from packshard.trainer_shim.state import StreamState, check_resume

require("train", "torch", "packshard.trainer_shim.stream")  # before torch is imported
import torch  # noqa: E402
from torch.utils.data import get_worker_info  # noqa: E402

log = logging.getLogger(__name__)

STALL_WARN_S = 60.0  # seconds without a row before the consumer warns (then 120, 240, ...)

LOCAL_WINDOW_ROWS = 64  # rows a window of a local dataset reads by default (window_rows)
REMOTE_WINDOW_ROWS = 8  # ... of a cached remote one (a window waits for the shards it touches)
WHOLE_BATCHES_PER_WINDOW = 4  # remote batches read whole are kept up to this many windows' bytes
CLOSE_WAIT_S = 10.0  # close() waits this long for the prefetch thread's read in flight


@dataclass(frozen=True)
class StreamConfig:
    """The stream's settings, validated on construction (ValueError naming the field)."""

    dp_rank: int
    dp_size: int
    rows_per_step: int
    cp_rank: int = 0
    cp_size: int = 1
    seed: int = 0
    epochs: int | None = 1
    shuffle: bool = True
    cp_layout: CpLayout = "contiguous"
    balance: Balance = "cost"
    prefetch: int | None = None  # None: LOCAL_WINDOW_ROWS from a local dataset, else 8
    read_threads: int = 4
    verify: bool = True
    seq_len: int | None = None
    cache_limit_bytes: int | None = None
    read_ahead_bytes: int = 64 << 20
    stall_timeout_s: float | None = None
    prefetch_thread: bool | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(
                f"PackedShardStream: {field}={getattr(self, field)!r} is invalid: {why}"
            )

        ints = ("dp_rank", "dp_size", "rows_per_step", "cp_rank", "cp_size", "seed",
                "read_threads", "read_ahead_bytes")  # fmt: skip
        optional_ints = ("epochs", "prefetch", "seq_len", "cache_limit_bytes")
        for name in (*ints, *optional_ints):
            value = getattr(self, name)
            if (value is not None or name in ints) and not _is_int(value):
                raise bad(name, "must be an int" + (" or None" if name in optional_ints else ""))
            if isinstance(value, np.integer):  # a plain int from here on (states are JSON)
                object.__setattr__(self, name, int(value))
        for name in ("shuffle", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")
        if self.prefetch_thread is not None and not isinstance(self.prefetch_thread, bool):
            raise bad("prefetch_thread", "must be True, False or None (chosen by the dataset)")
        if self.dp_size < 1:
            raise bad("dp_size", "must be >= 1")
        if not 0 <= self.dp_rank < self.dp_size:
            raise bad("dp_rank", f"must be in [0, dp_size={self.dp_size})")
        if self.cp_size < 1:
            raise bad("cp_size", "must be >= 1")
        if not 0 <= self.cp_rank < self.cp_size:
            raise bad("cp_rank", f"must be in [0, cp_size={self.cp_size})")
        if self.rows_per_step < 1 or self.rows_per_step % self.dp_size:
            raise bad("rows_per_step", f"must be a positive multiple of dp_size={self.dp_size}")
        if self.seed < 0:
            raise bad("seed", "must be >= 0")
        if self.epochs is not None and self.epochs < 1:
            raise bad("epochs", "must be >= 1, or None for endless")
        if self.cp_layout not in CP_LAYOUTS:
            raise bad("cp_layout", f"choose one of {sorted(CP_LAYOUTS)}")
        if self.balance not in BALANCES:
            raise bad("balance", f"choose one of {list(BALANCES)}")
        if self.prefetch is not None and self.prefetch < 1:
            raise bad("prefetch", "must be >= 1 (rows read per window)")
        if self.read_threads < 1:
            raise bad("read_threads", "must be >= 1")
        if self.seq_len is not None and self.seq_len < 1:
            raise bad("seq_len", "must be >= 1 or None")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes < 1:
            raise bad("cache_limit_bytes", "must be >= 1 or None (unbounded)")
        if self.read_ahead_bytes < 0:
            raise bad("read_ahead_bytes", "must be >= 0")
        stall = self.stall_timeout_s
        if stall is not None:
            real = isinstance(stall, numbers.Real) and not isinstance(stall, (bool, np.bool_))
            try:
                seconds = float(stall) if real else math.nan
            except OverflowError:  # an int beyond any float
                seconds = math.inf
            if not (math.isfinite(seconds) and seconds > 0):
                raise bad("stall_timeout_s", "must be a number of seconds > 0, or None (wait)")
            object.__setattr__(self, "stall_timeout_s", seconds)
            if self.prefetch_thread is False:
                raise bad(
                    "stall_timeout_s",
                    "needs the prefetch thread (it watches the thread's reads): leave "
                    "prefetch_thread at None or True",
                )


@dataclass
class _Progress:
    """What one iteration reads now, since when, and when it last got anything (a shard's part
    of a window), for the stall warnings and timeout: its own per iteration, as a prefetch
    thread left blocked by an earlier iteration may still finish a read."""

    reading: str | None = None
    since: float = field(default_factory=time.monotonic)  # when the read of `reading` began
    at: float = field(default_factory=time.monotonic)


def _is_int(value: Any) -> bool:
    """An int, numpy's included (RANK parsed by numpy, a config's np.int64), never a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def dataset_fingerprint(ds: ShardDataset) -> str:
    """The manifest's checksum of index.arrow (it covers every row's checksum), or failing
    that a hash of the shard checksums."""
    index = ds.manifest.get("index", {})
    if isinstance(index, dict) and isinstance(index.get("checksum"), str):
        return index["checksum"]
    import xxhash

    h = xxhash.xxh3_128()
    for s in ds.shards:
        h.update(s.checksum.encode())
    return f"shards-xxh3_128:{h.hexdigest()}"


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
_SUPERSEDED = (
    "this iteration was stopped (by close(), load_state_dict or a new iter()); iterate the "
    "stream again"
)


class PackedShardStream:
    """This rank's micro-batches of a packshard dataset, in step order (see the module docstring).

    Each micro-batch is a dict: tensors ``input_ids``, ``labels``, ``position_ids`` (int64,
    this rank's positions), ``cu_seqlens`` (int32, whole row), ``ks``, ``ke`` (int32, this
    rank's queries), and ints ``num_tokens``, ``num_loss_tokens``, ``padded_len``,
    ``attn_cost`` (whole row), ``step``, ``micro_step``, ``num_micro_steps``, ``epoch``,
    ``row`` (index.arrow position, -1 for a filler). Conventions: trainer_shim.microbatch.

    Reading: `prefetch` rows (at least a step's micro-batches; by default 64 from a local
    dataset, 8 from a remote one) are read per window, shards of a window on `read_threads`
    threads. `prefetch_thread` says where: True, on a background thread two windows ahead of
    the trainer; False, by the iterating thread when it needs the next window; None (the
    default), on the thread for a remote dataset, a `cache_dir` or a `stall_timeout_s`, in the
    iterating thread for a local dataset (memory-mapped: a read is a checksum, and a thread
    only contends with the trainer for the GIL; True suits a slow network file system). From a
    remote dataset without `cache_dir`, a window holds `read_ahead_bytes` of rows (64 MiB) so
    that nearby rows share a request, and record batches read whole are kept for later windows
    up to 4 x `read_ahead_bytes` (256 MiB: the dataset's `whole_batch_bytes`). Every row read is checked against index.arrow's
    `row_checksum` (a dataset without that column is checked only by `cache_dir`'s whole-shard
    downloads: the constructor warns); `verify=False` skips the checks. Every problem with the dataset is a
    `packers.FormatError` naming the file (`DatasetNotFoundError` without a dataset at `url`,
    `StorageError` when the store fails). A read that returns nothing for 60 s is logged (again
    at 120, 240, ... s); with `stall_timeout_s` the iterator raises `StorageError` naming the
    shards it waits for once it has waited that long with no row and no shard's part of a
    window read (a store that accepts connections but stops answering leaves its client
    library retrying for many minutes).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        dp_rank: int,
        dp_size: int,
        cp_rank: int = 0,
        cp_size: int = 1,
        rows_per_step: int,
        seed: int = 0,
        epochs: int | None = 1,
        shuffle: bool = True,
        cp_layout: CpLayout = "contiguous",
        balance: Balance = "cost",
        device: str | torch.device | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        prefetch: int | None = None,
        read_threads: int = 4,
        seq_len: int | None = None,
        cost_model: CostModel | None = None,
        verify: bool = True,
        read_ahead_bytes: int = 64 << 20,
        stall_timeout_s: float | None = None,
        prefetch_thread: bool | None = None,
    ) -> None:
        self.config = StreamConfig(
            dp_rank=dp_rank, dp_size=dp_size, rows_per_step=rows_per_step, cp_rank=cp_rank, cp_size=cp_size,
            seed=seed, epochs=epochs, shuffle=shuffle, cp_layout=cp_layout, balance=balance, prefetch=prefetch,
            read_threads=read_threads, verify=verify, seq_len=seq_len, cache_limit_bytes=cache_limit_bytes,
            read_ahead_bytes=read_ahead_bytes, stall_timeout_s=stall_timeout_s, prefetch_thread=prefetch_thread,
        )  # fmt: skip
        c = self.config  # the checked values (numpy ints made ints)
        dp_rank, dp_size, rows_per_step, seed, epochs = (
            c.dp_rank, c.dp_size, c.rows_per_step, c.seed, c.epochs
        )  # fmt: skip
        url = dataset_url(url)
        self.url = redact_url(url)  # for messages and logs; the dataset reads the real one
        self.cost_model = cost_model or CostModel()
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"PackedShardStream: device={device!r}, but torch sees no CUDA device")
        self._pin = self.device is not None and self.device.type == "cuda"
        self.dataset = ShardDataset.open(url, storage_options=storage_options)
        self.dataset.whole_batch_bytes = WHOLE_BATCHES_PER_WINDOW * self.config.read_ahead_bytes
        self._check_dataset()
        index = self.dataset.index
        self.costs = self.cost_model.row_costs(
            self.dataset.index_column("num_tokens"), self.dataset.index_column("attn_cost")
        )
        self.planner = StepPlanner(
            self.costs,
            dp_size=dp_size,
            rows_per_step=rows_per_step,
            seed=seed,
            shuffle=shuffle,
            epochs=epochs,
            balance=balance,
        )
        self.fingerprint = dataset_fingerprint(self.dataset)
        if self.config.verify and cache_dir is None and not self.dataset.has_row_checksums:
            log.warning(
                "PackedShardStream %s: index.arrow has no row_checksum column (another format-v1 "
                "writer, or an older packshard), so rows read in place are not checked: run "
                "`packshard verify %s` once, or give a cache_dir (whole shards are checked "
                "against the manifest as they are copied)",
                self.url, self.url,
            )  # fmt: skip
        self.pad_token_id = int(self.dataset.config["pad_token_id"])
        self.pad_multiple = int(self.dataset.config["pad_multiple"])
        self._position = Position(0, 0, 0)
        self._micro_step = 0
        self._generation = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._inline_reader: RowReader | None = None
        # held by the iterating thread while it reads; reentrant, so that close() from that
        # thread (a signal handler during the read) does not wait for itself
        self._inline_read = threading.RLock()
        self._closed = False
        self.cache = (
            ShardCache(
                self.dataset, cache_dir, fingerprint=self.fingerprint, limit_bytes=cache_limit_bytes
            )
            if cache_dir is not None
            else None
        )
        log.info(
            "PackedShardStream %s: %d rows in %d shards, dp %d/%d cp %d/%d (%s), %d micro-steps per step, %s steps per epoch",
            self.url, index.num_rows, len(self.dataset.shards), dp_rank, dp_size, cp_rank, cp_size, cp_layout,
            self.planner.micro_steps, self.planner.steps_in_epoch(),
        )  # fmt: skip

    # ---- construction checks -------------------------------------------------------------

    def _check_dataset(self) -> None:
        cfg, ds = self.config, self.dataset
        where = f"{self.url}/manifest.json"
        ds_seq = int(ds.config["seq_len"])
        if cfg.seq_len is not None and cfg.seq_len != ds_seq:
            raise ValueError(
                f"{where}: the dataset was packed with seq_len={ds_seq}, the stream expects seq_len={cfg.seq_len}; "
                f"re-pack with `--seq-len {cfg.seq_len}` or construct the stream with seq_len={ds_seq}"
            )
        check_layout(
            int(ds.config["pad_multiple"]), cfg.cp_size, cfg.cp_layout, where=where, seq_len=ds_seq
        )
        ds_cp = ds.config.get("cp")
        if ds_cp is not None and int(ds_cp) != cfg.cp_size:
            log.info(
                "%s was packed for cp=%s; streaming it with cp_size=%d (its rows divide as needed)",
                self.url,
                ds_cp,
                cfg.cp_size,
            )
        if ds.num_rows == 0:
            raise ValueError(f"{where}: the dataset has no rows")
        padded = ds.index_column("padded_len")
        divisor = row_divisor(cfg.cp_size, cfg.cp_layout)
        bad = np.flatnonzero(padded % divisor)
        if bad.size:
            r = int(bad[0])
            raise ValueError(
                f"{self.url}/index.arrow: row {r} (and {bad.size - 1} more) has length {int(padded[r])}, not a multiple of "
                f"{divisor} as cp_size={cfg.cp_size} cp_layout={cfg.cp_layout!r} needs; {repack_advice(divisor, ds_seq)}"
            )
        if (padded > ds_seq).any():
            r = int(np.flatnonzero(padded > ds_seq)[0])
            raise ValueError(
                f"{self.url}/index.arrow: row {r} has length {int(padded[r])} > seq_len {ds_seq}"
            )

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps per step on every rank (rows_per_step / dp_size)."""
        return self.planner.micro_steps

    @property
    def steps_per_epoch(self) -> int:
        return self.planner.steps_in_epoch()

    def __len__(self) -> int:
        """Micro-batches left from the current position."""
        steps = self.planner.remaining_steps(self._position)
        if steps is None:
            raise TypeError("an endless stream (epochs=None) has no length")
        return steps * self.num_micro_steps - self._micro_step

    # ---- state ------------------------------------------------------------------------------

    def _state(self) -> StreamState:
        c = self.config
        return StreamState(
            fingerprint=self.fingerprint, num_rows=self.dataset.num_rows, seed=c.seed, shuffle=c.shuffle, epochs=c.epochs,
            rows_per_step=c.rows_per_step, balance=c.balance,
            cost_model=(self.cost_model.token_weight, self.cost_model.attn_weight),
            dp_rank=c.dp_rank, dp_size=c.dp_size, cp_rank=c.cp_rank, cp_size=c.cp_size, cp_layout=c.cp_layout,
            epoch=self._position.epoch, offset=self._position.offset, step=self._position.step, micro_step=self._micro_step,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: after the last micro-batch handed out (not what was prefetched)."""
        return self._state().to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (see trainer_shim.state for what may change on resume).
        An iteration in progress is stopped; iterate the stream again to continue."""
        saved = StreamState.from_dict(dict(state) if isinstance(state, Mapping) else state)
        check_resume(saved, self._state())
        if saved.micro_step >= self.num_micro_steps:
            raise ValueError(
                f"state's micro_step {saved.micro_step} is not below num_micro_steps {self.num_micro_steps}"
            )
        if saved.offset >= self.dataset.num_rows:
            raise ValueError(
                f"state's offset {saved.offset} is outside the dataset's {self.dataset.num_rows} rows"
            )
        self._stop_producer()
        self._position = Position(saved.epoch, saved.offset, saved.step)
        self._micro_step = saved.micro_step
        if (saved.dp_size, saved.rows_per_step) != (self.config.dp_size, self.config.rows_per_step):
            log.info(
                "elastic resume at step %d (epoch %d, row offset %d): dp_size %d -> %d, rows_per_step %d -> %d",
                saved.step, saved.epoch, saved.offset, saved.dp_size, self.config.dp_size, saved.rows_per_step,
                self.config.rows_per_step,
            )  # fmt: skip

    # ---- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "PackedShardStream is iterated in a DataLoader worker process: every worker would "
                "read all of this rank's rows, and the state_dict() of the stream in the training "
                "process would never move. It reads ahead itself; iterate it in the "
                "training process (DataLoader num_workers=0, or no DataLoader)"
            )
        if self.config.epochs is not None and len(self) == 0:
            # `for epoch in range(3): for mb in stream:` would train one epoch without a word
            log.warning(
                "PackedShardStream %s: its %d epoch(s) are done; this iteration yields nothing "
                "(epochs=N covers all N epochs in one iteration, epochs=None is endless)",
                self.url, self.config.epochs,
            )  # fmt: skip
        self._stop_producer()
        self._generation += 1
        generation = self._generation
        stop = threading.Event()
        self._stop, self._closed = stop, False
        if not self.prefetch_thread:
            self._thread = None
            return self._consume_inline(generation, stop)
        progress = _Progress()
        # the queue holds windows of rows read (not built): two windows ahead of the consumer
        q: queue.Queue[Any] = queue.Queue(maxsize=2)
        thread = threading.Thread(
            target=self._produce,
            args=(self._position, self._micro_step, q, stop, progress),
            name="packshard-prefetch",
            daemon=True,
        )
        self._thread = thread
        thread.start()  # reading starts at iter(), before the first next()
        consumer = self._consume(q, stop, thread, generation, progress)
        # an iterator dropped before its first next() never runs its finally: stop the thread
        # when it is collected instead
        weakref.finalize(consumer, stop.set)
        return consumer

    def _consume(
        self,
        q: queue.Queue[Any],
        stop: threading.Event,
        thread: threading.Thread,
        generation: int,
        progress: _Progress,
    ) -> Iterator[dict[str, Any]]:
        timeout = self.config.stall_timeout_s
        waiting_since: float | None = None  # while the trainer waits for the next window
        warn_at = STALL_WARN_S
        try:
            while True:
                now = time.monotonic()
                if waiting_since is None:
                    waiting_since, warn_at = now, STALL_WARN_S
                wait = 0.5
                if timeout is not None:  # wake when the timeout would be reached
                    since = max(waiting_since, progress.at)
                    wait = min(wait, max(0.01, since + timeout - now))
                try:
                    item = q.get(timeout=wait)
                except queue.Empty:
                    item = None
                if generation != self._generation:
                    raise RuntimeError(_SUPERSEDED)
                if item is None:
                    if not thread.is_alive() and q.empty():
                        raise RuntimeError("the packshard prefetch thread ended without a result")
                    now = time.monotonic()
                    waited, idle = now - waiting_since, now - max(waiting_since, progress.at)
                    if timeout is not None and idle >= timeout:
                        raise StorageError(
                            f"PackedShardStream {self.url}: no rows for {waited:.1f} s and no "
                            f"read progress for {idle:.1f} s (stall_timeout_s={timeout:g}) while "
                            f"reading {progress.reading or 'the next window'}; the store accepts "
                            "connections but does not answer, or a read takes longer than "
                            "stall_timeout_s allows"
                        )
                    if waited >= warn_at:
                        warn_at *= 2
                        log.warning(
                            "PackedShardStream %s: no rows for %.0f s (a large shard download, "
                            "or a store that accepts connections but does not answer: its client "
                            "library keeps retrying)",
                            self.url, waited,
                        )  # fmt: skip
                    continue
                waiting_since = None
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                work, rows = item
                yield from self._deliver(work, rows, generation)
        finally:
            stop.set()
            thread.join(timeout=1.0)  # it stops at its next queue put; a slow read finishes alone

    def _consume_inline(self, generation: int, stop: threading.Event) -> Iterator[dict[str, Any]]:
        """The iteration without a prefetch thread: each window is read when its first
        micro-batch is asked for. A read that takes 60 s (then 120, 240, ...) is logged from a
        watching thread, which sleeps otherwise. The read's shard pool is closed with the
        iteration (`_stop_producer`); close() from another thread during a read cancels the
        read's shard reads not yet started and waits for the rest (up to CLOSE_WAIT_S), as it
        waits for the prefetch thread's read."""
        if generation != self._generation:  # an iterator started after a newer one
            raise RuntimeError(_SUPERSEDED)
        progress = _Progress()
        reader = self._inline_reader = self._reader(progress)
        threading.Thread(
            target=self._watch_reads, args=(progress, stop), name="packshard-watch", daemon=True
        ).start()
        try:
            windows = self._windows(self._position, self._micro_step, reader, progress)
            while True:
                if generation != self._generation:  # before a read: close() closed the shards
                    raise RuntimeError(_SUPERSEDED)
                try:
                    with self._inline_read:
                        window = next(windows, None)
                except Exception as e:  # close() or a new iteration may have ended its pool
                    if generation == self._generation:
                        raise
                    raise self._stopped_during_read() from e
                if generation != self._generation:
                    raise self._stopped_during_read()
                if window is None:
                    return
                yield from self._deliver(*window, generation)
        finally:
            stop.set()
            if not sys.is_finalizing():  # at exit the executor's modules are gone; so is it
                reader.close()

    def _stopped_during_read(self) -> RuntimeError:
        """The error of an inline read that close() or a new iteration overtook; a read that
        outlasted close()'s wait opened shards again, and closes them."""
        if self._closed:
            self.dataset.close()
        return RuntimeError(_SUPERSEDED)

    def _watch_reads(self, progress: _Progress, stop: threading.Event) -> None:
        """Log a read of the iterating thread that takes STALL_WARN_S, twice that, ... (what
        `_consume` logs while it waits for the prefetch thread)."""
        since, warn_at = None, STALL_WARN_S
        while True:
            reading = progress.reading
            if reading is None:
                since, wait = None, STALL_WARN_S
            else:
                if since != progress.since:
                    since, warn_at = progress.since, STALL_WARN_S
                wait = max(0.01, since + warn_at - time.monotonic())
            if stop.wait(wait):
                return
            if reading is not None and progress.reading is not None and progress.since == since:
                waited = time.monotonic() - since
                if waited >= warn_at:
                    warn_at *= 2
                    log.warning(
                        "PackedShardStream %s: no rows for %.0f s while the iterating thread "
                        "reads %s (slow storage: a file system, a network mount or a store that "
                        "stopped answering; or the thread is held mid-read, by a signal handler "
                        "or a debugger; prefetch_thread=True with stall_timeout_s makes a "
                        "stalled read an error)",
                        self.url, waited, reading,
                    )  # fmt: skip

    def _deliver(
        self, work: list[tuple[StepPlan, int, int]], rows: dict[int, Row], generation: int
    ) -> Iterator[dict[str, Any]]:
        """A window's micro-batches, built one at a time as they are asked for, moving the
        stream's position past each."""
        num_rows = self.dataset.num_rows
        for plan, k, r in work:
            if generation != self._generation:
                raise RuntimeError(_SUPERSEDED)
            mb = self._microbatch(r, rows.get(r))
            mb.update(step=plan.step, micro_step=k, num_micro_steps=plan.num_micro_steps, epoch=plan.epoch)  # fmt: skip
            if self.device is not None:
                for key in TENSOR_KEYS:
                    mb[key] = mb[key].to(self.device, non_blocking=True)
            if k == plan.num_micro_steps - 1:
                self._position, self._micro_step = plan.next_position(num_rows), 0
            else:
                self._micro_step += 1
            yield mb

    def _stop_producer(self) -> None:
        if self._stop is not None:
            self._stop.set()
        self._generation += 1
        reader, self._inline_reader = self._inline_reader, None
        if reader is not None:  # its pool's threads end now, not when the iterator is collected
            reader.close()

    def _put(self, q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, start: Position, skip: int) -> Iterator[tuple[StepPlan, int, int]]:
        """(plan, micro_step, global row) of this rank from `start`, skipping `skip` micro-steps."""
        for plan in self.planner.steps(start):
            rows = plan.rows[self.config.dp_rank]
            for k in range(skip, rows.size):
                yield plan, k, int(rows[k])
            skip = 0

    @property
    def prefetch_thread(self) -> bool:
        """Whether windows are read on a background thread (see the class docstring)."""
        if self.config.prefetch_thread is not None:
            return self.config.prefetch_thread
        local = self.cache is None and self.dataset.local
        return not local or self.config.stall_timeout_s is not None

    @property
    def window_rows(self) -> int:
        """Rows read per window: `prefetch` (at least a step's micro-batches). Its default is
        `LOCAL_WINDOW_ROWS` for a local dataset (its rows are views of the memory-mapped shards,
        so a window holds no bytes, and fewer windows mean fewer reads and hand-offs: 8-row windows
        read bench_stream's 1,500-row epoch 10% slower) and `REMOTE_WINDOW_ROWS` for a cached
        remote one (each window waits for the shards it touches to download; once the cache
        holds every shard, `LOCAL_WINDOW_ROWS` again: see `_windows`). From a remote
        dataset without a cache, as many as fit `read_ahead_bytes` (more rows per window merge
        more range requests: see packers.shard_file). A window is the unit of errors: the rows
        of the windows before a failure are delivered, its own are not."""
        prefetch = self.config.prefetch
        if prefetch is None:
            local = self.cache is None and self.dataset.local
            prefetch = LOCAL_WINDOW_ROWS if local else REMOTE_WINDOW_ROWS
        rows = max(prefetch, self.num_micro_steps, 1)
        if self.cache is None and not self.dataset.local:
            mean = float(self.dataset.index_column("padded_len").mean())
            rows = max(rows, int(self.config.read_ahead_bytes // max(1.0, mean * 4.2)))
        return min(rows, self._epoch_micro_batches)

    @property
    def _epoch_micro_batches(self) -> int:
        """The most rows a window takes: an epoch of this rank's micro-batches (a window fills
        before it is read, and an endless stream would never fill a larger one)."""
        return max(1, self.steps_per_epoch * self.num_micro_steps)

    def _produce(
        self,
        start: Position,
        skip: int,
        q: queue.Queue[Any],
        stop: threading.Event,
        progress: _Progress,
    ) -> None:
        """Read this rank's rows a window at a time, ahead of the consumer (which builds the
        micro-batches): I/O overlaps the trainer, and a window's reads run together. Once a
        shard cache holds the whole dataset, windows read as from a local one."""
        reader = self._reader(progress)
        try:
            for window in self._windows(start, skip, reader, progress):
                if not self._put(q, window, stop):
                    return
            self._put(q, _END, stop)
        except BaseException as e:  # delivered to the consumer, in order
            self._put(q, _Failed(e), stop)
        finally:
            reader.close()
            if self._closed and stop.is_set():  # a read outlasted close()'s wait: it reopened
                self.dataset.close()  # the shards it read

    def _reader(self, progress: _Progress) -> RowReader:
        return RowReader(
            self.dataset,
            cache=self.cache,
            threads=self.config.read_threads,
            verify=self.config.verify,
            on_progress=lambda: setattr(progress, "at", time.monotonic()),
        )

    def _windows(
        self, start: Position, skip: int, reader: RowReader, progress: _Progress
    ) -> Iterator[tuple[list[tuple[StepPlan, int, int]], dict[int, Row]]]:
        """(this rank's work items, their rows) a window at a time, from `start`. Once a shard
        cache holds the whole dataset, windows grow to a local dataset's."""
        window = self.window_rows
        grow = self.cache is not None and self.config.prefetch is None
        pending: list[tuple[StepPlan, int, int]] = []
        for item in self._work(start, skip):
            pending.append(item)
            if len(pending) >= window:
                yield pending, self._read(reader, pending, progress)
                pending = []
                if grow and self.cache is not None and self.cache.complete:
                    window = min(max(window, LOCAL_WINDOW_ROWS), self._epoch_micro_batches)
                    grow = False
        if pending:
            yield pending, self._read(reader, pending, progress)

    def _read(
        self, reader: RowReader, pending: list[tuple[StepPlan, int, int]], progress: _Progress
    ) -> dict[int, Row]:
        """The window's rows (fillers, row -1, have none); `progress.reading` names their
        shards meanwhile, for the stall timeout's message."""
        rows = np.asarray([r for _, _, r in pending if r >= 0], dtype=np.int64)
        shards = np.unique(np.searchsorted(self.dataset.shard_row_starts, rows, side="right") - 1)
        paths = [self.dataset.shards[int(i)].path for i in shards[:3]]
        more = f" and {shards.size - 3} more" if shards.size > 3 else ""
        progress.since = time.monotonic()  # first: the watch takes a read by its start
        progress.reading = f"{rows.size} rows of {', '.join(paths)}{more}"
        try:
            return reader.read(rows)
        finally:
            progress.reading = None

    def _microbatch(self, row: int, data: Row | None) -> dict[str, Any]:
        c = self.config
        if data is None:
            mb = filler_microbatch(
                self.pad_multiple,
                self.pad_token_id,
                cp_size=c.cp_size,
                cp_rank=c.cp_rank,
                cp_layout=c.cp_layout,
            )
        else:
            try:
                mb = build_microbatch(
                    *data, cp_size=c.cp_size, cp_rank=c.cp_rank, cp_layout=c.cp_layout, row=row
                )
            except ValueError as e:  # rows read with verify=False reach here unchecked
                shard, local = self.dataset.locate(row)
                raise FormatError(
                    f"{self.url}/{self.dataset.shards[shard].path}: row {local} (global row "
                    f"{row}): {e}; run `packshard verify {self.url}` (verify=False skips the "
                    "row checksums)"
                ) from None
        for k in TENSOR_KEYS:
            t = torch.from_numpy(mb[k])
            mb[k] = t.pin_memory() if self._pin else t
        # the ranges stay on the host too: the fp8 indexer plans from them without waiting for
        # the GPU (kernels.fp8_indexer.prepare_inputs)
        mb["ks_host"], mb["ke_host"] = mb["ks"], mb["ke"]
        return mb

    # ---- construction from the environment ------------------------------------------------------

    @classmethod
    def from_env(
        cls, url: str, *, cp_size: int = 1, rows_per_step: int, **kwargs: Any
    ) -> PackedShardStream:
        """A stream whose dp/cp ranks come from torch.distributed or torchrun's environment
        (CP innermost: rank = dp_rank * cp_size + cp_rank). See trainer_shim.topology."""
        from packshard.trainer_shim.topology import Topology

        topo = Topology.from_env(cp_size=cp_size)
        return cls(url, **topo.as_kwargs(), rows_per_step=rows_per_step, **kwargs)

    def close(self) -> None:
        """Stop the iteration (its prefetch thread, or its read pool) and close open shard
        files. A read in flight, the prefetch thread's or the iterating thread's when close()
        comes from another thread, is waited for (up to CLOSE_WAIT_S): it would open the shards
        it reads again; one that takes longer closes them itself when it ends."""
        self._closed = True
        self._stop_producer()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_WAIT_S)
        if self._inline_read.acquire(timeout=CLOSE_WAIT_S):  # a read in the iterating thread
            self._inline_read.release()
        if self.cache is not None:
            self.cache.close()
        self.dataset.close()

    def __enter__(self) -> PackedShardStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
