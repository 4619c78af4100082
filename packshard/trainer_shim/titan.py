"""torchtitan on a packshard dataset: a dataloader that fits torchtitan's protocol.

    from packshard.trainer_shim.titan import PackedShardDataLoader
    config = Trainer.Config(..., dataloader=PackedShardDataLoader.Config(
        dataset_path="s3://bucket/packed/run1", cache_dir="/nvme/packshard"))

torchtitan (0.3) builds its dataloader as ``config.dataloader.build(dp_world_size=...,
dp_rank=..., tokenizer=..., seq_len=..., local_batch_size=...)`` with the rank of the "batch"
mesh (dp_replicate x dp_shard, the ranks that get different data), checkpoints it through DCP
as a `Stateful` (``state_dict`` / ``load_state_dict``), and iterates it for
``(input_dict, labels)`` pairs: ``input_dict["input"]`` the tokens, ``input_dict["positions"]``
(restarting per document: torchtitan's flex / varlen attention builds its block-causal mask from
them) and labels already shifted (torchtitan's loss never shifts), -100 where ignored.

`PackedShardDataLoader` is that, over one `PackedShardStream` per DP rank: each batch is
``local_batch_size`` packed rows back to back as one sequence [1, N] (`flatten.py`; rows are not
padded to a common length), rows cost-balanced across DP ranks per step of
``rows_per_rank`` rows. The CP ranks of a DP group get the same rows (torchtitan's
``prepare_context_parallel_input`` splits them: pack with ``--pad-multiple 2*cp`` so every
row divides). Its state is the stream's (~0.5 KB, JSON): exact resume, and at a step boundary
under another DP size (the stream re-partitions the rest of the epoch); torchtitan's own
loaders refuse a changed DP degree. `topology_from_mesh` reads the DP rank from a
torchtitan-style DeviceMesh (its ``batch`` or ``dp`` axis, or ``dp_replicate`` x ``dp_shard``;
a mesh that does not say the data rank, such as a submesh of part of the ranks, is refused) for
loops that build the loader themselves.

Tested against torchtitan 0.3.0 itself (tests/trainer_shim/test_titan.py): its
`BaseDataLoader` / `Configurable` build path, `Stateful`, and the batch contract.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from packshard._extras import require

require("torchtitan", "torch", "packshard.trainer_shim.titan")  # before anything imports it
import torch  # noqa: E402

from packshard.trainer_shim.flatten import flatten_rows  # noqa: E402
from packshard.trainer_shim.stream import PackedShardStream  # noqa: E402
from packshard.trainer_shim.topology import Topology, rank_world  # noqa: E402

require("torchtitan", "torchtitan", "packshard.trainer_shim.titan")
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402

log = logging.getLogger(__name__)

STATE_KEY = "packshard_stream"


# torchtitan 0.3's mesh axes (parallel_dims.MeshAxisName and its flattened meshes):
DATA_AXES = ("batch", "dp")  # each alone is the data-parallel degree, dp_replicate x dp_shard
SPLIT_DATA_AXES = ("dp_replicate", "dp_shard")  # the same, as two axes
FOLDED_AXES = {  # axes that mix data ranks with others: the data rank cannot be read from them
    "fsdp": "dp_shard x cp",
    "efsdp": "dp_shard x cp x tp / ep",
    "loss": "batch x cp",
    "world": "every rank",
}
OTHER_AXES = ("pp", "cp", "tp", "ep")  # ranks of these hold the same rows


def topology_from_mesh(mesh: Any) -> Topology:
    """DP rank and size of this process in a torchtitan-style DeviceMesh: its ``batch`` (the
    dataloading mesh) or ``dp`` axis, else ``dp_replicate`` x ``dp_shard``; PP, CP, TP and EP
    ranks share it. A mesh with only one of dp_replicate / dp_shard, or no data axis, must span
    every rank of the run (else another data axis may lie outside it). ValueError for a mesh
    that does not say the data rank: unnamed, unknown names, axes that fold other ranks in
    (``fsdp`` = dp_shard x cp in torchtitan's dense FSDP mesh), or a part of the run's ranks.
    """
    names = tuple(mesh.mesh_dim_names or ())
    for axis in DATA_AXES:
        if axis in names:
            return Topology.from_device_mesh(mesh, dp_dims=axis, cp_dim=None)
    if all(d in names for d in SPLIT_DATA_AXES):
        return Topology.from_device_mesh(mesh, dp_dims=SPLIT_DATA_AXES, cp_dim=None)
    size, world = _mesh_size(mesh, names), rank_world()[1]
    if size == world == 1:  # a one-process run: whatever the axes, one data-parallel rank
        return Topology(dp_rank=0, dp_size=1)
    folded = [d for d in names if d in FOLDED_AXES]
    unknown = [d for d in names if d not in (*SPLIT_DATA_AXES, *FOLDED_AXES, *OTHER_AXES)]
    if not names or unknown or folded:
        why = (
            "has no axis names" if not names
            else f"has axes {names}; " + "; ".join(
                [f"{d!r} mixes {FOLDED_AXES[d]}" for d in folded]
                + [f"{d!r} is not a torchtitan axis" for d in unknown]
            )
        )  # fmt: skip
    elif size != world:
        why = (
            f"{names} holds {size} of the run's {world} ranks (other data axes may lie outside it)"
        )
    else:
        dims = [d for d in SPLIT_DATA_AXES if d in names]
        if not dims:  # only pp / cp / tp / ep over every rank: one data-parallel rank
            return Topology(dp_rank=0, dp_size=1)
        return Topology.from_device_mesh(mesh, dp_dims=dims, cp_dim=None)
    raise ValueError(
        f"topology_from_mesh: the device mesh {why}, so the data-parallel rank cannot be read "
        "from it: pass torchtitan's batch mesh (parallel_dims.get_mesh('batch'), when data "
        "parallelism is on) or the whole device mesh, or build Topology(dp_rank=..., dp_size=...)"
    )


def _mesh_size(mesh: Any, names: tuple[str, ...]) -> int:
    """Ranks in the mesh (the product of its axes' sizes; an unnamed mesh's ``size()``)."""
    if names:
        return math.prod(int(mesh.size(i)) for i in range(len(names)))
    return int(mesh.size())


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return int(value)


class PackedShardDataLoader(BaseDataLoader):
    """torchtitan dataloader over a packshard dataset (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        rows_per_rank: int | None = None
        """Rows per DP rank per planning step (default: local_batch_size); the step's rows are
        cost-balanced across DP ranks. A multiple of the loader's batch, and at most the rows
        one optimizer step takes per DP rank (local_batch_size x gradient accumulation): the
        epoch's last planning step is short and ends in filler rows, so a larger one can hand
        torchtitan a step of fillers only, with no loss token (a NaN loss). local_batch_size x
        gradient accumulation balances whole optimizer steps."""
        seed: int = 0
        shuffle: bool = True
        epochs: int | None = None
        """Passes over the data; None (default) is endless, as torchtitan trains for `steps`."""
        cache_dir: str | None = None
        prefetch: int | None = None
        read_threads: int = 4
        verify: bool = True
        stall_timeout_s: float | None = None
        """Seconds of waiting with no row and no shard read completing before iteration
        raises StorageError (None: wait, logging every doubling from 60 s): a stalled store
        then fails the run instead of hanging it."""
        prefetch_thread: bool | None = None
        """Read windows on a background thread (None: for a remote dataset, a cache_dir or a
        stall_timeout_s; a local dataset is read by the training thread: PackedShardStream)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        local_batch_size: int = 1,
        seq_len: int | None = None,
        tokenizer: Any = None,
        **_unused: Any,
    ) -> None:
        url = config.dataset_path or config.dataset
        if not url:
            raise ValueError(
                "PackedShardDataLoader.Config: set dataset_path to the packshard dataset's URL"
            )
        local_batch_size = _positive_int("local_batch_size", local_batch_size)
        self.config = config
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        rows = (
            local_batch_size
            if config.rows_per_rank is None
            else _positive_int("PackedShardDataLoader.Config: rows_per_rank", config.rows_per_rank)
        )
        if rows % local_batch_size:
            raise ValueError(
                f"PackedShardDataLoader.Config: rows_per_rank={rows} is not a multiple of the "
                f"loader's batch of {local_batch_size} rows (a planning step is whole batches)"
            )
        if rows > local_batch_size:  # torchtitan passes no gradient accumulation to check it by
            log.info(
                "PackedShardDataLoader: rows_per_rank=%d spans %d batches of %d rows; it must not "
                "exceed one optimizer step's rows per DP rank (local_batch_size x gradient "
                "accumulation steps): the epoch's last planning step ends in filler rows, and a "
                "torchtitan step of fillers only has no loss token (a NaN loss)",
                rows, rows // local_batch_size, local_batch_size,
            )  # fmt: skip
        self.stream = PackedShardStream(
            url, dp_rank=dp_rank, dp_size=dp_world_size, rows_per_step=rows * dp_world_size,
            seed=config.seed, shuffle=config.shuffle, epochs=config.epochs, cache_dir=config.cache_dir,
            prefetch=config.prefetch, read_threads=config.read_threads, verify=config.verify,
            stall_timeout_s=config.stall_timeout_s, prefetch_thread=config.prefetch_thread,
        )  # fmt: skip
        ds_seq = int(self.stream.dataset.config["seq_len"])
        if seq_len is not None and ds_seq > seq_len:
            raise ValueError(
                f"{self.stream.url} was packed with seq_len={ds_seq}, above torchtitan's training.seq_len={seq_len}: "
                f"re-pack with --seq-len {seq_len} or raise training.seq_len"
            )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        rows: list[dict[str, Any]] = []
        for mb in self.stream:
            rows.append(mb)
            if len(rows) == self.local_batch_size:
                yield self._batch(rows)
                rows = []
        if rows:  # the data's end: a short last batch rather than a lost one
            yield self._batch(rows)

    @staticmethod
    def _batch(rows: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        flat = flatten_rows(rows)
        return {"input": flat["input_ids"], "positions": flat["position_ids"]}, flat["shift_labels"]

    def state_dict(self) -> dict[str, Any]:
        """The stream's position after the last batch handed out (JSON; any DP rank's state
        restarts any rank: the position is global)."""
        return {STATE_KEY: json.dumps(self.stream.state_dict()), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan loads an empty state for a fresh start
            return
        if STATE_KEY not in state_dict:
            raise ValueError(
                f"not a PackedShardDataLoader state (keys {sorted(state_dict)}): the checkpoint was "
                "saved with another dataloader"
            )
        state = state_dict[STATE_KEY]  # JSON text as saved; a stream state dict is taken too
        self.stream.load_state_dict(json.loads(state) if isinstance(state, str | bytes) else state)

    def close(self) -> None:
        self.stream.close()
