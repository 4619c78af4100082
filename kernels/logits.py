"""The fp8 indexer logits kernel: one fixed config for every row length.

    score[t, s] = k_scale[s] * sum_h wq[t, h] * relu(q8[t, h] . k8[s]),   wq = w * q_scale

for ks[t] <= s < ke[t] (`-inf` elsewhere in the public logits; the top-k path never reads
outside the range, so the kernel writes only inside it).

Dtype and layout rules (checked by the launcher, `kernels.fp8_indexer` pads to meet them):
- q8: float8_e4m3fn, contiguous [S_q * H, D] (token-major, then head); wq: float32 [S_q * H].
- k8: float8_e4m3fn, contiguous [S_kp, D]; k_scale: float32 [S_kp]. S_kp is the key count
  padded (by `kernels.fp8_indexer`) to a multiple of 128 with zero keys and zero scales, so
  every row length hits one compiled kernel (Triton specialises integer arguments on
  divisibility by 16) and every key tile lies inside the keys: the K-tile and key-scale loads
  need no bound mask (EVEN_K; 20 fewer instructions a tile of the ~255 in the sm_90 loop).
  Any other S_kp works too, through a second, masked binary.
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
the SM: several programs resident per SM is what the serial schedule relies on (it issues a
tile's wgmma and waits). The pipelined schedule issues the next tile's wgmma first and runs
the current tile's epilogue while it computes (`LogitsConfig.schedule`; two accumulators,
two programs an SM). On the H200 the serial kernel reaches 890-990 TFLOP/s, which is close to
MMA time + epilogue issue time added up (~255 instructions a tile a warp against ~256-340
cycles of MMA), as if the four programs hardly overlapped.

The fixed config and the sweep it came from are in docs/KERNELS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

_SCHEDULES = ("serial", "pipelined")  # kernel bodies: see the module docstring


@dataclass(frozen=True)
class LogitsConfig:
    """Launch parameters of the logits kernel; block_n = queries per program x heads.

    `schedule`: "serial" issues a tile's wgmma and waits for it before its epilogue (4 programs
    an SM overlap one another); "pipelined" issues tile i+1's wgmma before tile i's epilogue
    (198 registers: 2 programs an SM, each overlapping its own MMA and epilogue).
    `key_mask`: "auto" drops the key-bound mask of the K-tile loads when the padded key count
    is a multiple of block_k (always, through `kernels.fp8_indexer`: keys are padded to 128);
    "always" keeps it (the kernel of the first two H200 runs). Both give identical scores.
    """

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    schedule: Literal["serial", "pipelined"] = "serial"
    key_mask: Literal["auto", "always"] = "auto"

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"LogitsConfig.{name}={v}: must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LogitsConfig.num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"LogitsConfig.num_stages={self.num_stages}: must be >= 1")
        if self.schedule not in _SCHEDULES:
            raise ValueError(
                f"LogitsConfig.schedule={self.schedule!r}: must be one of {sorted(_SCHEDULES)}"
            )
        if self.key_mask not in ("auto", "always"):
            raise ValueError(f"LogitsConfig.key_mask={self.key_mask!r}: must be 'auto' or 'always'")

    def block_q(self, heads: int) -> int:
        """Queries per program for `heads` (padded, power-of-two) heads."""
        if heads > self.block_n:
            raise ValueError(f"heads={heads} exceeds LogitsConfig.block_n={self.block_n}")
        return self.block_n // heads

    @property
    def label(self) -> str:
        """Short name for reports, e.g. `n128/k64/w4/s3` or `n128/k64/w4/s3/pipe`."""
        tag = f"n{self.block_n}/k{self.block_k}/w{self.num_warps}/s{self.num_stages}"
        if self.schedule == "pipelined":
            tag += "/pipe"
        if self.key_mask == "always":
            tag += "/mask"
        return tag


# Chosen by the H200 sweep recorded in docs/KERNELS.md (fixed for every length and both H):
# 128 (query, head) columns x 64 keys, one warpgroup, 3 stages; 128 registers, 41 KB of shared
# memory, so 4 programs share an SM and one's epilogue overlaps another's MMA.
FIXED_LOGITS_CONFIG = LogitsConfig(block_n=128, block_k=64, num_warps=4, num_stages=3)


@triton.jit
def _key_tile(k_ptr, offs, d, S_k, D: tl.constexpr, EVEN_K: tl.constexpr):
    """K rows `offs` [BLOCK_K, D] fp8; unmasked when every tile lies inside the padded keys."""
    ptrs = k_ptr + offs.to(tl.int64)[:, None] * D + d[None, :]
    if EVEN_K:
        kt = tl.load(ptrs)
    else:
        kt = tl.load(ptrs, mask=(offs < S_k)[:, None], other=0.0)
    return kt


@triton.jit
def _tile_epilogue(
    acc,
    wq,
    kscale_ptr,
    offs,
    ks,
    ke,
    out_rows,
    S_k,
    BLOCK_K: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    H: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """relu, head weights, head sum, key scale; store the [BLOCK_K, BLOCK_Q] scores in range."""
    acc = tl.maximum(acc, 0.0) * wq[None, :]
    score = tl.sum(tl.reshape(acc, (BLOCK_K, BLOCK_Q, H)), axis=2)  # [BLOCK_K, BLOCK_Q]
    if EVEN_K:
        ksc = tl.load(kscale_ptr + offs)
    else:
        ksc = tl.load(kscale_ptr + offs, mask=offs < S_k, other=0.0)
    score = score * ksc[:, None]
    valid = (offs[:, None] >= ks[None, :]) & (offs[:, None] < ke[None, :])
    tl.store(out_rows[None, :] + offs[:, None], score, mask=valid)


@triton.jit
def _query_block(
    q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out,
    H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """This program's queries: their ranges, union [lo, hi), q^T [D, BLOCK_N], wq, output rows."""
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
    return ks, ke, lo, hi, q_t, wq, out_rows, d


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
    EVEN_K: tl.constexpr,
    PIPELINED: tl.constexpr = False,
):
    """Scores of this program's queries over the key tiles of [lo, hi).

    Serial schedule (PIPELINED = False): per key tile, wgmma, wait, epilogue; MMA and epilogue
    overlap only across programs. Pipelined schedule: the loop carries the previous tile's
    accumulator and issues tile i+1's wgmma before tile i's epilogue. Triton waits for the new
    wgmma right after issuing it, but ptxas schedules the (register-only) relu/weight/head-sum
    of the carried tile above that wait, so the tensor cores and the epilogue overlap inside
    one program (sm_90 SASS of Triton 3.6: QGMMA, 148 epilogue instructions, then
    WARPGROUP.DEPBAR). Costs: a second accumulator (198 registers, 2 programs an SM) and 64
    register moves a tile. Both schedules run the same per-score arithmetic: identical scores.
    """
    ks, ke, lo, hi, q_t, wq, out_rows, d = _query_block(
        q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, H, D, BLOCK_Q
    )
    start = (lo // BLOCK_K) * BLOCK_K
    if not PIPELINED:
        for s0 in range(start, hi, BLOCK_K):
            offs = s0 + tl.arange(0, BLOCK_K)
            acc = tl.dot(_key_tile(k_ptr, offs, d, S_k, D, EVEN_K), q_t)  # [BLOCK_K, BLOCK_N] fp32
            _tile_epilogue(
                acc, wq, kscale_ptr, offs, ks, ke, out_rows, S_k, BLOCK_K, BLOCK_Q, H, EVEN_K
            )
    elif lo < hi:
        offs = start + tl.arange(0, BLOCK_K)
        acc = tl.dot(_key_tile(k_ptr, offs, d, S_k, D, EVEN_K), q_t)
        for s0 in range(start + BLOCK_K, hi, BLOCK_K):
            offs_next = s0 + tl.arange(0, BLOCK_K)
            acc_next = tl.dot(_key_tile(k_ptr, offs_next, d, S_k, D, EVEN_K), q_t)
            _tile_epilogue(
                acc, wq, kscale_ptr, offs, ks, ke, out_rows, S_k, BLOCK_K, BLOCK_Q, H, EVEN_K
            )
            acc = acc_next
            offs = offs_next
        _tile_epilogue(
            acc, wq, kscale_ptr, offs, ks, ke, out_rows, S_k, BLOCK_K, BLOCK_Q, H, EVEN_K
        )


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
    s_k = k8.shape[0]
    even_k = config.key_mask == "auto" and s_k % config.block_k == 0
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
        s_k,
        col0,
        out.stride(0),
        H=heads,
        D=d,
        BLOCK_Q=block_q,
        BLOCK_K=config.block_k,
        EVEN_K=even_k,
        PIPELINED=config.schedule == "pipelined",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
