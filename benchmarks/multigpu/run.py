"""Multi-GPU DP x CP run of the e2e DSA-style MoE model (issue 8): the per-rank worker.

Start it through the launcher, which sets the NVLink-multicast variables, runs torchrun and
writes the report (README.md beside this file has the exact device commands):

    benchmarks/multigpu/launch.sh --nproc 8 --cp 2 --out $OUT                  # H200 x8: dp 4 x cp 2
    benchmarks/multigpu/launch.sh --cpu --out .bench/multigpu_cpu              # CPU proxy: gloo, dp 2 x cp 2

Every rank runs the same interleaved schedule: step s runs every arm (in an order rotated by s)
before step s+1, so clock and thermal drift fall on all arms alike. Arms (same rows per step,
from one seed; only the padding and the DP split differ):

- `padseq`: rows padded to seq_len with token 0, the padding run as one more document (what
  loaders do today); balance="count" (every row has the same length, so nothing to balance);
- `count`: rows padded to a multiple of 8, split round-robin over the DP ranks;
- `cost`: the same rows, split by `trainer_shim`'s cost balancing (equal counts, min max cost).

Per arm and step, every rank measures its compute (forward + backward of its micro-batches,
CUDA events on the GPU / perf_counter on the CPU, up to the gradient all-reduce); the step time
and trained tokens/s come from `TrainedTokenMeter` (from an all-reduce that lines the ranks up
before the step to the meter's all-gather after the optimizer step). A DP rank's compute is the
max over its CP ranks (they synchronise at every layer's all-gather anyway). The step waits for
the slowest DP rank: step time ~ max over DP ranks of compute + all-reduce + optimizer.

The top-k identity check (`topk_check.py`) runs on `--check-steps` (default the first and the
last), over every layer of the first micro-batch, after the step is timed.

Rank 0 writes `multigpu_results.json` into --out after every round (a run cut short by the
deadline or a timeout still leaves what it finished); `report.py` summarises it.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROCESS_START = time.monotonic()
REPO = Path(__file__).resolve().parents[2]
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a script: keep this folder's module names (data, report) off the path
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

log = logging.getLogger("multigpu")

#: NVLink multicast must stay off on the shared hosts (device README, KINDS.md): NCCL's NVLS,
#: PyTorch's symmetric-memory multicast, NVSHMEM's NVLS. The launcher sets them; GPU ranks refuse
#: to start without them.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
ARM_NAMES = ("padseq", "count", "cost")
RESULTS_JSON = "multigpu_results.json"
#: cost model of the DSA model on the H200 (benchmarks/e2e_ablation/README.md, the least-squares
#: fit of the first run): ~14 us per token (dense + LM head + sparse attention + MoE) and
#: ~2e-11 s per unit of sum(doc_len^2) (the indexer's ranked pairs, 4 layers): attn_weight =
#: 2e-11 / 14e-6. Sparse attention is capped at top-k keys per query, so a DSA row costs nearly
#: its token count (a 32K single-document row: +4%); the dense-attention default would say +60%.
H200_ATTN_WEIGHT = 1.5e-6
#: the CPU proxy's reference indexer ranks each query against its whole document window in
#: fp32 torch: per unit of sum(doc_len^2) it costs ~ per token x 1/(2 x 512) at seq_len 1024
#: (measured: a 1,000-token row spends about half its time in the indexer).
CPU_ATTN_WEIGHT = 1.0 / 1024


@dataclass
class ArmState:
    name: str
    url: str
    balance: str
    pads_as_document: bool
    stream: Any = None
    iterator: Any = None
    model: Any = None
    optimizer: Any = None
    meter: Any = None
    indexer: Any = None
    attention: Any = None
    rows: list[list[int]] = field(default_factory=list)  # per step: this rank's rows


def check_multicast_env(gpu: bool) -> dict[str, str | None]:
    """The multicast variables as this process sees them; on the GPU, refuse to run without them."""
    seen = {k: os.environ.get(k) for k in MULTICAST_OFF}
    bad = {k: v for k, v in seen.items() if v != MULTICAST_OFF[k]}
    if gpu and bad:
        raise RuntimeError(
            "NVLink multicast must be off on these hosts: "
            + ", ".join(f"{k}={v!r} (need {MULTICAST_OFF[k]!r})" for k, v in bad.items())
            + "; start through benchmarks/multigpu/launch.sh (or export "
            + " ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items())
            + ")"
        )
    return seen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="folder holding pad8/ and padseq/")
    p.add_argument("--preset", choices=["h200", "cpu"], default="h200")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (dp = world / cp)")
    p.add_argument("--cp-layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--arms", default=",".join(ARM_NAMES), help=f"comma-separated among {ARM_NAMES}")
    p.add_argument(
        "--rows-per-rank", type=int, default=4, help="micro-batches per DP rank per step"
    )
    p.add_argument("--steps", type=int, default=10, help="steps per arm (fewer if the data ends)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the summary")
    p.add_argument(
        "--check-steps", default="0,-1", help="steps (negative: from the end) with the top-k check"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attn-weight",
        type=float,
        default=None,
        help="CostModel attn_weight (default: per preset)",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads per rank")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=480.0,
        help="no round starts that would end later (0: none)",
    )
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def run_config(preset: str) -> Any:
    from benchmarks.e2e_ablation.config import PRESETS

    return PRESETS["h200" if preset == "h200" else "smoke"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def self_checks(
    run: Any, device: torch.device, indexer_fn: Any
) -> tuple[str, bool, dict[str, Any]]:
    """(attention impl, Triton CE?, messages): the e2e kernels' self-checks on every rank, agreed
    over the world (a kernel is used only where it passed everywhere), and the indexer against
    the windowed torch reference on a small packed problem."""
    from benchmarks.e2e_ablation.indexers import self_check_problem
    from benchmarks.multigpu.cp_model import windowed_reference_topk

    m = run.model
    notes: dict[str, Any] = {}
    attn_ok = ce_ok = False
    if device.type == "cuda":
        from benchmarks.e2e_ablation.loss import self_check as ce_check
        from benchmarks.e2e_ablation.sparse_attention import self_check as attn_check

        dtype = getattr(torch, run.dtype)
        attn_ok, notes["sparse_attention"] = attn_check(
            device, dtype, h=m.n_heads, dc=m.kv_dim, dr=m.rope_dim, topk=m.index_topk
        )
        ce_ok, notes["cross_entropy"] = ce_check(device, dtype, vocab=m.vocab_size)
    flags = torch.tensor([int(attn_ok), int(ce_ok)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    attention = "triton" if int(flags[0]) else "torch"
    q, k, w, ks, ke = self_check_problem(m.index_heads, m.index_dim)
    got = indexer_fn(*(x.to(device) for x in (q, k, w, ks, ke)), 64).cpu()
    ref = windowed_reference_topk(q, k, w, ks, ke, 64)
    notes["indexer_vs_reference_slots_identical"] = float((got == ref).float().mean())
    notes["attention_impl"], notes["ce_impl"] = attention, "triton" if int(flags[1]) else "torch"
    return attention, bool(int(flags[1])), notes


def plan_rows(stream: Any, steps: int) -> list[list[int]]:
    """The global rows of each of the first `steps` steps (all DP ranks), from the shim's planner."""
    from packshard.trainer_shim import Position

    out, pos = [], Position(0, 0, 0)
    for _ in range(steps):
        plan = stream.planner.plan(pos)
        out.append(sorted(int(r) for r in plan.rows.ravel() if r >= 0))
        pos = plan.next_position(stream.dataset.num_rows)
    return out


def allreduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum every gradient over the world (each rank's loss is already over the step's labels)."""
    handles = [dist.all_reduce(p.grad, async_op=True) for p in params if p.grad is not None]
    for h in handles:
        h.wait()


def moe_slots(model: Any) -> tuple[int, int]:
    """(expert slots computed, (token, expert) pairs routed) since the last call, all layers."""
    slots = pairs = 0
    for block, calls in zip(model.blocks, model.moe_stats(), strict=True):
        for c in calls:
            slots += block.moe.n_experts * block.moe.capacity_of(c[0])
            pairs += int(c[0].sum())
    return slots, pairs


def run_step(arm: ArmState, step: int, ctx: dict[str, Any], capture: bool) -> dict[str, Any]:
    """One optimizer step of one arm on this rank; returns the step's record (rank 0: whole)."""
    from benchmarks.multigpu.cp_model import cp_loss, pads_as_document
    from benchmarks.multigpu.topk_check import check_captured

    run, device, cp, topo = ctx["run"], ctx["device"], ctx["cp"], ctx["topo"]
    mbs = [next(arm.iterator) for _ in range(arm.stream.num_micro_steps)]
    if any(int(mb["step"]) != step for mb in mbs):
        raise RuntimeError(
            f"arm {arm.name}: expected micro-batches of step {step}, got steps {[int(mb['step']) for mb in mbs]}"
        )
    if arm.pads_as_document:
        mbs = [pads_as_document(mb) for mb in mbs]
    arm.rows.append([int(mb["row"]) for mb in mbs])
    labels = torch.tensor(
        [float(sum(int((mb["labels"] != -100).sum()) for mb in mbs))],
        device=ctx["comm_device"],
        dtype=torch.float64,
    )
    dist.all_reduce(labels)  # also lines the ranks up before the step
    norm = max(1.0, float(labels.item()))
    for g in arm.optimizer.param_groups:
        g["lr"] = run.lr * min(1.0, (step + 1) / max(1, run.warmup_steps))
    _sync(device)
    arm.meter.start()
    captured: list[Any] = []
    if device.type == "cuda":
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
    t0, c0 = time.perf_counter(), time.thread_time()
    total = torch.zeros((), device=device)
    for i, mb in enumerate(mbs):
        arm.indexer.capture = captured if (capture and i == 0) else None
        loss = cp_loss(arm.model, mb, cp=cp, indexer=arm.indexer, attention=arm.attention, dtype=ctx["dtype"],
                       loss_norm=norm, ce_chunk=run.ce_chunk, ce_triton=ctx["ce_triton"])  # fmt: skip
        loss.backward()
        total += loss.detach()
        arm.meter.update(mb)
    arm.indexer.capture = None
    if device.type == "cuda":
        ev1.record()
    t1, c1 = time.perf_counter(), time.thread_time()
    params = ctx["params"][arm.name]
    allreduce_grads(params)
    torch.nn.utils.clip_grad_norm_(params, run.grad_clip)
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)
    loads = [b.moe.step_loads for b in arm.model.blocks]
    for x in loads:
        dist.all_reduce(x)  # one router bias for the whole job (every token the step fed)
    arm.model.update_router_biases(run.router_bias_rate)
    stats = arm.meter.step(step)
    compute = ev0.elapsed_time(ev1) / 1e3 if device.type == "cuda" else t1 - t0
    slots, pairs = moe_slots(arm.model)
    cost = float(
        sum(
            arm.meter.cost_model.row_costs(
                np.array([int(mb["num_tokens"])]), np.array([int(mb["attn_cost"])])
            )[0]
            for mb in mbs
        )
    )
    # sum of squared document lengths as run: padseq's padding is one more document
    attn = sum(
        int(mb["attn_cost"])
        + (arm.pads_as_document * (int(mb["padded_len"]) - int(mb["num_tokens"])) ** 2)
        for mb in mbs
    )
    mine = torch.tensor(
        [compute, float(total), sum(int(mb["row"]) >= 0 for mb in mbs), sum(int(mb["num_tokens"]) for mb in mbs),
         sum(int(mb["padded_len"]) for mb in mbs), cost, slots, pairs, t1 - t0, c1 - c0, attn],
        dtype=torch.float64, device=ctx["comm_device"],
    )  # fmt: skip
    parts = [torch.empty_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(parts, mine)
    per_rank = torch.stack(parts).cpu().numpy()
    checks = None
    if capture:
        checks = check_captured(captured, cp, ctx["indexer_fn"], run.model.index_topk)
        del captured
    record = {
        "arm": arm.name, "step": step, "step_time_s": stats.step_time_s, "num_tokens": stats.num_tokens,
        "padded_tokens": stats.padded_tokens, "rows": stats.rows, "fillers": stats.fillers,
        "tokens_per_s": stats.tokens_per_s, "meter_imbalance": stats.imbalance,
        "padding_fraction": stats.padding_fraction, "loss": float(per_rank[:, 1].sum()),
        "rank_compute_s": per_rank[:, 0].tolist(), "rank_wall_compute_s": per_rank[:, 8].tolist(),
        "rank_cpu_s": per_rank[:, 9].tolist(), "rank_attn": per_rank[:, 10].tolist(),
        "rank_rows": per_rank[:, 2].astype(int).tolist(), "rank_tokens": per_rank[:, 3].astype(int).tolist(),
        "rank_padded": per_rank[:, 4].astype(int).tolist(), "rank_cost": per_rank[:, 5].tolist(),
        "expert_slots": int(per_rank[:, 6].sum()), "expert_pairs": int(per_rank[:, 7].sum()),
    }  # fmt: skip
    dp_compute = per_rank[:, 0].reshape(topo.dp_size, topo.cp_size).max(axis=1)
    record["dp_compute_s"] = dp_compute.tolist()
    record["compute_imbalance"] = float(dp_compute.max() / max(dp_compute.mean(), 1e-12))
    record["dp_cpu_s"] = per_rank[:, 9].reshape(topo.dp_size, topo.cp_size).max(axis=1).tolist()
    if checks is not None:
        views: list[Any] = [None] * topo.world_size
        dist.all_gather_object(
            views, {"rank": topo.rank, "dp_rank": topo.dp_rank, "checks": checks}
        )
        record["topk_checks"] = [
            v for v in views if v["rank"] % topo.cp_size == 0
        ]  # one per CP group
    return record


def setup_arms(args: argparse.Namespace, names: list[str], ctx: dict[str, Any]) -> list[ArmState]:
    from benchmarks.e2e_ablation.model import DSAModel
    from benchmarks.multigpu.cp_model import CPAttention, CPIndexer
    from packshard.packers import CostModel
    from packshard.trainer_shim import PackedShardStream, TrainedTokenMeter

    topo, device, run = ctx["topo"], ctx["device"], ctx["run"]
    cost_model = CostModel(1.0, ctx["attn_weight"])
    torch.manual_seed(args.seed)
    with torch.device(device):
        base = DSAModel(run.model)
    for t in list(base.parameters()) + list(base.buffers()):
        dist.broadcast(t.data, src=0)  # the same initial weights everywhere, whatever the RNG
    arms = []
    for name in names:
        sub = "padseq" if name == "padseq" else "pad8"
        arm = ArmState(
            name,
            str(args.data / sub),
            "count" if name in ("padseq", "count") else "cost",
            name == "padseq",
        )
        arm.stream = PackedShardStream(
            arm.url, **topo.as_kwargs(), rows_per_step=args.rows_per_rank * topo.dp_size, seed=args.seed, epochs=1,
            shuffle=True, cp_layout=args.cp_layout, balance=arm.balance, device=device if device.type == "cuda" else None,
            cost_model=cost_model,
        )  # fmt: skip
        arm.model = copy.deepcopy(base)
        params = [p for p in arm.model.parameters() if p.requires_grad]
        ctx["params"][name] = params
        arm.optimizer = torch.optim.AdamW(params, lr=run.lr, betas=(0.9, 0.95), weight_decay=run.weight_decay,
                                          fused=device.type == "cuda")  # fmt: skip
        arm.meter = TrainedTokenMeter(
            dp_rank=topo.dp_rank, num_gpus=topo.world_size, cost_model=cost_model
        )
        arm.indexer = CPIndexer(ctx["indexer_fn"], ctx["cp"])
        arm.attention = CPAttention(ctx["attention"], ctx["cp"])
        arms.append(arm)
    del base
    return arms


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s r%(process)d: %(message)s", force=True
    )
    gpu = args.preset == "h200"
    env_seen = check_multicast_env(gpu)
    names = [a for a in args.arms.split(",") if a]
    bad = [a for a in names if a not in ARM_NAMES]
    if bad or not names:
        raise SystemExit(f"--arms {args.arms!r}: choose among {ARM_NAMES}")
    if gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--preset h200 needs CUDA GPUs (use --preset cpu for the gloo proxy)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    from benchmarks._results import run_stamp
    from benchmarks.multigpu.cp_model import CPGroup, windowed_reference_topk
    from packshard.kernels import fp8_indexer_topk
    from packshard.trainer_shim import Topology, new_process_groups

    topo = Topology.from_env(cp_size=args.cp)
    _, cp_group = new_process_groups(topo)
    cp = CPGroup(cp_group, topo.cp_rank, topo.cp_size, args.cp_layout, nccl=gpu)
    run = run_config(args.preset)
    indexer_fn = fp8_indexer_topk if gpu else windowed_reference_topk
    attention, ce_triton, notes = self_checks(run, device, indexer_fn)
    ctx: dict[str, Any] = {
        "run": run, "device": device, "comm_device": device, "cp": cp, "topo": topo, "dtype": getattr(torch, run.dtype),
        "indexer_fn": indexer_fn, "attention": attention, "ce_triton": ce_triton, "params": {},
        "attn_weight": args.attn_weight if args.attn_weight is not None else (H200_ATTN_WEIGHT if gpu else CPU_ATTN_WEIGHT),
    }  # fmt: skip
    arms = setup_arms(args, names, ctx)
    steps = min([args.steps] + [a.stream.steps_per_epoch for a in arms])
    # the padded and unpadded datasets must give the same rows at every step (same plan, same seed)
    plans = {a.name: plan_rows(a.stream, steps) for a in arms}
    same_rows = all(p == plans[names[0]] for p in plans.values())
    if not same_rows:
        log.warning("the arms' steps hold different rows: %s", {k: v[:2] for k, v in plans.items()})
    checks = sorted(
        {s if s >= 0 else steps + s for s in (int(x) for x in args.check_steps.split(",") if x)}
        & set(range(steps))
    )
    result: dict[str, Any] = {
        **run_stamp(),
        "device": torch.cuda.get_device_name(device) if gpu else "cpu", "backend": dist.get_backend(),
        "topology": {"world": topo.world_size, "dp": topo.dp_size, "cp": topo.cp_size, "cp_layout": args.cp_layout},
        "preset": args.preset, "model": run.model.__dict__, "dtype": run.dtype, "rows_per_rank": args.rows_per_rank,
        "rows_per_step": args.rows_per_rank * topo.dp_size, "steps_planned": steps, "warmup": args.warmup,
        "check_steps": checks, "attn_weight": ctx["attn_weight"], "multicast_env": env_seen, "self_checks": notes,
        "data": {a.name: a.stream.dataset.manifest["totals"] for a in arms}, "data_dir": str(args.data),
        "same_rows_per_step": same_rows, "arms": names, "records": [], "notes": [],
    }  # fmt: skip
    if topo.rank == 0:
        log.info("dp %d x cp %d (%s), %s, %d steps x %d rows; self-checks %s", topo.dp_size, topo.cp_size,
                 args.cp_layout, result["device"], steps, result["rows_per_step"], notes)  # fmt: skip
    for a in arms:
        a.iterator = iter(a.stream)
    deadline = args.deadline_s or None
    last_round = 0.0
    for step in range(steps):
        go = torch.tensor([1], device=device)
        if topo.rank == 0 and deadline is not None and step > 0:
            elapsed = time.monotonic() - PROCESS_START
            go[0] = int(elapsed + 1.3 * last_round + 10.0 < deadline)
        dist.broadcast(go, src=0)
        if not int(go[0]):
            result["notes"].append(
                f"deadline (--deadline-s {args.deadline_s:.0f}): stopped after {step} of {steps} steps"
            )
            log.warning(result["notes"][-1])
            break
        t_round = time.monotonic()
        shift = step % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            rec = run_step(arm, step, ctx, capture=step in checks)
            result["records"].append(rec)
            if topo.rank == 0:
                log.info("step %d %-6s loss %.5f, %.3f s, %.0f tok/s, compute max/mean %.3f (%s), meter imbalance %.3f%s",
                         step, arm.name, rec["loss"], rec["step_time_s"], rec["tokens_per_s"], rec["compute_imbalance"],
                         ", ".join(f"{x:.3f}" for x in rec["dp_compute_s"]), rec["meter_imbalance"],
                         "" if "topk_checks" not in rec else f", top-k checks {_check_line(rec['topk_checks'])}")  # fmt: skip
        last_round = time.monotonic() - t_round
        if topo.rank == 0:
            result["elapsed_s"] = time.monotonic() - PROCESS_START
            write_json(args.out, result)
    rows = [None] * topo.world_size
    dist.all_gather_object(rows, {"rank": topo.rank, "dp_rank": topo.dp_rank, "cp_rank": topo.cp_rank,
                                  "rows": {a.name: a.rows for a in arms}})  # fmt: skip
    for a in arms:
        a.stream.close()
    if topo.rank == 0:
        result["rank_rows"] = rows
        result["elapsed_s"] = time.monotonic() - PROCESS_START
        write_json(args.out, result)
        log.info("wrote %s", args.out / RESULTS_JSON)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _check_line(views: list[dict[str, Any]]) -> str:
    from benchmarks.multigpu.topk_check import verdict

    ok = all(verdict(v["checks"]) for v in views)
    n = sum(len(v["checks"]) for v in views)
    return f"{'PASS' if ok else 'FAIL'} ({n} calls)"


def write_json(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (RESULTS_JSON + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out / RESULTS_JSON)


if __name__ == "__main__":
    raise SystemExit(main())
