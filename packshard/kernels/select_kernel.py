"""The top-k's select: per row, the min(topk, n) best keys in index order, in two launches.

Scores are compared as `u = key32 ^ 0x80000000` read as uint32, where
`key32 = bits ^ ((bits >> 31) & 0x7fffffff)` (bits of the score with -0.0 folded onto +0.0):
u is monotone in the score, so "k-th largest" is an integer question with an exact answer.

One row a one-warp program (`TopkConfig.rows_per_program` > 1 only vectorises the CPU
interpreter). Launch 1 (`STAGE=1`, capped at `TopkConfig.compact_max_registers`):
1. Threshold: SAMPLE scores in evenly spaced runs of 16 (64-byte reads instead of a 32-byte
   sector a score); T = the sample's r-th largest by a 32-round bitwise search
   (`_kth_largest_zeroed`), r chosen so that about `ratio * topk` of the row's n scores are
   >= T. Rows with n <= CAP take T = 0 (everything).
2. One pass over the row writes every (u, index) with u >= T, in index order, to the row's
   candidate buffer (int32 keys at [0, CAP), int32 indices at [CAP, 2 CAP)) and counts them;
   block i+1's loads are issued before block i is tested. A count outside [min(topk, n), CAP]
   re-ranks r from the count inside a bracket of ranks already tried and passes again (at
   most MAX_PASSES); a row that still misses is flagged in `status`.
Launch 2 (`STAGE=2`, capped at `TopkConfig.warp_max_registers`):
3. Exact select among the <= CAP candidates: T* = the min(topk, count)-th largest u, the
   search stopping at the first trial with exactly that many keys at or above it; keep all
   u > T* and the lowest-index u == T* until min(topk, count) are kept; write them, still in
   index order, to a [rows, K2] staging pair (key32, index), padded with (INT32_MIN, sentinel).
The compaction pass needs few registers and wants many warps an SM; the exact select holds all
CAP keys in registers (128 a lane at topk 2048): each launch has its own register cap.

Positions (step 2's compaction, step 3's tie ranks and staging write) come from warp ballots
(`kernels.ballot`; GPU, 16-aligned rows) or from a prefix sum (the CPU interpreter and rows
that are not 16-aligned): the same positions. No atomics and no data-dependent reduction
order, so the output is a pure function of the scores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from packshard.kernels.ballot import _ballot_positions, _store_i32_asm


@triton.jit
def _ukey(x):
    """uint32 key, monotone in float x, -0.0 folded onto +0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF) ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _kth_largest_zeroed(u, k, EARLY: tl.constexpr = False):
    """Per row, the k-th largest uint32 of u [ROWS, M] whose invalid entries are 0 (they never
    count: every trial is > 0): the largest v with #(u >= v) >= k, by 32 dependent rounds of
    one count each. k = 0 gives 0xffffffff. No masked copy: half the registers for the
    one-warp kernel, which holds 128 keys a lane.

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
def _in_range(above, s0, ks, ke, todo, BLOCK: tl.constexpr):
    """above & (the column is in its row's [ks, ke) and the row is todo)."""
    offs = s0 + tl.arange(0, BLOCK)[None, :]
    return above & (offs >= ks[:, None]) & (offs < ke[:, None]) & todo[:, None]


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
    ALIGNED: tl.constexpr,
    BALLOT: tl.constexpr = False,
):
    """Rows in `todo`: write every u >= thr with its index to cand, in index order; count them.

    cand rows are 2 CAP long: int32 u at [0, CAP), int32 index at [CAP, 2 CAP). Block i+1's
    loads are issued before block i is tested (one block of scores in flight while the warp
    scans the other, carried in registers). See `_load_block` for ALIGNED. BALLOT (one row of
    one warp, GPU only): the positions come from warp ballots (`_ballot_positions`) instead of
    a prefix sum over the block, and the running count stays a per-element vector: the same
    positions, ~8 instructions an element instead of a shared-memory scan behind barriers.
    """
    count = ks * 0
    if BALLOT:
        base = tl.zeros([1, BLOCK], tl.int32)
    lo = tl.min(tl.where(todo, ks, 2147483647), axis=0)
    hi = tl.max(tl.where(todo, ke, 0), axis=0)
    start = (lo // 16) * 16
    x_next = _load_block(row_base, start, ks, ke, todo, BLOCK, ALIGNED)
    for s0 in range(start, hi, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)[None, :]
        x = x_next
        x_next = _load_block(row_base, s0 + BLOCK, ks, ke, todo, BLOCK, ALIGNED)
        u = _ukey(x)
        above = u >= thr[:, None]
        sel = _in_range(above, s0, ks, ke, todo, BLOCK)
        if BALLOT:
            pos, base = _ballot_positions(sel, base, BLOCK)
            keep = pos < CAP
            _store_i32_asm(cand[:, None] + pos, u.to(tl.int32, bitcast=True), keep)
            _store_i32_asm(cand[:, None] + CAP + pos, offs, keep)
        else:
            pos = count[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
            keep = sel & (pos < CAP)
            tl.store(cand[:, None] + pos, u.to(tl.int32, bitcast=True), mask=keep)
            tl.store(cand[:, None] + CAP + pos, offs, mask=keep)
            count += tl.sum(sel.to(tl.int32), axis=1)
    if BALLOT:
        count = tl.max(base, axis=1)
    return count


@triton.jit
def _sample_keys(row_base, ks, n, CAP: tl.constexpr, SAMPLE: tl.constexpr):
    """Keys of SAMPLE // 16 evenly spaced runs of 16 scores of each row with n > CAP; 0 for
    the others (below every real key, never counted)."""
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
    return tl.where(sok, samp, 0)


@triton.jit
def _threshold_and_compact(
    row_base,
    cand,
    ks,
    n,
    live,
    topk,
    target,
    CAP: tl.constexpr,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_PASSES: tl.constexpr,
    ALIGNED: tl.constexpr,
    BALLOT: tl.constexpr = False,
):
    """Steps 1-2 for the rows `live`: (count of candidates written, ok = count in [need, CAP]).

    The threshold sample is re-read from the scores at every pass instead of staying in
    registers through the compaction: 64 registers a lane fewer there, for more warps an SM."""
    ke = ks + n
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
            # 1. the threshold from SAMPLE // 16 runs of 16 scores of each long row
            samp = _sample_keys(row_base, ks, n, CAP, SAMPLE)
            thr = tl.where(n <= CAP, 0, _kth_largest_zeroed(samp, rank + 1))
            got = _compact_pass(row_base, cand, ks, ke, thr, todo, CAP, BLOCK, ALIGNED, BALLOT)
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
    CHUNK: tl.constexpr,
    ALIGNED: tl.constexpr,
    STAGE: tl.constexpr,
    count_ptr,
    BALLOT: tl.constexpr,
    BALLOT_STAGING: tl.constexpr,
):
    """STAGE 1: steps 1-2 for ROWS rows a program, each row's candidate count to count_ptr and
    its flag (1: the count missed [min(topk, n), CAP]) to status_ptr; STAGE 2: step 3 from the
    counts and flags stage 1 wrote.

    Candidates are int32 pairs (u at [0, CAP), index at [CAP, 2 CAP) of 2 CAP-long rows of
    cand_ptr); only the exact select holds all CAP keys in registers, the staging write
    re-reads them CHUNK at a time. ALIGNED (the indexer's chunks: col0, the row stride and the
    row width multiples of 16) passes col0 / 16, so that Triton proves row starts 16-float
    aligned, and masks the compaction loads per 16 scores: 16-byte vector loads. BALLOT: the
    compaction's positions from warp ballots; BALLOT_STAGING: the staging write's too.
    """
    tl.static_assert((STAGE == 1) | (STAGE == 2), "_select_kernel: STAGE must be 1 or 2")
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # chunk-local rows
    live = r < n_rows
    cand = cand_ptr + r.to(tl.int64) * (2 * CAP)
    if STAGE == 2:
        count = tl.load(count_ptr + r, mask=live, other=0)
        ok = tl.load(status_ptr + r, mask=live, other=1) == 0
        _finish_rows(
            cand, count, ok, live, r, topk, skey_ptr, sidx_ptr, sentinel, K2, CAP, CHUNK,
            BALLOT_STAGING,
        )  # fmt: skip
    else:
        ks = tl.load(ks_ptr + row0 + r, mask=live, other=0)
        ke = tl.maximum(tl.load(ke_ptr + row0 + r, mask=live, other=0), ks)
        n = ke - ks
        row_base = logits_ptr + r.to(tl.int64) * stride_l - col0 * (16 if ALIGNED else 1)
        count, ok = _threshold_and_compact(
            row_base, cand, ks, n, live, topk, target, CAP, SAMPLE, BLOCK, MAX_PASSES, ALIGNED,
            BALLOT,
        )  # fmt: skip
        tl.store(status_ptr + r, 1 - ok.to(tl.int32), mask=live)
        tl.store(count_ptr + r, count, mask=live)


@triton.jit
def _finish_rows(
    cand, count, ok, live, r, topk, skey_ptr, sidx_ptr, sentinel,
    K2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr, BALLOT: tl.constexpr = False,
):  # fmt: skip
    """Step 3 and the padding of the staging rows."""
    tl.debug_barrier()  # candidates written by other threads of this program
    srow = r.to(tl.int64)[:, None] * K2
    take = _exact_select_pairs(cand, count, ok, topk, skey_ptr, sidx_ptr, srow, CAP, CHUNK, BALLOT)
    slot = tl.arange(0, K2)[None, :]
    pad = (slot >= take[:, None]) & live[:, None]
    tl.store(skey_ptr + srow + slot, tl.full(slot.shape, -2147483648, tl.int32), mask=pad)
    tl.store(sidx_ptr + srow + slot, tl.zeros(slot.shape, tl.int32) + sentinel, mask=pad)


@triton.jit
def _exact_select_pairs(
    cand, count, ok, topk, skey_ptr, sidx_ptr, srow,
    CAP: tl.constexpr, CHUNK: tl.constexpr, BALLOT: tl.constexpr = False,
):  # fmt: skip
    """Step 3: the select over all CAP keys in registers (zero-filled, no masked copy), then
    the staging write CHUNK candidates a step. BALLOT (GPU, one row): the candidate rows are
    read whole (16-byte vectors; slots past the count are zeroed after the load, never used),
    and the tie ranks and staging positions come from warp ballots (`_ballot_positions`) with
    inline-PTX stores: the same staging rows."""
    have = tl.where(ok, count, 0)
    ci = tl.arange(0, CAP)[None, :]
    cu = _cand_keys(cand[:, None] + ci, ci < have[:, None], BALLOT)
    take = tl.minimum(have, topk)
    # empty slots hold 0, below every real key; the early exit may return a T* below the k-th
    # largest with exactly `take` keys above it (room 0): the same winners
    tstar = _kth_largest_zeroed(cu, take, True)
    room = take - tl.sum((cu > tstar[:, None]).to(tl.int32), axis=1)
    written = take * 0
    eq_seen = take * 0
    if BALLOT:
        written_v = tl.zeros([1, CHUNK], tl.int32)
        eq_v = tl.zeros([1, CHUNK], tl.int32)
    for c0 in range(0, tl.max(have, axis=0), CHUNK):
        cj = c0 + tl.arange(0, CHUNK)[None, :]
        v = cj < have[:, None]
        c_u = _cand_keys(cand[:, None] + cj, v, BALLOT)
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
def _cand_keys(ptrs, valid, WHOLE: tl.constexpr = False):
    """uint32 keys of the candidates at `ptrs` (0 where not valid: below every real key).

    WHOLE: load every slot (all lie inside the candidate row) and zero the invalid ones
    afterwards, so that the load compiles to 16-byte vectors."""
    if WHOLE:
        c = tl.where(valid, tl.load(ptrs), 0)
    else:
        c = tl.load(ptrs, mask=valid, other=0)
    return c.to(tl.uint32, bitcast=True)
