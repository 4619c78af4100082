"""packshard: pack post-training samples once into cp-padded Arrow shards, stream them into
DP x CP ranks with equal work per rank, and run a fixed-config fp8 DSA indexer on them.

Four subpackages, each installable on its own side through an extra:

- `packshard.packers` (core install): bin planning and the shard format v1 (read, write, verify);
- `packshard.pipeline` (``packshard[pack]``): the Ray pack job, ``packshard stats`` / ``verify``;
- `packshard.trainer_shim` (``packshard[train]``): `PackedShardStream`, `Topology`,
  `TrainedTokenMeter`, and adapters for Hugging Face Trainer / TRL and torchtitan;
- `packshard.kernels` (``packshard[kernels]``): `fp8_indexer_topk`, the Triton fp8 indexer.

The names below load on first use: ``import packshard`` imports neither torch, triton nor Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packshard.kernels import fp8_indexer_topk
    from packshard.trainer_shim import PackedShardStream, Topology, TrainedTokenMeter

__version__ = "0.1.0"

_LAZY = {
    "PackedShardStream": "packshard.trainer_shim",
    "Topology": "packshard.trainer_shim",
    "TrainedTokenMeter": "packshard.trainer_shim",
    "fp8_indexer_topk": "packshard.kernels",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["PackedShardStream", "Topology", "TrainedTokenMeter", "__version__", "fp8_indexer_topk"]
