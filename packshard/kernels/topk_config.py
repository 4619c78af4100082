"""`TopkConfig`: the launch parameters of the top-k's select kernels and its order step.

The defaults are the fixed config (`FIXED_TOPK_CONFIG`), which every indexer call runs: the
one-warp select of `kernels.select_kernel` as two launches (the compaction pass capped at 96
registers, the exact select at 168), compaction positions from warp ballots
(`kernels.ballot`), the radix order (`kernels.order`). The knobs that remain are sizes and
the two choices whose alternative is a path the fixed config takes anyway where its own does
not apply: `compact="scan"` (the prefix sum: the CPU interpreter and rows that are not
16-aligned) and `order="torch"` (the stable torch sort: the interpreter and staging rows
outside 32-2048). Every config gives the same indices.

H200, S = 64K, H = 64, causal, topk 2048: the select takes 5.9 ms and the radix order 0.43 ms
for 16K rows of 2048 (docs/KERNELS.md has the table; docs/kernels-history.md the configs that
lost: a CTA-wide select, 15.9 ms; one launch, 10.2 ms; a float threshold test, unmasked
interior blocks, a bitonic order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import triton

from packshard.kernels.ballot import BALLOT_BLOCKS

_COMPACTS = ("scan", "ballot")  # compaction positions: `select_kernel._compact_pass`
_ORDERS = ("torch", "radix")  # staging -> output: `kernels.order`


@dataclass(frozen=True)
class TopkConfig:
    """Launch parameters of the select kernels and the order step (defaults: the fixed config).

    The select runs one row a one-warp program: every count and scan is in-register work plus
    shuffles, no barrier, ~12 programs an SM, so one row's 64 dependent counts overlap other
    rows' instead of serialising behind CTA barriers. `order`: "radix" sorts each staging row
    in one warp with a stable radix sort in inline PTX (`kernels.order.radix_order_asm`; GPU,
    staging rows of 32-2048: elsewhere the torch sort runs); "torch" sorts the staging rows
    with a stable torch.sort and gathers.
    """

    sample: int = 2048  # threshold sample size (power of two, >= 16): runs of 16 scores
    block: int = 512  # scores per step of the compaction pass (power of two)
    cap_factor: int = 2  # candidate buffer = cap_factor * next_pow2(topk)
    min_cap: int = 16  # smallest candidate buffer
    ratio: float = 1.5  # aim: count(score >= T) ~= ratio * topk
    max_passes: int = 3
    # rows a program: 1 on the GPU; more only vectorises Triton's CPU interpreter (tests)
    rows_per_program: int = 1
    chunk: int = 512  # exact select: candidates a step of the staging write
    # the exact select's register cap: it holds CAP keys a row (128 registers a lane at topk
    # 2048); ptxas takes all 255 of a one-warp program otherwise (8 warps an SM), 168 gives 12
    # without spills at block 512, chunk 512, topk 2048 (sm_90)
    warp_max_registers: int = 168
    # the compaction pass's register cap: it needs few and wants many warps an SM (9.1 ms
    # against 10.3 for both steps in one launch at 168, S = 64K, H = 64)
    compact_max_registers: int = 96
    # compaction positions from warp ballots ("ballot": inline PTX, GPU only, blocks of
    # 128-1024; rows that are not 16-aligned and the CPU interpreter run the scan) or from a
    # prefix sum over the block ("scan"): the same positions
    compact: Literal["scan", "ballot"] = "ballot"
    order: Literal["torch", "radix"] = "radix"

    def __post_init__(self) -> None:
        for name, least in (
            ("sample", 16),
            ("block", 16),
            ("cap_factor", 2),
            ("min_cap", 2),
            ("rows_per_program", 1),
            ("chunk", 16),
        ):
            v = getattr(self, name)
            if v < least or v & (v - 1):
                raise ValueError(f"TopkConfig.{name}={v}: must be a power of two >= {least}")
        if not 1.0 < self.ratio < self.cap_factor:
            raise ValueError(
                f"TopkConfig.ratio={self.ratio}: must lie in (1, cap_factor={self.cap_factor})"
            )
        if self.max_passes < 1:
            raise ValueError(f"TopkConfig.max_passes={self.max_passes}: must be >= 1")
        if self.compact not in _COMPACTS:
            raise ValueError(
                f"TopkConfig.compact={self.compact!r}: must be one of {list(_COMPACTS)}"
            )
        if self.compact == "ballot" and self.block not in BALLOT_BLOCKS:
            raise ValueError(
                f"TopkConfig.block={self.block} with compact='ballot': the ballot compaction "
                f"takes blocks of {list(BALLOT_BLOCKS)}; use compact='scan' for others"
            )
        if self.compact == "ballot" and self.rows_per_program != 1:
            raise ValueError(
                f"TopkConfig.rows_per_program={self.rows_per_program} with compact='ballot': "
                "the ballot compaction runs one row a one-warp program; use compact='scan'"
            )
        for name in ("compact_max_registers", "warp_max_registers"):
            if not 24 <= getattr(self, name) <= 255:
                raise ValueError(f"TopkConfig.{name}={getattr(self, name)}: must lie in [24, 255]")
        if self.order not in _ORDERS:
            raise ValueError(f"TopkConfig.order={self.order!r}: must be one of {list(_ORDERS)}")

    def sizes(self, topk: int) -> tuple[int, int]:
        """(K2 = staging width, a power of two >= topk; CAP = candidate buffer per row)."""
        k2 = max(2, triton.next_power_of_2(topk))
        return k2, max(self.cap_factor * k2, self.min_cap)

    @property
    def label(self) -> str:
        """Short name for reports."""
        head = f"warp block={self.block} prefetch split/{self.compact_max_registers}r"
        if self.compact == "ballot":
            head += " ballot"
        order = "radix order" if self.order == "radix" else "torch sort"
        return f"{head} early sample={self.sample}, {order}"


FIXED_TOPK_CONFIG = TopkConfig()
