"""Train every arm on its micro-batches, interleaved step by step, and record what happened.

One base model is initialised from the seed and deep-copied per arm, so every arm starts from
the same weights; each has its own AdamW (betas 0.9/0.95, linear warm-up, grad-norm clip) and
its own router biases (DeepSeek-V3 balancing, updated after every optimizer step from the loads
of every token the arm fed, padding included). A step is `rows_per_step` micro-batches of one
row each; each micro-batch's summed loss is divided by the step's loss-token count before
backward, so the step's gradient is the mean over the step's loss tokens whatever the padding.

Interleaving (step s runs every arm before step s+1, arms in an order rotated by s) keeps
clock, thermal and allocator drift out of the comparison. The step time is wall time between
two device synchronisations around the step (forward, backward, clip, optimizer, bias
update), read from each arm's `TrainedTokenMeter`; an autotuning arm's retuning happens inside
its forward and is part of its step, as it is in a real run, and is also reported on its own.

Host syncs per step: one per MoE call (the buffer size), two per indexer call (inside
kernels/: the ranges for chunk planning, the fallback-row count), one at the end (the loss and
the step clock). Nothing else reads the device: the MoE statistics come back with the MoE's own
sync, the balancing runs on the device.

`same_weights_losses` evaluates one model on every arm's rows of a step (no gradient): with
the same weights the arms must agree to rounding, whatever their training trajectories did.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.e2e_ablation.arms import MicroBatch
from benchmarks.e2e_ablation.config import ARM_BY_NUMBER, RunConfig
from benchmarks.e2e_ablation.indexers import Indexer
from benchmarks.e2e_ablation.model import DSAModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Impl:
    """Which implementation runs the model's two hand-written parts (decided by self-checks)."""

    attention: str = "torch"
    ce_triton: bool = False


@dataclass
class ArmRun:
    """One arm's model, optimizer, data and measurements."""

    number: int
    model: DSAModel
    optimizer: torch.optim.Optimizer
    indexer: Indexer
    batches: list[MicroBatch]
    meter: Any
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tune_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss_tokens: list[int] = field(default_factory=list)
    padded: list[int] = field(default_factory=list)
    moe_capacity: list[list[int]] = field(
        default_factory=list
    )  # per step, per layer: max over micro-batches
    moe_max_load: list[list[int]] = field(default_factory=list)  # same, busiest expert (all tokens)
    moe_real_imbalance: list[list[float]] = field(
        default_factory=list
    )  # same, max/mean over real tokens
    expert_slots: list[int] = field(
        default_factory=list
    )  # per step: expert rows computed (E x capacity, summed)
    expert_pairs: list[int] = field(default_factory=list)  # per step: (token, expert) pairs routed
    router_bias_range: list[float] = field(
        default_factory=list
    )  # per step: max - min bias, over layers
    error: str | None = None

    def record(self) -> dict[str, Any]:
        arm = ARM_BY_NUMBER[self.number]
        return {
            "number": self.number, "name": arm.name, "label": arm.label, "control_of": arm.control_of,
            "indexer": self.indexer.describe(), "losses": self.losses, "step_times_s": self.step_times,
            "tune_times_s": self.tune_times, "num_tokens": self.tokens, "num_loss_tokens": self.loss_tokens,
            "padded_tokens": self.padded, "moe_capacity": self.moe_capacity, "moe_max_load": self.moe_max_load,
            "moe_real_imbalance": self.moe_real_imbalance, "expert_slots": self.expert_slots,
            "expert_pairs": self.expert_pairs, "router_bias_range": self.router_bias_range, "error": self.error,
            "meter": [s.as_dict() for s in self.meter.history],
        }  # fmt: skip


def build_base_model(run: RunConfig, device: torch.device) -> DSAModel:
    torch.manual_seed(run.seed)
    with torch.device(device):
        model = DSAModel(run.model)
    return model


def make_arm(
    number: int,
    base: DSAModel,
    indexer: Indexer,
    batches: list[MicroBatch],
    run: RunConfig,
    device: torch.device,
) -> ArmRun:
    from packshard.trainer_shim import TrainedTokenMeter

    model = copy.deepcopy(base)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=run.lr,
        betas=(0.9, 0.95),
        weight_decay=run.weight_decay,
        fused=device.type == "cuda",
    )
    on_device = [mb.to(device) for mb in batches]
    return ArmRun(number, model, opt, indexer, on_device, TrainedTokenMeter(dp_rank=0, num_gpus=1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_moe(arm: ArmRun, model: DSAModel) -> None:
    """Fold the MoE calls of this step (per layer, per micro-batch [2, E] host loads) into the record."""
    per_layer = model.moe_stats()
    moes = [b.moe for b in model.blocks]
    experts = moes[0].n_experts
    caps = [
        [moe.capacity_of(c[0]) for c in calls] for moe, calls in zip(moes, per_layer, strict=True)
    ]
    arm.moe_capacity.append([max(c) for c in caps])
    arm.moe_max_load.append([max(int(c[0].max()) for c in calls) for calls in per_layer])
    arm.moe_real_imbalance.append(
        [
            max(float(c[1].max()) * experts / max(1, int(c[1].sum())) for c in calls)
            for calls in per_layer
        ]
    )
    arm.expert_slots.append(experts * sum(sum(c) for c in caps))
    arm.expert_pairs.append(sum(int(c[0].sum()) for calls in per_layer for c in calls))


def train_step(arm: ArmRun, step: int, run: RunConfig, device: torch.device, impl: Impl) -> float:
    """Run optimizer step `step` (1-based) of this arm; returns the step's mean loss."""
    micro = arm.batches[(step - 1) * run.rows_per_step : step * run.rows_per_step]
    norm = max(1, sum(mb.meta["num_loss_tokens"] for mb in micro))
    dtype = getattr(torch, run.dtype)
    for g in arm.optimizer.param_groups:
        g["lr"] = run.lr * min(1.0, step / max(1, run.warmup_steps))
    tune0 = arm.indexer.tune_seconds
    _sync(device)
    arm.meter.start()
    total = torch.zeros((), device=device)
    for mb in micro:
        loss = arm.model(
            mb.tensors, loss_norm=norm, indexer=arm.indexer, attention=impl.attention, dtype=dtype,
            ce_chunk=run.ce_chunk, ce_triton=impl.ce_triton, n_real=mb.meta["num_tokens"],
        )  # fmt: skip
        aux = arm.model.aux_loss() if run.router_aux_weight > 0 else None
        (loss if aux is None else loss + aux * (run.router_aux_weight / len(micro))).backward()
        total += loss.detach()
        arm.meter.update(mb.meta)
    params = [p for p in arm.model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, run.grad_clip)
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)
    arm.model.update_router_biases(run.router_bias_rate)
    value = float(total)  # synchronises
    _sync(device)
    stats = arm.meter.step(step)
    arm.losses.append(value)
    arm.step_times.append(stats.step_time_s)
    arm.tune_times.append(arm.indexer.tune_seconds - tune0)
    arm.tokens.append(stats.num_tokens)
    arm.loss_tokens.append(stats.num_loss_tokens)
    arm.padded.append(stats.padded_tokens)
    _record_moe(arm, arm.model)
    biases = torch.stack([b.moe.expert_bias for b in arm.model.blocks])
    arm.router_bias_range.append(float((biases.max(1).values - biases.min(1).values).max()))
    return value


def train_interleaved(
    arms: list[ArmRun], run: RunConfig, device: torch.device, impl: Impl, *, deadline: float | None = None,
    reserve_s: float = 0.0,
) -> tuple[int, bool]:  # fmt: skip
    """Run steps 1..run.steps of every arm, interleaved. Returns (steps completed, stopped early).

    With a `deadline` (time.monotonic()), no step starts unless 1.2x the last interleaved
    step's duration plus `reserve_s` still fits before it. An arm whose step raises (a kernel that
    fails to build or launch, say) is recorded with its error and dropped; the others
    continue. A CUDA fault poisons the context, so then every later arm fails too and the
    workload ends with their errors recorded."""
    live = list(arms)
    last = 0.0
    for step in range(1, run.steps + 1):
        if (
            deadline is not None
            and step > 1
            and time.monotonic() + 1.2 * last + reserve_s > deadline
        ):
            log.warning(
                "deadline: step %d (~%.1f s) would end past it; stopping this workload after %d of %d steps",
                step, last, step - 1, run.steps,
            )  # fmt: skip
            return step - 1, True
        t0 = time.monotonic()
        shift = (step - 1) % max(1, len(live))
        for arm in live[shift:] + live[:shift]:
            try:
                loss = train_step(arm, step, run, device, impl)
            except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
                log.exception("arm %d failed at step %d; dropping it", arm.number, step)
                arm.error = f"step {step}: {type(e).__name__}: {e}"[:2000]
                arm.optimizer.zero_grad(set_to_none=True)
                continue
            log.info(
                "step %2d arm %d: loss %.5f, %.3f s (tuning %.3f s), slots/pair %.2f, real max/mean %.2f",
                step, arm.number, loss, arm.step_times[-1], arm.tune_times[-1],
                arm.expert_slots[-1] / max(1, arm.expert_pairs[-1]), max(arm.moe_real_imbalance[-1]),
            )  # fmt: skip
        last = time.monotonic() - t0
        live = [a for a in live if a.error is None]
        if not live:
            log.error("every arm failed; stopping this workload")
            return step, True
    return run.steps, False


@torch.no_grad()
def same_weights_losses(
    model: DSAModel, arms: list[ArmRun], step: int, run: RunConfig, device: torch.device, impl: Impl
) -> dict[str, float]:
    """{arm number: loss of `model` on that arm's micro-batches of `step`}, each arm's rows run
    with its own indexer; forward only. The router biases are left as they were."""
    dtype = getattr(torch, run.dtype)
    out: dict[str, float] = {}
    saved = [b.moe.step_loads.clone() for b in model.blocks]
    for arm in arms:
        micro = arm.batches[(step - 1) * run.rows_per_step : step * run.rows_per_step]
        norm = max(1, sum(mb.meta["num_loss_tokens"] for mb in micro))
        total = torch.zeros((), device=device)
        for mb in micro:
            total += model(
                mb.tensors, loss_norm=norm, indexer=arm.indexer, attention=impl.attention, dtype=dtype,
                ce_chunk=run.ce_chunk, ce_triton=impl.ce_triton, n_real=mb.meta["num_tokens"], with_grad=False,
            )  # fmt: skip
        out[str(arm.number)] = float(total)
    model.moe_stats()  # drop this evaluation's statistics
    for b, loads in zip(model.blocks, saved, strict=True):
        b.moe.step_loads.copy_(loads)
    return out
