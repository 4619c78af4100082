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
a program at H = 64) made it 2-5% faster from 16K keys on. Nsight
Compute puts the tensor cores at 58% busy and the issue slots at 48%: the epilogue is latency
bound with 12 warps an SM.

The config (`LogitsConfig`, `FIXED_LOGITS_CONFIG`) is in `kernels.logits_config`; the sweep
the fixed config came from in docs/KERNELS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from packshard.kernels.logits_config import FIXED_LOGITS_CONFIG, WS_LAUNCH, LogitsConfig


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
