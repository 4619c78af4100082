"""The fixed-config fp8 DSA "lightning indexer": per-query top-k keys, deterministic.

    fp8_indexer_topk(q, k, w, ks, ke, topk) -> int32 [S_q, topk]

q [S_q, H, D] bf16, k [S_k, D] bf16 (one key head shared by all query heads), w [S_q, H],
ks/ke [S_q] int32 in key coordinates: query t may select key s iff ks[t] <= s < ke[t] (a packed
row gives ks = the document's start, ke = the query's position + 1). ks/ke may stay on the CPU
while q, k, w are on a GPU (as `trainer_shim` hands them out): then the call never waits for the
GPU before its first launch, where ranges on the GPU must first be copied back to plan the
chunks (`prepare_inputs`).

- q and k are quantized per vector to fp8 e4m3 with power-of-two scales (`kernels.quant`).
- score[t, s] = k_scale[s] * sum_h (w[t,h] * q_scale[t,h]) * relu(q8[t,h] . k8[s]), fp32
  accumulation (`kernels.logits`, one compiled kernel for every row length).
- Order: higher score first, ties by lower key index, -0.0 == +0.0; slots past a row's valid
  keys hold the sentinel S_k (`kernels.topk`). Output is a pure function of the inputs: no
  atomics, fixed reduction trees, so it is bitwise identical across calls and processes on
  the same GPU model and software.
- NaN or +-inf in q, k or w raises ValueError (checked on the per-vector scales; by
  `fp8_indexer_topk` at the sync that ends the call, so that nothing waits for the check).

Memory: the fp32 logits are materialised one chunk of queries at a time, each chunk holding
rows x (its key window, padded to 16) floats plus the top-k workspace of its rows (72 KiB a row
at topk 2048), under `max_chunk_bytes` (default 8 GiB). Chunks are sized by their key windows
(`plan_chunks`): a 128K-token row takes 7 chunks of 8K-29K queries causal, 5 packed; 256K, 23
and 10. `fp8_indexer_logits` materialises the whole [S_q, S_k] matrix and is for tests and
inspection.

Inputs are padded to the kernels' rules where needed: keys to a multiple of 128 (zero keys with
zero scale, never inside any [ks, ke); whole 64/128-key tiles need no bound mask), H to a
power of two (zero weights), D to a power of two >= 32 (zero columns, after quantization so
scales are unchanged).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from packshard.kernels.chunks import _chunk_work, plan_chunks
from packshard.kernels.logits import launch_logits
from packshard.kernels.logits_config import FIXED_LOGITS_CONFIG, LogitsConfig
from packshard.kernels.order import order_topk
from packshard.kernels.prepare import (
    PreparedInputs,
    _finite_flags,
    _raise_unless_finite,
    check_triton_runs_on,
    prepare_inputs,
)
from packshard.kernels.topk import (
    FIXED_TOPK_CONFIG,
    TopkConfig,
    TopkWorkspace,
    launch_select,
    topk_rows_torch,
)

_EXACT_BYTES_PER_SCORE = 40  # topk_rows_torch: int64 keys, masked copy, sort values + indices


@dataclass(frozen=True)
class IndexerConfig:
    """Everything that shapes a launch; the defaults are the fixed config (docs/KERNELS.md)."""

    logits: LogitsConfig = FIXED_LOGITS_CONFIG
    topk: TopkConfig = FIXED_TOPK_CONFIG
    max_chunk_bytes: int = 8 << 30  # logits + top-k workspace of the chunks in flight
    # "none": every kernel on the current stream; "stream": chunk i's top-k on a second stream
    # while chunk i+1's logits run; "priority": the same with the second stream at high
    # priority. On the H200 (64K, H=64 causal) the overlap loses in 3 of 4 runs (51.1 ms
    # against 48.7 serial): the logits stretch from 35 to ~48 ms when the select shares their SMs
    overlap: Literal["none", "stream", "priority"] = "none"

    def __post_init__(self) -> None:
        if self.max_chunk_bytes < 1:
            raise ValueError(
                f"IndexerConfig.max_chunk_bytes={self.max_chunk_bytes}: must be positive"
            )
        if self.overlap not in ("none", "stream", "priority"):
            raise ValueError(
                f"IndexerConfig.overlap={self.overlap!r}: must be 'none', 'stream' or 'priority'"
            )


FIXED_CONFIG = IndexerConfig()


TRITON_MAX_NUMEL = 1 << 20  # the most elements a Triton block (tl.arange, a tensor) may hold


def _checked_topk(topk: Any, config: IndexerConfig) -> int:
    """`topk` as an int in [1, the config's limit] (numpy and 0-d torch integers accepted);
    ValueError / TypeError naming it otherwise."""
    try:
        k = operator.index(topk)
    except TypeError:
        raise TypeError(f"topk must be an int, got {type(topk).__name__} {topk!r}") from None
    if k < 1:
        raise ValueError(f"topk={k}: must be >= 1")
    _, cap = config.topk.sizes(k)
    if cap > TRITON_MAX_NUMEL:
        most = 1  # a power of two: every topk up to it has the same staging width
        while config.topk.sizes(2 * most)[1] <= TRITON_MAX_NUMEL:
            most *= 2
        raise ValueError(
            f"topk={k}: at most {most:,} (the select kernel's candidate buffer of {cap:,} "
            f"slots a row passes Triton's {TRITON_MAX_NUMEL:,} per block)"
        )
    return k


def indexer_topk_prepared(
    p: PreparedInputs,
    topk: int,
    config: IndexerConfig = FIXED_CONFIG,
    *,
    stats: dict | None = None,
    launch: Callable[..., None] = launch_logits,
) -> torch.Tensor:
    """Top-k on prepared inputs.

    Chunks run heaviest first (most in-range scores: the last chunk's top-k is the one that
    nothing overlaps). With `config.overlap` on a GPU, chunk i's select and order run on a
    second stream while chunk i+1's logits run (two logits buffers, each planned under half of
    `max_chunk_bytes`). Rows the select flags are finished after the last chunk: their logits
    are recomputed (bitwise the same scores) and ordered by `topk_rows_torch`.

    `stats`, if given, accumulates `fallback_rows` and `chunks`, and with `stats["timing"] = True`
    also `logits_ms`, `select_ms` (the select kernel), `order_ms` (order step) and `topk_ms` =
    select + order, from CUDA events (one sync at the end; with overlap the stages run
    concurrently and add up to more than the wall time).
    `launch` replaces the logits launcher (benchmarks/indexer_peers.py passes its autotuned one).
    """
    topk = _checked_topk(topk, config)
    dev = p.q8.device
    streams = _Streams.create(dev, config.overlap)
    out = torch.empty((p.s_q, topk), dtype=torch.int32, device=dev)
    extra = TopkWorkspace.bytes_per_row(topk, config.topk)
    s_kp = p.k8.shape[0]
    chunks = plan_chunks(p.ks_host, p.ke_host, s_kp, extra, config.max_chunk_bytes // streams.n_buf)
    work = _chunk_work(p.ks_host, p.ke_host, chunks)
    order = sorted(range(len(chunks)), key=lambda i: -work[i])  # stable: ties keep order
    chunks = [chunks[i] for i in order]
    max_rows = max((r1 - r0 for r0, r1, _, _ in chunks), default=0)
    max_floats = max(((r1 - r0) * w for r0, r1, _, w in chunks), default=0)
    bufs = [torch.empty(max_floats, dtype=torch.float32, device=dev) for _ in range(streams.n_buf)]
    # the select's workspace and flags are allocated behind the first logits launch: until it
    # the GPU waits for the host
    ws: TopkWorkspace | None = None
    status = torch.zeros(p.s_q, dtype=torch.int32, device=dev) if not chunks else None
    timing = bool(stats and stats.get("timing")) and dev.type == "cuda"
    marks: list[list[torch.cuda.Event]] = []

    def mark() -> None:
        if timing:
            marks[-1].append(torch.cuda.Event(enable_timing=True))
            marks[-1][-1].record()

    for j, (r0, r1, col0, width) in enumerate(chunks):
        n = r1 - r0
        logits = bufs[j % streams.n_buf][: n * width].view(n, width)
        marks.append([])
        streams.before_logits(j)
        mark()
        launch(
            p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, logits,
            heads=p.heads, row0=r0, n_rows=n, col0=col0, config=config.logits,
        )  # fmt: skip
        if ws is None:
            ws = TopkWorkspace.allocate(max_rows, topk, config.topk, dev)
            status = torch.zeros(p.s_q, dtype=torch.int32, device=dev)
        with streams.topk_side(j):
            mark()
            launch_select(
                logits, col0, p.ks, p.ke, ws.with_status(status[r0:r1]),
                topk=topk, row0=r0, n_rows=n, sentinel=p.s_k, config=config.topk,
            )  # fmt: skip
            mark()
            order_topk(ws, out[r0:r1], n, topk, config.topk)
            mark()
    streams.join()
    bufs.clear()  # the exact path below plans its own memory under the same bound
    del ws
    # the call's one sync after the chunks: the flagged rows, and the deferred finite check
    tail = [status]
    if p.unchecked is not None:
        tail.insert(0, _finite_flags(*p.unchecked).view(torch.int32))
    host = torch.cat(tail).cpu().numpy()
    if p.unchecked is not None:
        _raise_unless_finite(host[:4].view(np.float32))
        host = host[4:]
    fallback = _finish_flagged_rows(p, np.flatnonzero(host), out, topk, config, launch, chunks)
    if timing:
        torch.cuda.synchronize()
        for name, i in (("logits_ms", 0), ("select_ms", 1), ("order_ms", 2)):
            stats[name] = stats.get(name, 0.0) + sum(m[i].elapsed_time(m[i + 1]) for m in marks)
        stats["topk_ms"] = stats.get("topk_ms", 0.0) + sum(m[1].elapsed_time(m[3]) for m in marks)
    if stats is not None:
        stats["fallback_rows"] = stats.get("fallback_rows", 0) + fallback
        stats["chunks"] = stats.get("chunks", 0) + len(chunks)
    return out


@dataclass
class _Streams:
    """Where each chunk's kernels go: all on the current stream, or the top-k on a side stream.

    With a side stream, chunk j's logits (current stream) wait until the top-k of chunk j - 2
    has read the buffer they overwrite, and chunk j's top-k waits for its logits. `priority`
    makes the side stream the higher-priority one, so that its small select programs take SM
    slots as the logits programs of the next chunk retire instead of after all of them.
    """

    n_buf: int
    side: torch.cuda.Stream | None = None
    main: torch.cuda.Stream | None = None
    freed: list = field(default_factory=list)  # per buffer: the event after its last top-k

    @classmethod
    def create(cls, dev: torch.device, overlap: str) -> _Streams:
        if dev.type != "cuda" or overlap == "none":
            return cls(n_buf=1)
        priority = -(1 << 20) if overlap == "priority" else 0  # torch maps it to the highest
        side = torch.cuda.Stream(device=dev, priority=priority)
        return cls(n_buf=2, side=side, main=torch.cuda.current_stream(dev), freed=[None, None])

    def before_logits(self, j: int) -> None:
        ev = self.freed[j % 2] if self.side is not None else None
        if ev is not None:
            self.main.wait_event(ev)

    @contextmanager
    def topk_side(self, j: int):
        if self.side is None:
            yield
            return
        self.side.wait_stream(self.main)  # this chunk's logits are written
        with torch.cuda.stream(self.side):
            yield
            ev = torch.cuda.Event()
            ev.record(self.side)
        self.freed[j % 2] = ev

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)


@functools.cache
def _always_warp_specialised(config: LogitsConfig) -> LogitsConfig:
    """`config` with the warp-specialised kernel for every launch it can run."""
    return replace(config, ws_min_scores=1)


def _finish_flagged_rows(
    p: PreparedInputs,
    bad: np.ndarray,
    out: torch.Tensor,
    topk: int,
    config: IndexerConfig,
    launch: Callable[..., None],
    chunks: list[tuple[int, int, int, int]],
) -> int:
    """Rows the select flagged (`bad`, ascending): recompute their logits, exact torch top-k.
    Returns the count.

    Consecutive flagged rows of one chunk (`chunks`, as planned) share one logits launch (as
    many as fit `max_chunk_bytes` with the exact path's int64 sort temporaries, ~40 B a score);
    a row's scores do not depend on which other rows share its launch, and the launch runs the
    kernel the chunk ran (the warp-specialised one too, which a launch this small would not
    take by `ws_min_scores`), so they are the chunk's scores bitwise. (A launch small enough for
    the config's one-block form takes relu as max(x, 0) where a chunk's two-block programs may
    take x + |x| with halved weights: the same products unless |w * q_scale| < 2^-125,
    `LogitsConfig.pair_relu`.)
    """
    if bad.size == 0:
        return 0
    starts = np.array(sorted(c[0] for c in chunks))  # the chunks tile the rows
    ws = {
        r0: config.logits.runs_warp_specialised(p.q8, p.k8, p.heads, r1 - r0, col0)
        for r0, r1, col0, _ in chunks
    }
    home = starts[np.searchsorted(starts, bad, side="right") - 1]  # each row's chunk
    runs = np.split(bad, np.flatnonzero((np.diff(bad) != 1) | (np.diff(home) != 0)) + 1)
    for run in runs:
        logits_config = config.logits
        if ws[int(home[np.searchsorted(bad, run[0])])]:
            logits_config = _always_warp_specialised(config.logits)
        # at most one chunk's worth of rows per launch (the memory bound)
        for r0, r1, col0, width in plan_chunks(
            p.ks_host[run[0] : run[-1] + 1],
            p.ke_host[run[0] : run[-1] + 1],
            p.k8.shape[0],
            _EXACT_BYTES_PER_SCORE * p.k8.shape[0],
            config.max_chunk_bytes,
            align=1,
        ):
            n = r1 - r0
            logits = torch.empty((n, width), dtype=torch.float32, device=out.device)
            a = int(run[0]) + r0
            launch(
                p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, logits,
                heads=p.heads, row0=a, n_rows=n, col0=col0, config=logits_config,
            )  # fmt: skip
            out[a : a + n] = topk_rows_torch(
                logits, col0, p.ks[a : a + n], p.ke[a : a + n], topk, p.s_k
            )
    return int(bad.size)


def topk_from_logits(
    logits: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk: int,
    *,
    config: IndexerConfig = FIXED_CONFIG,
    stats: dict | None = None,
) -> torch.Tensor:
    """The indexer's top-k on given fp32 scores [S_q, S_k] (only [ks, ke) is read); sentinel S_k."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(
            f"logits must be float32 [S_q, S_k], got {logits.dtype} {tuple(logits.shape)}"
        )
    s_q, s_k = logits.shape
    for name, x in (("ks", ks), ("ke", ke)):
        if tuple(x.shape) != (s_q,) or x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [S_q={s_q}], got {x.dtype} {tuple(x.shape)}")
    topk = _checked_topk(topk, config)
    check_triton_runs_on(logits.device, "logits")
    if bool((ks < 0).any()) or bool((ke > s_k).any()):
        raise ValueError(f"[ks, ke) must lie inside the keys [0, {s_k})")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    per_row = 4 * s_k + TopkWorkspace.bytes_per_row(topk, config.topk)
    rows = max(1, min(s_q, config.max_chunk_bytes // per_row))
    out = torch.empty((s_q, topk), dtype=torch.int32, device=logits.device)
    ws = TopkWorkspace.allocate(rows, topk, config.topk, logits.device)
    fallback = 0
    for r0 in range(0, s_q, rows):
        r1 = min(s_q, r0 + rows)
        n = r1 - r0
        launch_select(
            logits[r0:r1], 0, ks, ke, ws, topk=topk, row0=r0, n_rows=n, sentinel=s_k,
            config=config.topk,
        )  # fmt: skip
        order_topk(ws, out[r0:r1], n, topk, config.topk)
        bad = torch.nonzero(ws.status[:n]).flatten()
        if bad.numel():
            rows_bad = bad + r0
            out[rows_bad] = topk_rows_torch(
                logits[rows_bad], 0, ks[rows_bad], ke[rows_bad], topk, s_k
            )
            fallback += int(bad.numel())
    if stats is not None:
        stats["fallback_rows"] = stats.get("fallback_rows", 0) + fallback
    return out


def fp8_indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk: int,
    *,
    config: IndexerConfig = FIXED_CONFIG,
) -> torch.Tensor:
    """Indices [S_q, topk] int32 of each query's top-k keys in [ks, ke) (see module docstring)."""
    p = prepare_inputs(q, k, w, ks, ke, defer_finite_check=True)
    return indexer_topk_prepared(p, topk, config)


def fp8_indexer_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    config: IndexerConfig = FIXED_CONFIG,
) -> torch.Tensor:
    """The fp32 indexer scores [S_q, S_k]; -inf outside each query's [ks, ke). Whole matrix."""
    p = prepare_inputs(q, k, w, ks, ke)
    out = torch.full((p.s_q, p.k8.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    launch_logits(
        p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, out,
        heads=p.heads, row0=0, n_rows=p.s_q, col0=0, config=config.logits,
    )  # fmt: skip
    return out[:, : p.s_k]
