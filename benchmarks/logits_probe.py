"""Where the logits kernel's time goes: the fixed config against candidates (issue 5; GPU only).

    PYTHONPATH=. python3 benchmarks/logits_probe.py --out $OUT/logits_probe
    LOGITS_PROBE_STAGES=1 PYTHONPATH=. python3 benchmarks/logits_probe.py ...  # + v10's stages
    ncu --clock-control none --set full -k regex:_indexer_logits_kernel --launch-skip 1 \\
        --launch-count 1 -o $OUT/fixed python3 benchmarks/logits_probe.py --profile

Times, interleaved at each shape (`time_interleaved`: shuffled rounds, >= 3 ms a sample,
medians), the fixed config against:

- `v9 fixed`: the shared key tiles with relu as max(x, 0); `v8`: one query block a program;
- 1-query blocks at H = 64 (`n64/...`): in pairs (the sweep's lead at several shapes), with
  x + |x|, and in fours (`g4`: each key tile shared four ways, as in the fixed config's two
  2-query blocks, at ~123 registers instead of 168: 4 programs an SM instead of 3).

With LOGITS_PROBE_STAGES=1 also v10's stage probes: kernels that change one stage of v9's or
v8's kernel (a copy of the repo kernel with switches):

- `tma`: the key tiles through a TMA descriptor (mbarriers instead of cp.async and a barrier);
- `asm store`: the scores stored straight from the accumulator's layout with inline PTX
  (no shared-memory layout conversion; 4 lanes a quad store the same value);
- diagnostics that give wrong scores: `no relu/weight` (the head sum of the raw products),
  `no store` (scores summed in registers and stored once at the end).

Every variant's scores are checked bitwise against the fixed config's first (the probe
kernels' against the repo kernel's with their config). `--profile` launches the fixed config
twice at 16K causal, H = 64 (compile, then the launch for `ncu --launch-skip 1`). Writes
logits_probe.json and .md under --out; `--append-results FILE` appends the markdown to
benchmarks/RESULTS.md here.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import (
    command_line,
    machine_description,
    markdown_table,
    probe_main,
    save_probe,
)
from benchmarks.bench_indexer import (
    D,
    chunk_plan,
    count_pairs,
    logits_buffer,
    logits_runner,
    random_row,
    row_ranges,
)
from benchmarks.indexer_final import shape_name, time_interleaved
from benchmarks.indexer_peers import V8_LOGITS_CONFIG, V9_LOGITS_CONFIG, V11_LOGITS_CONFIG
from packshard.kernels.fp8_indexer import prepare_inputs
from packshard.kernels.logits import (
    LogitsConfig,
    _key_scales,
    _key_tile,
    _query_block,
    launch_logits,
)

# the fixed config's Triton kernel: the fixed config itself runs the warp-specialised kernel
# for H = 64 launches from 2^28 scores on sm_90 (v13)
TRITON_FIXED = V11_LOGITS_CONFIG

TITLE = "fp8 indexer (issue 5): where the logits kernel's time goes"
V9, V8 = V9_LOGITS_CONFIG, V8_LOGITS_CONFIG
# 1-query blocks at H = 64 (2-query blocks at H = 32): in pairs as in the sweep, and in fours,
# which share each key tile four ways (as many K-tile reads a flop as the fixed config) at
# ~123 registers. The fours lost 7-30% at H = 64 from 16K in the first v11 probe (with 2 stages
# for 4 programs an SM, or 3 stages, whose 57.6 KB of shared memory fit 3), as did pairs with
# x + |x|: the best of them stays for the record.
N64_CANDIDATES = (
    LogitsConfig(64, 64, 4, 3, q_groups=2),
    LogitsConfig(64, 64, 4, 3, q_groups=4, pair_relu="abs"),
)
# (H, S, packed): the target shapes first
SHAPES = (
    (64, 16384, False),
    (64, 65536, False),
    (64, 16384, True),
    (64, 65536, True),
    (64, 4096, False),
    (64, 4096, True),
    (32, 16384, False),
    (32, 65536, False),
)
ROUNDS = 9
# probe-kernel stage switches
EPI_FULL, EPI_NO_RELU_WEIGHT, EPI_NO_STORE, EPI_ASM_STORE = 0, 1, 2, 3


@triton.jit
def _probe_epilogue(acc, wq, ksc, offs, ks, ke, out_rows, tot,
                    BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr, H: tl.constexpr,
                    EPI: tl.constexpr):  # fmt: skip
    """The fixed kernel's tree epilogue (relu as max), with one stage changed by EPI."""
    if EPI == 1:
        score = tl.sum(tl.reshape(acc, (BLOCK_K, BLOCK_Q, H)), axis=2)
    else:
        score = tl.sum(tl.reshape(tl.maximum(acc, 0.0) * wq[None, :], (BLOCK_K, BLOCK_Q, H)), 2)
    score = score * ksc[:, None]
    valid = (offs[:, None] >= ks[None, :]) & (offs[:, None] < ke[None, :])
    if EPI == 2:
        tot += tl.where(valid, score, 0.0)
    elif EPI == 3:
        tl.inline_asm_elementwise(
            "{ .reg .pred %sp; setp.ne.b32 %sp, $3, 0; @%sp st.global.b32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r",
            [out_rows[None, :] + offs[:, None], score.to(tl.int32, bitcast=True),
             valid.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.store(out_rows[None, :] + offs[:, None], score, mask=valid)
    return tot


@triton.jit
def _probe_key_tile(k_src, offs, s0, d, S_k, D: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        kt = k_src.load([s0, 0])
    else:
        kt = _key_tile(k_src, offs, d, S_k, D, True)
    return kt


@triton.jit(do_not_specialize=["row0", "n_rows", "col0"])
def _probe_kernel(q_ptr, wq_ptr, k_src, kscale_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, S_k,
                  col0, stride_out, H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, EPI: tl.constexpr,
                  TMA: tl.constexpr):  # fmt: skip
    """`kernels.logits._indexer_logits_kernel` (serial schedule, even keys, tree head sum with
    relu as max) with K tiles from a TMA descriptor (TMA) and one epilogue stage changed (EPI)."""
    n_groups = tl.cdiv(tl.cdiv(n_rows, BLOCK_Q), GROUPS)
    blk = (n_groups - 1 - tl.program_id(0)) * GROUPS
    ks, ke, lo, hi, q_t, wq, out_rows, d = _query_block(
        q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk, H, D, BLOCK_Q
    )
    tot = tl.zeros((BLOCK_K, BLOCK_Q), tl.float32)
    tot2 = tl.zeros((BLOCK_K, BLOCK_Q), tl.float32)
    if GROUPS == 2:
        ks2, ke2, lo2, hi2, q2_t, wq2, out_rows2, _ = _query_block(
            q_ptr, wq_ptr, ks_ptr, ke_ptr, out_ptr, row0, n_rows, col0, stride_out, blk + 1,
            H, D, BLOCK_Q,
        )  # fmt: skip
        lo = tl.minimum(lo, lo2)
        hi = tl.maximum(hi, hi2)
    start = (lo // BLOCK_K) * BLOCK_K
    for s0 in range(start, hi, BLOCK_K):
        offs = s0 + tl.arange(0, BLOCK_K)
        kt = _probe_key_tile(k_src, offs, s0, d, S_k, D, TMA)
        ksc = _key_scales(kscale_ptr, offs, S_k, True)
        tot = _probe_epilogue(tl.dot(kt, q_t), wq, ksc, offs, ks, ke, out_rows, tot,
                              BLOCK_K, BLOCK_Q, H, EPI)  # fmt: skip
        if GROUPS == 2:
            tot2 = _probe_epilogue(tl.dot(kt, q2_t), wq2, ksc, offs, ks2, ke2, out_rows2, tot2,
                                   BLOCK_K, BLOCK_Q, H, EPI)  # fmt: skip
    if EPI == 2:  # one tile of sums, inside the first block's ranges (in bounds)
        offs = start + tl.arange(0, BLOCK_K)
        valid = (offs[:, None] >= ks[None, :]) & (offs[:, None] < ke[None, :])
        tl.store(out_rows[None, :] + offs[:, None], tot + tot2, mask=valid)


def probe_runner(p, buf: torch.Tensor, cfg: LogitsConfig, epi: int, tma: bool) -> Callable:
    """Every chunk's launch of the probe kernel (cfg's blocks, warps, stages and cap)."""
    if cfg.schedule != "serial" or cfg.head_sum != "tree" or cfg.abs_relu(p.heads):
        raise ValueError(f"probe kernel: serial schedule, tree head sum, max relu only ({cfg})")
    if cfg.groups(p.heads) > 2:
        raise ValueError(f"probe kernel: at most two query blocks a program ({cfg})")
    assert p.k8.shape[0] % cfg.block_k == 0
    k_src = p.k8
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_src = TensorDescriptor.from_tensor(p.k8, [cfg.block_k, p.q8.shape[1]])
    meta, options = cfg.kernel_params(p.heads)
    block_q, groups = meta["BLOCK_Q"], meta["GROUPS"]
    chunks = chunk_plan(p)

    def run() -> None:
        for r0, r1, col0, width in chunks:
            out = buf[: (r1 - r0) * width].view(r1 - r0, width)
            grid = (triton.cdiv(triton.cdiv(r1 - r0, block_q), groups),)
            _probe_kernel[grid](
                p.q8, p.wq, k_src, p.k_scale, p.ks, p.ke, out, r0, r1 - r0, p.k8.shape[0],
                col0, out.stride(0), H=p.heads, D=p.q8.shape[1], BLOCK_Q=block_q,
                BLOCK_K=cfg.block_k, GROUPS=groups, EPI=epi, TMA=tma, **options,
            )  # fmt: skip

    return run


class Variant(NamedTuple):
    """A kernel to time: the repo kernel with `cfg` (epi None), or the probe kernel with cfg's
    blocks and one stage changed (epi, tma)."""

    cfg: LogitsConfig
    epi: int | None = None
    tma: bool = False
    same: bool = True  # must give the repo kernel's scores for cfg
    h32: bool = False  # a kernel of its own at H = 32 (else it runs one timed already)


FIXED_NAME = f"fixed ({TRITON_FIXED.label})"
# v11: the 1-query-block candidates (H = 64). v11 also tried launching the programs heaviest
# first (an order array planned on the host from ks / ke): no faster on the H200 (two probes
# in RESULTS.md, 2026-12-03 17:48 and 17:54 UTC), at 0.2-0.8 ms of host time a call: removed.
CANDIDATES: dict[str, Variant] = {
    FIXED_NAME: Variant(TRITON_FIXED, h32=True),
    f"v9 fixed ({V9.label})": Variant(V9),
    f"v8 ({V8.label})": Variant(V8),
    # at H = 32 the pairs run 2-query blocks in pairs (timed); the fours do too, with x + |x|
    **{c.label: Variant(c, h32=i == 0) for i, c in enumerate(N64_CANDIDATES)},
}
# v10: one stage of v9's or v8's kernel changed (the probe kernel); LOGITS_PROBE_STAGES=1
STAGES: dict[str, Variant] = {
    "v9 + tma": Variant(V9, EPI_FULL, True),
    "v9 + asm store": Variant(V9, EPI_ASM_STORE),
    "v9, no relu/weight (diagnostic)": Variant(V9, EPI_NO_RELU_WEIGHT, same=False),
    "v9, no store (diagnostic)": Variant(V9, EPI_NO_STORE, same=False),
    "v8 + tma": Variant(V8, EPI_FULL, True, h32=True),
    "v8 + asm store": Variant(V8, EPI_ASM_STORE, h32=True),
}
VARIANTS: dict[str, Variant] = {
    **CANDIDATES,
    **(STAGES if os.environ.get("LOGITS_PROBE_STAGES") == "1" else {}),
}


def _runner(p, buf, name: str) -> Callable:
    v = VARIANTS[name]
    if v.epi is None:
        return logits_runner(p, v.cfg, buf)
    return probe_runner(p, buf, v.cfg, v.epi, v.tma)


def _applies(name: str, heads: int) -> bool:
    """At H = 32 the two-block configs run v8's kernel: only the distinct kernels run there."""
    return heads >= 64 or VARIANTS[name].h32 or name.startswith("v8")


def bitwise_checks() -> dict[str, bool]:
    """Each variant's scores against the fixed config's (repo-kernel variants) or the repo
    kernel's with the same config (probe-kernel variants that must keep them); 4K packed."""
    res = {}
    for h in (64, 32):
        ks, ke = row_ranges(4096, packed=True)
        q, k, w = random_row(4096, h, seed=5)
        p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
        buf_a, buf_b = logits_buffer(p), logits_buffer(p)
        for name, v in VARIANTS.items():
            if not v.same or not _applies(name, h) or name == FIXED_NAME:
                continue
            buf_a.fill_(float("nan"))
            buf_b.fill_(float("nan"))
            logits_runner(p, TRITON_FIXED if v.epi is None else v.cfg, buf_a)()
            _runner(p, buf_b, name)()
            torch.cuda.synchronize()
            res[f"H={h} {name}"] = bool(
                torch.equal(buf_a.view(torch.int32), buf_b.view(torch.int32))
            )
    return res


def probe(out: Path | None) -> dict:
    res: dict = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "command": command_line(),
        "bitwise": bitwise_checks(),
        "shapes": [],
    }
    print("bitwise", res["bitwise"], flush=True)
    for h, s, packed in SHAPES:
        ks, ke = row_ranges(s, packed)
        flops = 2 * h * D * count_pairs(ks, ke)
        q, k, w = random_row(s, h, seed=s + h + packed)
        p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
        buf = logits_buffer(p)
        names = [n for n in VARIANTS if _applies(n, h)]
        ms = time_interleaved({n: _runner(p, buf, n) for n in names}, ROUNDS)
        shape = shape_name(h, s, packed)
        res["shapes"].append(
            {
                "shape": shape,
                "ms": ms,
                "tflops": {n: flops / (v * 1e9) for n, v in ms.items()},
            }
        )
        print(shape, json.dumps({n: round(v, 4) for n, v in ms.items()}), flush=True)
        del p, buf, q, k, w
        torch.cuda.empty_cache()
    res["markdown"] = markdown(res)
    return save_probe(out, "logits_probe", res)


def markdown(res: dict) -> str:
    shapes = res["shapes"]
    head = ["variant", *(r["shape"] for r in shapes)]
    body = []
    for name in VARIANTS:
        row: list[object] = [name]
        for r in shapes:
            if name not in r["ms"]:
                row.append("-")
                continue
            base = r["ms"][FIXED_NAME]
            row.append(f"{r['ms'][name]:.3f} ({r['ms'][name] / base:.3f}), {r['tflops'][name]:.0f}")
        body.append(row)
    checks = ", ".join(f"{k}: {v}" for k, v in res["bitwise"].items())
    return (
        f"Measured {res['date']}. Logits ms (ratio to the fixed config), TFLOP/s; "
        f"interleaved, {ROUNDS} rounds, medians. A dash: not timed at that head count (at "
        "H=32 the shared-tile configs run v8's kernel). Diagnostic rows compute wrong "
        "scores.\n\n" + markdown_table(head, body) + "\n\n"
        f"Scores bitwise equal to the fixed config's (probe kernels: to the repo kernel's with "
        f"their config; 4K packed): {checks}.\n"
    )


def profile() -> None:
    """Two launches of the fixed config at 16K causal, H = 64 (for ncu --launch-skip 1)."""
    ks, ke = row_ranges(16384, packed=False)
    q, k, w = random_row(16384, 64, seed=1)
    p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
    r0, r1, col0, width = chunk_plan(p)[0]
    out = logits_buffer(p)[: (r1 - r0) * width].view(r1 - r0, width)
    for _ in range(2):
        launch_logits(
            p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, out,
            heads=p.heads, row0=r0, n_rows=r1 - r0, col0=col0,
        )  # fmt: skip
    torch.cuda.synchronize()


def main() -> None:
    if sys.argv[1:] == ["--profile"]:
        profile()
        return
    probe_main(__doc__, TITLE, "logits_probe.py", "logits_probe.json", probe)


if __name__ == "__main__":
    main()
