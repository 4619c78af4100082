"""DSA sparse attention in MQA form: each query attends only to the keys its indexer selected.

DeepSeek's DSA runs MLA in its MQA mode: every query head reads the same per-token latent
key/value, so a query's selected keys are gathered once and shared by all its heads. Here:

    score[t, h, j] = scale * (q_nope[t, h] . kv[i_j] + q_pe[t, h] . k_pe[i_j]),  i_j = idx[t, j]
    out[t, h]      = sum_j softmax_j(score[t, h, :]) * kv[i_j]              (value = latent key)

for the first `nvalid[t]` slots of idx[t] (the indexer lists valid keys first, then the
sentinel S). A query with no valid key (padding with an empty range) outputs zeros.

Two implementations of the same function:

- `triton`: one program per query. It walks its selected keys in blocks of 64, gathers their
  latent and RoPE rows (192 bytes per key at kv_dim 64 + rope_dim 32 in bf16), and runs an
  online softmax with the 16 heads as the MMA's M dimension. Backward recomputes the scores,
  accumulates dq in registers and adds dkv / dk_pe into fp32 buffers with atomics (a key is
  selected by many queries; DSA's published training kernels do the same). Cost per (query,
  key) pair: 5,120 FLOPs forward at 16 heads, 192 bytes gathered (mostly L2 hits: neighbouring
  queries pick overlapping keys), 96 fp32 atomic adds backward (relaxed order: no fences). At 32K queries x 2048 keys
  that is 6.7e7 pairs per layer: 13 GB gathered forward, 6.4e9 atomics backward. The loop
  stops at `nvalid`, so short documents cost what they hold, not top-k.
- `torch`: the plain PyTorch reference (gather, bmm, softmax) in query chunks, each under
  activation checkpointing so the gathered [chunk, top-k, 96] keys are not kept for
  backward; ~3x the memory traffic of the kernel. Used on CPU, by the tests, and on the GPU as
  the fallback when the kernel's start-up self-check fails (`self_check`).

Triton 3.9's interpreter computes `tl.dot` on bf16 operands wrongly (a 16x32 @ 32x16 product
came out ~4e10 off; fp16 and fp32 are exact), so under TRITON_INTERPRET=1 the kernels upcast
dot operands to fp32 (`F32_DOT`); compiled kernels use bf16 operands with fp32 accumulation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint

from packshard.kernels._triton_env import interpreting

log = logging.getLogger(__name__)

BLOCK_KEYS = 64
NUM_WARPS = 4
NUM_STAGES = 2
REFERENCE_CHUNK = 1024
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _gather_block(
    idx_ptr,
    kc_ptr,
    kp_ptr,
    t,
    j,
    n,
    S,
    TOPK,
    DC: tl.constexpr,
    DR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Slots [j, j + BLOCK) of query t: (key ids, valid mask, latent rows, rope rows)."""
    offs = j + tl.arange(0, BLOCK)
    in_range = offs < n
    kid = tl.load(idx_ptr + t * TOPK + offs, mask=in_range, other=0).to(tl.int64)
    ok = in_range & (kid >= 0) & (kid < S)
    kid = tl.where(ok, kid, 0)
    kc = tl.load(
        kc_ptr + kid[:, None] * DC + tl.arange(0, DC)[None, :], mask=ok[:, None], other=0.0
    )
    kp = tl.load(
        kp_ptr + kid[:, None] * DR + tl.arange(0, DR)[None, :], mask=ok[:, None], other=0.0
    )
    return kid, ok, kc, kp


@triton.jit
def _token_tile(ptr, t, H: tl.constexpr, D: tl.constexpr):
    """The [H, D] rows of token t in a contiguous [S, H, D] tensor."""
    return tl.load(ptr + t * H * D + tl.arange(0, H)[:, None] * D + tl.arange(0, D)[None, :])


@triton.jit
def _scores(qn, qp, kc, kp, scale_log2, F32_DOT: tl.constexpr):
    """[H, BLOCK] scores in log2 units: (q_nope . kv + q_pe . k_pe) * scale * log2(e)."""
    return (_dot(qn, tl.trans(kc), F32_DOT) + _dot(qp, tl.trans(kp), F32_DOT)) * scale_log2


@triton.jit(do_not_specialize=["S"])  # one compile for every row length (no %16 variant)
def _sparse_fwd_kernel(
    qn_ptr, qp_ptr, kc_ptr, kp_ptr, idx_ptr, nv_ptr, o_ptr, lse_ptr, scale_log2, S, TOPK,
    H: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, BLOCK: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H)
    dc = tl.arange(0, DC)
    qn = _token_tile(qn_ptr, t, H, DC)
    qp = _token_tile(qp_ptr, t, H, DR)
    n = tl.load(nv_ptr + t)
    m = tl.full([H], float("-inf"), tl.float32)
    denom = tl.zeros([H], tl.float32)
    acc = tl.zeros([H, DC], tl.float32)
    for j in range(0, n, BLOCK):
        _, ok, kc, kp = _gather_block(idx_ptr, kc_ptr, kp_ptr, t, j, n, S, TOPK, DC, DR, BLOCK)
        s = tl.where(ok[None, :], _scores(qn, qp, kc, kp, scale_log2, F32_DOT), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(kc.dtype), kc, F32_DOT)
        m = m_new
    has = denom > 0
    l_safe = tl.where(has, denom, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, m + tl.log2(l_safe), float("inf"))
    tl.store(o_ptr + t * H * DC + h[:, None] * DC + dc[None, :], out.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + t * H + h, lse)


@triton.jit(do_not_specialize=["S"])
def _sparse_bwd_kernel(
    qn_ptr, qp_ptr, kc_ptr, kp_ptr, idx_ptr, nv_ptr, do_ptr, lse_ptr, delta_ptr,
    dqn_ptr, dqp_ptr, dkc_ptr, dkp_ptr, scale, scale_log2, S, TOPK,
    H: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, BLOCK: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H)
    dc = tl.arange(0, DC)
    dr = tl.arange(0, DR)
    qn = _token_tile(qn_ptr, t, H, DC)
    qp = _token_tile(qp_ptr, t, H, DR)
    do = _token_tile(do_ptr, t, H, DC)
    lse = tl.load(lse_ptr + t * H + h)
    delta = tl.load(delta_ptr + t * H + h)
    n = tl.load(nv_ptr + t)
    dqn = tl.zeros([H, DC], tl.float32)
    dqp = tl.zeros([H, DR], tl.float32)
    for j in range(0, n, BLOCK):
        kid, ok, kc, kp = _gather_block(idx_ptr, kc_ptr, kp_ptr, t, j, n, S, TOPK, DC, DR, BLOCK)
        s = _scores(qn, qp, kc, kp, scale_log2, F32_DOT)
        p = tl.where(ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(kc), F32_DOT)
        ds = p * (dp - delta[:, None]) * scale
        ds_lo = ds.to(kc.dtype)
        dqn += _dot(ds_lo, kc, F32_DOT)
        dqp += _dot(ds_lo, kp, F32_DOT)
        ds_t = tl.trans(ds_lo)
        dkc = _dot(ds_t, qn, F32_DOT) + _dot(tl.trans(p.to(kc.dtype)), do, F32_DOT)
        dkp = _dot(ds_t, qp, F32_DOT)
        # relaxed: only the sums matter, read after the kernel; Triton's default acq_rel puts a
        # fence around every atomic (2x on a flash-attention backward: Dao-AILab/flash-attention#1031)
        tl.atomic_add(
            dkc_ptr + kid[:, None] * DC + dc[None, :], dkc, mask=ok[:, None], sem="relaxed"
        )
        tl.atomic_add(
            dkp_ptr + kid[:, None] * DR + dr[None, :], dkp, mask=ok[:, None], sem="relaxed"
        )
    tl.store(dqn_ptr + t * H * DC + h[:, None] * DC + dc[None, :], dqn.to(dqn_ptr.dtype.element_ty))
    tl.store(dqp_ptr + t * H * DR + h[:, None] * DR + dr[None, :], dqp.to(dqp_ptr.dtype.element_ty))


def _check(
    qn: torch.Tensor,
    qp: torch.Tensor,
    kc: torch.Tensor,
    kp: torch.Tensor,
    idx: torch.Tensor,
    nvalid: torch.Tensor,
) -> None:
    s, h, dc = qn.shape
    dr = qp.shape[-1]
    if qp.shape[:2] != (s, h) or kc.shape != (s, dc) or kp.shape != (s, dr):
        raise ValueError(
            f"sparse attention shapes: q_nope {tuple(qn.shape)}, q_pe {tuple(qp.shape)}, kv {tuple(kc.shape)}, "
            f"k_pe {tuple(kp.shape)}: expected [S, H, Dc], [S, H, Dr], [S, Dc], [S, Dr]"
        )
    if idx.dim() != 2 or idx.shape[0] != s or idx.dtype != torch.int32:
        raise ValueError(f"idx must be int32 [S={s}, topk], got {idx.dtype} {tuple(idx.shape)}")
    if nvalid.shape != (s,) or nvalid.dtype != torch.int32:
        raise ValueError(f"nvalid must be int32 [S={s}], got {nvalid.dtype} {tuple(nvalid.shape)}")


class _TritonSparseMQA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qn, qp, kc, kp, idx, nvalid, scale):  # type: ignore[override]
        qn, qp, kc, kp, idx, nvalid = (x.contiguous() for x in (qn, qp, kc, kp, idx, nvalid))
        s, h, dc = qn.shape
        dr = qp.shape[-1]
        out = torch.empty_like(qn)
        lse = torch.empty((s, h), dtype=torch.float32, device=qn.device)
        f32 = interpreting()
        if s:
            _sparse_fwd_kernel[(s,)](
                qn, qp, kc, kp, idx, nvalid, out, lse, scale * LOG2E, s, idx.shape[1],
                H=h, DC=dc, DR=dr, BLOCK=BLOCK_KEYS, F32_DOT=f32, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
            )  # fmt: skip
        ctx.save_for_backward(qn, qp, kc, kp, idx, nvalid, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        qn, qp, kc, kp, idx, nvalid, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        s, h, dc = qn.shape
        dr = qp.shape[-1]
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        dqn = torch.empty_like(qn)
        dqp = torch.empty_like(qp)
        dkc = torch.zeros(kc.shape, dtype=torch.float32, device=kc.device)
        dkp = torch.zeros(kp.shape, dtype=torch.float32, device=kp.device)
        if s:
            _sparse_bwd_kernel[(s,)](
                qn, qp, kc, kp, idx, nvalid, dout, lse, delta, dqn, dqp, dkc, dkp,
                ctx.scale, ctx.scale * LOG2E, s, idx.shape[1],
                H=h, DC=dc, DR=dr, BLOCK=BLOCK_KEYS, F32_DOT=interpreting(), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
            )  # fmt: skip
        return dqn, dqp, dkc.to(kc.dtype), dkp.to(kp.dtype), None, None, None


def _reference_chunk(
    qn: torch.Tensor,
    qp: torch.Tensor,
    kc: torch.Tensor,
    kp: torch.Tensor,
    idx: torch.Tensor,
    nvalid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    s_k = kc.shape[0]
    ids = idx.long()
    slots = torch.arange(ids.shape[1], device=ids.device)
    valid = (slots[None, :] < nvalid[:, None].long()) & (ids >= 0) & (ids < s_k)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    kcs, kps = kc[safe], kp[safe]  # [C, W, Dc], [C, W, Dr]
    acc = torch.promote_types(qn.dtype, torch.float32)  # softmax in fp32 (fp64 stays fp64)
    scores = (
        torch.bmm(qn, kcs.transpose(1, 2)).to(acc) + torch.bmm(qp, kps.transpose(1, 2)).to(acc)
    ) * scale
    scores = scores.masked_fill(~valid[:, None, :], torch.finfo(acc).min)
    p = torch.softmax(scores, dim=-1) * valid[:, None, :]
    return torch.bmm(p.to(kcs.dtype), kcs)


def sparse_mqa_reference(
    qn: torch.Tensor, qp: torch.Tensor, kc: torch.Tensor, kp: torch.Tensor, idx: torch.Tensor, nvalid: torch.Tensor,
    scale: float, *, chunk: int = REFERENCE_CHUNK,
) -> torch.Tensor:  # fmt: skip
    """The plain PyTorch sparse attention (module docstring); differentiable."""
    _check(qn, qp, kc, kp, idx, nvalid)
    s = qn.shape[0]
    outs = []
    widths = [
        int(nvalid[c0 : c0 + chunk].max()) if s else 0 for c0 in range(0, s, chunk)
    ]  # one sync per chunk
    for c0, width in zip(range(0, s, chunk), widths, strict=True):
        c1 = min(s, c0 + chunk)
        if width == 0:
            outs.append(
                torch.zeros((c1 - c0, qn.shape[1], kc.shape[1]), dtype=qn.dtype, device=qn.device)
            )
            continue
        args = (qn[c0:c1], qp[c0:c1], kc, kp, idx[c0:c1, :width], nvalid[c0:c1], scale)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (qn, qp, kc, kp)):
            outs.append(checkpoint(_reference_chunk, *args, use_reentrant=False))
        else:
            outs.append(_reference_chunk(*args))
    return torch.cat(outs) if outs else qn.new_zeros((0, qn.shape[1], kc.shape[1]))


def sparse_mqa_triton(
    qn: torch.Tensor,
    qp: torch.Tensor,
    kc: torch.Tensor,
    kp: torch.Tensor,
    idx: torch.Tensor,
    nvalid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The Triton sparse attention (module docstring); differentiable."""
    _check(qn, qp, kc, kp, idx, nvalid)
    return _TritonSparseMQA.apply(qn, qp, kc, kp, idx, nvalid, scale)


IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "torch": sparse_mqa_reference,
    "triton": sparse_mqa_triton,
}


def random_problem(
    s: int, h: int, dc: int, dr: int, topk: int, *, docs: list[int] | None = None, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Random inputs and a valid selection (distinct keys in each query's document prefix,
    valid slots first, sentinel S after) for tests and the self-check."""
    g = torch.Generator().manual_seed(seed)
    qn = torch.randn(s, h, dc, generator=g)
    qp = torch.randn(s, h, dr, generator=g)
    kc = torch.randn(s, dc, generator=g)
    kp = torch.randn(s, dr, generator=g)
    docs = docs or [s]
    idx = torch.full((s, topk), s, dtype=torch.int32)
    nvalid = torch.zeros(s, dtype=torch.int32)
    start = 0
    for length in docs:
        for t in range(start, min(s, start + length)):
            cand = torch.arange(start, t + 1)
            pick = cand[torch.randperm(cand.numel(), generator=g)[:topk]]
            idx[t, : pick.numel()] = pick.int()
            nvalid[t] = pick.numel()
        start += length
    tensors = [x.to(device=device, dtype=dtype) for x in (qn, qp, kc, kp)]
    return (*tensors, idx.to(device), nvalid.to(device))


def self_check(
    device: torch.device, dtype: torch.dtype, *, h: int, dc: int, dr: int, topk: int, s: int = 384,
    docs: list[int] | None = None,
) -> tuple[bool, str]:  # fmt: skip
    """Run the Triton kernels against the reference on a small packed problem (forward and all
    gradients). Returns (ok, message); never raises for a kernel failure, so the caller can
    fall back to the reference. The default problem: documents of 100, 200 and 60 tokens and
    24 trailing queries with no key (as padding has), more than one 64-key block per query."""
    docs = docs or [100, 200, 60]
    qn, qp, kc, kp, idx, nvalid = random_problem(
        s, h, dc, dr, topk, docs=docs, dtype=dtype, device=device, seed=7
    )
    scale = 1.0 / math.sqrt(dc + dr)
    grads = torch.randn(s, h, dc, device=device, dtype=dtype)
    results = []
    for fn, cast in (
        (sparse_mqa_triton, dtype),
        (sparse_mqa_reference, torch.float32),
    ):  # reference in fp32
        leaves = [x.detach().to(cast).requires_grad_(True) for x in (qn, qp, kc, kp)]
        try:
            out = fn(*leaves, idx, nvalid, scale)
            out.backward(grads.to(cast))
        except (
            RuntimeError,
            ValueError,
            triton.CompilationError,
        ) as e:  # kernel build/launch failures
            return False, f"{fn.__name__} raised {type(e).__name__}: {e}"
        results.append([out.detach().float()] + [x.grad.float() for x in leaves])
    names = ("out", "dq_nope", "dq_pe", "dkv", "dk_pe")
    limit = (
        5e-2 if dtype == torch.bfloat16 else 1e-4
    )  # bf16 operands land near 1e-2; a wrong kernel near 1
    worst = 0.0
    for name, a, b in zip(names, *results, strict=True):
        if not bool(torch.isfinite(a).all()):
            return False, f"triton {name} has non-finite values"
        rel = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        if rel > limit:
            return (
                False,
                f"triton {name} differs from the reference: relative error {rel:.2e} > {limit:.0e}",
            )
    return True, f"triton sparse attention matches the reference (worst relative error {worst:.2e})"
