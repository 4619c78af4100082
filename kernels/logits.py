"""The fp8 indexer logits kernel: one fixed config for every row length.

    score[t, s] = k_scale[s] * sum_h wq[t, h] * relu(q8[t, h] . k8[s]),   wq = w * q_scale

for ks[t] <= s < ke[t] (`-inf` elsewhere in the public logits; the top-k path never reads
outside the range, so the kernel writes only inside it).

Dtype and layout rules (checked by the launcher, `kernels.fp8_indexer` pads to meet them):
- q8: float8_e4m3fn, contiguous [S_q * H, D] (token-major, then head); wq: float32 [S_q * H].
- k8: float8_e4m3fn, contiguous [S_kp, D]; k_scale: float32 [S_kp]. S_kp is the key count
  padded to a multiple of 16 with zero keys and zero scales, so every row length hits one
  compiled kernel (Triton specialises integer arguments on divisibility by 16).
- H and D powers of two, D >= 32 (fp8 wgmma has k = 32); H <= block_n.
- out: float32, row stride a multiple of 16 elements; written at column `s - col0`.
- row0, n_rows and col0 are not specialised on (`do_not_specialize`), so chunk offsets and row
  counts never trigger a recompile: one binary per (H, D, config) serves every length.

Blocking. One program owns block_q = block_n // H consecutive queries, i.e. block_n (query,
head) rows held in shared memory as the MMA's B operand, and streams key tiles of block_k rows
over [min ks, max ke) of its queries; tiles wholly outside that union are never visited. The
product is computed as keys x (query, head) — acc[block_k, block_n] = k8_tile @ q8_block^T — so
that the sum over heads runs along the accumulator's columns, which in the wgmma register
layout sits inside a thread and a quad of lanes (in-register adds and two shuffles), not across
warps through shared memory. Heavier (later, causal) query blocks are launched first.

Per pair the tensor cores do 2*D = 256 flops and the CUDA cores relu + fma on 64 (H) products
per output: epilogue ALU work is ~2 ops per accumulator element against 256 MMA flops, about
half the MMA time at the datasheet rate, so it must overlap with the MMA of other programs on
the SM: several programs resident per SM is what the fixed config buys (the kernel issues
its wgmma and waits; Triton does not overlap one program's epilogue with its own next MMA).

The fixed config and the sweep it came from are in docs/KERNELS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class LogitsConfig:
    """Launch parameters of the logits kernel; block_n = queries per program x heads."""

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"LogitsConfig.{name}={v}: must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LogitsConfig.num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"LogitsConfig.num_stages={self.num_stages}: must be >= 1")

    def block_q(self, heads: int) -> int:
        """Queries per program for `heads` (padded, power-of-two) heads."""
        if heads > self.block_n:
            raise ValueError(f"heads={heads} exceeds LogitsConfig.block_n={self.block_n}")
        return self.block_n // heads


# Chosen by the H200 sweep recorded in docs/KERNELS.md (fixed for every length and both H):
# 128 (query, head) columns x 64 keys, one warpgroup, 3 stages; 128 registers, 41 KB of shared
# memory, so 4 programs share an SM and one's epilogue overlaps another's MMA.
FIXED_LOGITS_CONFIG = LogitsConfig(block_n=128, block_k=64, num_warps=4, num_stages=3)


@triton.jit(do_not_specialize=["row0", "n_rows", "col0"])
def _indexer_logits_kernel(
    q_ptr,
    wq_ptr,
    k_ptr,
    kscale_ptr,
    ks_ptr,
    ke_ptr,
    out_ptr,
    row0,
    n_rows,
    S_k,
    col0,
    stride_out,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    BLOCK_N: tl.constexpr = BLOCK_Q * H
    n_blocks = tl.cdiv(n_rows, BLOCK_Q)
    blk = n_blocks - 1 - tl.program_id(0)  # heaviest (latest) query blocks first
    rows = blk * BLOCK_Q + tl.arange(0, BLOCK_Q)  # chunk-local query rows
    row_ok = rows < n_rows
    ks = tl.load(ks_ptr + row0 + rows, mask=row_ok, other=2147483647)
    ke = tl.load(ke_ptr + row0 + rows, mask=row_ok, other=0)
    lo = tl.min(ks, axis=0)
    hi = tl.max(ke, axis=0)

    qh = (row0 + blk * BLOCK_Q).to(tl.int64) * H + tl.arange(0, BLOCK_N)
    qh_ok = tl.arange(0, BLOCK_N) < (n_rows - blk * BLOCK_Q) * H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qh[:, None] * D + d[None, :], mask=qh_ok[:, None], other=0.0)
    wq = tl.load(wq_ptr + qh, mask=qh_ok, other=0.0)
    q_t = tl.trans(q)  # [D, BLOCK_N], K-major as fp8 wgmma wants
    out_rows = out_ptr + rows.to(tl.int64) * stride_out - col0

    start = (lo // BLOCK_K) * BLOCK_K
    for s0 in range(start, hi, BLOCK_K):
        offs = s0 + tl.arange(0, BLOCK_K)
        k_ok = offs < S_k
        kt = tl.load(
            k_ptr + offs.to(tl.int64)[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0
        )
        acc = tl.dot(kt, q_t)  # [BLOCK_K, BLOCK_N] fp32
        acc = tl.maximum(acc, 0.0) * wq[None, :]
        score = tl.sum(tl.reshape(acc, (BLOCK_K, BLOCK_Q, H)), axis=2)  # [BLOCK_K, BLOCK_Q]
        ksc = tl.load(kscale_ptr + offs, mask=k_ok, other=0.0)
        score = score * ksc[:, None]
        valid = (offs[:, None] >= ks[None, :]) & (offs[:, None] < ke[None, :])
        tl.store(out_rows[None, :] + offs[:, None], score, mask=valid)


def launch_logits(
    q8: torch.Tensor,
    wq: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    out: torch.Tensor,
    *,
    heads: int,
    row0: int,
    n_rows: int,
    col0: int,
    config: LogitsConfig = FIXED_LOGITS_CONFIG,
) -> None:
    """Write scores of queries [row0, row0 + n_rows) into out[0:n_rows, s - col0] (in-range only).

    `q8` is [S_q * heads, D] fp8, `k8` [S_kp, D] fp8; see the module docstring for the rules.
    """
    d = q8.shape[1]
    block_q = config.block_q(heads)
    if n_rows <= 0:
        return
    grid = (triton.cdiv(n_rows, block_q),)
    _indexer_logits_kernel[grid](
        q8,
        wq,
        k8,
        k_scale,
        ks,
        ke,
        out,
        row0,
        n_rows,
        k8.shape[0],
        col0,
        out.stride(0),
        H=heads,
        D=d,
        BLOCK_Q=block_q,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
