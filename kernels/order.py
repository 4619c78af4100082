"""The order step of the top-k: staging rows (key32, index) -> output indices, best first.

`kernels.topk`'s select writes each row's min(topk, n) winners in index order to a [rows, K2]
staging pair (int32 key32, int32 index), padded with (INT32_MIN, sentinel). This module orders
them under the contract (higher score first, ties by lower index):

- "torch" (`finish_topk`): a stable `torch.sort` of the keys, then a gather of the indices. The
  stability keeps index order among equal keys. H200, S=64K, H=64: 5.6 ms for 64K rows of 2048
  (run 2); it also materialises int64 sort indices.
- "bitonic" (`_order_kernel`): one Triton program a row sorts the packed int64
  (key32 << 32 | 2^31-1-index) descending with a bitonic network and writes the low halves
  back as indices. Real entries' packed values are distinct (distinct indices), so the order
  is the contract's without any stability; padding slots are equal to one another and sort
  after every real entry. sm_90 (Triton 3.6): 7,136 SASS instructions a thread of 4 warps
  (~28.5K warp instructions a row), 64 registers; predicted 2.5-3.5 ms at S=64K.

The network is `tl.sort`'s (the hypercube formulation of triton.language.standard), with the
partner exchange done by a pair sum instead of an xor reduction: Triton's CPU interpreter runs
xor reductions element by element in Python (98 s for a [37, 64] sort, 1.5 s with sums); on
the GPU both are one in-thread op or one shuffle an element, and the sum compiled to 12% fewer
instructions than `tl.sort` here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kernels.topk import TopkConfig, TopkWorkspace


@triton.jit
def _hypercube_bit(n_dims: tl.constexpr, j: tl.constexpr):
    """0/1 along the j-th innermost axis of a [2] * n_dims hypercube (broadcastable)."""
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_swap(h, flip, i: tl.constexpr, n_dims: tl.constexpr):
    """One bitonic step along the i-th innermost axis of the int64 hypercube h.

    The partner of each element is (pair sum) - element: exact in wrapping int64 arithmetic.
    `tl.sort` gets it with an xor reduction instead, which the CPU interpreter runs element by
    element in Python (~100 s for a [37, 64] sort); a sum runs in numpy. On the GPU both are
    one in-thread op or one shuffle per element.
    """
    partner = tl.sum(h, axis=n_dims - 1 - i, keep_dims=True) - h
    right = _hypercube_bit(n_dims, i) == 1
    return tl.where((h > partner) != (flip != right), partner, h)


@triton.jit
def _sort_rows_desc(x, LOG_N: tl.constexpr, N_DIMS: tl.constexpr):
    """Sort each row of the int64 x [rows, 2**LOG_N] descending (N_DIMS = log2 of x.numel):
    the bitonic network of `tl.sort(x, descending=True)`."""
    h = tl.reshape(x, [2] * N_DIMS)
    for stage in tl.static_range(1, LOG_N + 1):
        if stage < LOG_N:
            flip = _hypercube_bit(N_DIMS, stage) == 1  # alternating runs
        else:
            flip = _hypercube_bit(N_DIMS, 0) >= 0  # all true: descending
        for i in tl.static_range(stage):
            h = _compare_swap(h, flip, stage - 1 - i, N_DIMS)
    return tl.reshape(h, x.shape)


@triton.jit(do_not_specialize=["n_rows", "topk"])
def _order_kernel(
    skey_ptr,
    sidx_ptr,
    out_ptr,
    stride_out,
    n_rows,
    topk,
    ROWS: tl.constexpr,
    K2: tl.constexpr,
    LOG_ROWS: tl.constexpr,
    LOG_K2: tl.constexpr,
):
    """Staging rows -> output indices: sort (key32, 2^31-1-index) packed in int64, descending.

    Real entries' packed values are all distinct (distinct indices), so the order is the
    contract's (higher score, then lower index) whatever the sort's stability; padding slots
    (INT32_MIN, sentinel) equal one another and sort after every real entry. ROWS > 1 only
    vectorises the CPU interpreter (tests).
    """
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    live = r < n_rows
    j = tl.arange(0, K2)[None, :]
    src = r.to(tl.int64) * K2 + j
    key = tl.load(skey_ptr + src, mask=live, other=0)
    idx = tl.load(sidx_ptr + src, mask=live, other=0)
    packed = (key.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)
    packed = _sort_rows_desc(packed, LOG_K2, LOG_ROWS + LOG_K2)
    res = (2147483647 - (packed & 0xFFFFFFFF)).to(tl.int32)
    tl.store(out_ptr + r.to(tl.int64) * stride_out + j, res, mask=live & (j < topk))


def finish_topk(
    ws: TopkWorkspace, n_rows: int, topk: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Order each staging row: key descending, stable (index order among equal keys); [n_rows, topk].

    `out` (contiguous) receives the gather directly."""
    perm = torch.sort(ws.skey[:n_rows], dim=1, descending=True, stable=True).indices[:, :topk]
    return torch.gather(ws.sidx[:n_rows], 1, perm, out=out)


def order_topk(
    ws: TopkWorkspace, out: torch.Tensor, n_rows: int, topk: int, config: TopkConfig
) -> None:
    """Write the ordered top-k of the first n_rows staging rows into out [n_rows, topk]."""
    if n_rows <= 0:
        return
    if config.order == "torch":
        if out.is_contiguous():
            finish_topk(ws, n_rows, topk, out=out)
        else:
            out.copy_(finish_topk(ws, n_rows, topk))
        return
    k2 = ws.skey.shape[1]
    rows = config.rows_per_program
    _order_kernel[(triton.cdiv(n_rows, rows),)](
        ws.skey, ws.sidx, out, out.stride(0), n_rows, topk, ROWS=rows, K2=k2,
        LOG_ROWS=rows.bit_length() - 1, LOG_K2=k2.bit_length() - 1, num_warps=config.order_warps,
    )  # fmt: skip
