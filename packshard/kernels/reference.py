"""Plain PyTorch reference for the fp8 indexer: fp32 logits on dequantized inputs, exact top-k.

Written for clarity, not speed (it materialises [S_q, H, S_k] products): tests use it at small
shapes. The top-k here is an independent implementation of the order contract (a stable
descending sort of the float scores with -0.0 folded onto +0.0), not the kernel's packed keys.
"""

from __future__ import annotations

import torch

from packshard.kernels.quant import quantize_fp8_torch


def reference_logits_fp8(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """score[t, s] = k_scale[s] * sum_h w[t,h] q_scale[t,h] relu(q8[t,h] . k8[s]); -inf outside [ks, ke).

    q8 [S_q, H, D] and k8 [S_k, D] are fp8 (or their float values); fp32 throughout.
    """
    qf = q8.float()
    kf = k8.float()
    dots = torch.einsum("thd,sd->ths", qf, kf)
    wq = w.float() * q_scale.float()
    score = torch.einsum("th,ths->ts", wq, torch.relu(dots)) * k_scale.float()[None, :]
    cols = torch.arange(kf.shape[0], device=score.device)
    valid = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    return torch.where(valid, score, torch.full_like(score, float("-inf")))


def reference_logits(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor
) -> torch.Tensor:
    """Quantize q and k (torch quantizer) and return the fp32 reference logits [S_q, S_k]."""
    q8, qs = quantize_fp8_torch(q)
    k8, kscale = quantize_fp8_torch(k)
    return reference_logits_fp8(q8, qs, k8, kscale, w, ks, ke)


def reference_topk(
    logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, topk: int
) -> torch.Tensor:
    """Top-k indices per row of full-width logits under the order contract; sentinel S_k.

    Higher score first, equal scores by lower key index (stable sort), -0.0 == +0.0; only
    columns in [ks, ke) count. Row by row, in float64, so it shares nothing with the kernel.
    """
    s_q, s_k = logits.shape
    out = torch.full((s_q, topk), s_k, dtype=torch.int32)
    for t in range(s_q):
        lo, hi = int(ks[t]), int(ke[t])
        if hi <= lo:
            continue
        vals = logits[t, lo:hi].double().cpu() + 0.0  # -0.0 + 0.0 == +0.0
        order = torch.sort(vals, descending=True, stable=True).indices[:topk]
        out[t, : order.numel()] = (order + lo).to(torch.int32)
    return out


def reference_indexer_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, topk: int
) -> torch.Tensor:
    """The whole indexer in torch: quantize, fp32 logits, exact top-k."""
    return reference_topk(reference_logits(q, k, w, ks, ke), ks, ke, topk)
