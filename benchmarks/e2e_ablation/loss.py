"""The LM head and its cross entropy, fused and chunked: logits never exist whole, nothing is
recomputed, and on the GPU one Triton pass per chunk turns the bf16 logits into the loss and
the logits' gradient in place.

Per chunk of `chunk` positions (8,192 on the h200 preset):

    logits = h_c @ W^T                       [chunk, V] in the compute dtype (bf16 on the GPU)
    loss_t = lse(logits_t) - logits_t[y_t]   for labelled t (fp32)
    g      = (softmax(logits) - onehot(y)) * [labelled] / norm      -> written over logits (bf16)
    grad_h[c] = g @ W ;  grad_W += g^T @ h_c (fp32 accumulation)

The forward computes both gradients (Liger-style), so the backward only scales them: 3 matmuls
per token instead of 4 with recomputation.

`triton` (`_ce_rows_kernel`): one program per row reads the row twice (online max / sum-exp,
then the gradient) and writes it once, in place: 3 x V x 2 bytes per position. The torch path
(`ce_rows_torch`, used on the CPU, by the tests, and on the GPU if the start-up self-check
fails) materialises the chunk in fp32 and runs ~8 elementwise passes over it: ~34 GB of
memory traffic per 4,096 x 151,936 chunk against ~3.7 GB, i.e. ~0.15 s of a 65K-token step on
the H200 against ~0.02 s (the first run's linear fit put 5.8 us on every token; this was ~2.3
of them). Both compute in fp32 from the bf16 logits and round the gradient to bf16 once, so
they agree to rounding (`self_check`).

grad_W accumulates in fp32 through `torch.addmm(..., out_dtype=torch.float32)` where the build
supports bf16 x bf16 -> fp32 (CUDA), else through a bf16 product added in fp32.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _ce_rows_kernel(
    x_ptr, stride, labels_ptr, loss_ptr, n_cols, coef,
    IGNORE: tl.constexpr, BLOCK: tl.constexpr, WITH_GRAD: tl.constexpr,
):  # fmt: skip
    """Row r of x [rows, n_cols]: loss_ptr[r] = lse - x[label] (0 unlabelled); with WITH_GRAD,
    x[r] <- (softmax(x[r]) - onehot(label)) * coef (0 unlabelled), in x's dtype."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != IGNORE
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(base + c0 + cols, mask=c0 + cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    safe = tl.where(valid, label, 0)
    picked = tl.load(base + safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    if WITH_GRAD:
        c = tl.where(valid, coef, 0.0)
        for c0 in range(0, n_cols, BLOCK):
            idx = c0 + cols
            x = tl.load(base + idx, mask=idx < n_cols, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * c
            g = tl.where(idx == safe, g - c, g)
            tl.store(base + idx, g.to(x_ptr.dtype.element_ty), mask=idx < n_cols)


def ce_rows_triton(
    logits: torch.Tensor, labels: torch.Tensor, coef: float, *, with_grad: bool
) -> torch.Tensor:
    """Per-row losses (fp32); with `with_grad`, `logits` is overwritten by its gradient x coef."""
    rows, n = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("ce_rows_triton: logits must be contiguous along the vocabulary")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _ce_rows_kernel[(rows,)](
            logits, logits.stride(0), labels, loss, n, float(coef),
            IGNORE=IGNORE_INDEX, BLOCK=min(BLOCK_V, triton.next_power_of_2(n)), WITH_GRAD=with_grad,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return loss


def ce_rows_torch(
    logits: torch.Tensor, labels: torch.Tensor, coef: float, *, with_grad: bool
) -> torch.Tensor:
    """The same as ce_rows_triton in plain PyTorch (fp32 intermediates)."""
    x = logits.float()
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(1, safe[:, None]).squeeze(1), torch.zeros_like(lse))
    if with_grad:
        g = torch.softmax(x, dim=-1)
        g.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
        logits.copy_(g * (valid.float() * coef)[:, None])
    return loss


@functools.cache
def _mixed_addmm_ok(device: str) -> bool:
    """Whether torch.addmm(fp32, bf16, bf16, out_dtype=fp32) runs and is right on `device`."""
    try:
        a = torch.randn(64, 48, device=device)
        b = torch.randn(48, 32, device=device)
        c = torch.randn(64, 32, device=device)
        got = torch.addmm(c, a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        log.info(
            "addmm with out_dtype unavailable on %s (%s): grad_W adds a bf16 product", device, e
        )
        return False
    ref = c + a.bfloat16().float() @ b.bfloat16().float()
    return bool(torch.allclose(got, ref, rtol=1e-3, atol=1e-3))


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b with acc fp32 and a, b in the compute dtype."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if a.is_cuda and _mixed_addmm_ok(str(a.device)):
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    return acc.add_((a @ b).float())


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, norm, chunk, use_triton):  # type: ignore[override]
        w = weight.to(h.dtype)
        rows_fn = ce_rows_triton if use_triton else ce_rows_torch
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for c0 in range(0, h.shape[0], chunk):
            hc, yc = h[c0 : c0 + chunk], labels[c0 : c0 + chunk]
            logits = hc @ w.t()
            total += rows_fn(logits, yc, 1.0 / norm, with_grad=True).sum()
            grad_h[c0 : c0 + chunk] = logits @ w
            grad_w = _accumulate(grad_w, logits.t(), hc)
        ctx.save_for_backward(grad_h, grad_w)
        return total / norm

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out, None, None, None, None


def fused_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, norm: float, chunk: int, *,
    use_triton: bool = False, with_grad: bool = True,
) -> torch.Tensor:  # fmt: skip
    """sum over positions with a label of CE(h @ weight.T, label), divided by `norm`.

    `with_grad=False`: the loss alone, no gradients computed (call under torch.no_grad())."""
    if with_grad:
        return _FusedLinearCE.apply(h, weight, labels, float(norm), int(chunk), bool(use_triton))
    rows_fn = ce_rows_triton if use_triton else ce_rows_torch
    w = weight.to(h.dtype)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for c0 in range(0, h.shape[0], chunk):
        logits = h[c0 : c0 + chunk] @ w.t()
        total += rows_fn(logits, labels[c0 : c0 + chunk], 1.0, with_grad=False).sum()
    return total / norm


def self_check(
    device: torch.device, dtype: torch.dtype, *, vocab: int, rows: int = 300
) -> tuple[bool, str]:
    """The Triton rows kernel against the torch path on random logits (loss and gradient).
    Returns (ok, message); never raises for a kernel failure, so the caller can fall back."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(device=device, dtype=dtype)
    y = torch.randint(0, vocab, (rows,), generator=g).to(device)
    y[::5] = IGNORE_INDEX
    outs = []
    for fn in (ce_rows_triton, ce_rows_torch):
        buf = x.clone()
        try:
            loss = fn(buf, y, 0.37, with_grad=True)
        except (RuntimeError, ValueError, triton.CompilationError) as e:
            return False, f"{fn.__name__} raised {type(e).__name__}: {e}"
        outs.append((loss.float(), buf.float()))
    (la, ga), (lb, gb) = outs
    loss_err = float(((la - lb).abs() / lb.abs().clamp_min(1e-6)).max())
    grad_err = float((ga - gb).norm() / gb.norm().clamp_min(1e-12))
    limit = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 gradient: rounding only
    if not (loss_err <= 1e-5 and grad_err <= limit):
        return False, (
            f"triton cross entropy differs from torch: loss {loss_err:.1e} (limit 1e-5), "
            f"gradient {grad_err:.1e} (limit {limit:.0e})"
        )
    return True, (
        f"triton cross entropy matches torch (loss {loss_err:.1e}, gradient {grad_err:.1e} relative)"
    )
