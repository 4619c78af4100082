"""PackedShardDataLoader against torchtitan itself (0.3): built the way its Trainer builds a
dataloader, a `BaseDataLoader` and DCP `Stateful`, batches in its (input_dict, labels) contract,
every row once over the DP ranks, exact resume from its state (also under another DP size at a
step boundary), and the DP rank read from a torchtitan-style device mesh."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan")
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.dataloader import BaseDataLoader

from packshard.packers import ShardDataset
from packshard.trainer_shim.microbatch import build_microbatch
from packshard.trainer_shim.titan import PackedShardDataLoader, topology_from_mesh


def build(url: Path, rank: int, world: int, batch: int = 2, **cfg) -> PackedShardDataLoader:
    config = PackedShardDataLoader.Config(dataset_path=str(url), epochs=1, seed=5, **cfg)
    return config.build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=512, local_batch_size=batch
    )


def test_built_like_torchtitan_and_a_stateful_base_dataloader(small_dataset: Path):
    loader = build(small_dataset, 0, 1)
    assert isinstance(loader, BaseDataLoader) and isinstance(loader, Stateful)
    inputs, labels = next(iter(loader))
    assert set(inputs) == {"input", "positions"}
    assert inputs["input"].shape == inputs["positions"].shape == labels.shape
    assert inputs["input"].shape[0] == 1 and inputs["input"].dtype == torch.int64


def test_batches_hold_whole_rows_with_shifted_labels_and_restarting_positions(small_dataset: Path):
    ds = ShardDataset.open(str(small_dataset))
    loader = build(small_dataset, 0, 1, batch=3)
    stream = loader.stream
    for inputs, labels in loader:
        rows: list[int] = []
        # recover the rows of the batch from its position ids' segments and the index
        ids, pos, lab = (
            inputs["input"][0].numpy(),
            inputs["positions"][0].numpy(),
            labels[0].numpy(),
        )
        offset = 0
        while offset < ids.size:
            for r in range(ds.num_rows):
                row = ds.read_row(r)
                n = row["input_ids"].size
                if n <= ids.size - offset and np.array_equal(
                    row["input_ids"], ids[offset : offset + n]
                ):
                    want = build_microbatch(row["input_ids"], row["loss_mask"], row["doc_lens"])
                    assert np.array_equal(lab[offset : offset + n], want["labels"])
                    assert np.array_equal(pos[offset : offset + n], want["position_ids"])
                    rows.append(r)
                    offset += n
                    break
            else:
                raise AssertionError(f"no row of the dataset starts at position {offset}")
        assert 1 <= len(rows) <= 3
    assert len(stream) == 0


def test_every_row_once_over_dp_ranks(small_dataset: Path):
    n = ShardDataset.open(str(small_dataset)).num_rows
    rows = []
    for rank in range(2):
        loader = build(small_dataset, rank, 2)
        rows += [mb["row"] for mb in loader.stream if mb["row"] >= 0]
    assert sorted(rows) == list(range(n))


@pytest.mark.parametrize("new_world", [2, 1])
def test_resume_from_state_dict_continues_exactly(small_dataset: Path, new_world: int):
    def batches(loader, k=None):  # exactly k batches pulled, as torchtitan's loop pulls them
        return [(i["input"].clone(), lab.clone()) for i, lab in itertools.islice(loader, k)]

    full = [batches(build(small_dataset, r, 2, rows_per_rank=4)) for r in range(2)]
    first = [build(small_dataset, r, 2, rows_per_rank=4) for r in range(2)]
    head = [batches(loader, 4) for loader in first]  # 4 batches of 2 rows = 2 whole steps
    states = [loader.state_dict() for loader in first]
    assert (
        json.loads(states[0]["packshard_stream"])["position"]
        == json.loads(states[1]["packshard_stream"])["position"]
    )
    for r in range(2):
        assert all(torch.equal(a[0], b[0]) for a, b in zip(head[r], full[r][:4], strict=True))
    if new_world == 2:
        for r in range(2):
            loader = build(small_dataset, r, 2, rows_per_rank=4)
            loader.load_state_dict(states[1 - r])  # any rank's state restarts any rank
            rest = batches(loader)
            assert len(rest) == len(full[r]) - 4
            assert all(
                torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                for a, b in zip(rest, full[r][4:], strict=True)
            )
    else:  # elastic: 2 DP ranks -> 1 at a step boundary; the rest of the epoch, nothing twice
        loader = build(small_dataset, 0, 1, rows_per_rank=4)
        loader.load_state_dict(states[0])
        before = {int(mb["row"]) for loader0 in [build(small_dataset, r, 2, rows_per_rank=4) for r in range(2)]
                  for i, mb in zip(range(8), loader0.stream, strict=False) if mb["row"] >= 0}  # fmt: skip
        after = [int(mb["row"]) for mb in loader.stream if mb["row"] >= 0]
        n = ShardDataset.open(str(small_dataset)).num_rows
        assert (
            not before & set(after)
            and len(after) == len(set(after))
            and len(before) + len(after) == n
        )


def test_empty_state_is_a_fresh_start_and_foreign_state_is_refused(small_dataset: Path):
    loader = build(small_dataset, 0, 1)
    loader.load_state_dict({})
    with pytest.raises(ValueError, match="another dataloader"):
        loader.load_state_dict({"dp_rank_0": b"x", "world_size": 1})


def test_a_state_given_as_a_dict_resumes_like_its_json(small_dataset: Path):
    first = build(small_dataset, 0, 1)
    it = iter(first)
    next(it)
    saved = first.state_dict()
    rest = [b[1].tolist() for b in it]
    assert rest  # a resume that ignored the state would yield one batch more
    for state in ({**saved}, {"packshard_stream": json.loads(saved["packshard_stream"])}):
        again = build(small_dataset, 0, 1)
        again.load_state_dict(state)
        assert [b[1].tolist() for b in again] == rest


@pytest.mark.parametrize(
    "cfg, batch, named",
    [
        ({"rows_per_rank": 0}, 2, "rows_per_rank=0"),
        ({"rows_per_rank": -1}, 2, "rows_per_rank=-1"),
        ({"rows_per_rank": 2.5}, 2, "rows_per_rank=2.5"),
        ({}, 2.0, "local_batch_size=2.0"),
        ({}, 0, "local_batch_size=0"),
    ],
)
def test_batch_and_step_sizes_are_checked_under_their_own_names(
    small_dataset: Path, cfg: dict, batch, named: str
):
    with pytest.raises(ValueError, match=f"{re.escape(named)} must be an int >= 1"):
        build(small_dataset, 0, 1, batch=batch, **cfg)


def test_a_planning_step_is_whole_batches_and_a_larger_one_is_told_its_limit(
    small_dataset: Path, caplog
):
    """The epoch's short last step ends in filler rows: a planning step longer than an
    optimizer step can give torchtitan a step of fillers only (no loss token, a NaN loss)."""
    with pytest.raises(
        ValueError, match=r"rows_per_rank=3 is not a multiple of the loader's batch of 2"
    ):
        build(small_dataset, 0, 1, rows_per_rank=3)
    with caplog.at_level("INFO", logger="packshard.trainer_shim.titan"):
        build(small_dataset, 0, 1)  # the default: one batch
        assert not caplog.text
        build(small_dataset, 0, 1, rows_per_rank=4)
    assert (
        "rows_per_rank=4 spans 2 batches of 2 rows; it must not exceed one optimizer step"
        in caplog.text
    )


def test_seq_len_above_torchtitans_is_refused(small_dataset: Path):
    config = PackedShardDataLoader.Config(dataset_path=str(small_dataset))
    with pytest.raises(ValueError, match=r"re-pack with --seq-len 256 or raise training\.seq_len"):
        config.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=256, local_batch_size=1)


class FakeMesh:
    """The DeviceMesh calls Topology.from_device_mesh makes: names, sizes, this rank's coordinates."""

    def __init__(self, dims: dict[str, tuple[int, int]]) -> None:
        self.mesh_dim_names = tuple(dims)
        self._dims = dims

    def size(self, i: int | None = None) -> int:
        if i is None:  # DeviceMesh.size(): the whole mesh
            return int(np.prod([n for n, _ in self._dims.values()], dtype=np.int64))
        return self._dims[self.mesh_dim_names[i]][0]

    def get_local_rank(self, name: str) -> int:
        return self._dims[name][1]


def test_topology_from_a_torchtitan_mesh(monkeypatch):
    mesh = FakeMesh({"dp_replicate": (2, 1), "dp_shard": (4, 3), "cp": (2, 1), "tp": (2, 0)})
    topo = topology_from_mesh(mesh)
    assert (topo.dp_rank, topo.dp_size, topo.cp_size) == (1 * 4 + 3, 8, 1)
    flat = topology_from_mesh(FakeMesh({"batch": (6, 5), "cp": (2, 0)}))
    assert (flat.dp_rank, flat.dp_size, flat.cp_size) == (5, 6, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a cp-only mesh over every rank: one DP rank
    assert topology_from_mesh(FakeMesh({"cp": (2, 1)})).dp_size == 1
    # torchtitan 0.3's spmd_types dense mesh names the data axis "dp"
    spmd = topology_from_mesh(FakeMesh({"pp": (1, 0), "dp": (8, 5), "cp": (2, 1), "tp": (2, 0)}))
    assert (spmd.dp_rank, spmd.dp_size) == (5, 8)


@pytest.mark.parametrize(
    "dims, why",
    [
        # torchtitan's legacy dense FSDP mesh: "fsdp" is dp_shard x cp
        ({"pp": (1, 0), "dp_replicate": (2, 1), "fsdp": (4, 3), "tp": (2, 0)}, "'fsdp' mixes"),
        ({"fsdp": (8, 5)}, "'fsdp' mixes dp_shard x cp"),
        ({"dp_replicate": (2, 1), "efsdp": (4, 3), "ep": (2, 0)}, "'efsdp' mixes"),
        ({"data": (4, 1)}, "'data' is not a torchtitan axis"),
        ({}, "has no axis names"),
    ],
)
def test_a_mesh_that_does_not_say_the_data_rank_is_refused(dims, why, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # even a mesh over every rank: its axes do not say it
    with pytest.raises(ValueError, match=f"{re.escape(why)}.*get_mesh"):
        topology_from_mesh(FakeMesh(dims))


def test_a_submesh_of_part_of_the_ranks_is_refused(monkeypatch):
    """torchtitan's get_mesh('dp_shard') or get_mesh('cp') of a 16-rank run: other data axes
    lie outside the submesh, so it cannot say the data rank."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    for dims in ({"dp_shard": (2, 1)}, {"dp_replicate": (2, 1)}, {"cp": (2, 1)}):
        with pytest.raises(ValueError, match=r"holds 2 of the run's 16 ranks"):
            topology_from_mesh(FakeMesh(dims))
    monkeypatch.setenv("WORLD_SIZE", "4")  # the same axis over every rank is the whole story
    topo = topology_from_mesh(FakeMesh({"dp_shard": (4, 3)}))
    assert (topo.dp_rank, topo.dp_size) == (3, 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert topology_from_mesh(FakeMesh({"world": (1, 0)})).dp_size == 1
