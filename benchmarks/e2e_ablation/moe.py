"""Top-k routed MoE FFN whose cost follows the most loaded expert (dropless).

Routing: softmax router in fp32, top-k experts per token, weights renormalised over the k.
Dispatch: every (token, expert) pair gets a slot in a per-expert buffer [E, C, d]; experts run
as two batched matmuls over that buffer (SwiGLU), and outputs are gathered back and mixed.

C is the *largest* expert load of the micro-batch, rounded up to `capacity_multiple` (Tutel's
dynamic capacity; on a single GPU it is the cost that expert parallelism pays, where the rank
holding the hottest expert sets everyone's step time). Nothing is dropped, so the function
computed for a real token does not depend on what else is in the row, which is what lets the
four arms train the same model. The cost does: 6,500 identical pad tokens all routed to the
same 2 of 16 experts lift C from ~5K to ~11K at 32K tokens per row, doubling the expert
FLOPs. A capacity-factor MoE that drops overflow would make that crowding change the *loss*
instead (pads would push real tokens out of their experts), and no load-balancing loss is used
for the same reason: its batch statistics would count the padding.

Determinism: the dispatch is an index_put with distinct slots and the combine a gather, so the
backward has no colliding scatter-adds; one host sync per layer reads C.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    """`n_experts` SwiGLU experts of width `expert_dim`, `topk` per token, dropless."""

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        topk: int,
        expert_dim: int,
        *,
        capacity_multiple: int,
        init_std: float,
    ) -> None:
        super().__init__()
        self.n_experts, self.topk, self.capacity_multiple = n_experts, topk, capacity_multiple
        self.router = nn.Parameter(torch.randn(d_model, n_experts) * init_std)
        self.w_in = nn.Parameter(torch.randn(n_experts, d_model, 2 * expert_dim) * init_std)
        self.w_out = nn.Parameter(
            torch.randn(n_experts, expert_dim, d_model) * (init_std / math.sqrt(2))
        )
        self.last_capacity = 0
        self.last_max_load = 0
        self.last_mean_load = 0.0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] int64, mixing weights [T, k] fp32); fp32 router, no autocast."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            probs = torch.softmax(x.float() @ self.router.float(), dim=-1)
        weights, experts = probs.topk(self.topk, dim=-1)
        return experts, weights / weights.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        experts, weights = self.route(x)
        flat = experts.reshape(-1)  # pair p = token p // k, choice p % k
        counts = torch.bincount(flat, minlength=self.n_experts)
        max_load = int(counts.max()) if t else 0  # host sync: the buffer's size
        cap = max(
            self.capacity_multiple, -(-max_load // self.capacity_multiple) * self.capacity_multiple
        )
        order = torch.argsort(flat, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.empty_like(flat)
        rank_in_expert[order] = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
        slot = flat * cap + rank_in_expert  # distinct per pair
        pairs = x.unsqueeze(1).expand(t, self.topk, d).reshape(-1, d)
        buf = x.new_zeros(self.n_experts * cap, d)
        buf = buf.index_put((slot,), pairs)
        h = torch.bmm(buf.view(self.n_experts, cap, d), self.w_in.to(x.dtype))
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.w_out.to(x.dtype)).view(-1, d)
        out = (y[slot].view(t, self.topk, d) * weights.to(y.dtype).unsqueeze(-1)).sum(1)
        self.last_capacity, self.last_max_load = cap, max_load
        self.last_mean_load = flat.numel() / self.n_experts
        return out
