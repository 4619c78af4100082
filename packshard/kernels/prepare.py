"""The indexer's inputs in the kernels' layouts: validated, quantized to fp8 and padded.

`prepare_inputs(q, k, w, ks, ke)` checks shapes, dtypes, devices and ranges (a bad one raises
ValueError naming it), quantizes q and k per vector to fp8 e4m3 with power-of-two scales
(`kernels.quant`), folds the query scales into the weights (wq = w * q_scale) and pads to the
kernels' rules: keys to a multiple of 128 (zero keys with zero scale, never inside any
[ks, ke): whole 64/128-key tiles need no bound mask), H to a power of two (zero weights), D to
a power of two >= 32 (zero columns, after quantization so scales are unchanged).

It never waits for the GPU on the way: ranges on the host are copied up asynchronously from
pinned memory; ranges on the GPU are copied down first and waited for alone, while the
quantizers run. NaN or +-inf in q, k or w is four floats on the device (`_finite_flags`),
checked here or, deferred, at the sync that ends `indexer_topk_prepared`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from packshard.kernels._triton_env import interpreting
from packshard.kernels.quant import quantize_fp8

KEY_PAD = 128  # keys padded to a multiple of this: every key tile (block_k <= 128) is whole


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
    if d < 1 or h < 1:
        raise ValueError(f"q must have H >= 1 heads of D >= 1 dims, got shape {tuple(q.shape)}")
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
    check_triton_runs_on(dev, "q, k, w")


def check_triton_runs_on(dev: torch.device, what: str) -> None:
    """ValueError unless Triton can run kernels on `dev` (a GPU, or the CPU interpreter)."""
    if dev.type == "cpu" and not interpreting():
        raise ValueError(
            f"{what} on the CPU: the Triton kernels need a GPU, or TRITON_INTERPRET=1 set "
            "before triton is imported (the interpreter, for small shapes)"
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
