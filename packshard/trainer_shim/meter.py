"""Trained-token throughput: what the DP group really trained on per second, not seq_len x rows.

`TrainedTokenMeter` is fed every micro-batch (`update(mb)`: whole-row counts, plain ints, no
device sync) and closed once per optimizer step (`step()`), which all-gathers an 8-number
vector per rank over the process group (default: the world) when torch.distributed is
initialised. Contributions are de-duplicated by dp_rank, so the CP ranks of a DP group, which
all see the same row, count it once, whatever group is used. It reports per step:

- ``num_tokens``: true tokens summed over the DP group (padding and fillers excluded);
- ``step_time_s``: wall time since the previous `step()` (or `start()`); the all-gather waits
  for the slowest rank, so this is the step as the job experiences it;
- ``tokens_per_s`` (trained tokens/s), ``tokens_per_s_per_gpu`` (divided by every GPU of the
  job, dp x cp by default), ``loss_tokens_per_s``;
- ``padding_fraction``: padded positions / all positions fed, fillers included;
- ``imbalance``: max / mean of the DP ranks' step cost (`CostModel` over the rows they ran);
- ``mfu``: with a `FlopsModel` and a peak, achieved / peak FLOPs.

FLOPs model (training, forward + backward = 3 x forward), per row:

    6 * num_params * num_tokens  +  6 * num_layers * attn_dim * sum_d L_d^2

The first term is the matmuls (2 FLOPs per parameter per token forward). The second is causal
attention counted per document d of length L_d: QK^T and PV are 2 * 2 * attn_dim FLOPs per
(query, key) pair and a causal document has L_d^2 / 2 pairs, i.e. 2 * attn_dim * L_d^2 forward
per layer. Counting seq_len^2 instead would credit attention across documents that the mask
removes (a 32K row of 100 documents of 320 tokens: 100x too much attention).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from packshard._extras import require
from packshard.packers import CostModel

require("train", "torch", "packshard.trainer_shim.meter")  # before torch is imported
import torch  # noqa: E402

# a row's counts the meter takes from a micro-batch (the whole row's, on every CP rank)
COUNT_KEYS = ("num_tokens", "num_loss_tokens", "padded_len", "attn_cost", "row")


@dataclass(frozen=True)
class FlopsModel:
    """Training FLOPs of a decoder-only transformer (module docstring). `num_params`: the
    parameters every token multiplies (exclude the input embedding table; include the output
    projection); `attn_dim`: query heads x head dim."""

    num_params: int
    num_layers: int
    attn_dim: int

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "attn_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"FlopsModel.{name} must be >= 0, got {getattr(self, name)}")

    def row_flops(self, num_tokens: int | float, attn_cost: int | float) -> float:
        """FLOPs to train on one row with `num_tokens` true tokens and sum(L_d^2) = attn_cost."""
        return 6.0 * self.num_params * float(
            num_tokens
        ) + 6.0 * self.num_layers * self.attn_dim * float(attn_cost)


@dataclass(frozen=True)
class StepStats:
    """One step's numbers over the DP group (module docstring)."""

    step: int
    step_time_s: float
    num_tokens: int
    num_loss_tokens: int
    padded_tokens: int
    rows: int
    fillers: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    loss_tokens_per_s: float
    padding_fraction: float
    imbalance: float
    flops: float | None
    mfu: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """One log line."""
        out = (
            f"step {self.step}: {self.num_tokens} tokens in {self.step_time_s * 1e3:.1f} ms, "
            f"{self.tokens_per_s:,.0f} tok/s ({self.tokens_per_s_per_gpu:,.0f}/GPU), "
            f"loss {self.loss_tokens_per_s:,.0f} tok/s, padding {self.padding_fraction:.2%}, imbalance {self.imbalance:.3f}"
        )
        return out + (f", MFU {self.mfu:.1%}" if self.mfu is not None else "")


# per-rank vector: dp_rank, tokens, loss tokens, padded, cost, flops, rows, fillers
_FIELDS = 8


class TrainedTokenMeter:
    """Trained tokens/s over the DP group; one per rank, fed every micro-batch."""

    def __init__(
        self,
        *,
        dp_rank: int = 0,
        group: Any = None,
        num_gpus: int | None = None,
        cost_model: CostModel | None = None,
        flops_model: FlopsModel | None = None,
        peak_flops_per_gpu: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if peak_flops_per_gpu is not None and (flops_model is None or peak_flops_per_gpu <= 0):
            raise ValueError("peak_flops_per_gpu needs a flops_model and must be > 0")
        self.dp_rank = dp_rank
        self.group = group
        self.cost_model = cost_model or CostModel()
        self.flops_model = flops_model
        self.peak_flops_per_gpu = peak_flops_per_gpu
        self._clock = clock
        self._num_gpus = num_gpus
        self._acc = np.zeros(_FIELDS, dtype=np.float64)
        self._t0 = clock()
        self.history: list[StepStats] = []
        self.total_tokens = 0
        self.total_time_s = 0.0

    def start(self) -> None:
        """Restart the step clock (call after warm-up or a checkpoint save)."""
        self._t0 = self._clock()

    def update(self, mb: Mapping[str, Any]) -> None:
        """Count one micro-batch (its whole row: call on every CP rank, it is counted once)."""
        missing = [k for k in COUNT_KEYS if k not in mb]
        if missing:
            raise KeyError(
                f"TrainedTokenMeter.update takes one micro-batch or item as the stream yields it "
                f"(a row's counts); this one lacks {missing} (a collated batch has none: update "
                "with each of its items)"
            )
        n, attn = int(mb["num_tokens"]), int(mb["attn_cost"])
        self._acc[1] += n
        self._acc[2] += int(mb["num_loss_tokens"])
        self._acc[3] += int(mb["padded_len"])
        self._acc[4] += float(self.cost_model.row_costs(np.array([n]), np.array([attn]))[0])
        if self.flops_model is not None:
            self._acc[5] += self.flops_model.row_flops(n, attn)
        self._acc[6 if int(mb["row"]) >= 0 else 7] += 1

    def _gather(self) -> np.ndarray:
        import torch.distributed as dist

        mine = self._acc.copy()
        mine[0] = self.dp_rank
        if not (dist.is_available() and dist.is_initialized()):
            return mine[None, :]
        device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.from_numpy(mine).to(device)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out).cpu().numpy()

    def num_gpus(self) -> int:
        if self._num_gpus is not None:
            return self._num_gpus
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def step(self, step: int | None = None) -> StepStats:
        """Close the step: gather over the group, compute the numbers, reset. Collective."""
        rows = self._gather()
        now = self._clock()
        dt = max(now - self._t0, 1e-12)
        self._t0 = now
        self._acc[:] = 0
        _, first = np.unique(rows[:, 0], return_index=True)  # one contribution per DP rank
        per_dp = rows[np.sort(first)]
        tot = per_dp.sum(axis=0)
        costs = per_dp[:, 4]
        gpus = self.num_gpus()
        flops = float(tot[5]) if self.flops_model is not None else None
        stats = StepStats(
            step=len(self.history) if step is None else step,
            step_time_s=dt,
            num_tokens=int(tot[1]),
            num_loss_tokens=int(tot[2]),
            padded_tokens=int(tot[3]),
            rows=int(tot[6]),
            fillers=int(tot[7]),
            tokens_per_s=tot[1] / dt,
            tokens_per_s_per_gpu=tot[1] / dt / gpus,
            loss_tokens_per_s=tot[2] / dt,
            padding_fraction=float((tot[3] - tot[1]) / tot[3]) if tot[3] else 0.0,
            imbalance=float(costs.max() / costs.mean()) if costs.mean() > 0 else 1.0,
            flops=flops,
            mfu=flops / (dt * gpus * self.peak_flops_per_gpu)
            if flops is not None and self.peak_flops_per_gpu
            else None,
        )
        self.history.append(stats)
        self.total_tokens += stats.num_tokens
        self.total_time_s += dt
        return stats

    @property
    def mean_tokens_per_s(self) -> float:
        """Trained tokens/s over every step so far."""
        return self.total_tokens / self.total_time_s if self.total_time_s else 0.0
