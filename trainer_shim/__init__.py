"""trainer_shim: stream packshard rows into DP x CP ranks (equal work per rank), with exact
resume and trained-token throughput. Imports packers and torch only (never ray or pipeline).

Entry points: `PackedShardStream` (one per rank), `TrainedTokenMeter`, `Topology`
(ranks from the environment or a device mesh). Conventions of the micro-batch (labels,
position ids, cu_seqlens, ks/ke): `trainer_shim.microbatch`.

The pure modules (planning, cp, microbatch, state, topology) import no torch; the torch-backed
names (`PackedShardStream`, `TrainedTokenMeter`, ...) load on first use, so planning tools and
tests start in ~0.3 s instead of ~4 s.
"""

from typing import TYPE_CHECKING, Any

from trainer_shim.cp import CP_LAYOUTS, CpLayout, cp_positions, reassemble, row_divisor
from trainer_shim.microbatch import IGNORE_INDEX, build_microbatch
from trainer_shim.planning import (
    Balance,
    Position,
    StepPlan,
    StepPlanner,
    epoch_order,
    plan_step,
    step_imbalance,
)
from trainer_shim.state import STATE_VERSION, StreamState
from trainer_shim.topology import Topology, new_process_groups

if TYPE_CHECKING:
    from trainer_shim.meter import FlopsModel, StepStats, TrainedTokenMeter
    from trainer_shim.stream import PackedShardStream, StreamConfig, dataset_fingerprint

_LAZY = {
    "FlopsModel": "trainer_shim.meter",
    "StepStats": "trainer_shim.meter",
    "TrainedTokenMeter": "trainer_shim.meter",
    "PackedShardStream": "trainer_shim.stream",
    "StreamConfig": "trainer_shim.stream",
    "dataset_fingerprint": "trainer_shim.stream",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainer_shim' has no attribute {name!r}")


__all__ = [
    "CP_LAYOUTS",
    "IGNORE_INDEX",
    "STATE_VERSION",
    "Balance",
    "CpLayout",
    "FlopsModel",
    "PackedShardStream",
    "Position",
    "StepPlan",
    "StepPlanner",
    "StepStats",
    "StreamConfig",
    "StreamState",
    "Topology",
    "TrainedTokenMeter",
    "build_microbatch",
    "cp_positions",
    "dataset_fingerprint",
    "epoch_order",
    "new_process_groups",
    "plan_step",
    "reassemble",
    "row_divisor",
    "step_imbalance",
]
