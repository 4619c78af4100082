"""Per-component GPU times on one real row, so the step-time model in README.md can be checked.

After the workloads (only if the deadline leaves time), one micro-batch of the first workload
is timed piece by piece with CUDA events, each piece on inputs of the row's real shapes and
document ranges (random values; what is timed does not depend on them except the MoE, whose
inputs are spread so its buffers are at balanced size):

- `indexer`: kernels.fp8_indexer_topk, one layer's call (forward only, as in the model);
- `sparse_attention_fwd` / `_bwd`: the chosen sparse attention on the indexer's selection;
- `moe_fwd_bwd`: one MoE layer at the row's length (balanced routing);
- `cross_entropy`: the fused LM head + loss + gradients (the chosen implementation), whole row;
- `cross_entropy_torch`: the same with the torch rows path, for the fused kernel's saving.

Median of 3 after one warm-up. Per step, multiply the per-layer pieces by layers x rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.e2e_ablation.config import RunConfig

log = logging.getLogger(__name__)


def _time(fn: Callable[[], Any], reps: int = 3) -> float:
    """Median milliseconds of fn() over `reps` runs after one warm-up (CUDA events)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def time_components(batch: dict[str, torch.Tensor], run: RunConfig, impl: Any) -> dict[str, float]:
    """{piece: ms} for one row (module docstring); `batch` is a micro-batch's tensors on the GPU."""
    from benchmarks.e2e_ablation.loss import fused_linear_cross_entropy
    from benchmarks.e2e_ablation.moe import MoE
    from benchmarks.e2e_ablation.sparse_attention import IMPLEMENTATIONS
    from packshard.kernels import fp8_indexer_topk

    m = run.model
    dev = batch["input_ids"].device
    s = batch["input_ids"].shape[0]
    ks, ke = batch["ks"], batch["ke"]
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)

    out: dict[str, float] = {"tokens": float(s)}
    q, k, w = (
        randn(s, m.index_heads, m.index_dim),
        randn(s, m.index_dim),
        randn(s, m.index_heads).float(),
    )
    out["indexer"] = _time(lambda: fp8_indexer_topk(q, k, w, ks, ke, m.index_topk))
    idx = fp8_indexer_topk(q, k, w, ks, ke, m.index_topk)
    nvalid = (idx < s).sum(dim=1, dtype=torch.int32)
    leaves = [
        randn(s, m.n_heads, m.kv_dim),
        randn(s, m.n_heads, m.rope_dim),
        randn(s, m.kv_dim),
        randn(s, m.rope_dim),
    ]
    leaves = [x.requires_grad_(True) for x in leaves]
    attn = IMPLEMENTATIONS[impl.attention]
    scale = 1.0 / math.sqrt(m.head_dim)
    grad = randn(s, m.n_heads, m.kv_dim)
    out["sparse_attention_fwd"] = _time(lambda: attn(*leaves, idx, nvalid, scale))
    fwd_bwd = _time(lambda: attn(*leaves, idx, nvalid, scale).backward(grad))
    out["sparse_attention_bwd"] = fwd_bwd - out["sparse_attention_fwd"]
    with torch.device(dev):
        moe = MoE(m.d_model, m.n_experts, m.expert_topk, m.expert_dim, capacity_multiple=m.capacity_multiple,
                  init_std=m.init_std)  # fmt: skip
    x = randn(s, m.d_model).requires_grad_(True)
    out["moe_fwd_bwd"] = _time(lambda: moe(x).float().sum().backward())
    moe.take_stats()
    h = randn(s, m.d_model).requires_grad_(True)
    emb = torch.nn.Parameter(torch.randn(m.vocab_size, m.d_model, device=dev) * m.init_std)
    labels = batch["labels"]

    def ce(use_triton: bool) -> None:
        fused_linear_cross_entropy(
            h, emb, labels, 1000.0, run.ce_chunk, use_triton=use_triton
        ).backward()

    out["cross_entropy"] = _time(lambda: ce(impl.ce_triton))
    if impl.ce_triton:
        out["cross_entropy_torch"] = _time(lambda: ce(False))
    return {k: round(v, 3) for k, v in out.items()}
