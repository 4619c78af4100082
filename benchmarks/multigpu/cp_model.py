"""The e2e ablation's DSA-style MoE model run with context parallelism (CP) over a process group.

`benchmarks/e2e_ablation/model.py` runs one whole row per GPU. Here each CP rank holds only its
chunk of the row (`trainer_shim` cuts it: contiguous or zigzag) and the model's blocks run
unchanged (`Block.forward` is called as it is), with two callables swapped in:

- **indexer** (`CPIndexer`): the block computes the indexer's queries, weights and keys for its
  own positions (RoPE by their global position ids, so nothing depends on the split); the keys
  are all-gathered over the CP group and put back in row order, and the fp8 indexer runs on
  *this rank's queries against the whole row's keys* with the shim's ks/ke (already in row
  coordinates). Its output indexes the gathered row; the sentinel is the row length. Every rank
  of a CP group thus runs the indexer over the same keys, and `topk_check.py` verifies that the
  split computation is bitwise the unsplit one.
- **attention** (`CPAttention`): the shared MQA key/value latent and the RoPE key are
  all-gathered with autograd (one gather of [S/cp, kv_dim + rope_dim] per layer; its backward is
  a reduce-scatter on NCCL, an all-reduce + slice on gloo, which has no reduce-scatter), then
  the e2e sparse attention runs over the selected keys. Its kernels require as many query rows
  as key rows, so the local queries are padded to the row length with empty selections
  (nvalid = 0: the Triton programs of those rows exit at once, the torch path skips them) and
  the output is sliced back. `nvalid` is recounted against the row length (Block.forward counts
  selected keys below the *local* length, which is right only without CP).

Costs per layer and micro-batch added by CP: two all-gathers ([S, 96] bf16 with grad, [S, 128]
bf16 without: 12 MB at 32K over NVLink, ~0.1 ms) and one reduce-scatter in backward; the
padded query rows of the attention (cp-1 of every cp programs do nothing).

On CPU the Triton indexer cannot run at useful speed (TRITON_INTERPRET=1 took > 9 minutes for
one 1,024-query call here), so `windowed_reference_topk` runs the kernels' torch reference
(per-vector fp8 quantisation, `reference_logits_fp8`, the contract's top-k `topk_rows_torch`)
over 128-query blocks and their key windows [min ks, max ke), as the kernel's own chunk
planner does. It equals `kernels.reference_indexer_topk` bitwise (tests) at a fraction of its
cost (no Python loop per query; work ~ queries x document length, like the kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.e2e_ablation.loss import fused_linear_cross_entropy
from benchmarks.e2e_ablation.model import DSAModel, rms_norm, rope_tables
from benchmarks.e2e_ablation.sparse_attention import IMPLEMENTATIONS
from packshard.trainer_shim import cp_positions

IndexerFn = Callable[..., torch.Tensor]
QUERY_BLOCK = 128  # queries per block of the windowed reference (the kernel plans 64-row multiples)


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over the CP group (rank order); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, rank: int, size: int, nccl: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.rank, ctx.size, ctx.n, ctx.nccl = group, rank, size, x.shape[0], nccl
        return all_gather_rows(x, group, size, nccl)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        if ctx.nccl:
            out = grad.new_empty((ctx.n, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None, None, None, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None, None


def all_gather_rows(x: torch.Tensor, group: Any, size: int, nccl: bool) -> torch.Tensor:
    """Concatenation of every CP rank's `x` along dim 0, in rank order (no autograd)."""
    x = x.contiguous()
    if nccl:
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


@dataclass
class CPGroup:
    """This rank's place in its CP group and how to turn chunks into whole rows.

    `size == 1` (no CP) makes every gather the identity, so the same code runs dp-only."""

    group: Any
    rank: int
    size: int
    layout: str
    nccl: bool
    _inverse: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)

    def row_order(self, row_len: int, device: torch.device) -> torch.Tensor:
        """Index that puts the rank-order concatenation of the chunks into row order."""
        key = (row_len, str(device))
        if key not in self._inverse:
            order = np.concatenate(
                [cp_positions(row_len, self.size, r, self.layout) for r in range(self.size)]  # type: ignore[arg-type]
            )
            self._inverse[key] = torch.from_numpy(np.argsort(order)).to(device)
        return self._inverse[key]

    def positions(self, row_len: int) -> np.ndarray:
        """This rank's global positions of a row of `row_len` tokens."""
        return cp_positions(row_len, self.size, self.rank, self.layout)  # type: ignore[arg-type]

    def gather(self, x: torch.Tensor, row_len: int) -> torch.Tensor:
        """The whole row of a per-position tensor, with gradient back to this rank's chunk."""
        if self.size == 1:
            return x
        full = _GatherRows.apply(x, self.group, self.rank, self.size, self.nccl)
        return full[self.row_order(row_len, x.device)]

    @torch.no_grad()
    def gather_nograd(self, x: torch.Tensor, row_len: int) -> torch.Tensor:
        if self.size == 1:
            return x
        full = all_gather_rows(x, self.group, self.size, self.nccl)
        return full[self.row_order(row_len, x.device)]


@dataclass
class Captured:
    """One indexer call as it ran on this rank (for the top-k identity check)."""

    layer: int
    q: torch.Tensor  # [S_local, H, D] bf16, this rank's queries
    k: torch.Tensor  # [L, D] bf16, the gathered keys in row order
    w: torch.Tensor  # [S_local, H]
    ks: torch.Tensor  # [S_local] int32
    ke: torch.Tensor
    idx: torch.Tensor  # [S_local, topk] int32, what the model used


class CPIndexer:
    """The indexer over the CP-gathered keys (module docstring); optionally records its calls."""

    def __init__(self, fn: IndexerFn, cp: CPGroup) -> None:
        self.fn, self.cp = fn, cp
        self.row_len = 0
        self.capture: list[Captured] | None = None
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
                 topk: int) -> torch.Tensor:  # fmt: skip
        k_full = self.cp.gather_nograd(k, self.row_len)
        idx = self.fn(q, k_full, w, ks, ke, topk)
        if self.capture is not None:
            self.capture.append(Captured(len(self.capture), q, k_full, w, ks, ke, idx))
        self.calls += 1
        return idx


class CPAttention:
    """The e2e sparse attention over the CP-gathered key/value latent (module docstring)."""

    def __init__(self, impl: str, cp: CPGroup) -> None:
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"attention {impl!r}: choose one of {sorted(IMPLEMENTATIONS)}")
        self.fn, self.cp = IMPLEMENTATIONS[impl], cp
        self.row_len = 0

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
                 idx: torch.Tensor, nvalid: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        if self.cp.size == 1:
            return self.fn(q_nope, q_pe, kv, k_pe, idx, nvalid, scale)
        row_len, s = self.row_len, q_nope.shape[0]
        dc = kv.shape[1]
        full = self.cp.gather(torch.cat((kv, k_pe), dim=1), row_len)
        kv_full, kpe_full = full[:, :dc].contiguous(), full[:, dc:].contiguous()
        nvalid = (idx < row_len).sum(dim=1, dtype=torch.int32)  # valid slots come first
        pad = row_len - s
        qn = F.pad(q_nope, (0, 0, 0, 0, 0, pad))
        qp = F.pad(q_pe, (0, 0, 0, 0, 0, pad))
        idx_p = F.pad(idx, (0, 0, 0, pad), value=row_len)
        nv_p = F.pad(nvalid, (0, pad))
        return self.fn(qn, qp, kv_full, kpe_full, idx_p, nv_p, scale)[:s]


def cp_loss(
    model: DSAModel, mb: dict[str, Any], *, cp: CPGroup, indexer: CPIndexer, attention: CPAttention,
    dtype: torch.dtype, loss_norm: float, ce_chunk: int, ce_triton: bool,
) -> torch.Tensor:  # fmt: skip
    """This rank's summed CE over its chunk's labelled positions / `loss_norm`, with both
    gradients computed in the forward (the e2e fused LM head). `mb` is a shim micro-batch."""
    cfg = model.cfg
    row_len = int(mb["padded_len"])
    indexer.row_len = attention.row_len = row_len
    ids = mb["input_ids"]
    rope = rope_tables(mb["position_ids"], cfg.rope_dim, cfg.rope_theta)
    x = F.embedding(ids, model.embed).float() * cfg.embed_multiplier
    for block in model.blocks:
        x = block(x, rope, mb["ks"], mb["ke"], indexer, attention, dtype, ids.shape[0])
    h = rms_norm(x, model.norm_out, cfg.norm_eps).to(dtype)
    head = model.embed if model.lm_head is None else model.lm_head
    return fused_linear_cross_entropy(
        h, head, mb["labels"], loss_norm, ce_chunk, use_triton=ce_triton
    )


def pads_as_document(mb: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch whose padding is run as one more document (what loaders that pad to seq_len
    do; arm 1 of the e2e ablation): pad positions p get [num_tokens, p + 1) instead of the
    shim's empty range, so they rank, attend and route like a document. Labels stay -100."""
    out = dict(mb)
    ks, ke = mb["ks"], mb["ke"]
    pad = ks == ke  # only padding has an empty range (a real query sees at least itself)
    out["ks"] = torch.where(pad, torch.full_like(ks, int(mb["num_tokens"])), ks)
    out["ke"] = torch.where(pad, ke + 1, ke)
    return out


def windowed_reference_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, topk: int,
    *, block: int = QUERY_BLOCK,
) -> torch.Tensor:  # fmt: skip
    """`kernels.reference_indexer_topk` computed per block of queries over the block's key
    window (module docstring); same contract and output, sentinel k.shape[0]."""
    from packshard.kernels import quantize_fp8_torch, reference_logits_fp8, topk_rows_torch

    s_q, s_k = q.shape[0], k.shape[0]
    out = torch.full((s_q, topk), s_k, dtype=torch.int32, device=q.device)
    if s_q == 0:
        return out
    q8, qs = quantize_fp8_torch(q)
    k8, kscale = quantize_fp8_torch(k)
    ks_h, ke_h = ks.long().cpu().numpy(), ke.long().cpu().numpy()
    for r0 in range(0, s_q, block):
        r1 = min(s_q, r0 + block)
        lo, hi = int(ks_h[r0:r1].min()), int(ke_h[r0:r1].max())
        if hi <= lo:
            continue
        b_ks, b_ke = ks[r0:r1], ke[r0:r1]
        logits = reference_logits_fp8(
            q8[r0:r1], qs[r0:r1], k8[lo:hi], kscale[lo:hi], w[r0:r1], b_ks - lo, b_ke - lo
        )
        out[r0:r1] = topk_rows_torch(logits, lo, b_ks, b_ke, topk, s_k)
    return out
