"""Top-k routed MoE FFN, balanced the way DeepSeek-V3 balances it, whose cost follows the most
loaded expert (dropless).

Routing (DeepSeek-V3, "auxiliary-loss-free load balancing"): affinities s = sigmoid(x R) in
fp32; each token picks the top-k experts of s + b, where b is a per-expert bias that only
*selects* (the mixing weights are s over the chosen k, renormalised) and is not trained by the
gradient: after every optimizer step b_e += rate * sign(mean load - load_e), the loads counted
over every token the step fed through the layer, padding included, as a trainer does (it sees
a token, not a flag saying the token is padding). V3 uses rate 1e-3; see config.py for ours.

Why balance matters here: an untrained router sends real tokens wherever the residual stream's
common direction points. The first H200 run (softmax router, no balancing) had the busiest
expert at 3-5x the mean load at step 1 and ~8x (every token on one expert) by step 3, in every
arm: the buffers were padded to ~6 slots per routed pair whatever the padding, so the MoE cost
the same in all arms, and the token-0 pads, which all go to the same 2 experts, landed on
experts that were already the busiest. A trained MoE keeps real tokens spread (that is what
its balancing is for), so identical pads stand out: at 21% padding the pads' experts carry
~0.2 x 2 x 32K + their share of real tokens, ~3x the mean.

Dispatch: every (token, expert) pair gets a slot in a per-expert buffer [E, C, d]; experts run
as two batched matmuls over that buffer (SwiGLU), and outputs are gathered back and mixed. C is
the *largest* expert load of the micro-batch, rounded up to `capacity_multiple` (Tutel's
dynamic capacity; on one GPU it is the cost that expert parallelism pays, where the rank
holding the hottest expert sets everyone's step time, and what a grouped GEMM pays on the SM
that gets the hottest expert's tiles last). Nothing is dropped, so the function computed for a
real token does not depend on what else is in the row. A capacity-factor MoE that drops
overflow would make crowding change the *loss* instead (pads would push real tokens out).

Cost model, per layer and micro-batch: 3 matmuls x 2 (fwd) x 3 (fwd + bwd) x d x expert_dim x
E x C flops, i.e. `expert slots per routed pair` = E x C / (k x tokens) times the balanced
cost; the report prints that ratio per arm (1.0 = perfect balance).

Host syncs: one per call, which reads the loads (all tokens and real tokens, 2 x E integers)
to size the buffer; the balancing statistics stay on the device. The dispatch is an index_put
with distinct slots and the combine a gather, so the backward has no colliding scatter-adds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    """`n_experts` SwiGLU experts of width `expert_dim`, `topk` per token, dropless, V3 routing."""

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
        # selection bias (not a parameter: no gradient, no weight decay) and this step's loads
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.register_buffer("step_loads", torch.zeros(n_experts, dtype=torch.int64))
        self.calls: list[torch.Tensor] = []  # per call: int64 [2, E] loads (all, real tokens), host
        self.aux_loss: torch.Tensor | None = None  # the last call's balance loss (differentiable)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] int64, mixing weights [T, k] fp32, affinities [T, E] fp32);
        fp32 router, no autocast."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(x.float() @ self.router.float())
        experts = (scores + self.expert_bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, experts)
        return experts, weights / weights.sum(-1, keepdim=True), scores

    def forward(self, x: torch.Tensor, n_real: int | None = None) -> torch.Tensor:
        """x [T, d]; the first `n_real` tokens (default all) are counted as real in the stats."""
        t, d = x.shape
        n_real = t if n_real is None else min(n_real, t)
        experts, weights, scores = self.route(x)
        flat = experts.reshape(-1)  # pair p = token p // k, choice p % k
        counts = torch.bincount(flat, minlength=self.n_experts)
        if torch.is_grad_enabled() and t:  # sequence-wise balance loss (V3 eq. 17-20), all tokens
            share = counts.float() * (self.n_experts / (self.topk * t))
            self.aux_loss = (share * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum()
        else:
            self.aux_loss = None
        with torch.no_grad():
            self.step_loads += counts
            real = torch.bincount(flat[: n_real * self.topk], minlength=self.n_experts)
            host = torch.stack((counts, real)).cpu()  # the one host sync: the buffer's size
        self.calls.append(host)
        cap = self.capacity_of(host[0])
        order = torch.argsort(flat, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.empty_like(flat)
        rank_in_expert[order] = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
        slot = flat * cap + rank_in_expert  # distinct per pair
        pairs = x.unsqueeze(1).expand(t, self.topk, d).reshape(-1, d)
        buf = x.new_zeros(self.n_experts * cap, d).index_put((slot,), pairs)
        h = torch.bmm(buf.view(self.n_experts, cap, d), self.w_in.to(x.dtype))
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.w_out.to(x.dtype)).view(-1, d)
        return (y[slot].view(t, self.topk, d) * weights.to(y.dtype).unsqueeze(-1)).sum(1)

    def capacity_of(self, loads: torch.Tensor) -> int:
        """The buffer rows per expert for these loads (max, rounded up to capacity_multiple)."""
        m = self.capacity_multiple
        return max(m, -(-int(loads.max()) // m) * m)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's bias step over this step's loads (all tokens fed), then reset them."""
        if rate > 0:
            loads = self.step_loads.float()
            self.expert_bias += rate * torch.sign(loads.mean() - loads)
        self.step_loads.zero_()

    def take_stats(self) -> list[torch.Tensor]:
        """The per-call loads recorded since the last call (and forget them)."""
        out, self.calls = self.calls, []
        return out
