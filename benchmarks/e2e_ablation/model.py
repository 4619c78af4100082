"""A small DSA-style MoE causal LM in plain PyTorch, trained by every arm of the ablation.

Per layer (pre-norm, residual stream in fp32, matmuls in the compute dtype, bf16 on the GPU):

    c_q  = norm(x W_dq)                                q latent (MLA's q_lora_rank)
    q    = c_q W_uq -> [S, H, kv_dim + rope_dim]       RoPE on the last rope_dim
    kv   = norm(x W_dkv[:kv_dim]); k_pe = rope(x W_dkv[kv_dim:])     one shared key/value (MQA)
    idx  = indexer(c_q, x)                             top-k keys per query in [ks, ke)
    x   += sparse_mqa(q, kv, k_pe, idx) W_o            attention over the selected keys only
    x   += MoE(norm(x))

The lightning indexer (DeepSeek-V3.2): q_I = c_q W_iq -> [S, H_I, D_I], k_I = x W_ik -> [S, D_I],
w = x W_iw / sqrt(H_I), RoPE on the first rope_dim of q_I and k_I, then the fp8 top-k of
kernels/ (or another `IndexerFn`). Its inputs are detached and its weights are not trained:
top-k passes no gradient, and the indexer's own KL objective of DSA is outside what this
ablation measures (its cost is the forward, which is what runs here in every layer).

Documents: the indexer only ranks keys in [ks[t], ke[t]) (the query's document, causally), so
attention is document-causal without any mask tensor; a query with an empty range (packshard's
padding) attends to nothing and outputs zeros.

Loss: `fused_linear_cross_entropy` computes the LM head, the loss and both gradients chunk by
chunk in the forward (Liger-style), so the [S, 151,936] logits never exist whole and nothing
is recomputed; 3 matmuls per token instead of 4 with checkpointing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.e2e_ablation.config import ModelConfig
from benchmarks.e2e_ablation.moe import MoE
from benchmarks.e2e_ablation.sparse_attention import IMPLEMENTATIONS

IGNORE_INDEX = -100


class IndexerFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        w: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        topk: int,
    ) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_tables(
    position_ids: torch.Tensor, dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, dim/2] (fp32) for the given positions."""
    inv = 1.0 / (
        theta ** (torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim)
    )
    ang = position_ids.float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [S, ..., d] by the position's angle."""
    half = x.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, norm, chunk):  # type: ignore[override]
        w = weight.to(h.dtype)
        grad_h = torch.zeros_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for c0 in range(0, h.shape[0], chunk):
            hc, yc = h[c0 : c0 + chunk], labels[c0 : c0 + chunk]
            logits = (hc @ w.t()).float()
            valid = yc != IGNORE_INDEX
            safe = torch.where(valid, yc, torch.zeros_like(yc))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            g = torch.softmax(logits, dim=-1)
            g.scatter_add_(1, safe[:, None], -torch.ones_like(picked)[:, None])
            g = (g * (valid.float() / norm)[:, None]).to(h.dtype)
            grad_h[c0 : c0 + chunk] = g @ w
            grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        return total / norm

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out, None, None, None


def fused_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, norm: float, chunk: int
) -> torch.Tensor:
    """sum over positions with a label of CE(h @ weight.T, label), divided by `norm`."""
    return _FusedLinearCE.apply(h, weight, labels, float(norm), int(chunk))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, std = cfg.d_model, cfg.init_std
        self.cfg = cfg
        self.norm_attn = nn.Parameter(torch.ones(d))
        self.norm_q = nn.Parameter(torch.ones(cfg.q_rank))
        self.norm_kv = nn.Parameter(torch.ones(cfg.kv_dim))
        self.norm_ffn = nn.Parameter(torch.ones(d))
        self.w_dq = nn.Parameter(torch.randn(cfg.q_rank, d) * std)
        self.w_uq = nn.Parameter(torch.randn(cfg.n_heads * cfg.head_dim, cfg.q_rank) * std)
        self.w_dkv = nn.Parameter(torch.randn(cfg.kv_dim + cfg.rope_dim, d) * std)
        self.w_o = nn.Parameter(
            torch.randn(d, cfg.n_heads * cfg.kv_dim) * (std / math.sqrt(2 * cfg.n_layers))
        )
        # the indexer: not trained (see the module docstring)
        self.w_iq = nn.Parameter(
            torch.randn(cfg.index_heads * cfg.index_dim, cfg.q_rank) * std, requires_grad=False
        )
        self.w_ik = nn.Parameter(torch.randn(cfg.index_dim, d) * std, requires_grad=False)
        self.w_iw = nn.Parameter(torch.randn(cfg.index_heads, d) * std, requires_grad=False)
        self.moe = MoE(
            d,
            cfg.n_experts,
            cfg.expert_topk,
            cfg.expert_dim,
            capacity_multiple=cfg.capacity_multiple,
            init_std=std,
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ks: torch.Tensor, ke: torch.Tensor,
        indexer: IndexerFn, attention: Callable[..., torch.Tensor], dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        cfg = self.cfg
        s = x.shape[0]
        h = rms_norm(x, self.norm_attn, cfg.norm_eps).to(dtype)
        c_q = rms_norm(F.linear(h, self.w_dq.to(dtype)), self.norm_q, cfg.norm_eps)
        q = F.linear(c_q, self.w_uq.to(dtype)).view(s, cfg.n_heads, cfg.head_dim)
        q_nope, q_pe = q[..., : cfg.kv_dim], apply_rope(q[..., cfg.kv_dim :], *rope)
        kv_all = F.linear(h, self.w_dkv.to(dtype))
        kv = rms_norm(kv_all[:, : cfg.kv_dim], self.norm_kv, cfg.norm_eps)
        k_pe = apply_rope(kv_all[:, cfg.kv_dim :], *rope)
        with torch.no_grad():
            idx = self._select(c_q.detach(), h.detach(), rope, ks, ke, indexer, dtype)
            nvalid = (idx < s).sum(dim=1, dtype=torch.int32)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        o = attention(
            q_nope.contiguous(),
            q_pe.contiguous(),
            kv.contiguous(),
            k_pe.contiguous(),
            idx,
            nvalid,
            scale,
        )
        x = x + F.linear(o.reshape(s, -1), self.w_o.to(dtype)).float()
        return x + self.moe(rms_norm(x, self.norm_ffn, cfg.norm_eps).to(dtype)).float()

    def _select(
        self, c_q: torch.Tensor, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ks: torch.Tensor, ke: torch.Tensor,
        indexer: IndexerFn, dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        cfg = self.cfg
        s, r = c_q.shape[0], cfg.rope_dim
        qi = F.linear(c_q, self.w_iq.to(dtype)).view(s, cfg.index_heads, cfg.index_dim)
        ki = F.linear(h, self.w_ik.to(dtype))
        qi = torch.cat((apply_rope(qi[..., :r], *rope), qi[..., r:]), dim=-1)
        ki = torch.cat((apply_rope(ki[:, :r], *rope), ki[:, r:]), dim=-1)
        wi = F.linear(h, self.w_iw.to(dtype)).float() / math.sqrt(cfg.index_heads)
        return indexer(qi.to(torch.bfloat16), ki.to(torch.bfloat16), wi, ks, ke, cfg.index_topk)


class DSAModel(nn.Module):
    """Embedding (tied with the LM head), `n_layers` DSA blocks, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_out = nn.Parameter(torch.ones(cfg.d_model))

    def forward(
        self, batch: dict[str, torch.Tensor], *, loss_norm: float, indexer: IndexerFn, attention: str, dtype: torch.dtype,
        ce_chunk: int,
    ) -> torch.Tensor:  # fmt: skip
        """Summed CE over the row's labelled positions divided by `loss_norm` (a scalar)."""
        ids, labels = batch["input_ids"], batch["labels"]
        rope = rope_tables(batch["position_ids"], self.cfg.rope_dim, self.cfg.rope_theta)
        attn = IMPLEMENTATIONS[attention]
        x = F.embedding(ids, self.embed).float()
        for block in self.blocks:
            x = block(x, rope, batch["ks"], batch["ke"], indexer, attn, dtype)
        h = rms_norm(x, self.norm_out, self.cfg.norm_eps).to(dtype)
        return fused_linear_cross_entropy(h, self.embed, labels, loss_norm, ce_chunk)

    def moe_loads(self) -> list[tuple[int, float, int]]:
        """(max load, mean load, capacity) of each layer's last MoE call."""
        return [
            (b.moe.last_max_load, b.moe.last_mean_load, b.moe.last_capacity) for b in self.blocks
        ]


def count_parameters(model: DSAModel) -> dict[str, int]:
    """Total, trained, and per-token active parameters (top-k of the experts, LM head included)."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts = sum(b.moe.w_in.numel() + b.moe.w_out.numel() for b in model.blocks)
    active = total - model.embed.numel() - experts + experts * cfg.expert_topk // cfg.n_experts
    return {
        "total": total,
        "trained": trained,
        "active_per_token_ex_head": active,
        "lm_head": model.embed.numel(),
    }
