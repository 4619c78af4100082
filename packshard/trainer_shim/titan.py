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
torchtitan-style DeviceMesh (dims ``dp_replicate``, ``dp_shard``, ``cp``; or a flattened
``batch``) for loops that build the loader themselves.

Tested against torchtitan 0.3.0 itself (tests/trainer_shim/test_titan.py): its
`BaseDataLoader` / `Configurable` build path, `Stateful`, and the batch contract.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from packshard._extras import require
from packshard.trainer_shim.flatten import flatten_rows
from packshard.trainer_shim.stream import PackedShardStream
from packshard.trainer_shim.topology import Topology

require("torchtitan", "torchtitan", "packshard.trainer_shim.titan")
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402

STATE_KEY = "packshard_stream"


def topology_from_mesh(mesh: Any) -> Topology:
    """DP rank and size of this process in a torchtitan-style DeviceMesh: its ``batch`` dim if
    flattened, else ``dp_replicate`` x ``dp_shard`` (those present); CP and TP ranks share it."""
    names = tuple(mesh.mesh_dim_names or ())
    if "batch" in names:
        return Topology.from_device_mesh(mesh, dp_dims="batch", cp_dim=None)
    dims = [d for d in ("dp_replicate", "dp_shard") if d in names]
    if not dims:
        return Topology(dp_rank=0, dp_size=1)
    return Topology.from_device_mesh(mesh, dp_dims=dims, cp_dim=None)


class PackedShardDataLoader(BaseDataLoader):
    """torchtitan dataloader over a packshard dataset (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        rows_per_rank: int | None = None
        """Rows per DP rank per planning step (default: local_batch_size); the step's rows are
        cost-balanced across DP ranks. local_batch_size x gradient accumulation balances whole
        optimizer steps."""
        seed: int = 0
        shuffle: bool = True
        epochs: int | None = None
        """Passes over the data; None (default) is endless, as torchtitan trains for `steps`."""
        cache_dir: str | None = None
        prefetch: int | None = None
        read_threads: int = 4
        verify: bool = True

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
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size={local_batch_size} must be >= 1")
        self.config = config
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        rows = config.rows_per_rank or local_batch_size
        self.stream = PackedShardStream(
            url, dp_rank=dp_rank, dp_size=dp_world_size, rows_per_step=rows * dp_world_size,
            seed=config.seed, shuffle=config.shuffle, epochs=config.epochs, cache_dir=config.cache_dir,
            prefetch=config.prefetch, read_threads=config.read_threads, verify=config.verify,
        )  # fmt: skip
        ds_seq = int(self.stream.dataset.config["seq_len"])
        if seq_len is not None and ds_seq > seq_len:
            raise ValueError(
                f"{url} was packed with seq_len={ds_seq}, above torchtitan's training.seq_len={seq_len}: "
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
        self.stream.load_state_dict(json.loads(state_dict[STATE_KEY]))

    def close(self) -> None:
        self.stream.close()
