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
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch

from packshard.kernels.logits import FIXED_LOGITS_CONFIG, LogitsConfig, launch_logits
from packshard.kernels.order import order_topk
from packshard.kernels.quant import quantize_fp8
from packshard.kernels.topk import (
    FIXED_TOPK_CONFIG,
    TopkConfig,
    TopkWorkspace,
    launch_select,
    topk_rows_torch,
)

_EXACT_BYTES_PER_SCORE = 40  # topk_rows_torch: int64 keys, masked copy, sort values + indices
KEY_PAD = 128  # keys padded to a multiple of this: every key tile (block_k <= 128) is whole
COL_ALIGN = 16  # chunk key windows start and end on multiples of this (16-float rows)


@dataclass(frozen=True)
class IndexerConfig:
    """Everything that shapes a launch; the defaults are the fixed config (docs/KERNELS.md)."""

    logits: LogitsConfig = FIXED_LOGITS_CONFIG
    topk: TopkConfig = FIXED_TOPK_CONFIG
    max_chunk_bytes: int = 8 << 30  # logits + top-k workspace of the chunks in flight
    # "none": every kernel on the current stream; "stream": chunk i's top-k on a second stream
    # while chunk i+1's logits run; "priority": the same with the second stream at high
    # priority. On the H200 (64K, H=64 causal) the overlap lost in 3 of 4 runs (51.1 ms against
    # 48.7 serial in the last): the logits stretch from 35 to ~48 ms when the select shares
    # their SMs (docs/KERNELS.md, v5)
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


@dataclass
class PreparedInputs:
    """Quantized, padded operands in the kernels' layouts, plus host copies of ks/ke."""

    q8: torch.Tensor  # [S_q * Hp, Dp] fp8
    wq: torch.Tensor  # [S_q * Hp] fp32 = w * q_scale
    k8: torch.Tensor  # [S_kp, Dp] fp8, S_kp a multiple of KEY_PAD
    k_scale: torch.Tensor  # [S_kp] fp32
    ks: torch.Tensor  # [S_q] int32, on the device
    ke: torch.Tensor  # [S_q] int32, on the device
    ks_host: np.ndarray = field(repr=False)  # int32 copies for chunk planning
    ke_host: np.ndarray = field(repr=False)
    s_q: int = 0
    s_k: int = 0
    heads: int = 0  # padded
    # (q_scale, k_scale, w) not yet checked for non-finite values
    # (`prepare_inputs(defer_finite_check=True)`): `indexer_topk_prepared` reduces them after
    # queueing the chunks and checks the result at its final sync
    unchecked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [S_q, H, D], got shape {tuple(q.shape)}")
    s_q, h, d = q.shape
    if k.dim() != 2 or k.shape[1] != d:
        raise ValueError(f"k must be [S_k, D={d}], got shape {tuple(k.shape)}")
    if tuple(w.shape) != (s_q, h):
        raise ValueError(f"w must be [S_q={s_q}, H={h}], got shape {tuple(w.shape)}")
    for name, x in (("ks", ks), ("ke", ke)):
        if tuple(x.shape) != (s_q,) or x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [S_q={s_q}], got {x.dtype} {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("w", w)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point (bf16 expected), got {x.dtype}")
    devs = {x.device for x in (q, k, w)}
    if len(devs) != 1:
        raise ValueError(f"q, k, w must share one device, got {sorted(map(str, devs))}")
    dev = q.device
    if ks.device != ke.device or ks.device not in (dev, torch.device("cpu")):
        raise ValueError(
            f"ks and ke must both be on q's device ({dev}) or both on the CPU, got "
            f"{ks.device} and {ke.device}"
        )


def _extreme(scale: torch.Tensor) -> torch.Tensor:
    """float32 scalar: the largest scale (NaN or inf if any is), 0 for none."""
    if scale.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=scale.device)
    return scale.amax().float()


def _extremes(x: torch.Tensor) -> list[torch.Tensor]:
    """float32 scalars min and max of x (NaN if any element is), 0 and 0 for none."""
    if x.numel() == 0:
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return [zero, zero]
    lo, hi = torch.aminmax(x)
    return [lo.float(), hi.float()]


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    defer_finite_check: bool = False,
) -> PreparedInputs:
    """Validate, quantize and pad; raises ValueError on bad shapes, ranges or non-finite values.

    ks and ke on the CPU (q on a GPU): the host plans from them as they are and they are
    copied to the GPU asynchronously (from pinned memory), so nothing here waits for the GPU:
    the call's host work runs while the GPU still works through what was queued before it.
    ks and ke on the GPU: their copy to the host is queued first (asynchronous, into pinned
    memory), then the quantizers, which read no ranges; the host waits for the copy, i.e. for
    all work queued before the call, and checks the ranges (and `indexer_topk_prepared` plans
    and queues the chunks) while the quantizers run. A bad range raises before anything reads
    it either way. Pinned host ranges are read by their copy after this returns, and
    `PreparedInputs.ks_host` / `ke_host` may share their memory: leave them unchanged until
    the GPU has caught up and the prepared inputs are done with (`fp8_indexer_topk` returns
    after both).
    The finiteness of q, k and w is four floats on the device (`_finite_flags`): checked here
    with one more transfer, or, with `defer_finite_check`, by `indexer_topk_prepared` at the
    sync it makes anyway at the end (`PreparedInputs.unchecked`); a non-finite input then
    still raises, after the (meaningless) scores were computed.
    """
    _check_inputs(q, k, w, ks, ke)
    s_q, h, d = q.shape
    s_k = k.shape[0]
    copied = None
    if ks.is_cuda:
        host_t = torch.cat([ks, ke]).to("cpu", non_blocking=True)  # pinned: no sync
        copied = torch.cuda.Event()
        copied.record()
    else:
        ks_host, ke_host = np.ascontiguousarray(ks.numpy()), np.ascontiguousarray(ke.numpy())
        if q.is_cuda:  # ranges from the host: copied up, waiting for nothing
            ks, ke = _upload(ks, q.device), _upload(ke, q.device)
    q8, q_scale = quantize_fp8(q)
    k8, k_scale = quantize_fp8(k)
    if copied is not None:
        copied.synchronize()  # the copy only: the quantizers queued after it keep running
        host = host_t.numpy()
        ks_host, ke_host = host[:s_q], host[s_q:]
    if s_q and (int(ks_host.min()) < 0 or int(ke_host.max()) > s_k):
        t = int(np.flatnonzero((ks_host < 0) | (ke_host > s_k))[0])
        raise ValueError(
            f"query {t}: [ks, ke) = [{ks_host[t]}, {ke_host[t]}) leaves the keys [0, {s_k})"
        )
    if not defer_finite_check:
        check_finite(_finite_flags(q_scale, k_scale, w))
    wq = w.float() * q_scale
    hp, dp = _next_pow2(h), max(32, _next_pow2(d))
    s_kp = -(-s_k // KEY_PAD) * KEY_PAD
    if hp != h or dp != d:
        q8p = torch.zeros((s_q, hp, dp), dtype=q8.dtype, device=q.device)
        q8p[:, :h, :d] = q8
        wqp = torch.zeros((s_q, hp), dtype=torch.float32, device=q.device)
        wqp[:, :h] = wq
        q8, wq = q8p, wqp
    if s_kp != s_k or dp != d:
        k8p = torch.zeros((s_kp, dp), dtype=k8.dtype, device=k.device)
        k8p[:s_k, :d] = k8
        ksp = torch.zeros((s_kp,), dtype=torch.float32, device=k.device)
        ksp[:s_k] = k_scale
        k8, k_scale = k8p, ksp
    return PreparedInputs(
        q8=q8.reshape(s_q * hp, dp).contiguous(),
        wq=wq.reshape(-1).contiguous(),
        k8=k8.contiguous(),
        k_scale=k_scale.contiguous(),
        ks=ks.contiguous(),
        ke=ke.contiguous(),
        ks_host=ks_host,
        ke_host=ke_host,
        s_q=s_q,
        s_k=s_k,
        heads=hp,
        unchecked=(q_scale, k_scale, w) if defer_finite_check else None,
    )


def _upload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU `x` on `device` by an asynchronous copy from contiguous pinned memory (made so here
    unless it is, as trainer_shim's ranges are: a copy from pageable or strided memory may wait
    for the stream)."""
    if not (x.is_pinned() and x.is_contiguous()):
        x = x.contiguous().pin_memory()
    return x.to(device, non_blocking=True)


def _finite_flags(q_scale: torch.Tensor, k_scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 [4] on the device: the largest q and k scales, the smallest and largest w.

    The quantizers set a vector's scale to NaN or inf when it holds NaN or inf, and amax /
    aminmax propagate both: four floats say whether q, k and w are finite (a handful of
    kernels instead of a chain of elementwise ops and reductions a tensor)."""
    return torch.stack([_extreme(q_scale), _extreme(k_scale), *_extremes(w)])


def check_finite(flags: torch.Tensor) -> None:
    """Raise ValueError unless the four extremes (q scale, k scale, min w, max w) are finite."""
    _raise_unless_finite(flags.cpu().numpy())


def _raise_unless_finite(extremes: np.ndarray) -> None:
    finite = np.isfinite(extremes)
    names = [
        name
        for name, ok in zip("qkw", [finite[0], finite[1], finite[2:].all()], strict=True)
        if not ok
    ]
    if names:
        raise ValueError(
            f"non-finite values (NaN or inf) in {', '.join(names)}: the indexer refuses them"
        )


def plan_chunks(
    ks: np.ndarray,
    ke: np.ndarray,
    s_kp: int,
    extra_per_row: int,
    max_chunk_bytes: int,
    align: int = 64,
) -> list[tuple[int, int, int, int]]:
    """Query chunks (row0, row1, col0, width) whose logits + workspace fit max_chunk_bytes.

    Pure function of the ranges: a chunk's key window is [col0, col0 + width), col0 the smallest
    ks of its non-empty rows rounded down to 16 and width padded to 16. The chunks tile the rows
    in order, each a multiple of `align` rows (whole query blocks) but the last, at least
    `align` even if that exceeds the bound. Sized by their windows, not by all s_kp keys: every
    chunk holds at most R rows, and the largest chunk's logits (rows x width floats) plus R
    rows of workspace (`extra_per_row` bytes each: what the buffers, reused across chunks,
    take) fit the bound. R is the rows that s_kp-wide rows fit (every chunk's window then fits)
    or a power-of-two multiple of it, whichever plans the fewest chunks (the smallest on a tie):
    fewer, larger launches leave fewer idle last waves (the 128K packed row on the H200: 981
    TFLOP/s in 10 chunks of all keys, 1031 in 3 under a 32 GiB bound, benchmarks/chunk_probe.py;
    1003 in the 5 chunks of its windows under the default 8 GiB).
    """
    # Planned in int64 whatever the ranges' dtype (the shim's `ks_host` is int32): the empty-row
    # sentinel below is int64's max, which an int32 array can neither hold nor compare against.
    ks, ke = np.asarray(ks, dtype=np.int64), np.asarray(ke, dtype=np.int64)
    n = len(ks)
    if n == 0:
        return []
    starts = np.arange(0, n, align)
    live = ke > ks  # empty rows do not widen a chunk's key window
    none = np.iinfo(np.int64).max
    if live.all():  # the common case: two reductions, no masked copies
        lo, hi = np.minimum.reduceat(ks, starts), np.maximum.reduceat(ke, starts)
    else:
        lo = np.minimum.reduceat(np.where(live, ks, none), starts)
        hi = np.maximum.reduceat(np.where(live, ke, -1), starts)
    ends = np.minimum(starts + align, n)
    r0 = max(align, (max_chunk_bytes // (4 * s_kp + extra_per_row)) // align * align)
    best = _plan_greedy(lo, hi, starts, ends, r0, extra_per_row, max_chunk_bytes, none, n)
    cap = r0 * 2
    while len(best) > 1 and cap < 2 * n and 2 * cap * extra_per_row <= max_chunk_bytes:
        plan = _plan_greedy(
            lo, hi, starts, ends, cap, extra_per_row, max_chunk_bytes, none, len(best) - 1
        )
        if plan is not None:
            best = plan
        cap *= 2
    return best


def _plan_greedy(
    lo: np.ndarray,
    hi: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    cap: int,
    extra_per_row: int,
    max_chunk_bytes: int,
    none: int,
    limit: int,
) -> list[tuple[int, int, int, int]] | None:
    """`plan_chunks` at a row cap: from each block, as many blocks as keep the chunk within
    `cap` rows and its logits within the bound less `cap` rows of workspace; None past `limit`
    chunks."""
    logits_bytes = max_chunk_bytes - cap * extra_per_row
    chunks: list[tuple[int, int, int, int]] = []
    i, nb = 0, len(starts)
    while i < nb:
        if len(chunks) == limit:
            return None
        j = int(np.searchsorted(ends, starts[i] + cap, side="right"))  # blocks within the cap
        j = max(j, i + 1)
        a = np.minimum.accumulate(lo[i:j])
        b = np.maximum.accumulate(hi[i:j])
        col0 = np.where(a == none, 0, a // COL_ALIGN * COL_ALIGN)
        width = np.where(a == none, COL_ALIGN, -(-(b - col0) // COL_ALIGN) * COL_ALIGN)
        need = 4 * (ends[i:j] - starts[i]) * width  # nondecreasing along the blocks
        m = max(1, int(np.searchsorted(need, logits_bytes, side="right")))
        chunks.append((int(starts[i]), int(ends[i + m - 1]), int(col0[m - 1]), int(width[m - 1])))
        i += m
    return chunks


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
    if topk < 1:
        raise ValueError(f"topk={topk}: must be >= 1")
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


def _chunk_work(
    ks: np.ndarray, ke: np.ndarray, chunks: list[tuple[int, int, int, int]]
) -> list[int]:
    """In-range (query, key) pairs of each chunk (rows [r0, r1)): what its logits and its
    select cost. The chunks tile the rows in order (`plan_chunks`)."""
    if not chunks:
        return []
    starts = np.array([c[0] for c in chunks])
    return np.add.reduceat(np.maximum(ke - ks, 0), starts, dtype=np.int64).tolist()


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
    if topk < 1:
        raise ValueError(f"topk={topk}: must be >= 1")
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
