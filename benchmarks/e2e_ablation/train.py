"""Train every arm on its micro-batches, interleaved step by step, and record what happened.

One base model is initialised from the seed and deep-copied per arm, so every arm starts from
the same weights; each has its own AdamW (betas 0.9/0.95, linear warm-up, grad-norm clip). A
step is `rows_per_step` micro-batches of one row each; each micro-batch's summed loss is
divided by the step's loss-token count before backward, so the step's gradient is the mean
over the step's loss tokens whatever the padding.

Interleaving (step s runs every arm before step s+1, arms in an order rotated by s) keeps
clock, thermal and allocator drift out of the comparison. The step time is wall time between
two device synchronisations around the step (forward, backward, clip, optimizer), read from
each arm's `TrainedTokenMeter`; an autotuning arm's retuning happens inside its forward and
is part of its step, as it is in a real run, and is also reported on its own.
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
    )  # per step: per layer, max over micro-batches
    moe_max_load: list[list[int]] = field(default_factory=list)
    expert_slots: list[int] = field(
        default_factory=list
    )  # per step: expert rows computed (E x capacity, summed)
    expert_pairs: list[int] = field(default_factory=list)  # per step: (token, expert) pairs routed
    error: str | None = None

    def record(self) -> dict[str, Any]:
        arm = ARM_BY_NUMBER[self.number]
        return {
            "number": self.number, "name": arm.name, "label": arm.label, "indexer": self.indexer.describe(),
            "losses": self.losses, "step_times_s": self.step_times, "tune_times_s": self.tune_times,
            "num_tokens": self.tokens, "num_loss_tokens": self.loss_tokens, "padded_tokens": self.padded,
            "moe_capacity": self.moe_capacity, "moe_max_load": self.moe_max_load, "expert_slots": self.expert_slots,
            "expert_pairs": self.expert_pairs, "error": self.error,
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
    from trainer_shim import TrainedTokenMeter

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


def train_step(
    arm: ArmRun, step: int, run: RunConfig, device: torch.device, attention: str
) -> float:
    """Run optimizer step `step` (1-based) of this arm; returns the step's mean loss."""
    micro = arm.batches[(step - 1) * run.rows_per_step : step * run.rows_per_step]
    norm = max(1, sum(mb.meta["num_loss_tokens"] for mb in micro))
    dtype = getattr(torch, run.dtype)
    for g in arm.optimizer.param_groups:
        g["lr"] = run.lr * min(1.0, step / max(1, run.warmup_steps))
    tune0 = arm.indexer.tune_seconds
    caps: list[list[int]] = []
    loads: list[list[int]] = []
    slots = pairs = 0
    experts = run.model.n_experts
    _sync(device)
    arm.meter.start()
    total = torch.zeros((), device=device)
    for mb in micro:
        loss = arm.model(
            mb.tensors,
            loss_norm=norm,
            indexer=arm.indexer,
            attention=attention,
            dtype=dtype,
            ce_chunk=run.ce_chunk,
        )
        loss.backward()
        total += loss.detach()
        arm.meter.update(mb.meta)
        moe = arm.model.moe_loads()
        loads.append([m[0] for m in moe])
        caps.append([m[2] for m in moe])
        slots += experts * sum(m[2] for m in moe)
        pairs += round(experts * sum(m[1] for m in moe))
    params = [p for p in arm.model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, run.grad_clip)
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)
    value = float(total)  # synchronises
    _sync(device)
    stats = arm.meter.step(step)
    arm.losses.append(value)
    arm.step_times.append(stats.step_time_s)
    arm.tune_times.append(arm.indexer.tune_seconds - tune0)
    arm.tokens.append(stats.num_tokens)
    arm.loss_tokens.append(stats.num_loss_tokens)
    arm.padded.append(stats.padded_tokens)
    arm.moe_capacity.append([max(c) for c in zip(*caps, strict=True)])
    arm.moe_max_load.append([max(c) for c in zip(*loads, strict=True)])
    arm.expert_slots.append(slots)
    arm.expert_pairs.append(pairs)
    return value


def train_interleaved(
    arms: list[ArmRun], run: RunConfig, device: torch.device, attention: str, *, deadline: float | None = None,
) -> tuple[int, bool]:  # fmt: skip
    """Run steps 1..run.steps of every arm, interleaved. Returns (steps completed, stopped early).

    An arm whose step raises (a kernel that fails to build or launch, say) is recorded with
    its error and dropped; the others continue. A CUDA fault poisons the context, so then
    every later arm fails too and the workload ends with their errors recorded."""
    live = list(arms)
    for step in range(1, run.steps + 1):
        shift = (step - 1) % max(1, len(live))
        for arm in live[shift:] + live[:shift]:
            try:
                loss = train_step(arm, step, run, device, attention)
            except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
                log.exception("arm %d failed at step %d; dropping it", arm.number, step)
                arm.error = f"step {step}: {type(e).__name__}: {e}"[:2000]
                arm.optimizer.zero_grad(set_to_none=True)
                continue
            log.info(
                "step %2d arm %d: loss %.5f, %.3f s (tuning %.3f s)",
                step,
                arm.number,
                loss,
                arm.step_times[-1],
                arm.tune_times[-1],
            )
        live = [a for a in live if a.error is None]
        if not live:
            log.error("every arm failed; stopping this workload")
            return step, True
        if deadline is not None and time.monotonic() > deadline and step < run.steps:
            log.warning(
                "deadline reached after step %d of %d: stopping this workload", step, run.steps
            )
            return step, True
    return run.steps, False
