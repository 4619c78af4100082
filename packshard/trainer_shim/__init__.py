"""trainer_shim: stream packshard rows into DP x CP ranks (equal work per rank), with exact
resume and trained-token throughput. Imports packers and torch only (never ray or pipeline).

Entry points: `PackedShardStream` (one per rank), `TrainedTokenMeter`, `Topology`
(ranks from the environment or a device mesh). Trainer adapters, imported on first use and
only then needing their trainer: `PackedShardDataset`, `packed_collator`,
`StreamStateCallback`, `sft_trainer` (`trainer_shim.hf`: Hugging Face Trainer / TRL; needs
transformers, except the dataset) and `PackedShardDataLoader` (`trainer_shim.titan`: torchtitan). Conventions of the micro-batch (labels,
position ids, cu_seqlens, ks/ke): `trainer_shim.microbatch`.

The pure modules (planning, cp, microbatch, state, topology) import no torch; the torch-backed
names (`PackedShardStream`, `TrainedTokenMeter`, ...) load on first use, so planning tools and
tests start in ~0.3 s instead of ~4 s.
"""

from typing import TYPE_CHECKING, Any

from packshard.trainer_shim.cp import CP_LAYOUTS, CpLayout, cp_positions, reassemble, row_divisor
from packshard.trainer_shim.microbatch import IGNORE_INDEX, build_microbatch
from packshard.trainer_shim.planning import (
    Balance,
    Position,
    StepPlan,
    StepPlanner,
    epoch_order,
    plan_step,
    step_imbalance,
)
from packshard.trainer_shim.state import STATE_VERSION, StreamState
from packshard.trainer_shim.topology import Topology, new_process_groups

if TYPE_CHECKING:
    from packshard.trainer_shim.hf import StreamStateCallback, packed_collator, sft_trainer
    from packshard.trainer_shim.hf_dataset import PackedShardDataset
    from packshard.trainer_shim.meter import FlopsModel, StepStats, TrainedTokenMeter
    from packshard.trainer_shim.stream import PackedShardStream, StreamConfig, dataset_fingerprint
    from packshard.trainer_shim.titan import PackedShardDataLoader

_LAZY = {
    "PackedShardDataset": "packshard.trainer_shim.hf_dataset",
    "StreamStateCallback": "packshard.trainer_shim.hf",
    "packed_collator": "packshard.trainer_shim.hf",
    "sft_trainer": "packshard.trainer_shim.hf",
    "PackedShardDataLoader": "packshard.trainer_shim.titan",
    "FlopsModel": "packshard.trainer_shim.meter",
    "StepStats": "packshard.trainer_shim.meter",
    "TrainedTokenMeter": "packshard.trainer_shim.meter",
    "PackedShardStream": "packshard.trainer_shim.stream",
    "StreamConfig": "packshard.trainer_shim.stream",
    "dataset_fingerprint": "packshard.trainer_shim.stream",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        from packshard._extras import require

        require("train", "torch", f"packshard.trainer_shim.{name}")
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packshard.trainer_shim' has no attribute {name!r}")


__all__ = [
    "CP_LAYOUTS",
    "IGNORE_INDEX",
    "STATE_VERSION",
    "Balance",
    "CpLayout",
    "FlopsModel",
    "PackedShardDataLoader",
    "PackedShardDataset",
    "PackedShardStream",
    "Position",
    "StepPlan",
    "StepPlanner",
    "StepStats",
    "StreamConfig",
    "StreamState",
    "StreamStateCallback",
    "Topology",
    "TrainedTokenMeter",
    "build_microbatch",
    "cp_positions",
    "dataset_fingerprint",
    "epoch_order",
    "new_process_groups",
    "packed_collator",
    "plan_step",
    "reassemble",
    "row_divisor",
    "sft_trainer",
    "step_imbalance",
]
