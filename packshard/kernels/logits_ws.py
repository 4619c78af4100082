"""The warp-specialised logits kernel (Gluon, sm_90 only): the fixed config's launches of 2^28
scores and more at H = 64 and 32 (`LogitsConfig.ws_min_scores`, `kernels.logits.WS_LAUNCH`).

The same scores as `kernels.logits` (`score[t, s] = k_scale[s] * sum_h wq[t, h] *
relu(q8[t, h] . k8[s])`, written in range only, same operands and output rules), computed by
one CTA of four warpgroups that share every key tile:

- Each warpgroup owns one query block of 128 (query, head) columns (2 queries at H = 64, 4 at
  H = 32). Its accumulators hold [64 keys, 128 columns] (64 registers a thread) and its
  weights 32: 128 registers, so four warpgroups (512 threads) fill the register file: 16 warps
  an SM, where the Triton kernel holds 12, and each key tile is read from L2 once for 8
  queries at H = 64 (4 in the Triton kernel).
- Key tiles come by TMA into a ring of STAGES buffers; `ready[s]` (TMA bytes) and `empty[s]`
  (one arrive per warpgroup after its wgmma) are mbarriers: no CTA-wide barrier in the loop
  (the Triton kernel meets one every tile, its cp.async pipeline), so the warpgroups drift
  apart and one's MMA can run under the others' epilogues.
- Warpgroup 0 also issues the loads: at tile i it refills the buffer of tile i - LAG (once all
  warpgroups are done with it) with tile i + STAGES - LAG, so STAGES - LAG tiles are in flight
  ahead of it. A loader warp of its own would need registers the four warpgroups use up.
- The epilogues (`EPILOGUES`). "banks" (the fixed path's): the 128 columns as two 64-column
  wgmmas issued together; the first's relu(x) * w is summed over each lane's heads (x + |x|
  with half weights, one chain a (key, query)) while the second runs, then the second's; the
  four lanes' partial sums of a score meet in one thread through a shared-memory transpose
  (`STS.128` + `LDSM`), which adds them and stores one score. Another summation order than
  the Triton kernel's: equal to fp32 rounding, not bitwise. "convert" and "direct": one
  128-column wgmma, waited for, then the Triton kernel's head sum (bitwise its scores), stored
  one score a thread after a layout conversion, or the four a thread holds (duplicated across
  a lane quad, three of four stores predicated off).

Measured on the H200 against the Triton fixed config in the same run, with the fixed path's
launch (`WS_LAUNCH`: banks, 4 stages, lag 1, warp-uniform key ranges, the first key tiles
issued under the queries' TMA): 0.92-0.95 of its time at H = 64 and 0.86-0.93 at H = 32 from
16K rows, 1.03-1.04 on 8K packed rows and 1.6-1.8 on 4K ones (hence the 2^28-score
threshold). At H = 32 warpgroups 1-3 take 120 registers a thread and warpgroup 0 152
(`worker_regs`): at 128 ptxas spills. "convert": 0.97-0.99 at H = 64 128K, 0.88-1.01 on H = 32
causal rows, up to 8% slower elsewhere. Nsight Compute at 16K causal, H = 64: tensor pipe 59%
(Triton 58%, "convert" 56%), 8.3 cycles between a warp's instructions with 16 warps.
docs/kernels-history.md has the forms that lost (a persistent kernel, two warpgroups a CTA,
64-column accumulators, register-A wgmma, a rotating producer).

`launch_logits_ws` takes the arguments of `kernels.logits.launch_logits`. Needs Triton's Gluon
with Hopper warp specialisation (Triton 3.6 on the device) and an sm_90 GPU;
`kernels.logits_config.LogitsConfig.runs_warp_specialised` says when the fixed path launches
it. `benchmarks/probes/ws_sass.py` compiles it to SASS without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_K = 64  # keys a tile (the wgmma's M)
BLOCK_N = 128  # (query, head) columns a warpgroup (the wgmma's N)
WARPGROUPS = 4
# the epilogue variants: the kernel's EPILOGUE constexpr
EPILOGUES = {"direct": 0, "convert": 1, "banks": 2}


@gluon.constexpr_function
def _one_score_layout(block_k, queries):
    """[block_k keys, queries] over one warpgroup, one score a thread where it can: lane bit 0
    query bit 0, lane bit 1 key bit 3, lane bits 2-4 key bits 0-2, warps key bits 4-5, further
    query bits in registers (the head sum's layout, with its 4-lane broadcast spent)."""
    assert block_k == 64 and queries >= 2
    regs = [[0, 2 << i] for i in range(queries.bit_length() - 2)]
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=[[0, 1], [8, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[block_k, queries],
    )  # fmt: skip


@gluon.constexpr_function
def _partials_layout(block_k, queries):
    """[block_k keys, queries, 4 lane partials]: the one-score layout with the 4 partials of a
    score (one from each lane of a quad) in a thread's registers."""
    assert block_k == 64 and queries >= 2
    regs = [[0, 0, 1], [0, 0, 2]] + [[0, 2 << i, 0] for i in range(queries.bit_length() - 2)]
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=[[0, 1, 0], [8, 0, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[block_k, queries, 4],
    )  # fmt: skip


@gluon.jit
def _lane_partials(acc, w, BLOCK_K: gl.constexpr, QB: gl.constexpr, H: gl.constexpr):
    """[BLOCK_K, QB, 4]: each lane's sum of relu(acc) * w over the heads it holds (head
    h = 8 i + 2 t + j of a bank column: i, j a thread's registers, t its lane in the quad);
    w holds half the weights and relu(x) is x + |x|."""
    x = (acc + gl.abs(acc)) * w[None, :]
    x = gl.permute(gl.reshape(x, [BLOCK_K, QB, H // 8, 4, 2]), (0, 1, 3, 2, 4))
    return gl.sum(gl.reshape(x, [BLOCK_K, QB, 4, H // 4]), axis=3)


@gluon.jit
def _quad_sum(p_a, p_b, part_layout: gl.constexpr, out_layout: gl.constexpr,
              BLOCK_K: gl.constexpr, QW: gl.constexpr):  # fmt: skip
    """[BLOCK_K, QW] scores in out_layout from the two banks' lane partials."""
    parts = gl.reshape(gl.permute(gl.join(p_a, p_b), (0, 3, 1, 2)), [BLOCK_K, QW, 4])
    score = gl.sum(gl.convert_layout(parts, part_layout), axis=2)
    return gl.convert_layout(score, out_layout)


@gluon.jit
def _issue_tile(k_desc, k_bufs, ready, empty, start, j, n_tiles,
                BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """TMA key tile j into buffer j % STAGES once every warpgroup released its last use."""
    if j < n_tiles:
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [start + j * BLOCK_K, 0], ready.index(s), k_bufs.index(s)
        )


@gluon.jit
def _banks_tile(k_buf, b_a, b_b, zero_b, w_a, w_b, empty_bar, part_layout: gl.constexpr,
                out_layout: gl.constexpr, BLOCK_K: gl.constexpr, QB: gl.constexpr,
                QW: gl.constexpr, H: gl.constexpr):  # fmt: skip
    """One key tile's [BLOCK_K, QW] scores (before the key scales) by the banks epilogue: two
    64-column wgmmas, bank B's under bank A's head sum; releases the key buffer (empty_bar)
    once both have read it."""
    acc_a = warpgroup_mma(k_buf, b_a, zero_b, use_acc=False, is_async=True)
    acc_b = warpgroup_mma(k_buf, b_b, zero_b, use_acc=False, is_async=True)
    acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
    p_a = _lane_partials(acc_a, w_a, BLOCK_K, QB, H)
    acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b,))
    mbarrier.arrive(empty_bar, count=1)
    p_b = _lane_partials(acc_b, w_b, BLOCK_K, QB, H)
    return _quad_sum(p_a, p_b, part_layout, out_layout, BLOCK_K, QW)


@gluon.jit
def _block_range(ks_ptr, ke_ptr, row0, n_rows, blk, QUERIES: gl.constexpr,
                 BLOCK_K: gl.constexpr, START_ALIGN: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """(first key, key tiles) of query block blk: from its queries' smallest ks rounded down
    to START_ALIGN keys (a TMA copy may start at any key) to their largest ke; the last tile
    ends at most at max ke rounded up to BLOCK_K, inside the padded keys and their scales (a
    16-aligned start would otherwise run up to 48 keys past them)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    r = blk * QUERIES + gl.arange(0, QUERIES, layout=lay)
    ok = r < n_rows
    lo = gl.min(gl.load(ks_ptr + row0 + r, mask=ok, other=2147483647), axis=0)
    hi = gl.max(gl.load(ke_ptr + row0 + r, mask=ok, other=0), axis=0)
    start = (lo // START_ALIGN) * START_ALIGN
    n_tiles = gl.maximum(gl.cdiv(hi - start, BLOCK_K), 0)
    start = gl.minimum(start, gl.cdiv(hi, BLOCK_K) * BLOCK_K - n_tiles * BLOCK_K)
    return start, n_tiles


@gluon.jit
def _warp_uniform(x):
    """x (the same in every lane) through a shuffle from lane 0. ptxas cannot tell that a value
    the partitions receive from the kernel's first warps is the same in every lane; after the
    shuffle it keeps what the tile loop computes from it (key offsets, ring indices, the TMA
    coordinates) in uniform registers: warpgroup 0's loop 230-231 SASS instructions a tile
    instead of 244-246, and no spills at 128 registers (`benchmarks/probes/ws_sass.py`)."""
    return gl.inline_asm_elementwise(
        "shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [x], dtype=gl.int32, is_pure=True,
        pack=1,
    )  # fmt: skip


@gluon.jit
def _consumer(
    q_smem, qbar, k_desc, k_bufs, ready, empty, kscale_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr,
    row0, n_rows, col0, stride_out, blk, start, n_tiles,
    H: gl.constexpr, BLOCK_K: gl.constexpr, QUERIES: gl.constexpr, STAGES: gl.constexpr,
    WGI: gl.constexpr, LAG: gl.constexpr, EPILOGUE: gl.constexpr, UNIFORM: gl.constexpr,
    EARLY: gl.constexpr,
):  # fmt: skip
    """Warpgroup WGI: its query block's scores over the CTA's key tiles."""
    BLOCK_N: gl.constexpr = 128
    QW: gl.constexpr = BLOCK_N // H
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    q0 = blk * QUERIES + WGI * QW  # chunk-local first query of this warpgroup
    qh0 = (row0 + q0).to(gl.int64) * H
    qh = qh0 + cols
    wq = gl.load(wq_ptr + qh, mask=cols < (n_rows - q0) * H, other=0.0) * 0.5
    zero = gl.zeros([BLOCK_K, BLOCK_N], gl.float32, acc_layout)
    # the head sum's layout (key rows, queries): what the scores are stored from
    sum_layout: gl.constexpr = gl.sum(gl.reshape(zero, [BLOCK_K, QW, H]), axis=2).type.layout
    if EPILOGUE >= 1:
        out_layout: gl.constexpr = _one_score_layout(BLOCK_K, QW)
    else:
        out_layout: gl.constexpr = sum_layout
    rows = q0 + gl.arange(0, QW, layout=gl.SliceLayout(0, out_layout))
    row_ok = rows < n_rows
    ks = gl.load(ks_ptr + row0 + rows, mask=row_ok, other=2147483647)
    ke = gl.load(ke_ptr + row0 + rows, mask=row_ok, other=0)
    out_rows = out_ptr + rows.to(gl.int64) * stride_out - col0
    keys = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, out_layout))
    b = q_smem.slice(WGI * BLOCK_N, BLOCK_N).permute((1, 0))  # [D, 128] K-major
    if EPILOGUE >= 2:
        BN2: gl.constexpr = BLOCK_N // 2
        QB: gl.constexpr = BN2 // H  # queries a bank
        bank_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN2, 32]
        )
        bcols = gl.arange(0, BN2, layout=gl.SliceLayout(0, bank_layout))
        n_cols = (n_rows - q0) * H
        w_a = gl.load(wq_ptr + qh0 + bcols, mask=bcols < n_cols, other=0.0) * 0.5
        w_b = gl.load(wq_ptr + qh0 + BN2 + bcols, mask=BN2 + bcols < n_cols, other=0.0) * 0.5
        zero_b = gl.zeros([BLOCK_K, BN2], gl.float32, bank_layout)
        b_a = q_smem.slice(WGI * BLOCK_N, BN2).permute((1, 0))
        b_b = q_smem.slice(WGI * BLOCK_N + BN2, BN2).permute((1, 0))
        part_layout: gl.constexpr = _partials_layout(BLOCK_K, QW)
    if UNIFORM:
        start = _warp_uniform(start)
        n_tiles = _warp_uniform(n_tiles)
    # a warpgroup whose queries are all past n_rows (the last CTA) still runs every tile: the
    # ring's `empty` barriers count one arrive from each of the four warpgroups
    if EARLY:
        # the first key tiles' TMA under the queries' (the kernel did not wait for them)
        if WGI == 0:
            for j in gl.static_range(STAGES - LAG):
                _issue_tile(k_desc, k_bufs, ready, empty, start, j, n_tiles, BLOCK_K, STAGES)
        mbarrier.wait(qbar, 0)
    else:
        # the queries' TMA has landed (the CTA's first warps waited before the partitions
        # began; this wait makes each partition's own ordering explicit and costs one
        # completed-phase test)
        mbarrier.wait(qbar, 0)
        if WGI == 0:
            for j in gl.static_range(STAGES - LAG):
                _issue_tile(k_desc, k_bufs, ready, empty, start, j, n_tiles, BLOCK_K, STAGES)
    for i in range(n_tiles):
        if WGI == 0:
            _issue_tile(
                k_desc, k_bufs, ready, empty, start, i + STAGES - LAG, n_tiles, BLOCK_K, STAGES
            )
        s = i % STAGES
        offs = start + i * BLOCK_K + keys
        ksc = gl.load(kscale_ptr + offs)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if EPILOGUE == 2:
            score = _banks_tile(
                k_bufs.index(s), b_a, b_b, zero_b, w_a, w_b, empty.index(s), part_layout,
                out_layout, BLOCK_K, QB, QW, H,
            )  # fmt: skip
        else:
            acc = warpgroup_mma(k_bufs.index(s), b, zero, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s), count=1)
            x = (acc + gl.abs(acc)) * wq[None, :]
            score = gl.sum(gl.reshape(x, [BLOCK_K, QW, H]), axis=2)
            if EPILOGUE >= 1:
                score = gl.convert_layout(score, out_layout)
        score = score * ksc[:, None]
        valid = (offs[:, None] >= ks[None, :]) & (offs[:, None] < ke[None, :])
        gl.store(out_rows[None, :] + offs[:, None], score, mask=valid)


@gluon.jit(do_not_specialize=["row0", "n_rows", "col0"])
def _ws_logits_kernel(
    q_desc, k_desc, kscale_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out,
    H: gl.constexpr, BLOCK_K: gl.constexpr, QUERIES: gl.constexpr, STAGES: gl.constexpr,
    LAG: gl.constexpr, EPILOGUE: gl.constexpr, START_ALIGN: gl.constexpr,
    WREGS: gl.constexpr, UNIFORM: gl.constexpr, EARLY: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """One CTA: QUERIES queries (heaviest first), four warpgroups over [min ks, max ke)."""
    blk = gl.cdiv(n_rows, QUERIES) - 1 - gl.program_id(0)
    BLOCK_N: gl.constexpr = QUERIES * H
    D: gl.constexpr = q_desc.block_type.shape[1]
    QBOX: gl.constexpr = q_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N, D], q_desc.layout)
    ring: gl.constexpr = [STAGES] + k_desc.block_type.shape  # noqa: RUF005 (jit code)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, ring, k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=4)
    mbarrier.init(qbar, count=1)
    mbarrier.expect(qbar, BLOCK_N * D)
    for j in gl.static_range(BLOCK_N // QBOX):
        tma.async_copy_global_to_shared(
            q_desc, [(row0 + blk * QUERIES) * H + j * QBOX, 0], qbar, q_smem.slice(j * QBOX, QBOX)
        )
    # the key range: the queries' TMA is in flight meanwhile
    start, n_tiles = _block_range(
        ks_ptr, ke_ptr, row0, n_rows, blk, QUERIES, BLOCK_K, START_ALIGN, num_warps
    )
    if not EARLY:
        mbarrier.wait(qbar, 0)
    # the partitions' arguments are spelled out in full: in Triton 3.6's Gluon a tuple bound to
    # a name turns its constexprs (H, BLOCK_K, ...) into tensors, so it cannot be built once
    gl.warp_specialize(
        [
            (_consumer, (q_smem, qbar, k_desc, k_bufs, ready, empty, kscale_ptr, wq_ptr, ks_ptr,
                         ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk, start, n_tiles,
                         H, BLOCK_K, QUERIES, STAGES, 0, LAG, EPILOGUE, UNIFORM,
                         EARLY)),
            (_consumer, (q_smem, qbar, k_desc, k_bufs, ready, empty, kscale_ptr, wq_ptr, ks_ptr,
                         ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk, start, n_tiles,
                         H, BLOCK_K, QUERIES, STAGES, 1, LAG, EPILOGUE, UNIFORM,
                         EARLY)),
            (_consumer, (q_smem, qbar, k_desc, k_bufs, ready, empty, kscale_ptr, wq_ptr, ks_ptr,
                         ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk, start, n_tiles,
                         H, BLOCK_K, QUERIES, STAGES, 2, LAG, EPILOGUE, UNIFORM,
                         EARLY)),
            (_consumer, (q_smem, qbar, k_desc, k_bufs, ready, empty, kscale_ptr, wq_ptr, ks_ptr,
                         ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk, start, n_tiles,
                         H, BLOCK_K, QUERIES, STAGES, 3, LAG, EPILOGUE, UNIFORM,
                         EARLY)),
        ],
        [4, 4, 4],
        # registers a thread of warpgroups 1-3; the default partition (warpgroup 0) gets the
        # rest of the register file (152 for 120: the producer's tile loop then does not spill)
        [WREGS, WREGS, WREGS],
    )  # fmt: skip


def queries_per_cta(heads: int) -> int:
    return WARPGROUPS * (BLOCK_N // heads)


@functools.cache
def _fp8_layout(block: tuple[int, ...]):
    """The TMA / wgmma shared layout of an fp8 block (made once a shape: making it costs host
    time that the 0.03-0.1 ms launches of 4K rows would show)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv)


def _desc(t: torch.Tensor, block: list[int]):
    """A TMA descriptor of the fp8 matrix t, `block` rows x columns a copy. Made each launch
    (the CUtensorMap is anyway): a cached one would keep its tensor alive."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, _fp8_layout(tuple(block)))


def _check_launch(q8, wq, k8, k_scale, ks, ke, out, heads, row0, n_rows, col0, stages, lag):
    """What `launch_logits_ws` needs of its arguments, as ValueErrors (a TMA descriptor or the
    kernel would otherwise crash, or write wrong scores without a word)."""
    where = "launch_logits_ws"
    if heads not in (32, 64):  # the head counts the GPU tests run
        raise ValueError(f"{where}: heads={heads}: must be 32 or 64")
    if stages not in (3, 4) or not 1 <= lag < stages:
        # two warpgroups a CTA with 5-6 stages wrote wrong, run-to-run different scores on the
        # H200 (cause not found): only what passed the GPU tests is allowed
        raise ValueError(
            f"{where}: stages={stages}, lag={lag}: need stages 3 or 4, 1 <= lag < stages"
        )
    if n_rows <= 0:
        return
    fp8, f32, i32 = torch.float8_e4m3fn, torch.float32, torch.int32
    tensors = (
        ("q8", q8, fp8), ("k8", k8, fp8), ("wq", wq, f32), ("k_scale", k_scale, f32),
        ("ks", ks, i32), ("ke", ke, i32), ("out", out, f32),
    )  # fmt: skip
    for name, t, dtype in tensors:
        if t.dtype != dtype or t.device != q8.device:
            raise ValueError(
                f"{where}: {name} is {t.dtype} on {t.device}: need {dtype} on q8's device"
            )
    if q8.dim() != 2 or k8.dim() != 2 or q8.shape[1] != 128 or k8.shape[1] != 128:
        raise ValueError(f"{where}: q8 {tuple(q8.shape)}, k8 {tuple(k8.shape)}: need D = 128")
    if not (q8.is_contiguous() and k8.is_contiguous() and wq.is_contiguous()):
        raise ValueError(f"{where}: q8, k8 and wq must be contiguous")
    if k8.shape[0] % BLOCK_K or k_scale.numel() != k8.shape[0]:
        raise ValueError(
            f"{where}: keys={k8.shape[0]}: keys must be padded to a multiple of {BLOCK_K}, with "
            f"one k_scale each ({k_scale.numel()} given)"
        )
    rows = row0 + n_rows
    if (
        q8.shape[0] < rows * heads
        or wq.numel() < rows * heads
        or min(ks.numel(), ke.numel()) < rows
    ):
        raise ValueError(f"{where}: rows [{row0}, {rows}) exceed q8, wq, ks or ke")
    if out.dim() != 2 or out.stride(1) != 1 or out.shape[0] < n_rows:
        raise ValueError(f"{where}: out {tuple(out.shape)}: need [>= {n_rows}, keys - col0] rows")
    if col0 < 0 or col0 % 16:
        # (the kernel writes columns ks - col0 to ke - col0 of each row: that out is wide
        # enough for the rows' ranges is the caller's, as in `launch_logits`)
        raise ValueError(f"{where}: col0={col0}: must be a non-negative multiple of 16")
    if not q8.is_cuda:
        raise ValueError(f"{where}: tensors on {q8.device}: need a CUDA device (sm_90)")


def launch_logits_ws(q8, wq, k8, k_scale, ks, ke, out, *, heads, row0, n_rows, col0,
                     stages: int = 4, lag: int = 2, epilogue: str = "convert",
                     start_align: int = 16, worker_regs: int = 128,
                     uniform_ranges: bool = False, early_tiles: bool = False):  # fmt: skip
    """`kernels.logits.launch_logits` with the warp-specialised kernel (sm_90, D = 128; all
    tensors on one GPU). Warpgroup 0 keeps stages - lag key tiles in flight ahead of its own.
    `epilogue` (`EPILOGUES`): "convert" stores one score a thread, "direct" the four a thread
    holds (3 of 4 lanes' stores predicated off), "banks" splits each warpgroup's columns in two
    wgmmas and sums the first's heads while the second runs (another summation order than the
    fixed config's: equal to fp32 rounding, not bitwise). A CTA's key tiles start at its
    queries' smallest ks rounded down to `start_align` keys (16, or 64: whole key tiles as the
    Triton kernel's): a packed row's documents start anywhere, and 16 saves 24 keys of the
    first tile on average; every score is computed alike either way (bitwise the same).
    `worker_regs`: registers a thread of warpgroups 1-3, 120 or 128 (warpgroup 0, the
    producer, gets the rest of the register file: 152 for 120; bitwise the same scores).
    `uniform_ranges` passes the CTA's key range through a lane-0 shuffle (`_warp_uniform`), and
    `early_tiles` has warpgroup 0 issue the first key tiles before the queries' TMA has landed:
    bitwise the same scores either way; the fixed path's launch takes both, while both
    default to off here. The fixed path's launch is
    `kernels.logits.WS_LAUNCH`, not these defaults."""
    qbox, meta = kernel_meta(
        heads, stages=stages, lag=lag, epilogue=epilogue, start_align=start_align,
        worker_regs=worker_regs, uniform_ranges=uniform_ranges, early_tiles=early_tiles,
    )  # fmt: skip
    _check_launch(q8, wq, k8, k_scale, ks, ke, out, heads, row0, n_rows, col0, stages, lag)
    if n_rows <= 0:
        return None
    return run_kernel(
        _desc(q8, [qbox, q8.shape[1]]), _desc(k8, [BLOCK_K, k8.shape[1]]),
        k_scale, wq, ks, ke, out, row0, n_rows, col0, meta,
    )  # fmt: skip


def run_kernel(q_desc, k_desc, k_scale, wq, ks, ke, out, row0, n_rows, col0, meta):
    """The kernel launch itself, from the TMA descriptors and `kernel_meta`'s constexprs (what
    `launch_logits_ws` does after its checks, apart so that a benchmark can time it alone)."""
    return _ws_logits_kernel[(triton.cdiv(n_rows, meta["QUERIES"]),)](
        q_desc, k_desc, k_scale, wq, ks, ke, out, row0, n_rows, col0, out.stride(0), **meta
    )


def kernel_meta(heads: int, *, stages: int, lag: int, epilogue: str, start_align: int,
                worker_regs: int, uniform_ranges: bool, early_tiles: bool) -> tuple[int, dict]:  # fmt: skip
    """(the queries' TMA box rows, `_ws_logits_kernel`'s constexprs and launch options) of a
    `launch_logits_ws` launch, its keyword arguments checked: the one place the launcher and
    `benchmarks/probes/ws_sass.py` (which compiles the kernel without a GPU) take them from."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"launch_logits_ws: epilogue={epilogue!r}: one of {list(EPILOGUES)}")
    if start_align not in (16, BLOCK_K):
        raise ValueError(f"launch_logits_ws: start_align={start_align}: 16 or {BLOCK_K}")
    if worker_regs not in (120, 128):  # what the H200 runs measured
        raise ValueError(f"launch_logits_ws: worker_regs={worker_regs}: 120 or 128")
    queries = queries_per_cta(heads)
    meta = {
        "H": heads, "BLOCK_K": BLOCK_K, "QUERIES": queries, "STAGES": stages, "LAG": lag,
        "EPILOGUE": EPILOGUES[epilogue], "START_ALIGN": start_align, "WREGS": worker_regs,
        "UNIFORM": uniform_ranges, "EARLY": early_tiles, "num_warps": 4, "maxnreg": 128,
    }  # fmt: skip
    return min(queries * heads, 256), meta
