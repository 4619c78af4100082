"""FLOPs of one training row of the ablation's model (forward + backward), by component.

    dense    6 * (attention projections + router + top-k experts) * tokens   (2 fwd + 4 bwd per weight)
    lm_head  6 * vocab * d_model * tokens                                   (fused CE: 3 matmuls)
    indexer  2 * (indexer projections) * tokens + 2 * H_I * D_I * ranked pairs    (forward only)
    sparse   3 * 2 * H * (head_dim + kv_dim) * selected pairs              (QK^T and PV, fwd + 2x bwd)

`ranked pairs` = sum over queries of (ke - ks): every (query, key) the indexer scores;
`selected pairs` = sum over queries of min(top-k, ke - ks): what sparse attention reads. These
count useful work: the MoE's padding to the most loaded expert (`expert slots per routed pair`
in the report) and the kernels' block rounding come on top.
"""

from __future__ import annotations

import torch

from benchmarks.e2e_ablation.config import ModelConfig


def pair_counts(ks: torch.Tensor, ke: torch.Tensor, topk: int) -> tuple[int, int]:
    """(ranked pairs, selected pairs) of a row's queries."""
    span = (ke.long() - ks.long()).clamp_min(0)
    return int(span.sum()), int(span.clamp_max(topk).sum())


def per_token_weights(cfg: ModelConfig) -> dict[str, int]:
    d = cfg.d_model
    attn = (
        cfg.q_rank * d
        + cfg.n_heads * cfg.head_dim * cfg.q_rank
        + (cfg.kv_dim + cfg.rope_dim) * d
        + d * cfg.n_heads * cfg.kv_dim
    )
    experts = cfg.expert_topk * 3 * d * cfg.expert_dim + d * cfg.n_experts
    indexer = cfg.index_heads * cfg.index_dim * cfg.q_rank + cfg.index_dim * d + cfg.index_heads * d
    return {
        "dense": cfg.n_layers * (attn + experts),
        "indexer": cfg.n_layers * indexer,
        "lm_head": cfg.vocab_size * d,
    }


def row_flops(
    cfg: ModelConfig, tokens: int, ranked_pairs: int, selected_pairs: int
) -> dict[str, float]:
    """Training FLOPs of a row with `tokens` positions run through the model (padding included
    when it is run) and the given pair counts, by component (module docstring)."""
    w = per_token_weights(cfg)
    out = {
        "dense": 6.0 * w["dense"] * tokens,
        "lm_head": 6.0 * w["lm_head"] * tokens,
        "indexer": 2.0 * w["indexer"] * tokens
        + cfg.n_layers * 2.0 * cfg.index_heads * cfg.index_dim * ranked_pairs,
        "sparse_attention": cfg.n_layers
        * 3
        * 2.0
        * cfg.n_heads
        * (cfg.head_dim + cfg.kv_dim)
        * selected_pairs,
    }
    out["total"] = sum(out.values())
    return out
