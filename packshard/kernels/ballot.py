"""Warp-ballot compaction in inline PTX: stable positions of the selected elements of a block.

The one-warp select (`kernels.select_kernel`) writes its candidates, and later its winners, at
positions `base + #(selected elements before this one)`. Triton computes such positions with
a prefix sum (`tl.cumsum`), which for a one-warp block goes through shared memory behind
barriers. Here each lane asks the warp: one `vote.sync.ballot` an element slot gives the mask
of lanes whose element is selected, `popc(mask & lanemask_lt)` the count below this lane,
`popc(mask)` the run's total: ~8 instructions an element, no shared memory, no barrier, and
the same positions as `cumsum(sel) - 1`. On the H200 the select takes 6.4 ms at S = 64K,
H = 64 with ballots (and the next block's loads issued early) against 9.2 ms with the prefix
sum; 1.13-2.33 ms against 1.19-3.87 ms for 16K rows of 8K-64K scores.

GPU only (the CPU interpreter has no inline PTX: the select runs the prefix sum there, which
gives the same positions). tests/kernels/test_ballot.py runs this PTX on the CPU with a small
warp executor (tests/kernels/_ptx.py); tests/kernels/test_gpu.py pins it on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
