"""Deterministic per-row top-k over indexer logits: sampled threshold, compaction, exact select, stable sort.

Order contract (shared with the torch fallback and the reference): higher score first, ties by
lower key index; -0.0 equals +0.0; slots past a row's valid keys hold the sentinel S_k. Only keys
in [ks[t], ke[t]) are read, so whatever lies outside them in the logits buffer is ignored.

Scores are compared as `u = key32 ^ 0x80000000` read as uint32, where
`key32 = bits ^ ((bits >> 31) & 0x7fffffff)` (bits of the score with -0.0 folded onto +0.0):
u is monotone in the score, so "k-th largest" is an integer question with an exact answer.

Per row (`_select_kernel`, ROWS rows per program; 1 on the GPU):
1. Threshold: SAMPLE scores in evenly spaced runs of 16; T = the sample's r-th largest (no
   sort: a 32-round bitwise search, or radix select in eight 16-bin histograms, per
   `TopkConfig.select`), r chosen so that about `ratio * topk` of the row's n scores are >= T.
   Rows with n <= CAP take T = 0 (everything).
2. One pass over the row writes every (u, index) with u >= T, in index order, to the row's
   candidate buffer and counts them. A count outside [min(topk, n), CAP] re-ranks r from the
   count inside a bracket of ranks already tried and passes again (at most MAX_PASSES); a row
   that still misses is flagged.
3. Exact select among the <= CAP candidates: T* = the min(topk, count)-th largest u (the same
   select); keep all u > T* and the lowest-index u == T* until min(topk, count) are kept;
   write them, still in index order, to a [rows, K2] staging pair (key32, index), padded with
   (INT32_MIN, sentinel).
Then the order step (`kernels.order`, `TopkConfig.order`): "torch" sorts each staging row by
key32 descending with a *stable* sort (torch.sort(stable=True)), which keeps index order among
equal keys: exactly the contract; "bitonic" sorts (key32 << 32 | 2^31-1-index) int64
descending in one Triton program a row (values distinct: the contract's order, no stability).
Flagged rows are finished by `topk_rows_torch` (exact and deterministic, slower).

Steps 1-3 run CTA-wide (`TopkConfig.kernel="cta"`, 8 warps a row, run 2's fixed config) or in one
warp a row ("warp": same algorithm and output; counts and scans are shuffles, no barriers, 12
programs an SM; see `_select_kernel`). The fixed config runs the one-warp select as two launches
whose positions (step 2's compaction, step 3's tie ranks and staging write) come from warp
ballots in inline PTX (`compact="ballot"`, `ballot_asm`; GPU only, the interpreter runs the
prefix sum, same positions), and stops step 3's bitwise search at the first trial with exactly
min(topk, count) candidates at or above it (`early_exit`).

No atomics and no data-dependent reduction order anywhere, so the output is a pure function of
the scores. Why not a bitonic top-k of the candidates inside the select: a 4096-wide int64
bitonic top-k compiled to ~23K SASS lines per row (about 5.8M thread-instructions: ~12 ms per
64K rows) and 50-110 s of compile time; the selects cost 32 counts of CAP values and compile
in seconds. The bitonic *order* sorts only the 2048 selected: ~7K SASS lines a thread of 4
warps (~28K warp instructions a row), ~10-20 s to compile.

H200, S=64K, H=64, causal, topk 2048: run 2's CTA select 16.3 ms (it reads the 8.6 GB of
scores at ~0.5 TB/s: each 2048-score step is a CTA-wide scan and count behind barriers), the
one-warp split select 9.3 ms, with ballots, prefetch and early exit 6.1 ms (2026-12-03); stable
sort and gather 4.6 ms; docs/KERNELS.md has the sweeps and the candidates' predictions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from packshard.kernels._triton_env import interpreting

IDX_MAX = 2**31 - 1
I32_MIN = -(2**31)


_SELECTS = {"radix": 1, "bitwise": 0}  # constexpr RADIX of the CTA kernel
_KERNELS = ("cta", "warp")  # `_select_kernel` with WARP = False / True
_ORDERS = ("torch", "bitonic", "radix")  # staging -> output: `kernels.order`
_COMPACTS = ("scan", "ballot")  # compaction positions: `_compact_pass`


def ballot_asm(per_thread: int, vec: int = 4) -> str:
    """PTX of the ballot compaction's positions for one lane's `per_thread` elements.

    The block is a [1, 32 * per_thread] tensor of one warp whose blocked layout gives lane L
    the `vec`-element runs at columns r * 32 * vec + L * vec + j (r < per_thread // vec,
    j < vec), handed to the asm in that (r, j) order. Operands: $0..$(n-1) out: the exclusive
    position base + #(selected columns before this one), or INT32_MAX where not selected;
    $n..$(2n-1) out: base + #(selected in the block) (every element the same); $2n..$(3n-1)
    in: 0/1 selected; $3n in: the running base (the next n-1 inputs are copies, unread). Per
    run of 32 * vec columns: one ballot an element slot, popc(mask & lanemask_lt) counts the
    lower lanes' selections, popc(mask) the run's total; then the in-lane prefix. Stable:
    positions follow the column order, exactly `cumsum(sel) - 1` of the scan path.
    """
    n = per_thread
    if n % vec:
        raise ValueError(f"ballot_asm: per_thread={n} is not a multiple of vec={vec}")
    lines = [
        "{",
        ".reg .pred %bp;",
        ".reg .b32 %blt, %bm, %bt, %blow, %btot, %bb, %bpos;",
        "mov.u32 %blt, %lanemask_lt;",
        f"mov.b32 %bb, ${3 * n};",
    ]
    for r in range(n // vec):
        lines += ["mov.b32 %blow, 0;", "mov.b32 %btot, 0;"]
        for j in range(vec):
            e = r * vec + j
            lines += [
                f"setp.ne.b32 %bp, ${2 * n + e}, 0;",
                "vote.sync.ballot.b32 %bm, %bp, 0xffffffff;",
                "popc.b32 %bt, %bm;",
                "add.u32 %btot, %btot, %bt;",
                "and.b32 %bt, %bm, %blt;",
                "popc.b32 %bt, %bt;",
                "add.u32 %blow, %blow, %bt;",
            ]
        lines.append("add.u32 %bpos, %bb, %blow;")
        for j in range(vec):
            e = r * vec + j
            lines += [
                f"setp.ne.b32 %bp, ${2 * n + e}, 0;",
                f"selp.b32 ${e}, %bpos, 2147483647, %bp;",
                f"add.u32 %bpos, %bpos, ${2 * n + e};",
            ]
        lines.append("add.u32 %bb, %bb, %btot;")
    lines += [f"mov.b32 ${n + e}, %bb;" for e in range(n)]
    lines.append("}")
    return "\n".join(lines)


def ballot_constraints(per_thread: int) -> str:
    """Constraints of `ballot_asm(per_thread)`: 2n int32 outputs, 2n int32 inputs."""
    n = per_thread
    return ",".join(["=r"] * (2 * n) + ["r"] * (2 * n))


# One asm per supported block (a one-warp program: BLOCK // 32 elements a lane).
_BALLOT_ASM_128 = tl.constexpr(ballot_asm(4))
_BALLOT_CONS_128 = tl.constexpr(ballot_constraints(4))
_BALLOT_ASM_256 = tl.constexpr(ballot_asm(8))
_BALLOT_CONS_256 = tl.constexpr(ballot_constraints(8))
_BALLOT_ASM_512 = tl.constexpr(ballot_asm(16))
_BALLOT_CONS_512 = tl.constexpr(ballot_constraints(16))
_BALLOT_ASM_1024 = tl.constexpr(ballot_asm(32))
_BALLOT_CONS_1024 = tl.constexpr(ballot_constraints(32))
BALLOT_BLOCKS = (128, 256, 512, 1024)


@triton.jit
def _store_i32_asm(ptrs, vals, mask):
    """`tl.store(ptrs, vals, mask=mask)` for int32 as inline PTX, one element an instance.

    An elementwise op keeps its operands' layout: a scattered `tl.store` makes Triton convert
    the pointers, values and mask to a one-element-a-lane layout through shared memory (three
    conversions a store in the compaction loop, ~40 instructions a lane and a barrier)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred %sp; setp.ne.b32 %sp, $3, 0; @%sp st.global.b32 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptrs, vals, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _ballot_positions(sel, base, BLOCK: tl.constexpr):
    """(exclusive position or INT32_MAX, new base) of each element of sel [1, BLOCK] (one warp).

    GPU only (inline PTX: warp ballots); `ballot_asm` has the layout it relies on."""
    s = sel.to(tl.int32)
    if BLOCK == 128:
        pos, nb = tl.inline_asm_elementwise(
            _BALLOT_ASM_128, _BALLOT_CONS_128, [s, base], dtype=(tl.int32, tl.int32),
            is_pure=False, pack=4,
        )  # fmt: skip
    elif BLOCK == 256:
        pos, nb = tl.inline_asm_elementwise(
            _BALLOT_ASM_256, _BALLOT_CONS_256, [s, base], dtype=(tl.int32, tl.int32),
            is_pure=False, pack=8,
        )  # fmt: skip
    elif BLOCK == 512:
        pos, nb = tl.inline_asm_elementwise(
            _BALLOT_ASM_512, _BALLOT_CONS_512, [s, base], dtype=(tl.int32, tl.int32),
            is_pure=False, pack=16,
        )  # fmt: skip
    else:
        tl.static_assert(BLOCK == 1024, "ballot compaction: BLOCK must be 128, 256, 512 or 1024")
        pos, nb = tl.inline_asm_elementwise(
            _BALLOT_ASM_1024, _BALLOT_CONS_1024, [s, base], dtype=(tl.int32, tl.int32),
            is_pure=False, pack=32,
        )  # fmt: skip
    return pos, nb


@dataclass(frozen=True)
class TopkConfig:
    """Launch parameters of the selection kernel and the order step.

    `kernel`: "cta" runs `rows_per_program` rows in a program of `num_warps` warps (every
    count and scan is CTA-wide, behind barriers); "warp" runs one row in a one-warp program
    (counts and scans are shuffles; ~11 programs an SM), with the same algorithm and output.
    `order`: "torch" sorts the staging rows with a stable torch.sort and gathers; "bitonic"
    sorts packed (key, index) int64 pairs with `tl.sort` in one Triton kernel of
    `order_warps` warps; "radix" sorts each row in one warp with a stable radix sort in inline
    PTX (`kernels.order.radix_order_asm`; GPU, staging rows of 32-2048: elsewhere the torch
    sort runs), its peers found with 8 ballots or `match.any` (`order_peers`). Every
    combination gives the same indices.
    """

    sample: int = 2048  # threshold sample size (power of two, >= 16): runs of 16 scores
    block: int = 2048  # scores per step of the compaction pass (power of two)
    cap_factor: int = 2  # candidate buffer = cap_factor * next_pow2(topk)
    min_cap: int = 16  # smallest candidate buffer
    ratio: float = 1.5  # aim: count(score >= T) ~= ratio * topk
    max_passes: int = 3
    rows_per_program: int = 1  # rows sharing one program (> 1 also vectorises the interpreter)
    num_warps: int = 8
    # k-th largest: 32 CTA-wide counts ("bitwise") or 8 16-bin histograms ("radix"). On the
    # H200 at S=64K the select kernel took 15.7 ms with bitwise, 26.7 ms with radix (203
    # registers a thread: one program per SM instead of two).
    select: Literal["radix", "bitwise"] = "bitwise"
    kernel: Literal["cta", "warp"] = "cta"
    order: Literal["torch", "bitonic", "radix"] = "torch"
    order_warps: int = 4
    # radix order: each lane's peers (same digit) from 8 ballots or from match.any, which was
    # slower on the H200 (0.86 against 0.68 ms for 16K rows of 2048, select probe 2026-12-03)
    order_peers: Literal["match", "ballot"] = "ballot"
    chunk: int = 512  # warp kernel: candidates a step of the staging write
    # warp kernel: register cap (ptxas takes all 255 of a one-warp program otherwise: 8 warps
    # an SM; 168 gives 12 without spills at block 512, chunk 512, topk 2048; sm_90 compile)
    warp_max_registers: int = 168
    # warp kernel, compaction pass: "ukey" maps every score to its uint32 key u before the
    # threshold test and stores u; "float" tests the float score against the threshold's float
    # (the same predicate: u is monotone and folds -0.0 like the float compare does) and stores
    # the raw bits, so u is made only for the <= CAP candidates (~6 fewer ops a score)
    compare: Literal["ukey", "float"] = "ukey"
    # warp kernel: issue the loads of compaction block i+1 before testing block i (one block of
    # scores in flight while the warp scans the other; 16 more registers a lane at block 512)
    prefetch: bool = False
    # warp kernel: compaction blocks inside every row's [ks, ke) load and test without range
    # masks (a uniform branch a block; with one row a program, all but a long row's two ends)
    interior: bool = False
    # warp kernel: steps 1-2 and step 3 as two launches (`_select_kernel`'s STAGE), the first
    # capped at `compact_max_registers` (more warps an SM for the compaction pass), the second
    # at `warp_max_registers`
    split: bool = False
    compact_max_registers: int = 96
    # warp kernel, compaction pass: the candidates' positions from a prefix sum over the block
    # ("scan") or from warp ballots ("ballot": inline PTX, GPU only, blocks of 128-1024; rows
    # that are not 16-aligned and the CPU interpreter run the scan: the same positions)
    compact: Literal["scan", "ballot"] = "scan"
    # warp kernel, exact select: stop the 32-round search at the first trial with exactly
    # min(topk, count) candidates at or above it (`_kth_largest_zeroed`'s EARLY; same winners)
    early_exit: bool = False

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
        if self.select not in _SELECTS:
            raise ValueError(
                f"TopkConfig.select={self.select!r}: must be one of {sorted(_SELECTS)}"
            )
        if self.max_passes < 1:
            raise ValueError(f"TopkConfig.max_passes={self.max_passes}: must be >= 1")
        if self.kernel not in _KERNELS:
            raise ValueError(f"TopkConfig.kernel={self.kernel!r}: must be one of {list(_KERNELS)}")
        if self.kernel == "warp" and self.select != "bitwise":
            raise ValueError(
                f"TopkConfig.select={self.select!r} with kernel='warp': the one-warp kernel "
                "selects bitwise only; use select='bitwise'"
            )
        if self.compare not in ("ukey", "float"):
            raise ValueError(f"TopkConfig.compare={self.compare!r}: must be 'ukey' or 'float'")
        if self.compact not in _COMPACTS:
            raise ValueError(
                f"TopkConfig.compact={self.compact!r}: must be one of {list(_COMPACTS)}"
            )
        if self.compact == "ballot" and self.block not in BALLOT_BLOCKS:
            raise ValueError(
                f"TopkConfig.block={self.block} with compact='ballot': the ballot compaction "
                f"takes blocks of {list(BALLOT_BLOCKS)}"
            )
        if self.compact == "ballot" and self.rows_per_program != 1:
            raise ValueError(
                f"TopkConfig.rows_per_program={self.rows_per_program} with compact='ballot': "
                "the ballot compaction runs one row a one-warp program"
            )
        warp_only = (
            self.compare != "ukey"
            or self.prefetch
            or self.interior
            or self.split
            or self.compact != "scan"
            or self.early_exit
        )
        if self.kernel != "warp" and warp_only:
            raise ValueError(
                f"TopkConfig.compare={self.compare!r}, prefetch={self.prefetch}, "
                f"interior={self.interior}, split={self.split}, compact={self.compact!r}, "
                f"early_exit={self.early_exit} with kernel={self.kernel!r}: the float compare, "
                "the prefetch, the interior path, the split, the ballot compaction and the early "
                "exit are one-warp kernel options; use kernel='warp'"
            )
        if not 24 <= self.compact_max_registers <= 255:
            raise ValueError(
                f"TopkConfig.compact_max_registers={self.compact_max_registers}: must lie in "
                "[24, 255]"
            )
        if self.order not in _ORDERS:
            raise ValueError(f"TopkConfig.order={self.order!r}: must be one of {list(_ORDERS)}")
        if not 24 <= self.warp_max_registers <= 255:
            raise ValueError(
                f"TopkConfig.warp_max_registers={self.warp_max_registers}: must lie in [24, 255]"
            )
        if self.order_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TopkConfig.order_warps={self.order_warps}: must be 1, 2, 4, 8 or 16")
        if self.order_peers not in ("match", "ballot"):
            raise ValueError(
                f"TopkConfig.order_peers={self.order_peers!r}: must be 'match' or 'ballot'"
            )

    def sizes(self, topk: int) -> tuple[int, int]:
        """(K2 = staging width, a power of two >= topk; CAP = candidate buffer per row)."""
        k2 = max(2, triton.next_power_of_2(topk))
        return k2, max(self.cap_factor * k2, self.min_cap)

    @property
    def label(self) -> str:
        """Short name for reports."""
        if self.kernel == "warp":
            head = f"warp block={self.block}"
            if self.compare == "float":
                head += " float"
            if self.prefetch:
                head += " prefetch"
            if self.interior:
                head += " interior"
            if self.split:
                head += f" split/{self.compact_max_registers}r"
            if self.compact == "ballot":
                head += " ballot"
            if self.early_exit:
                head += " early"
        else:
            head = f"{self.select} rows={self.rows_per_program} warps={self.num_warps} block={self.block}"
        order = {
            "bitonic": f"bitonic/{self.order_warps}w",
            "radix": "radix order" + (" (match.any peers)" if self.order_peers == "match" else ""),
        }.get(self.order, "torch sort")
        return f"{head} sample={self.sample}, {order}"


# The one-warp select with the stable torch sort: same indices as the CTA kernel (checked
# bitwise end to end), select 16.9 -> 10.4 ms and the whole 64K/H=64 call 57.4 -> 51.6 ms in
# the candidates run (benchmarks/RESULTS.md, "final candidates"; H100 SXM). Split in two
# launches since the H200 runs of 2026-12-03: the compaction capped at 96 registers, the exact
# select at 168; select 10.3 -> 9.1 ms at 64K/H=64 (8-11% at every row length in the select
# probe), same indices. Compaction positions from warp ballots since the afternoon H200 runs
# of 2026-12-03 (`compact="ballot"`, with the next block's loads issued before the current
# block is tested): select 9.2 -> 6.5 ms at 64K/H=64 (top-k sweep), faster at every row length
# of the select probe (1.13-2.33 against 1.19-3.87 ms for 16K rows of 8K-64K scores; slope
# 0.048 -> 0.022 ms per 1K scores a row), same staging rows; the scan split it replaced is
# `SCAN_TOPK_CONFIG`. The exact select stops its bitwise search early (`early_exit`): the
# probe's fixed part 0.87 -> 0.78 ms, 6.3 -> 6.1 ms at 64K/H=64, same indices.
ONE_LAUNCH_TOPK_CONFIG = TopkConfig(kernel="warp", block=512, chunk=512)
SCAN_TOPK_CONFIG = TopkConfig(
    kernel="warp", block=512, chunk=512, split=True, compact_max_registers=96
)
BALLOT_TOPK_CONFIG = dataclasses.replace(  # the fixed top-k before the radix order
    SCAN_TOPK_CONFIG, compact="ballot", prefetch=True, early_exit=True
)
FIXED_TOPK_CONFIG = dataclasses.replace(BALLOT_TOPK_CONFIG, order="radix")


@triton.jit
def _ukey(x):
    """uint32 key, monotone in float x, -0.0 folded onto +0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF) ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _ufloat(u):
    """The float whose `_ukey` is u (u below the key of -inf, e.g. 0 = "take all": -inf).

    x >= _ufloat(u) <=> _ukey(x) >= u for every non-NaN x: both orders are the float order
    with -0.0 == +0.0."""
    key = (u ^ 0x80000000).to(tl.int32, bitcast=True)
    f = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return tl.where((u >> 23) == 0, float("-inf"), f)


@triton.jit
def _kth_largest_bitwise(u, valid, k):
    """Per row, the k-th largest valid uint32 of u [ROWS, M]: the largest v with #(u >= v) >= k.

    32 dependent rounds, one CTA-wide count each (every trial is > 0, so invalid entries set to
    0 never count). k = 0 gives 0xffffffff.
    """
    u = tl.where(valid, u, 0)
    ans = (k * 0).to(tl.uint32)
    for b in range(32):
        trial = ans | (tl.full(ans.shape, 2147483648, tl.uint32) >> b)
        cnt = tl.sum((u >= trial[:, None]).to(tl.int32), axis=1)
        ans = tl.where(cnt >= k, trial, ans)
    return ans


@triton.jit
def _kth_largest_zeroed(u, k, EARLY: tl.constexpr = False):
    """`_kth_largest_bitwise` for u [ROWS, M] whose invalid entries are already 0 (no masked
    copy: half the registers for the one-warp kernel, which holds 128 keys a lane).

    EARLY (the exact select's use): stop at the first trial t with exactly k entries >= t and
    return t - 1 instead: then #(u > result) = k and no entry equals the result's successor
    range, so "all u > T*, then ties by index" picks the same k entries as with the exact
    k-th largest. Distinct random keys get there after ~20 of the 32 rounds (the rounds run
    until the trial separates the k-th largest from the (k+1)-th); a tie at the boundary runs
    all 32, as without EARLY."""
    ans = (k * 0).to(tl.uint32)
    if EARLY:
        done = k < 0  # per row: found a trial with exactly k entries at or above it
        b = 0
        while (b < 32) & (tl.min(done.to(tl.int32), axis=0) == 0):
            trial = ans | (tl.full(ans.shape, 2147483648, tl.uint32) >> b)
            cnt = tl.sum((u >= trial[:, None]).to(tl.int32), axis=1)
            up = (cnt >= k) & (done == 0)
            hit = up & (cnt == k)
            ans = tl.where(hit, trial - 1, tl.where(up, trial, ans))
            done = done | hit
            b += 1
    else:
        for b in range(32):
            trial = ans | (tl.full(ans.shape, 2147483648, tl.uint32) >> b)
            cnt = tl.sum((u >= trial[:, None]).to(tl.int32), axis=1)
            ans = tl.where(cnt >= k, trial, ans)
    return ans


@triton.jit
def _kth_largest(u, valid, k, ROWS: tl.constexpr, M: tl.constexpr, RADIX: tl.constexpr):
    """Per row, the k-th largest valid uint32 of u [ROWS, M] (RADIX: 1 radix, 0 bitwise)."""
    if RADIX:
        ans = _kth_largest_radix(u, valid, k, ROWS, M)
    else:
        ans = _kth_largest_bitwise(u, valid, k)
    return ans


@triton.jit
def _kth_largest_radix(u, valid, k, ROWS: tl.constexpr, M: tl.constexpr):
    """Per row, the k-th largest (k >= 1) valid uint32 of u [ROWS, M]: MSD radix select.

    Eight rounds of 4 bits: a 16-bin histogram of the next digit among the values that still
    match the prefix chosen so far (one `tl.histogram` per round, rows kept apart by offsetting
    their bins), then the digit whose suffix count reaches k. Eight dependent steps instead of
    the 32 CTA-wide reductions of a bitwise search. k = 0 gives 0xffffffff (nothing selected);
    callers never ask for more than the valid count.
    """
    ans = (k * 0).to(tl.uint32)
    rem = k
    live = valid
    rowbin = tl.arange(0, ROWS)[:, None] * 32
    d = tl.arange(0, 32)[None, :]
    for rd in tl.static_range(8):
        digit = ((u >> (28 - 4 * rd)) & 15).to(tl.int32)
        bins = tl.where(live, rowbin + digit, rowbin + 16)  # bin 16: no longer in the race
        hist = tl.reshape(tl.histogram(tl.reshape(bins, [ROWS * M]), ROWS * 32), [ROWS, 32])
        hist = tl.where(d < 16, hist, 0)
        ge = tl.sum(hist, axis=1)[:, None] - (tl.cumsum(hist, axis=1) - hist)  # count(digit >= d)
        dig = tl.max(tl.where((ge >= rem[:, None]) & (d < 16), d, 0), axis=1)
        rem -= tl.sum(tl.where(d > dig[:, None], hist, 0), axis=1)
        ans = ans | (dig.to(tl.uint32) << (28 - 4 * rd))
        live = live & (digit == dig[:, None])
    return ans


@triton.jit
def _load_block(row_base, s0, ks, ke, todo, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Scores [ROWS, BLOCK] at columns s0 + [0, BLOCK) of the rows `todo` (0.0 elsewhere).

    ALIGNED = 1 (rows 16-float aligned and readable up to ke rounded up to 16): masked per 16
    scores, so the loads compile to 16-byte vectors; scores outside [ks, ke) are read, and the
    caller never selects them."""
    offs = s0 + tl.arange(0, BLOCK)[None, :]
    if ALIGNED:
        lmask = (offs >= (ks[:, None] // 16) * 16) & (offs < ((ke + 15) // 16 * 16)[:, None])
    else:
        lmask = (offs >= ks[:, None]) & (offs < ke[:, None])
    return tl.load(row_base[:, None] + offs, mask=lmask & todo[:, None], other=0.0)


@triton.jit
def _load_any_block(
    row_base, s0, ks, ke, todo, in_lo, in_hi,
    BLOCK: tl.constexpr, ALIGNED: tl.constexpr, INTERIOR: tl.constexpr,
):  # fmt: skip
    """`_load_block`; with INTERIOR, unmasked when the block lies inside every row's [ks, ke)
    (in_lo = max ks <= s0 and s0 + BLOCK <= in_hi = min ke)."""
    if INTERIOR:
        if (s0 >= in_lo) & (s0 + BLOCK <= in_hi):
            x = tl.load(row_base[:, None] + s0 + tl.arange(0, BLOCK)[None, :])
        else:
            x = _load_block(row_base, s0, ks, ke, todo, BLOCK, ALIGNED)
    else:
        x = _load_block(row_base, s0, ks, ke, todo, BLOCK, ALIGNED)
    return x


@triton.jit
def _in_range(
    above, s0, ks, ke, todo, in_lo, in_hi, BLOCK: tl.constexpr, INTERIOR: tl.constexpr
):  # fmt: skip
    """above & (the column is in its row's [ks, ke) and the row is todo); with INTERIOR the
    masks are skipped for a block inside every row's range."""
    offs = s0 + tl.arange(0, BLOCK)[None, :]
    if INTERIOR:
        if (s0 >= in_lo) & (s0 + BLOCK <= in_hi):
            sel = above
        else:
            sel = above & (offs >= ks[:, None]) & (offs < ke[:, None]) & todo[:, None]
    else:
        sel = above & (offs >= ks[:, None]) & (offs < ke[:, None]) & todo[:, None]
    return sel


@triton.jit
def _compact_pass(
    row_base,
    cand,
    ks,
    ke,
    thr,
    todo,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRS: tl.constexpr,
    ALIGNED: tl.constexpr,
    RAW: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    INTERIOR: tl.constexpr = False,
    BALLOT: tl.constexpr = False,
):
    """Rows in `todo`: write every u >= thr with its index to cand, in index order; count them.

    PAIRS = 0: one int64 (u << 32 | index) a candidate, cand rows CAP long; PAIRS = 1: int32 u
    (RAW: the score's raw bits instead, tested as float >= `_ufloat(thr)`) at [0, CAP) and
    int32 index at [CAP, 2 CAP) of cand rows 2 CAP long. PREFETCH: block i+1's loads are
    issued before block i is tested (carried in registers). INTERIOR: a block inside every
    row's [ks, ke) (most of a long row) is loaded and tested without range masks (a uniform
    branch). See `_load_block` for ALIGNED. BALLOT (one row of one warp, GPU only): the
    positions come from warp ballots (`_ballot_positions`) instead of a prefix sum over the
    block, and the running count stays a per-element vector: the same positions, ~8
    instructions an element instead of a shared-memory scan behind barriers.
    """
    count = ks * 0
    if BALLOT:
        base = tl.zeros([1, BLOCK], tl.int32)
    lo = tl.min(tl.where(todo, ks, 2147483647), axis=0)
    hi = tl.max(tl.where(todo, ke, 0), axis=0)
    # blocks [s0, s0 + BLOCK) with in_lo <= s0 and s0 + BLOCK <= in_hi are inside every row
    in_lo = tl.max(tl.where(todo, ks, 0), axis=0)
    in_hi = tl.min(tl.where(todo, ke, 0), axis=0)  # 0 (no block) unless every row is todo
    start = (lo // 16) * 16
    if RAW:
        tf = _ufloat(thr)
    if PREFETCH:
        x_next = _load_any_block(
            row_base, start, ks, ke, todo, in_lo, in_hi, BLOCK, ALIGNED, INTERIOR
        )
    for s0 in range(start, hi, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)[None, :]
        if PREFETCH:
            x = x_next
            x_next = _load_any_block(
                row_base, s0 + BLOCK, ks, ke, todo, in_lo, in_hi, BLOCK, ALIGNED, INTERIOR
            )
        else:
            x = _load_any_block(row_base, s0, ks, ke, todo, in_lo, in_hi, BLOCK, ALIGNED, INTERIOR)
        if RAW:
            above = x >= tf[:, None]
        else:
            u = _ukey(x)
            above = u >= thr[:, None]
        sel = _in_range(above, s0, ks, ke, todo, in_lo, in_hi, BLOCK, INTERIOR)
        if BALLOT:
            pos, base = _ballot_positions(sel, base, BLOCK)
            keep = pos < CAP
        else:
            pos = count[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
            keep = sel & (pos < CAP)
        if BALLOT:
            if RAW:
                _store_i32_asm(cand[:, None] + pos, x.to(tl.int32, bitcast=True), keep)
            else:
                _store_i32_asm(cand[:, None] + pos, u.to(tl.int32, bitcast=True), keep)
            _store_i32_asm(cand[:, None] + CAP + pos, offs, keep)
        elif PAIRS:
            if RAW:
                tl.store(cand[:, None] + pos, x.to(tl.int32, bitcast=True), mask=keep)
            else:
                tl.store(cand[:, None] + pos, u.to(tl.int32, bitcast=True), mask=keep)
            tl.store(cand[:, None] + CAP + pos, offs, mask=keep)
        else:
            packed = (u.to(tl.int64) << 32) | offs.to(tl.int64)
            tl.store(cand[:, None] + pos, packed, mask=keep)
        if not BALLOT:
            count += tl.sum(sel.to(tl.int32), axis=1)
    if BALLOT:
        count = tl.max(base, axis=1)
    return count


@triton.jit
def _sample_keys(row_base, ks, n, CAP: tl.constexpr, SAMPLE: tl.constexpr, PAIRS: tl.constexpr):
    """Keys of SAMPLE // 16 evenly spaced runs of 16 scores of each row with n > CAP, and
    which are real; PAIRS: the others are 0 (below every real key, never counted)."""
    si = tl.arange(0, SAMPLE)[None, :]
    spos = (
        ks[:, None]
        + ((si // 16).to(tl.int64) * n[:, None] // (SAMPLE // 16)).to(tl.int32)
        + si % 16
    )
    sok = (si >= 0) & (n[:, None] > CAP)
    # a run may start within 15 of the row's end when n < 16 * (SAMPLE // 16) (small CAP):
    # keep every read inside [ks, ke)
    spos = tl.minimum(spos, ks[:, None] + n[:, None] - 1)
    samp = _ukey(tl.load(row_base[:, None] + spos, mask=sok, other=0.0))
    if PAIRS:
        samp = tl.where(sok, samp, 0)
    return samp, sok


@triton.jit
def _threshold_and_compact(
    row_base,
    cand,
    ks,
    n,
    live,
    topk,
    target,
    ROWS: tl.constexpr,
    CAP: tl.constexpr,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_PASSES: tl.constexpr,
    RADIX: tl.constexpr,
    PAIRS: tl.constexpr,
    ALIGNED: tl.constexpr,
    RAW: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    INTERIOR: tl.constexpr = False,
    RELOAD: tl.constexpr = False,
    BALLOT: tl.constexpr = False,
):
    """Steps 1-2 for the rows `live`: (count of candidates written, ok = count in [need, CAP]).

    RELOAD (one-warp kernel only): the threshold sample is re-read from the scores at every
    pass instead of staying in registers through the compaction (64 registers a lane fewer
    there, for the split kernel's higher occupancy)."""
    ke = ks + n
    # 1. threshold candidates: SAMPLE // 16 evenly spaced runs of 16 scores of each long row
    #    (runs, not single scores: 64-byte reads instead of a 32-byte sector per 4-byte score)
    if not RELOAD:
        samp, sok = _sample_keys(row_base, ks, n, CAP, SAMPLE, PAIRS)
    rank = tl.minimum(tl.maximum(tl.cdiv(target * SAMPLE, tl.maximum(n, 1)) - 1, 0), SAMPLE - 1)

    # 2. compaction passes (rows with n <= CAP take everything); re-rank the rows that miss
    need = tl.minimum(n, topk)
    count = n * 0
    lo_r = n * 0
    hi_r = lo_r + (SAMPLE - 1)
    todo = live & (n > 0)
    ok = live & (n <= 0)
    for _ in range(MAX_PASSES):
        if tl.max(todo.to(tl.int32), axis=0) > 0:
            if RELOAD:
                samp, sok = _sample_keys(row_base, ks, n, CAP, SAMPLE, PAIRS)
            if PAIRS:
                thr = tl.where(n <= CAP, 0, _kth_largest_zeroed(samp, rank + 1))
            else:
                thr = tl.where(n <= CAP, 0, _kth_largest(samp, sok, rank + 1, ROWS, SAMPLE, RADIX))
            got = _compact_pass(
                row_base, cand, ks, ke, thr, todo, CAP, BLOCK, PAIRS, ALIGNED, RAW, PREFETCH,
                INTERIOR, BALLOT,
            )  # fmt: skip
            count = tl.where(todo, got, count)
            hit = todo & (got >= need) & (got <= CAP)
            ok = ok | hit
            # bracket the rank (too many -> below it, too few -> above it), then scale it by
            # target / count inside the bracket; an empty bracket gives up on the row
            lo_r = tl.where(todo & (got < need), rank + 1, lo_r)
            hi_r = tl.where(todo & (got > CAP), rank - 1, hi_r)
            est = tl.cdiv((rank + 1) * target, tl.maximum(got, 1)) - 1
            todo = todo & (hit == 0) & (lo_r <= hi_r)
            rank = tl.where(todo, tl.minimum(tl.maximum(est, lo_r), hi_r), rank)
    return count, ok


@triton.jit(do_not_specialize=["col0", "row0", "n_rows", "sentinel", "topk", "target"])
def _select_kernel(
    logits_ptr,
    stride_l,
    col0,
    ks_ptr,
    ke_ptr,
    row0,
    n_rows,
    cand_ptr,
    skey_ptr,
    sidx_ptr,
    status_ptr,
    sentinel,
    topk,
    target,
    ROWS: tl.constexpr,
    K2: tl.constexpr,
    CAP: tl.constexpr,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_PASSES: tl.constexpr,
    RADIX: tl.constexpr,
    WARP: tl.constexpr = False,
    CHUNK: tl.constexpr = 16,
    ALIGNED: tl.constexpr = False,
    RAW: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    INTERIOR: tl.constexpr = False,
    STAGE: tl.constexpr = 0,
    count_ptr=None,
    BALLOT: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    BALLOT_STAGING: tl.constexpr = False,
):
    """Steps 1-3 for ROWS rows a program.

    WARP = False (TopkConfig.kernel="cta"): every count and scan is CTA-wide; candidates are
    int64 (u << 32 | index). WARP = True ("warp", launched as one-warp programs of one row):
    the same algorithm and output, but every count and scan is in-register work plus five
    shuffles, no barrier, and ~12 programs share an SM (vs 2 of 8 warps), so the 64 dependent
    counts of a row overlap with other rows' instead of serialising behind CTA barriers.
    Candidates are int32 pairs (u at [0, CAP), index at [CAP, 2 CAP) of 2 CAP-long rows); only
    the select holds all CAP keys in registers (128 a lane at topk 2048), the staging write
    re-reads them CHUNK at a time. ALIGNED (the indexer's chunks: col0, the row stride and
    the row width multiples of 16) passes col0 / 16, so that Triton proves row starts 16-float
    aligned, and masks the compaction loads per 16 scores: 16-byte vector loads. ROWS > 1
    with WARP only vectorises the CPU interpreter (tests). RAW, PREFETCH, INTERIOR (WARP
    only): `TopkConfig.compare == "float"`, `.prefetch`, `.interior`; see `_compact_pass`.
    STAGE (`TopkConfig.split`): 0 runs steps 1-3; 1 runs steps 1-2 (the threshold sample
    re-read every pass) and writes each row's candidate count to count_ptr; 2 runs step 3 from
    the counts and flags stage 1 wrote. Each stage is its own launch with its own register
    cap: the compaction pass needs few registers and wants many warps an SM, the exact select
    holds CAP keys a row (128 registers a lane at topk 2048).
    """
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # chunk-local rows
    live = r < n_rows
    cand = cand_ptr + r.to(tl.int64) * (2 * CAP if WARP else CAP)
    if STAGE == 2:
        count = tl.load(count_ptr + r, mask=live, other=0)
        ok = tl.load(status_ptr + r, mask=live, other=1) == 0
    else:
        ks = tl.load(ks_ptr + row0 + r, mask=live, other=0)
        ke = tl.maximum(tl.load(ke_ptr + row0 + r, mask=live, other=0), ks)
        n = ke - ks
        row_base = logits_ptr + r.to(tl.int64) * stride_l - col0 * (16 if ALIGNED else 1)
        count, ok = _threshold_and_compact(
            row_base, cand, ks, n, live, topk, target, ROWS, CAP, SAMPLE, BLOCK, MAX_PASSES,
            RADIX, WARP, ALIGNED, RAW, PREFETCH, INTERIOR, STAGE == 1, BALLOT,
        )  # fmt: skip
        tl.store(status_ptr + r, 1 - ok.to(tl.int32), mask=live)
        if STAGE == 1:
            tl.store(count_ptr + r, count, mask=live)
    if STAGE != 1:
        _finish_rows(
            cand, count, ok, live, r, topk, skey_ptr, sidx_ptr, sentinel, K2, ROWS, CAP,
            RADIX, WARP, CHUNK, RAW, BALLOT_STAGING, EARLY,
        )  # fmt: skip


@triton.jit
def _finish_rows(
    cand, count, ok, live, r, topk, skey_ptr, sidx_ptr, sentinel,
    K2: tl.constexpr, ROWS: tl.constexpr, CAP: tl.constexpr, RADIX: tl.constexpr,
    WARP: tl.constexpr, CHUNK: tl.constexpr, RAW: tl.constexpr, BALLOT: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):  # fmt: skip
    """Step 3 and the padding of the staging rows."""
    tl.debug_barrier()  # candidates written by other threads of this program
    srow = r.to(tl.int64)[:, None] * K2
    if WARP:
        take = _exact_select_pairs(
            cand, count, ok, topk, skey_ptr, sidx_ptr, srow, CAP, CHUNK, RAW, BALLOT, EARLY
        )
    else:
        take = _exact_select_packed(
            cand, count, ok, topk, skey_ptr, sidx_ptr, srow, ROWS, CAP, RADIX
        )
    slot = tl.arange(0, K2)[None, :]
    pad = (slot >= take[:, None]) & live[:, None]
    tl.store(skey_ptr + srow + slot, tl.full(slot.shape, -2147483648, tl.int32), mask=pad)
    tl.store(sidx_ptr + srow + slot, tl.zeros(slot.shape, tl.int32) + sentinel, mask=pad)


@triton.jit
def _exact_select_packed(
    cand, count, ok, topk, skey_ptr, sidx_ptr, srow,
    ROWS: tl.constexpr, CAP: tl.constexpr, RADIX: tl.constexpr,
):  # fmt: skip
    """Step 3 on int64 candidates: all u > T*, then the lowest-index u == T*, min(topk, count)
    in all, written in index order to the staging rows; returns how many."""
    ci = tl.arange(0, CAP)[None, :]
    valid = (ci < count[:, None]) & ok[:, None]
    c64 = tl.load(cand[:, None] + ci, mask=valid, other=0)
    cu = (c64 >> 32).to(tl.uint32)
    cidx = (c64 & 0xFFFFFFFF).to(tl.int32)
    take = tl.where(ok, tl.minimum(count, topk), 0)
    tstar = _kth_largest(cu, valid, take, ROWS, CAP, RADIX)
    gt = valid & (cu > tstar[:, None])
    eq = valid & (cu == tstar[:, None])
    room = take - tl.sum(gt.to(tl.int32), axis=1)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=1) <= room[:, None]))
    pos = tl.cumsum(sel.to(tl.int32), axis=1) - 1
    key32 = (cu ^ 0x80000000).to(tl.int32, bitcast=True)
    tl.store(skey_ptr + srow + pos, key32, mask=sel)
    tl.store(sidx_ptr + srow + pos, cidx, mask=sel)
    return take


@triton.jit
def _exact_select_pairs(
    cand, count, ok, topk, skey_ptr, sidx_ptr, srow,
    CAP: tl.constexpr, CHUNK: tl.constexpr, RAW: tl.constexpr = False,
    BALLOT: tl.constexpr = False, EARLY: tl.constexpr = False,
):  # fmt: skip
    """Step 3 on int32 pair candidates (the one-warp kernel): the select over all CAP keys in
    registers (zero-filled, no masked copy), then the staging write CHUNK candidates a step.
    RAW: the candidates hold raw score bits, mapped to their keys here. BALLOT (GPU, one row):
    the candidate rows are read whole (16-byte vectors; slots past the count are zeroed after
    the load, never used), and the tie ranks and staging positions come from warp ballots
    (`_ballot_positions`) with inline-PTX stores: the same staging rows."""
    have = tl.where(ok, count, 0)
    ci = tl.arange(0, CAP)[None, :]
    cu = _cand_keys(cand[:, None] + ci, ci < have[:, None], RAW, BALLOT)
    take = tl.minimum(have, topk)
    # empty slots hold 0, below every real key; EARLY may return a T* below the k-th largest
    # with exactly `take` keys above it (room 0): the same winners
    tstar = _kth_largest_zeroed(cu, take, EARLY)
    room = take - tl.sum((cu > tstar[:, None]).to(tl.int32), axis=1)
    written = take * 0
    eq_seen = take * 0
    if BALLOT:
        written_v = tl.zeros([1, CHUNK], tl.int32)
        eq_v = tl.zeros([1, CHUNK], tl.int32)
    for c0 in range(0, tl.max(have, axis=0), CHUNK):
        cj = c0 + tl.arange(0, CHUNK)[None, :]
        v = cj < have[:, None]
        c_u = _cand_keys(cand[:, None] + cj, v, RAW, BALLOT)
        gt = v & (c_u > tstar[:, None])
        eq = v & (c_u == tstar[:, None])
        key32 = (c_u ^ 0x80000000).to(tl.int32, bitcast=True)
        if BALLOT:
            c_i = tl.load(cand[:, None] + CAP + cj)
            eq_pos, eq_v = _ballot_positions(eq, eq_v, CHUNK)  # INT32_MAX where not eq
            sel = gt | (eq_pos < room[:, None])
            pos, written_v = _ballot_positions(sel, written_v, CHUNK)
            _store_i32_asm(skey_ptr + srow + pos, key32, sel)
            _store_i32_asm(sidx_ptr + srow + pos, c_i, sel)
        else:
            c_i = tl.load(cand[:, None] + CAP + cj, mask=v, other=0)
            eq_rank = eq_seen[:, None] + tl.cumsum(eq.to(tl.int32), axis=1)
            sel = gt | (eq & (eq_rank <= room[:, None]))
            pos = written[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
            tl.store(skey_ptr + srow + pos, key32, mask=sel)
            tl.store(sidx_ptr + srow + pos, c_i, mask=sel)
            written += tl.sum(sel.to(tl.int32), axis=1)
            eq_seen += tl.sum(eq.to(tl.int32), axis=1)
    return take


@triton.jit
def _cand_keys(ptrs, valid, RAW: tl.constexpr, WHOLE: tl.constexpr = False):
    """uint32 keys of the candidates at `ptrs` (0 where not valid: below every real key).

    WHOLE: load every slot (all lie inside the candidate row) and zero the invalid ones
    afterwards, so that the load compiles to 16-byte vectors."""
    if WHOLE:
        c = tl.where(valid, tl.load(ptrs), 0)
    else:
        c = tl.load(ptrs, mask=valid, other=0)
    if RAW:
        cu = tl.where(valid, _ukey(c.to(tl.float32, bitcast=True)), 0)
    else:
        cu = c.to(tl.uint32, bitcast=True)
    return cu


@dataclass
class TopkWorkspace:
    """Buffers for up to `rows` rows of one chunk (reused across chunks)."""

    cand: torch.Tensor  # [rows * CAP] int64 (the warp kernel: [rows, 2 CAP] int32 pairs)
    skey: torch.Tensor  # [rows, K2] int32
    sidx: torch.Tensor  # [rows, K2] int32
    status: torch.Tensor  # [rows] int32
    count: torch.Tensor  # [rows] int32: candidates a row (between the split kernel's launches)

    @classmethod
    def allocate(
        cls, rows: int, topk: int, config: TopkConfig, device: torch.device
    ) -> TopkWorkspace:
        k2, cap = config.sizes(topk)
        return cls(
            cand=torch.empty(rows * cap, dtype=torch.int64, device=device),
            skey=torch.empty((rows, k2), dtype=torch.int32, device=device),
            sidx=torch.empty((rows, k2), dtype=torch.int32, device=device),
            status=torch.empty(rows, dtype=torch.int32, device=device),
            count=torch.empty(rows, dtype=torch.int32, device=device),
        )

    def with_status(self, status: torch.Tensor) -> TopkWorkspace:
        """The same buffers, flags written to `status` (e.g. a slice of a per-call array)."""
        return dataclasses.replace(self, status=status)

    @staticmethod
    def bytes_per_row(topk: int, config: TopkConfig) -> int:
        """Workspace bytes per row, sort temporaries included (values + int64 indices)."""
        k2, cap = config.sizes(topk)
        return 8 * cap + 8 * k2 + 12 * k2 + 8


def _use_ballot(config: TopkConfig, aligned: bool) -> bool:
    """Whether the compaction takes its positions from warp ballots.

    `compact="ballot"` on the GPU, for 16-aligned rows (the indexer's chunks always are): the
    asm relies on the 4-score runs a lane that 16-byte vector loads give (`ballot_asm`).
    Unaligned rows and Triton's CPU interpreter (no inline PTX) run the prefix sum, which
    gives the same positions."""
    return config.compact == "ballot" and aligned and not interpreting()


def launch_select(
    logits: torch.Tensor,
    col0: int,
    ks: torch.Tensor,
    ke: torch.Tensor,
    ws: TopkWorkspace,
    *,
    topk: int,
    row0: int,
    n_rows: int,
    sentinel: int,
    config: TopkConfig = FIXED_TOPK_CONFIG,
) -> None:
    """Steps 1-3 for chunk rows [row0, row0 + n_rows): logits row i is query row0 + i."""
    k2, cap = config.sizes(topk)
    if n_rows <= 0:
        return
    target = round(config.ratio * topk)
    if config.kernel == "warp":
        aligned = col0 % 16 == 0 and logits.stride(0) % 16 == 0 and logits.shape[1] % 16 == 0
        rows = config.rows_per_program
        grid = (triton.cdiv(n_rows, rows),)
        args = (
            logits, logits.stride(0), col0 // 16 if aligned else col0, ks, ke, row0, n_rows,
            ws.cand.view(torch.int32), ws.skey, ws.sidx, ws.status, sentinel, topk, target,
        )  # fmt: skip
        chunk = min(cap, config.chunk)
        ballot = _use_ballot(config, aligned)
        meta = dict(
            ROWS=rows, K2=k2, CAP=cap, SAMPLE=config.sample, BLOCK=config.block,
            MAX_PASSES=config.max_passes, RADIX=0, WARP=True, CHUNK=chunk,
            ALIGNED=aligned, RAW=config.compare == "float", PREFETCH=config.prefetch,
            INTERIOR=config.interior, BALLOT=ballot, EARLY=config.early_exit,
            # the staging write's ballots take CHUNK-wide steps: 128-1024 (a small topk's
            # candidate buffer, CAP < 128, is written with the prefix sum)
            BALLOT_STAGING=ballot and chunk in BALLOT_BLOCKS, num_warps=1,
        )  # fmt: skip
        if not config.split:
            _select_kernel[grid](*args, **meta, maxnreg=config.warp_max_registers)
            return
        for stage, regs in ((1, config.compact_max_registers), (2, config.warp_max_registers)):
            _select_kernel[grid](*args, **meta, STAGE=stage, count_ptr=ws.count, maxnreg=regs)
        return
    rows = config.rows_per_program
    _select_kernel[(triton.cdiv(n_rows, rows),)](
        logits, logits.stride(0), col0, ks, ke, row0, n_rows,
        ws.cand, ws.skey, ws.sidx, ws.status, sentinel, topk, target,
        ROWS=rows, K2=k2, CAP=cap, SAMPLE=config.sample, BLOCK=config.block,
        MAX_PASSES=config.max_passes, RADIX=_SELECTS[config.select], num_warps=config.num_warps,
    )  # fmt: skip


def packed_keys_torch(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 sort key: larger = earlier in the output (score, then lower index); -0.0 == +0.0."""
    v = torch.where(values == 0, torch.zeros_like(values), values.float())
    b = v.view(torch.int32)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (key.to(torch.int64) << 32) | (IDX_MAX - index.to(torch.int64))


def topk_rows_torch(
    logits: torch.Tensor, col0: int, ks: torch.Tensor, ke: torch.Tensor, topk: int, sentinel: int
) -> torch.Tensor:
    """Exact top-k of rows logits[i, ks[i]-col0 : ke[i]-col0] under the contract; [rows, topk] int32."""
    rows = logits.shape[0]
    out = torch.full((rows, topk), sentinel, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    lo = int(ks.min())
    hi = max(int(ke.max()), lo)
    if hi == lo:
        return out
    cols = torch.arange(lo, hi, device=logits.device)
    inr = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    keys = packed_keys_torch(logits[:, lo - col0 : hi - col0], cols.expand(rows, -1))
    keys = torch.where(inr, keys, torch.full_like(keys, torch.iinfo(torch.int64).min))
    m = min(topk, hi - lo)
    top = torch.sort(keys, dim=1, descending=True).values[:, :m]
    idx = (IDX_MAX - (top & 0xFFFFFFFF)).to(torch.int32)
    n = (ke.long() - ks.long()).clamp_min(0)
    valid = torch.arange(m, device=logits.device)[None, :] < n[:, None]
    out[:, :m] = torch.where(valid, idx, torch.full_like(idx, sentinel))
    return out
