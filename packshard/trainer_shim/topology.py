"""Where this process sits in the DP x CP grid: explicit, or read from the environment or a
device mesh. No module-level state; the stream itself only ever takes the four integers.

Rank layout of `from_env` / `from_rank`: CP innermost, ``rank = dp_rank * cp_size + cp_rank``,
so a CP group is cp_size consecutive ranks (on one node when cp_size divides the GPUs per
node, which keeps the CP all-gathers on NVLink). torchtitan's mesh ("dp", "cp") is the same
order. With a `DeviceMesh`, the mesh decides and `from_device_mesh` reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Topology:
    """dp_rank/dp_size/cp_rank/cp_size, validated."""

    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.cp_size < 1:
            raise ValueError(f"dp_size ({self.dp_size}) and cp_size ({self.cp_size}) must be >= 1")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_size}), got {self.dp_rank}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {self.cp_rank}")

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def rank(self) -> int:
        """Global rank under the CP-innermost layout."""
        return self.dp_rank * self.cp_size + self.cp_rank

    def as_kwargs(self) -> dict[str, Any]:
        """dp_rank, dp_size, cp_rank, cp_size: ``PackedShardStream(url, **topo.as_kwargs(), ...)``."""
        return {
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "cp_rank": self.cp_rank,
            "cp_size": self.cp_size,
        }

    @classmethod
    def from_rank(cls, rank: int, world_size: int, *, cp_size: int = 1) -> Topology:
        if cp_size < 1 or world_size % cp_size:
            raise ValueError(f"world_size {world_size} is not a multiple of cp_size {cp_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        return cls(
            dp_rank=rank // cp_size,
            dp_size=world_size // cp_size,
            cp_rank=rank % cp_size,
            cp_size=cp_size,
        )

    @classmethod
    def from_env(cls, *, cp_size: int = 1, env: Mapping[str, str] | None = None) -> Topology:
        """From torch.distributed when it is initialised, else torchrun's RANK / WORLD_SIZE
        (a single process when neither is set)."""
        import torch.distributed as dist

        if env is None and dist.is_available() and dist.is_initialized():
            return cls.from_rank(dist.get_rank(), dist.get_world_size(), cp_size=cp_size)
        env = os.environ if env is None else env
        try:
            rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        except ValueError as e:
            raise ValueError(f"RANK / WORLD_SIZE must be integers ({e})") from None
        try:
            return cls.from_rank(rank, world, cp_size=cp_size)
        except ValueError as e:
            raise ValueError(
                f"{e} (RANK={rank}, WORLD_SIZE={world} from the environment)"
            ) from None

    @classmethod
    def from_device_mesh(
        cls, mesh: Any, *, dp_dims: str | Sequence[str] = "dp", cp_dim: str | None = "cp"
    ) -> Topology:
        """From a torch DeviceMesh. Several DP dimensions (e.g. ("dp_replicate", "dp_shard"))
        are flattened in the order given; `cp_dim=None` (or a mesh without it) means cp_size 1."""
        names = tuple(mesh.mesh_dim_names or ())
        dims = (dp_dims,) if isinstance(dp_dims, str) else tuple(dp_dims)
        for d in dims:
            if d not in names:
                raise ValueError(
                    f"the device mesh has dimensions {names}, not {d!r}; pass dp_dims=..."
                )
        dp_rank, dp_size = 0, 1
        for d in dims:
            dp_rank = dp_rank * mesh.size(names.index(d)) + mesh.get_local_rank(d)
            dp_size *= mesh.size(names.index(d))
        if cp_dim is None or cp_dim not in names:
            return cls(dp_rank=dp_rank, dp_size=dp_size)
        return cls(
            dp_rank=dp_rank,
            dp_size=dp_size,
            cp_rank=mesh.get_local_rank(cp_dim),
            cp_size=mesh.size(names.index(cp_dim)),
        )

    def dp_group_ranks(self) -> list[list[int]]:
        """Global ranks of every DP group (one per cp_rank), CP-innermost layout."""
        return [[d * self.cp_size + c for d in range(self.dp_size)] for c in range(self.cp_size)]

    def cp_group_ranks(self) -> list[list[int]]:
        """Global ranks of every CP group (one per dp_rank), CP-innermost layout."""
        return [[d * self.cp_size + c for c in range(self.cp_size)] for d in range(self.dp_size)]


def new_process_groups(topo: Topology, backend: str | None = None) -> tuple[Any, Any]:
    """(this rank's DP group, this rank's CP group). Collective: every rank must call it."""
    import torch.distributed as dist

    dp_group = cp_group = None
    for ranks in topo.dp_group_ranks():
        g = dist.new_group(ranks, backend=backend)
        if topo.rank in ranks:
            dp_group = g
    for ranks in topo.cp_group_ranks():
        g = dist.new_group(ranks, backend=backend)
        if topo.rank in ranks:
            cp_group = g
    return dp_group, cp_group


def rank_world() -> tuple[int, int, str]:
    """(rank, world size, where they came from): torch.distributed when it is initialised,
    else the launcher's RANK / WORLD_SIZE, else one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), "torch.distributed"
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE must be integers ({e})") from None
    return rank, world, ("RANK/WORLD_SIZE" if "WORLD_SIZE" in os.environ else "one process")
