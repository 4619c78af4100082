"""A small DSA-style MoE causal LM in plain PyTorch, trained by every arm of the ablation.

Embedding rows are scaled by sqrt(d_model) on the way in and the LM head is a separate matrix
(DSAModel's docstring says why). Per layer (pre-norm, residual stream in fp32, matmuls in the
compute dtype, bf16 on the GPU):

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

Loss: `loss.fused_linear_cross_entropy` computes the LM head, the loss and both gradients chunk
by chunk in the forward (Liger-style), so the [S, 151,936] logits never exist whole and nothing
is recomputed; on the GPU a Triton kernel turns each bf16 logits chunk into loss and gradient
in place. MoE: DeepSeek-V3 routing, dropless, cost set by the busiest expert (moe.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.e2e_ablation.config import ModelConfig
from benchmarks.e2e_ablation.loss import fused_linear_cross_entropy
from benchmarks.e2e_ablation.moe import MoE
from benchmarks.e2e_ablation.sparse_attention import IMPLEMENTATIONS


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
    """RMSNorm computed in fp32 (torch's fused kernel), returned in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


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
        indexer: IndexerFn, attention: Callable[..., torch.Tensor], dtype: torch.dtype, n_real: int,
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
        return x + self.moe(rms_norm(x, self.norm_ffn, cfg.norm_eps).to(dtype), n_real).float()

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
    """Embedding, `n_layers` DSA blocks, final norm, LM head (tied to the embedding or not).

    Untied by default: the input rows are scaled by sqrt(d_model) so that the residual stream
    carries the token (what balances the router at step 1), and a tied head would then score
    every position's own input token ~20 logits up (loss ~19 at step 1, not ~12)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * cfg.init_std)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * cfg.init_std)
        )
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_out = nn.Parameter(torch.ones(cfg.d_model))

    def forward(
        self, batch: dict[str, torch.Tensor], *, loss_norm: float, indexer: IndexerFn, attention: str, dtype: torch.dtype,
        ce_chunk: int, ce_triton: bool = False, n_real: int | None = None, with_grad: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """Summed CE over the row's labelled positions divided by `loss_norm` (a scalar).

        `n_real`: the row's true tokens (the first n_real positions; default all), for the MoE's
        real-token statistics only. `with_grad=False` computes the loss alone (no LM-head
        gradients), for evaluation under torch.no_grad()."""
        ids, labels = batch["input_ids"], batch["labels"]
        n_real = ids.shape[0] if n_real is None else n_real
        rope = rope_tables(batch["position_ids"], self.cfg.rope_dim, self.cfg.rope_theta)
        attn = IMPLEMENTATIONS[attention]
        x = F.embedding(ids, self.embed).float() * self.cfg.embed_multiplier
        for block in self.blocks:
            x = block(x, rope, batch["ks"], batch["ke"], indexer, attn, dtype, n_real)
        h = rms_norm(x, self.norm_out, self.cfg.norm_eps).to(dtype)
        head = self.embed if self.lm_head is None else self.lm_head
        return fused_linear_cross_entropy(
            h, head, labels, loss_norm, ce_chunk, use_triton=ce_triton, with_grad=with_grad
        )

    def moe_stats(self) -> list[list[torch.Tensor]]:
        """Per layer, the [2, E] host loads (all tokens, real tokens) of every MoE call since the
        last call of this method."""
        return [b.moe.take_stats() for b in self.blocks]

    def aux_loss(self) -> torch.Tensor | None:
        """Sum over layers of the MoE balance losses of the last forward (None without grad)."""
        terms = [b.moe.aux_loss for b in self.blocks if b.moe.aux_loss is not None]
        return torch.stack(terms).sum() if terms else None

    def update_router_biases(self, rate: float) -> None:
        """DeepSeek-V3's bias step in every layer (after the optimizer step)."""
        for b in self.blocks:
            b.moe.update_bias(rate)


def count_parameters(model: DSAModel) -> dict[str, int]:
    """Total, trained, and per-token active parameters (top-k of the experts, LM head included)."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts = sum(b.moe.w_in.numel() + b.moe.w_out.numel() for b in model.blocks)
    head = model.embed if model.lm_head is None else model.lm_head
    lookup = 0 if model.lm_head is None else model.embed.numel()
    active = total - lookup - head.numel() - experts + experts * cfg.expert_topk // cfg.n_experts
    return {
        "total": total,
        "trained": trained,
        "active_per_token_ex_head": active,
        "lm_head": head.numel(),
    }
