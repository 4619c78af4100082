"""Step planning: which packed row each DP rank trains on at each micro-step. Pure functions.

Everything is computed from index.arrow's per-row numbers (no token data is read), by every
rank independently, with no communication: the same inputs give the same plan everywhere.

The plan, per epoch `e`:

1. **Global order.** ``order_e`` is a permutation of all rows, seeded by ``(seed, e)``
   (numpy PCG64 via ``SeedSequence([seed, e])``), or ``0..N-1`` without shuffling. It does not
   depend on the topology.
2. **Steps are contiguous blocks of it.** The step that starts at offset ``o`` of the epoch
   takes ``order_e[o : o + rows_per_step]`` (the epoch's last step may be shorter). So the rows
   a run has consumed are exactly a prefix of ``order_e``, whatever the dp_size was when each
   step ran: a state saved under dp_size=4 resumes under dp_size=2 (or with another
   rows_per_step) from the same offset, and over the epoch no row is skipped or repeated.
3. **Split across DP ranks.** A step's rows go to the dp_size ranks with equal counts
   (``rows_per_step / dp_size`` micro-steps each). A short last step is completed with filler
   micro-steps (row -1, zero cost), so every rank runs the same number of micro-steps and no
   collective hangs. ``balance="cost"`` uses `packers.partition_balanced` (LPT with a
   cardinality cap, then swaps) on `CostModel` costs. On the long-trajectory mix of
   benchmarks/bench_stream.py (dp=4, rows packed at 32K) the largest rank is 1.0% over the
   mean with 4 rows per rank per step (round-robin: 8.6%) and 0.01% with 8 (6.3%); with 2
   rows per rank it is 7%, the optimum for pairs (more rows per step balance better, and a
   trainer with gradient accumulation has them). It is never worse than round-robin: when
   the heuristic's largest load would exceed round-robin's, the round-robin split is used.
   ``balance="count"`` is plain round-robin in block order (what most loaders do).
4. **Order within a rank.** With ``"cost"``, a rank runs its rows heaviest first (ties by
   block position), so micro-step k of every rank holds rows of similar cost: under FSDP,
   whose all-gathers synchronise the DP ranks every micro-step, that keeps each micro-step
   balanced too, not only the step. With ``"count"``, block order. Fillers always come last.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from packshard.packers import part_loads, partition_balanced, partition_round_robin

Balance = Literal["cost", "count"]
BALANCES: tuple[str, ...] = ("cost", "count")
FILLER = -1


@dataclass(frozen=True)
class Position:
    """A step boundary: the next step is global step `step`, in epoch `epoch`, starting at
    offset `offset` of that epoch's row order (`offset` rows of the epoch are consumed)."""

    epoch: int
    offset: int
    step: int


@dataclass(frozen=True)
class StepPlan:
    """One global step: ``rows[r, k]`` is the global row (index.arrow position) that DP rank r
    trains on at micro-step k, or -1 for a filler."""

    step: int
    epoch: int
    offset: int
    rows: np.ndarray  # int64 [dp_size, micro_steps]
    num_real: int

    @property
    def num_micro_steps(self) -> int:
        return int(self.rows.shape[1])

    def next_position(self, num_rows: int) -> Position:
        """Where the step after this one starts (rolling over to the next epoch)."""
        end = self.offset + self.num_real
        if end >= num_rows:
            return Position(self.epoch + 1, 0, self.step + 1)
        return Position(self.epoch, end, self.step + 1)


def epoch_order(num_rows: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's global row order (int64), independent of the topology."""
    if not shuffle:
        return np.arange(num_rows, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_rows).astype(np.int64)


def partition_step(costs: np.ndarray, dp_size: int, balance: Balance) -> np.ndarray:
    """Rank of each of a step's items (equal counts). `costs` has a multiple of dp_size items."""
    if balance == "count":
        return partition_round_robin(costs.size, dp_size)
    rr = partition_round_robin(costs.size, dp_size)
    part = partition_balanced(costs, dp_size)
    if part_loads(costs, part, dp_size).max() > part_loads(costs, rr, dp_size).max():
        return rr
    return part


def plan_step(
    block: np.ndarray, costs: np.ndarray, *, dp_size: int, rows_per_step: int, balance: Balance
) -> np.ndarray:
    """Split one step's block of global rows (at most rows_per_step of them; fillers are added)
    over dp_size ranks: int64 [dp_size, rows_per_step // dp_size], ordered as the module says."""
    block = np.asarray(block, dtype=np.int64)
    n_fill = rows_per_step - block.size
    if n_fill < 0:
        raise ValueError(
            f"a step block holds {block.size} rows, more than rows_per_step={rows_per_step}"
        )
    items = np.concatenate((block, np.full(n_fill, FILLER, dtype=np.int64)))
    item_cost = np.concatenate((np.asarray(costs, dtype=np.float64)[block], np.zeros(n_fill)))
    part = partition_step(item_cost, dp_size, balance)
    position = np.arange(items.size)
    is_filler = items == FILLER
    if balance == "cost":
        keys = np.lexsort((position, -item_cost, is_filler, part))
    else:
        keys = np.lexsort((position, is_filler, part))
    return items[keys].reshape(dp_size, rows_per_step // dp_size)


class StepPlanner:
    """Plans steps for one dataset and run configuration (every rank builds the same one)."""

    def __init__(
        self,
        costs: np.ndarray,
        *,
        dp_size: int,
        rows_per_step: int,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = 1,
        balance: Balance = "cost",
    ) -> None:
        self.costs = np.asarray(costs, dtype=np.float64)
        if self.costs.ndim != 1 or self.costs.size == 0:
            raise ValueError(
                f"costs must be a non-empty 1-D array (one per row), got shape {self.costs.shape}"
            )
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if rows_per_step < 1 or rows_per_step % dp_size:
            raise ValueError(
                f"rows_per_step must be a positive multiple of dp_size={dp_size}, got {rows_per_step} "
                f"(e.g. {dp_size * max(1, rows_per_step // dp_size)})"
            )
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (endless), got {epochs}")
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r} is not known; choose one of {list(BALANCES)}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_rows = int(self.costs.size)
        self.dp_size = dp_size
        self.rows_per_step = rows_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.balance: Balance = balance
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def micro_steps(self) -> int:
        """Micro-steps per rank per step (rows_per_step / dp_size)."""
        return self.rows_per_step // self.dp_size

    def order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (
                epoch,
                epoch_order(self.num_rows, seed=self.seed, epoch=epoch, shuffle=self.shuffle),
            )
        return self._order_cache[1]

    def steps_in_epoch(self, offset: int = 0) -> int:
        """Steps from `offset` to the end of an epoch."""
        return -(-(self.num_rows - offset) // self.rows_per_step)

    def remaining_steps(self, start: Position) -> int | None:
        """Steps left from `start` (None when epochs is None)."""
        if self.epochs is None:
            return None
        if start.epoch >= self.epochs:
            return 0
        return (
            self.steps_in_epoch(start.offset)
            + (self.epochs - start.epoch - 1) * self.steps_in_epoch()
        )

    def plan(self, at: Position) -> StepPlan:
        """The step that starts at `at`."""
        if not 0 <= at.offset < self.num_rows:
            raise ValueError(f"offset {at.offset} is outside the epoch's [0, {self.num_rows}) rows")
        block = self.order(at.epoch)[at.offset : at.offset + self.rows_per_step]
        rows = plan_step(
            block,
            self.costs,
            dp_size=self.dp_size,
            rows_per_step=self.rows_per_step,
            balance=self.balance,
        )
        return StepPlan(
            step=at.step, epoch=at.epoch, offset=at.offset, rows=rows, num_real=int(block.size)
        )

    def steps(self, start: Position | None = None) -> Iterator[StepPlan]:
        """Every step from `start` (default: the beginning) to the end of the last epoch."""
        at = start or Position(0, 0, 0)
        while self.epochs is None or at.epoch < self.epochs:
            p = self.plan(at)
            yield p
            at = p.next_position(self.num_rows)


def step_imbalance(plan: StepPlan, costs: np.ndarray) -> float:
    """max / mean of the ranks' total cost in this step (fillers cost 0)."""
    c = np.where(plan.rows >= 0, np.asarray(costs, dtype=np.float64)[np.maximum(plan.rows, 0)], 0.0)
    loads = c.sum(axis=1)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0
