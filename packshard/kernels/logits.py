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
  counts never trigger a recompile: one binary per (H, D, config) serves every length (two for
  a config with `group_min_scores`: its small launches run its one-block form).

Blocking. A query block is block_q = block_n // H consecutive queries, i.e. block_n (query,
head) rows held in shared memory as the MMA's B operand. A program owns one block, or two (or
four) when blocks hold at most two queries (one) (`LogitsConfig.q_groups`: the blocks run over
each key tile, which is loaded once), and streams key tiles of block_k rows over [min ks,
max ke) of its queries; tiles wholly outside that union are never visited. The product is
computed as keys x (query, head) — acc[block_k, block_n] = k8_tile @ q8_block^T — so
that the sum over heads runs along the accumulator's columns, which in the wgmma register
layout sits inside a thread and a quad of lanes (in-register adds and two shuffles), not across
warps through shared memory. Heavier (later, causal) query blocks are launched first.

Per pair the tensor cores do 2*D = 256 flops and the CUDA cores relu + fma on 64 (H) products
per output: epilogue ALU work is ~2 ops per accumulator element against 256 MMA flops, about
half the MMA time at the datasheet rate, so it must overlap with the MMA of other programs on
the SM: several programs resident per SM is what the serial schedule relies on (it issues a
tile's wgmma and waits). The pipelined schedule issues the next tile's wgmma first and runs
the current tile's epilogue while it computes (`LogitsConfig.schedule`; two accumulators,
two programs an SM). On the H200 the one-block serial kernel reaches 890-990 TFLOP/s under
sustained load, where the card sits at its 700 W power cap; 10% fewer loop instructions (the
fma-chain head sum) did not make it faster, while halving the K-tile reads from L2 (two blocks
a program at H = 64) made it 2-5% faster from 16K keys on (v9 in docs/KERNELS.md). Nsight
Compute puts the tensor cores at 58% busy and the issue slots at 48%: the epilogue is latency
bound with 12 warps an SM (v10 in docs/KERNELS.md).

The fixed config and the sweep it came from are in docs/KERNELS.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import torch
import triton
import triton.language as tl

from packshard.kernels._triton_env import interpreting

_SCHEDULES = ("serial", "pipelined")  # kernel bodies: see the module docstring


@dataclass(frozen=True)
class LogitsConfig:
    """Launch parameters of the logits kernel; block_n = queries per query block x heads.

    `schedule`: "serial" issues a tile's wgmma and waits for it before its epilogue (4 programs
    an SM overlap one another); "pipelined" issues tile i+1's wgmma before tile i's epilogue
    (198 registers: 2 programs an SM, each overlapping its own MMA and epilogue).
    `key_mask`: "auto" drops the key-bound mask of the K-tile loads when the padded key count
    is a multiple of block_k (always, through `kernels.fp8_indexer`: keys are padded to 128);
    "always" keeps it (the kernel of the first two H200 runs). Both give identical scores.
    `q_groups`: 2 pairs up query blocks of at most two queries (H >= 64 at block_n 128): a
    program owns two blocks, which share each key tile (loaded once into shared memory; two
    wgmma chains one after the other, each with its epilogue): half the K-tile traffic from L2
    a flop, at 168 registers (`pair_max_registers=168`; ptxas takes 200 uncapped), so 3
    programs an SM. Blocks of 4 or more queries (H <= 32) stay one a program: a second one
    needs 216 registers, spills under the cap, and lost at every H = 32 shape (v9 in
    docs/KERNELS.md). `q_groups=4`: four blocks a program, which need 1-query blocks (H = 64
    at block_n 64; 2-query blocks pair up): the same K-tile reads a flop as two 2-query blocks
    at ~123 registers, yet 7-30% slower than the fixed config on the H200 with 2 or 3 stages
    (v11 in docs/KERNELS.md). `groups(heads)` is the count that runs: a multi-block program
    holds at most 4 queries. Serial schedule only; same per-score arithmetic: identical scores.
    `head_sum`: "tree" is Triton's pairwise in-thread sum of relu(product) x weight over a
    thread's heads (an fmul, an ffma and an fadd a pair); "chain" is one chain of fmas (16 at
    H = 64, then 2 shuffles): 240 instead of 268 sm_90 instructions a tile a warp, yet no
    faster on the H200 at H = 64 and slower at H = 32, where it needs 134 registers (v9 in
    docs/KERNELS.md). The two round differently: scores differ in the last bits.
    `pair_max_registers`: ptxas register cap (`maxnreg`) of the multi-block programs; one-block
    programs are never capped (under a 168 cap ptxas gives the H = 32 kernel 139 registers
    instead of 128: 3 programs an SM instead of 4, 11% slower). None leaves ptxas its choice.
    `pair_relu`: how the multi-block programs' tree head sum takes relu(x) * wq. "max" is
    max(x, 0) * wq (FMNMX, on the ALU pipe); "abs" is (x + |x|) * (wq / 2) (an FADD with an
    |x| operand, on the FMA pipe; wq halved once a program). The products are equal (x + |x|
    = 2x or +0, and halving wq is exact unless |wq| < 2^-125), so the scores are identical
    (checked bitwise on the H200). 0.6-2.3% faster at H = 64 from 16K in the three H200 runs
    of v10, 3-6% slower in the one-block H = 32 kernel, which therefore keeps "max" (as does
    the chain head sum, where "abs" lost too). Multi-block programs only, like the cap.
    `group_min_scores`: launches of fewer scores (rows x all padded keys, not the launch's key
    window) than this run the config's one-block form (`for_launch`): q_groups 1, no cap, max
    relu; the same scores. Tuned on square rows (4K and 8K); a CP rank's queries against the
    whole row's keys count rows x all keys, more than the scores inside their ranges.
    Multi-block programs halve the grid, which small launches cannot fill (H = 64, 4K rows:
    1024 programs for 132 SMs, 1.01-1.15x slower than one block a program in v10's and v11's
    H200 runs). None: every launch runs the config as it is.
    `ws_min_scores`: launches (H = 64 or 32) of at least this many scores (rows x all padded
    keys) run the warp-specialised Gluon kernel instead (`kernels.logits_ws`, "banks"
    epilogue: four warpgroups a CTA over shared TMA key tiles, each splitting its 128 columns
    into two wgmmas and summing the first's heads while the second runs; `WS_LAUNCH` per head
    count) on an sm_90 GPU whose Triton has Gluon (`runs_warp_specialised`); elsewhere the
    Triton kernel. It sums a thread's heads in another order: scores equal to fp32 rounding,
    not bitwise, across the threshold and across GPU kinds (bitwise the same from call to call
    on one kind). At H = 64: 0.94-1.00 of the Triton kernel's time from 16K rows x 16K keys in
    v13's H200 probes (0.96-1.00 in its final runs), 1.03-1.04 at 8K packed rows, 1.6-1.8 at
    4K (v13 in docs/KERNELS.md). At H = 32, with 120 registers for warpgroups 1-3 (v14):
    0.90-0.98 from 16K rows (0.94-0.98 at 8K rows, under the fixed threshold). v14c's launch:
    0.92-0.95 (H = 64) and 0.86-0.93 (H = 32) from 16K rows. The threshold stays at 16K x 16K:
    a WS launch costs the host 60-110 us (the Triton kernel's 36-60), as much as a small
    launch's GPU time: 2K-8K packed rows took 1.1-2.1x the Triton kernel's time and 2K-4K
    causal rows 0.8-1.9x (host-bound, varying with the host from machine to machine), while
    8K causal rows gain 5-10%. None: the Triton kernel everywhere.
    """

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    schedule: Literal["serial", "pipelined"] = "serial"
    key_mask: Literal["auto", "always"] = "auto"
    q_groups: int = 1
    head_sum: Literal["tree", "chain"] = "tree"
    pair_max_registers: int | None = None
    pair_relu: Literal["max", "abs"] = "max"
    group_min_scores: int | None = None
    ws_min_scores: int | None = None

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
        if self.head_sum not in ("tree", "chain"):
            raise ValueError(f"LogitsConfig.head_sum={self.head_sum!r}: must be 'tree' or 'chain'")
        regs = self.pair_max_registers
        if regs is not None and not 24 <= regs <= 255:
            raise ValueError(f"LogitsConfig.pair_max_registers={regs}: must be 24-255")
        if regs is not None and self.q_groups == 1:
            raise ValueError("LogitsConfig.pair_max_registers needs q_groups 2 or 4")
        if self.pair_relu not in ("max", "abs"):
            raise ValueError(f"LogitsConfig.pair_relu={self.pair_relu!r}: must be 'max' or 'abs'")
        if self.pair_relu != "max" and (self.q_groups == 1 or self.head_sum != "tree"):
            raise ValueError(
                "LogitsConfig.pair_relu='abs' needs q_groups 2 or 4 and head_sum='tree'"
            )
        if self.group_min_scores is not None and self.group_min_scores < 1:
            raise ValueError(
                f"LogitsConfig.group_min_scores={self.group_min_scores}: must be >= 1 or None"
            )
        if self.ws_min_scores is not None and self.ws_min_scores < 1:
            raise ValueError(
                f"LogitsConfig.ws_min_scores={self.ws_min_scores}: must be >= 1 or None"
            )
        if self.q_groups not in (1, 2, 4):
            raise ValueError(f"LogitsConfig.q_groups={self.q_groups}: must be 1, 2 or 4")
        if self.q_groups != 1 and self.schedule != "serial":
            raise ValueError(f"LogitsConfig.q_groups={self.q_groups} needs schedule='serial'")

    def block_q(self, heads: int) -> int:
        """Queries per query block (`groups(heads)` blocks a program) for `heads` (padded) heads."""
        if heads > self.block_n:
            raise ValueError(f"heads={heads} exceeds LogitsConfig.block_n={self.block_n}")
        return self.block_n // heads

    def groups(self, heads: int) -> int:
        """Query blocks a program for `heads` heads: up to q_groups, holding <= 4 queries."""
        return min(self.q_groups, max(1, 4 // self.block_q(heads)))

    def max_registers(self, heads: int) -> int | None:
        """ptxas register cap (`maxnreg`) for `heads` heads: multi-block programs only."""
        return self.pair_max_registers if self.groups(heads) > 1 else None

    def for_launch(self, n_rows: int, n_keys: int) -> LogitsConfig:
        """The config a launch of n_rows queries over n_keys (padded) keys runs: this one, or,
        below `group_min_scores` scores, its one-block form (the same scores)."""
        if self.group_min_scores is None or n_rows * n_keys >= self.group_min_scores:
            return self
        return self._one_block

    @cached_property
    def _one_block(self) -> LogitsConfig:
        # made once: a new frozen dataclass each launch costs ~10 us of host time, which the
        # small launches that take this form (0.04-0.15 ms kernels) cannot hide
        return replace(
            self, q_groups=1, pair_max_registers=None, pair_relu="max", group_min_scores=None,
            ws_min_scores=None,
        )  # fmt: skip

    def abs_relu(self, heads: int) -> bool:
        """Whether the kernel for `heads` heads takes relu as x + |x| (multi-block programs)."""
        return self.pair_relu == "abs" and self.groups(heads) > 1

    def kernel_params(self, heads: int) -> tuple[dict, dict]:
        """The logits kernel's constexprs for `heads` heads (all but H, D and EVEN_K, which
        depend on the operands) and its launch options (warps, stages, register cap): the one
        place a config becomes a kernel, for `launch_logits` and the benchmarks' autotuned peer."""
        meta = {
            "BLOCK_Q": self.block_q(heads),
            "BLOCK_K": self.block_k,
            "PIPELINED": self.schedule == "pipelined",
            "GROUPS": self.groups(heads),
            "CHAIN": self.head_sum == "chain",
            "ABS_RELU": self.abs_relu(heads),
        }
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        regs = self.max_registers(heads)
        if regs is not None:
            options["maxnreg"] = regs
        return meta, options

    @property
    def label(self) -> str:
        """Short name for reports, e.g. `n128/k64/w4/s3` or `n128/k64/w4/s3/pipe`."""
        tag = f"n{self.block_n}/k{self.block_k}/w{self.num_warps}/s{self.num_stages}"
        if self.schedule == "pipelined":
            tag += "/pipe"
        if self.key_mask == "always":
            tag += "/mask"
        if self.q_groups != 1:
            tag += f"/g{self.q_groups}"
        if self.head_sum == "chain":
            tag += "/chain"
        if self.pair_max_registers is not None:
            tag += f"/r{self.pair_max_registers}"
        if self.pair_relu != "max":
            tag += f"/{self.pair_relu}"
        if self.group_min_scores is not None:
            tag += f"/g>={_count(self.group_min_scores)}"
        if self.ws_min_scores is not None:
            tag += f"/ws>={_count(self.ws_min_scores)}"
        return tag

    def runs_warp_specialised(self, q8: torch.Tensor, k8: torch.Tensor, heads: int,
                              n_rows: int, col0: int) -> bool:  # fmt: skip
        """Whether a launch runs `kernels.logits_ws` (banks epilogue) instead of the Triton
        kernel: at least `ws_min_scores` scores (rows x all padded keys) at 64 or 32 heads
        (`WS_LAUNCH`), D = 128,
        contiguous q8 and k8, keys padded to 64, col0 a multiple of 16, on an sm_90 GPU whose
        Triton has Gluon's Hopper warp specialisation (not under TRITON_INTERPRET). Every other
        launch runs the config's Triton kernel."""
        return (
            self.ws_min_scores is not None
            and heads in WS_LAUNCH
            and n_rows * k8.shape[0] >= self.ws_min_scores
            and q8.is_cuda
            and q8.shape[1] == 128
            and q8.is_contiguous()
            and k8.is_contiguous()
            and k8.shape[0] % 64 == 0
            and col0 % 16 == 0
            and not interpreting()
            and _gluon_hopper(q8.device)
        )


@functools.cache
def _gluon_hopper(device: torch.device) -> bool:
    """An sm_90 GPU and a Triton whose Gluon has Hopper warp specialisation (one check a
    device; Triton 3.6 on the H200 has it)."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        import packshard.kernels.logits_ws  # noqa: F401 (Gluon's Hopper modules import or not)
    except ImportError:
        return False
    return True


def _count(n: int) -> str:
    """n for a label: 33554432 -> 32M, 4096 -> 4K."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# Chosen by the H200 sweeps recorded in docs/KERNELS.md (fixed for every row length): 128
# (query, head) columns x 64 keys, one warpgroup, 3 stages. At H = 64 two 2-query blocks share
# each key tile (q_groups, v9): 168 registers, 57 KB of shared memory, 3 programs an SM, relu
# as x + |x| (v10); launches under 2^25 scores (4K rows at 4K keys) one block a program (v11);
# launches of 2^28 scores and more (16K rows at 16K keys) the warp-specialised Gluon kernel on
# sm_90 (v13). At H = 32 one 4-query block a program: 128 registers, 41 KB, 4 programs an SM.
FIXED_LOGITS_CONFIG = LogitsConfig(
    block_n=128,
    block_k=64,
    num_warps=4,
    num_stages=3,
    q_groups=2,
    pair_max_registers=168,
    pair_relu="abs",
    group_min_scores=1 << 25,
    ws_min_scores=1 << 28,
)


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
def _head_chain(x, w, s, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr, NI: tl.constexpr,
                FIRST: tl.constexpr):  # fmt: skip
    """s + sum of relu(x) * w over the NI axis of x [BLOCK_K, BLOCK_Q, NI, 4], one fma a value.

    Halves NI on its lowest bit (a register bit of the wgmma accumulator: no data moves) until
    one value a thread is left, then chains fma(relu(x), w, s)."""
    if NI == 1:
        xv = tl.maximum(tl.reshape(x, (BLOCK_K, BLOCK_Q, 4)), 0.0)
        wv = tl.reshape(w, (1, BLOCK_Q, 4))
        if FIRST:
            s = xv * wv
        else:
            s = tl.fma(xv, wv, s)
    else:
        # i = 2 a + b: put b last and split on it
        xa, xb = tl.split(
            tl.permute(tl.reshape(x, (BLOCK_K, BLOCK_Q, NI // 2, 2, 4)), 0, 1, 2, 4, 3)
        )
        wa, wb = tl.split(tl.permute(tl.reshape(w, (1, BLOCK_Q, NI // 2, 2, 4)), 0, 1, 2, 4, 3))
        s = _head_chain(xa, wa, s, BLOCK_K, BLOCK_Q, NI // 2, FIRST)
        s = _head_chain(xb, wb, s, BLOCK_K, BLOCK_Q, NI // 2, False)
    return s


@triton.jit
def _head_sum(acc, wq, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr, H: tl.constexpr,
              CHAIN: tl.constexpr, ABS_RELU: tl.constexpr):  # fmt: skip
    """[BLOCK_K, BLOCK_Q] = sum over heads of relu(acc) * wq (acc columns are (query, head)).

    ABS_RELU: wq holds half the weights and relu(x) is taken as x + |x| (tree sum only)."""
    if CHAIN and H >= 8:
        # head h = 8 i + 2 t + j: i and j index a thread's registers, t its lane in a quad
        x0, x1 = tl.split(tl.reshape(acc, (BLOCK_K, BLOCK_Q, H // 8, 4, 2)))
        w0, w1 = tl.split(tl.reshape(wq, (1, BLOCK_Q, H // 8, 4, 2)))
        s = _head_chain(x0, w0, 0.0, BLOCK_K, BLOCK_Q, H // 8, True)
        s = _head_chain(x1, w1, s, BLOCK_K, BLOCK_Q, H // 8, False)
        score = tl.sum(s, axis=2)
    else:
        if ABS_RELU:
            acc = (acc + tl.abs(acc)) * wq[None, :]
        else:
            acc = tl.maximum(acc, 0.0) * wq[None, :]
        score = tl.sum(tl.reshape(acc, (BLOCK_K, BLOCK_Q, H)), axis=2)
    return score


@triton.jit
def _key_scales(kscale_ptr, offs, S_k, EVEN_K: tl.constexpr):
    """k_scale of the key tile `offs` [BLOCK_K] fp32."""
    if EVEN_K:
        ksc = tl.load(kscale_ptr + offs)
    else:
        ksc = tl.load(kscale_ptr + offs, mask=offs < S_k, other=0.0)
    return ksc


@triton.jit
def _tile_epilogue(
    acc, wq, ksc, offs, ks, ke, out_rows,
    BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr, H: tl.constexpr, CHAIN: tl.constexpr,
    ABS_RELU: tl.constexpr = False,
):  # fmt: skip
    """relu, head weights, head sum, key scale; store the [BLOCK_K, BLOCK_Q] scores in range."""
    score = _head_sum(acc, wq, BLOCK_K, BLOCK_Q, H, CHAIN, ABS_RELU) * ksc[:, None]
    valid = (offs[:, None] >= ks[None, :]) & (offs[:, None] < ke[None, :])
    tl.store(out_rows[None, :] + offs[:, None], score, mask=valid)


@triton.jit
def _query_block(
    q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk,
    H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """Query block `blk`: the ranges, their union [lo, hi), q^T [D, BLOCK_N], wq, output rows.

    A block past the last row has no rows: lo = int32 max, hi = 0, zero q and wq."""
    BLOCK_N: tl.constexpr = BLOCK_Q * H
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
    GROUPS: tl.constexpr = 1,
    CHAIN: tl.constexpr = False,
    ABS_RELU: tl.constexpr = False,
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
    GROUPS = 2 (serial only): the program owns query blocks 2b and 2b + 1 and runs both over
    each key tile, which is loaded once. ABS_RELU (GROUPS >= 2, tree head sum): relu(x) * wq is
    (x + |x|) * (wq / 2), the same products (`LogitsConfig.pair_relu`). GROUPS = 4: blocks
    4b to 4b + 3 likewise.
    """
    n_groups = tl.cdiv(tl.cdiv(n_rows, BLOCK_Q), GROUPS)
    blk = (n_groups - 1 - tl.program_id(0)) * GROUPS  # heaviest (latest) query blocks first
    ks, ke, lo, hi, q_t, wq, out_rows, d = _query_block(
        q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk,
        H, D, BLOCK_Q,
    )  # fmt: skip
    if GROUPS >= 2:
        ks2, ke2, lo2, hi2, q2_t, wq2, out_rows2, _ = _query_block(
            q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk + 1,
            H, D, BLOCK_Q,
        )  # fmt: skip
        lo = tl.minimum(lo, lo2)
        hi = tl.maximum(hi, hi2)
        if ABS_RELU:
            wq = wq * 0.5
            wq2 = wq2 * 0.5
    if GROUPS == 4:
        ks3, ke3, lo3, hi3, q3_t, wq3, out_rows3, _ = _query_block(
            q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk + 2,
            H, D, BLOCK_Q,
        )  # fmt: skip
        ks4, ke4, lo4, hi4, q4_t, wq4, out_rows4, _ = _query_block(
            q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk + 3,
            H, D, BLOCK_Q,
        )  # fmt: skip
        lo = tl.minimum(lo, tl.minimum(lo3, lo4))
        hi = tl.maximum(hi, tl.maximum(hi3, hi4))
        if ABS_RELU:
            wq3 = wq3 * 0.5
            wq4 = wq4 * 0.5
    start = (lo // BLOCK_K) * BLOCK_K
    if GROUPS >= 2:
        for s0 in range(start, hi, BLOCK_K):
            offs = s0 + tl.arange(0, BLOCK_K)
            kt = _key_tile(k_ptr, offs, d, S_k, D, EVEN_K)
            ksc = _key_scales(kscale_ptr, offs, S_k, EVEN_K)
            acc = tl.dot(kt, q_t)
            _tile_epilogue(acc, wq, ksc, offs, ks, ke, out_rows, BLOCK_K, BLOCK_Q, H, CHAIN,
                           ABS_RELU)  # fmt: skip
            acc = tl.dot(kt, q2_t)
            _tile_epilogue(acc, wq2, ksc, offs, ks2, ke2, out_rows2, BLOCK_K, BLOCK_Q, H, CHAIN,
                           ABS_RELU)  # fmt: skip
            if GROUPS == 4:
                acc = tl.dot(kt, q3_t)
                _tile_epilogue(acc, wq3, ksc, offs, ks3, ke3, out_rows3, BLOCK_K, BLOCK_Q, H,
                               CHAIN, ABS_RELU)  # fmt: skip
                acc = tl.dot(kt, q4_t)
                _tile_epilogue(acc, wq4, ksc, offs, ks4, ke4, out_rows4, BLOCK_K, BLOCK_Q, H,
                               CHAIN, ABS_RELU)  # fmt: skip
    elif not PIPELINED:
        for s0 in range(start, hi, BLOCK_K):
            offs = s0 + tl.arange(0, BLOCK_K)
            acc = tl.dot(_key_tile(k_ptr, offs, d, S_k, D, EVEN_K), q_t)  # [BLOCK_K, BLOCK_N] fp32
            ksc = _key_scales(kscale_ptr, offs, S_k, EVEN_K)
            _tile_epilogue(acc, wq, ksc, offs, ks, ke, out_rows, BLOCK_K, BLOCK_Q, H, CHAIN)
    elif lo < hi:
        offs = start + tl.arange(0, BLOCK_K)
        acc = tl.dot(_key_tile(k_ptr, offs, d, S_k, D, EVEN_K), q_t)
        for s0 in range(start + BLOCK_K, hi, BLOCK_K):
            offs_next = s0 + tl.arange(0, BLOCK_K)
            acc_next = tl.dot(_key_tile(k_ptr, offs_next, d, S_k, D, EVEN_K), q_t)
            ksc = _key_scales(kscale_ptr, offs, S_k, EVEN_K)
            _tile_epilogue(acc, wq, ksc, offs, ks, ke, out_rows, BLOCK_K, BLOCK_Q, H, CHAIN)
            acc = acc_next
            offs = offs_next
        ksc = _key_scales(kscale_ptr, offs, S_k, EVEN_K)
        _tile_epilogue(acc, wq, ksc, offs, ks, ke, out_rows, BLOCK_K, BLOCK_Q, H, CHAIN)


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
):
    """Write scores of queries [row0, row0 + n_rows) into out[0:n_rows, s - col0] (in-range only).

    `q8` is [S_q * heads, D] fp8, `k8` [S_kp, D] fp8; see the module docstring for the rules.
    `config.for_launch(n_rows, S_kp)` is what runs (the one-block form of a launch under
    `group_min_scores` scores, counted over all S_kp keys, not the launch's key window).
    Returns Triton's handle of the launched kernel (None when there are no rows), whose
    `n_regs` / `n_spills` the benchmarks report.
    """
    config.block_q(heads)  # heads > block_n raises, with rows or without
    if n_rows <= 0:
        return None
    s_k = k8.shape[0]
    if config.runs_warp_specialised(q8, k8, heads, n_rows, col0):
        from packshard.kernels.logits_ws import launch_logits_ws

        return launch_logits_ws(
            q8, wq, k8, k_scale, ks, ke, out, heads=heads, row0=row0, n_rows=n_rows,
            col0=col0, **WS_LAUNCH[heads],
        )  # fmt: skip
    grid, meta, options = triton_launch(config, heads, n_rows, s_k)
    return _indexer_logits_kernel[grid](
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
        D=q8.shape[1],
        **meta,
        **options,
    )


# the warp-specialised kernel's launch in the fixed path (`launch_logits`), by head count: at
# H = 32 warpgroups 1-3 take 120 registers a thread and the producer 152 (128 spilled there;
# 0.90-0.98 of the Triton kernel's time from 8K rows instead of 1.04-1.26, v14); at H = 64 the
# split is within 1% either way and v13's 128 stays. Since v14c the CTA's key range passes
# through a lane shuffle (uniform_ranges) and the first key tiles go out under the queries' TMA
# (early_tiles): 0.94-0.98 of v14's launch time from 16K rows, 0.92-0.96 at 8K (the same
# scores, bitwise)
WS_LAUNCH = {
    64: {"stages": 4, "lag": 1, "epilogue": "banks", "worker_regs": 128,
         "uniform_ranges": True, "early_tiles": True},
    32: {"stages": 4, "lag": 1, "epilogue": "banks", "worker_regs": 120,
         "uniform_ranges": True, "early_tiles": True},
}  # fmt: skip


def triton_launch(
    config: LogitsConfig, heads: int, n_rows: int, s_k: int
) -> tuple[tuple[int], dict, dict]:
    """The Triton kernel's grid, constexprs (EVEN_K included; not H and D) and launch options
    for a launch of n_rows queries over s_k padded keys: `config.for_launch`'s form. The one
    place `launch_logits` and the benchmarks (`bench_indexer.launch_identity`) take them from."""
    config = config.for_launch(n_rows, s_k)
    meta, options = config.kernel_params(heads)
    meta["EVEN_K"] = config.key_mask == "auto" and s_k % config.block_k == 0
    grid = (triton.cdiv(triton.cdiv(n_rows, meta["BLOCK_Q"]), meta["GROUPS"]),)
    return grid, meta, options
