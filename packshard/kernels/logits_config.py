"""`LogitsConfig`: the launch parameters of the fp8 indexer's logits kernels, and the fixed
config every call runs (`FIXED_LOGITS_CONFIG`, with `WS_LAUNCH` for its warp-specialised
launches).

The fields are the logits kernel's (`kernels.logits`) knobs: blocking, stages, the serial or
pipelined schedule, query blocks sharing key tiles, the head sum and relu forms, register caps,
and two thresholds by launch size: under `group_min_scores` a launch runs the one-block form,
from `ws_min_scores` on the warp-specialised kernel (`kernels.logits_ws`). The fixed config is
one point of this space, chosen by H200 sweeps; `benchmarks/indexer_peers.py` autotunes over
others (`SWEEP_CONFIGS`) as the peer the fixed config is measured against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import torch

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
    "always" keeps it. Both give identical scores.
    `q_groups`: 2 pairs up query blocks of at most two queries (H >= 64 at block_n 128): a
    program owns two blocks, which share each key tile (loaded once into shared memory; two
    wgmma chains one after the other, each with its epilogue): half the K-tile traffic from L2
    a flop, at 168 registers (`pair_max_registers=168`; ptxas takes 200 uncapped), so 3
    programs an SM. Blocks of 4 or more queries (H <= 32) stay one a program: a second one
    needs 216 registers, spills under the cap, and loses at every H = 32 shape. `q_groups=4`: four blocks a program, which need 1-query blocks (H = 64
    at block_n 64; 2-query blocks pair up): the same K-tile reads a flop as two 2-query blocks
    at ~123 registers, yet 7-30% slower than the fixed config on the H200 with 2 or 3 stages. `groups(heads)` is the count that runs: a multi-block program
    holds at most 4 queries. Serial schedule only; same per-score arithmetic: identical scores.
    `head_sum`: "tree" is Triton's pairwise in-thread sum of relu(product) x weight over a
    thread's heads (an fmul, an ffma and an fadd a pair); "chain" is one chain of fmas (16 at
    H = 64, then 2 shuffles): 240 instead of 268 sm_90 instructions a tile a warp, yet no
    faster on the H200 at H = 64 and slower at H = 32, where it needs 134 registers. The two
    round differently: scores differ in the last bits.
    `pair_max_registers`: ptxas register cap (`maxnreg`) of the multi-block programs; one-block
    programs are never capped (under a 168 cap ptxas gives the H = 32 kernel 139 registers
    instead of 128: 3 programs an SM instead of 4, 11% slower). None leaves ptxas its choice.
    `pair_relu`: how the multi-block programs' tree head sum takes relu(x) * wq. "max" is
    max(x, 0) * wq (FMNMX, on the ALU pipe); "abs" is (x + |x|) * (wq / 2) (an FADD with an
    |x| operand, on the FMA pipe; wq halved once a program). The products are equal (x + |x|
    = 2x or +0, and halving wq is exact unless |wq| < 2^-125), so the scores are identical
    (checked bitwise on the H200). 0.6-2.3% faster at H = 64 from 16K in three H200 runs, 3-6%
    slower in the one-block H = 32 kernel, which therefore keeps "max" (as does the chain head
    sum, where "abs" loses too). Multi-block programs only, like the cap.
    `group_min_scores`: launches of fewer scores (rows x all padded keys, not the launch's key
    window) than this run the config's one-block form (`for_launch`): q_groups 1, no cap, max
    relu; the same scores. Tuned on square rows (4K and 8K); a CP rank's queries against the
    whole row's keys count rows x all keys, more than the scores inside their ranges.
    Multi-block programs halve the grid, which small launches cannot fill (H = 64, 4K rows:
    1024 programs for 132 SMs, 1.01-1.15x slower than one block a program on the H200). None:
    every launch runs the config as it is.
    `ws_min_scores`: launches (H = 64 or 32) of at least this many scores (rows x all padded
    keys) run the warp-specialised Gluon kernel instead (`kernels.logits_ws`, "banks"
    epilogue: four warpgroups a CTA over shared TMA key tiles, each splitting its 128 columns
    into two wgmmas and summing the first's heads while the second runs; `WS_LAUNCH` per head
    count) on an sm_90 GPU whose Triton has Gluon (`runs_warp_specialised`); elsewhere the
    Triton kernel. It sums a thread's heads in another order: scores equal to fp32 rounding,
    not bitwise, across the threshold and across GPU kinds (bitwise the same from call to call
    on one kind). With `WS_LAUNCH` it takes 0.92-0.95 (H = 64) and 0.86-0.93 (H = 32) of the
    Triton kernel's time from 16K rows x 16K keys on the H200, 1.03-1.04 at 8K packed rows
    and 1.6-1.8 at 4K. The threshold is 16K x 16K:
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
            raise ValueError(
                f"{heads} heads (H padded to a power of two) exceed LogitsConfig.block_n="
                f"{self.block_n}: the logits kernel takes at most {self.block_n} heads"
            )
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
        (`WS_LAUNCH`), D = 128, contiguous q8 and k8, keys padded to 64, col0 a multiple of 16, on an sm_90 GPU whose
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


# Chosen by the H200 sweeps (docs/KERNELS.md; fixed for every row length): 128 (query, head)
# columns x 64 keys, one warpgroup, 3 stages. At H = 64 two 2-query blocks share each key tile
# (q_groups): 168 registers, 57 KB of shared memory, 3 programs an SM, relu as x + |x|;
# launches under 2^25 scores (4K rows at 4K keys) run one block a program; launches of 2^28
# scores and more (16K rows at 16K keys) the warp-specialised Gluon kernel on sm_90. At H = 32
# one 4-query block a program: 128 registers, 41 KB, 4 programs an SM.
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


# The warp-specialised kernel's launch in the fixed path (`launch_logits`), by head count: 4
# ring stages, tile loads one tile behind (lag 1), the banks epilogue, the CTA's key range made
# warp-uniform by a lane shuffle (uniform_ranges) and the first key tiles issued under the
# queries' TMA (early_tiles). At H = 32 warpgroups 1-3 take 120 registers a thread and the
# producer 152: at 128 ptxas spills and the kernel takes 1.04-1.26x the Triton kernel's time
# from 8K rows instead of 0.90-0.98; at H = 64 the split is within 1% either way.
WS_LAUNCH = {
    64: {"stages": 4, "lag": 1, "epilogue": "banks", "worker_regs": 128,
         "uniform_ranges": True, "early_tiles": True},
    32: {"stages": 4, "lag": 1, "epilogue": "banks", "worker_regs": 120,
         "uniform_ranges": True, "early_tiles": True},
}  # fmt: skip
