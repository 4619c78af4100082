"""Are the indexer's top-k indices bitwise identical across the ranks of a CP group?

Each CP rank holds different queries, so "identical" needs a definition. Ours has three parts,
checked on every captured indexer call (every layer of a micro-batch):

1. **Same keys.** Every rank of the group indexes the same gathered key matrix: the hash of
   its [L, D] keys (bytes, row order) is equal on all ranks.
2. **Split = unsplit.** The ranks exchange their queries, weights, ks/ke and top-k chunks
   (all-gather over the CP group) and put them in row order. Every rank then recomputes the
   indexer for the *whole row* in one call and compares it bitwise with the assembled chunks.
   A kernel whose result for a query depended on which other queries shared the launch (chunk
   planning that moves the key window, a per-tensor fp8 scale, a tie broken by launch order)
   would fail here, and the model's selection would then depend on cp and the layout.
3. **Every rank agrees on the whole row.** The hash of each rank's whole-row recomputation is
   all-gathered; all must be equal (same software and GPU model: the kernel's output is a pure
   function of its inputs).

Cost: cp x one micro-batch's indexer calls, plus gathering the queries (~256 MB per layer at
32K tokens, 32 heads x 128 in bf16): run on a few steps, after the step's timing is taken.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.multigpu.cp_model import Captured, CPGroup, IndexerFn, all_gather_rows


def tensor_hash(x: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of the tensor's bytes, contiguous, on the CPU."""
    t = x.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def _assemble(x: torch.Tensor, cp: CPGroup, row_len: int) -> torch.Tensor:
    if cp.size == 1:
        return x
    return all_gather_rows(x, cp.group, cp.size, cp.nccl)[cp.row_order(row_len, x.device)]


@torch.no_grad()
def check_call(c: Captured, cp: CPGroup, fn: IndexerFn, topk: int) -> dict[str, Any]:
    """The three checks of the module docstring for one captured call. Collective over the CP
    group; returns this rank's view (every rank returns the same verdicts)."""
    row_len = c.k.shape[0]
    q, w = _assemble(c.q, cp, row_len), _assemble(c.w, cp, row_len)
    ks, ke = _assemble(c.ks, cp, row_len), _assemble(c.ke, cp, row_len)
    assembled = _assemble(c.idx, cp, row_len)
    whole = fn(q, c.k, w, ks, ke, topk)
    diff_rows = int((assembled != whole).any(dim=1).sum())
    mine = {
        "keys": tensor_hash(c.k),
        "whole": tensor_hash(whole),
        "assembled": tensor_hash(assembled),
        "diff_rows": diff_rows,
    }
    views: list[Any] = [None] * cp.size
    if cp.size > 1:
        dist.all_gather_object(views, mine, group=cp.group)
    else:
        views = [mine]
    return {
        "layer": c.layer,
        "row_len": row_len,
        "same_keys": len({v["keys"] for v in views}) == 1,
        "split_equals_whole": all(v["assembled"] == v["whole"] for v in views),
        "ranks_agree": len({v["whole"] for v in views}) == 1,
        "diff_rows": max(v["diff_rows"] for v in views),
        "hash": views[0]["whole"],
        "valid_slots": int((whole < row_len).sum()),
    }


def check_captured(
    captured: list[Captured], cp: CPGroup, fn: IndexerFn, topk: int
) -> list[dict[str, Any]]:
    """`check_call` on every captured call (same number on every rank of the group)."""
    return [check_call(c, cp, fn, topk) for c in captured]


def verdict(results: list[dict[str, Any]]) -> bool:
    """True when every check of every call passed."""
    return bool(results) and all(
        r["same_keys"] and r["split_equals_whole"] and r["ranks_agree"] for r in results
    )
