"""trainer_shim with real processes: 4 gloo ranks on CPU as dp=2 x cp=2 (zigzag).

Each rank streams its micro-batches; the CP group all-gathers them and checks that the chunks
reassemble into the row as stored, that labels and position ids are right at every document
boundary (against a plain per-document reference, not the shim's own code), that both CP
ranks got the same row, and that the meter counts every row once over the epoch.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from packshard.trainer_shim.synthetic import write_synthetic_dataset

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

DP, CP = 2, 2


def reference_row(
    ids: np.ndarray, mask: np.ndarray, doc_lens: np.ndarray
) -> tuple[list[int], list[int]]:
    """labels / position ids by plain loops over documents."""
    labels, pos = [-100] * len(ids), list(range(len(ids)))
    start = 0
    for n in doc_lens.tolist():
        for t in range(start, start + n):
            pos[t] = t - start
            if t + 1 < start + n and mask[t + 1]:
                labels[t] = int(ids[t + 1])
        start += n
    pos[start:] = range(len(ids) - start)
    return labels, pos


def worker(rank: int, url: str, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from packshard.packers import ShardDataset
    from packshard.trainer_shim import (
        PackedShardStream,
        Topology,
        TrainedTokenMeter,
        cp_positions,
        new_process_groups,
    )

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DP * CP
    )
    try:
        topo = Topology.from_env(cp_size=CP)
        mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
        assert Topology.from_device_mesh(mesh) == topo, (Topology.from_device_mesh(mesh), topo)
        _, cp_group = new_process_groups(topo)
        stream = PackedShardStream(
            url, **topo.as_kwargs(), rows_per_step=4, seed=1, cp_layout="zigzag"
        )
        ds = ShardDataset.open(url)
        meter = TrainedTokenMeter(dp_rank=topo.dp_rank)
        step_tokens, rows_seen, checked = [], [], 0
        for mb in stream:
            meter.update(mb)
            n_local = mb["input_ids"].numel()
            gathered = {}
            for key in ("input_ids", "labels", "position_ids", "ks", "ke"):
                parts = [torch.empty_like(mb[key]) for _ in range(CP)]
                dist.all_gather(parts, mb[key].contiguous(), group=cp_group)
                gathered[key] = parts
            row_ids = [torch.zeros(1, dtype=torch.int64) for _ in range(CP)]
            dist.all_gather(row_ids, torch.tensor([mb["row"]]), group=cp_group)
            assert len({int(r) for r in row_ids}) == 1, "CP ranks got different rows"
            length = n_local * CP
            order = np.concatenate([cp_positions(length, CP, r, "zigzag") for r in range(CP)])
            whole = {k: np.empty(length, np.int64) for k in gathered}
            for k, parts in gathered.items():
                whole[k][order] = torch.cat(parts).numpy()
            if mb["row"] >= 0:
                row = ds.read_row(mb["row"])
                assert np.array_equal(whole["input_ids"], row["input_ids"]), (
                    "chunks do not reassemble into the row"
                )
                labels, pos = reference_row(row["input_ids"], row["loss_mask"], row["doc_lens"])
                assert whole["labels"].tolist() == labels
                assert whole["position_ids"].tolist() == pos
                starts = np.concatenate(([0], np.cumsum(row["doc_lens"])))
                doc_start = np.repeat(starts[:-1], row["doc_lens"])
                n = int(row["num_tokens"])
                assert np.array_equal(whole["ks"][:n], doc_start) and np.array_equal(
                    whole["ke"][:n], np.arange(1, n + 1)
                )
                assert np.array_equal(whole["ks"][n:], whole["ke"][n:])
                checked += 1
                rows_seen.append(mb["row"])
            if mb["micro_step"] == mb["num_micro_steps"] - 1:
                step_tokens.append(meter.step(mb["step"]).num_tokens)
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "topo": topo.as_kwargs(),
                    "rows": rows_seen,
                    "step_tokens": step_tokens,
                    "checked": checked,
                }
            )
        )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dp2_cp2_gloo(tmp_path: Path):
    url = tmp_path / "ds"
    rng = np.random.default_rng(2)
    manifest = write_synthetic_dataset(
        str(url),
        lengths=rng.integers(5, 300, 120),
        seq_len=512,
        pad_multiple=4,
        max_rows_per_shard=8,
    )
    out = tmp_path / "out"
    out.mkdir()
    # forkserver with the heavy imports preloaded: the ranks fork from a clean server that has
    # imported torch and pyarrow once (spawn re-imports them per rank, ~10 s each on 2 cores;
    # plain fork would copy this pytest process, threads of earlier tests and all)
    multiprocessing.set_forkserver_preload(
        [
            "torch.distributed",
            "torch.distributed.device_mesh",
            "pyarrow",
            "pandas",
            "pytest",
            "packshard.trainer_shim.stream",
        ]
    )  # fmt: skip  (pandas: pyarrow imports it at the first to_numpy)
    mp.start_processes(
        worker,
        args=(str(url), free_port(), str(out)),
        nprocs=DP * CP,
        join=True,
        start_method="forkserver",
    )
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(DP * CP)]
    n_rows, n_tokens = manifest["totals"]["rows"], manifest["totals"]["num_tokens"]
    # CP peers saw the same rows; the two DP ranks together saw every row once
    assert res[0]["rows"] == res[1]["rows"] and res[2]["rows"] == res[3]["rows"]
    assert sorted(res[0]["rows"] + res[2]["rows"]) == list(range(n_rows))
    assert all(r["checked"] > 0 for r in res)
    # the meter: every rank reports the same per-step totals, which add up to the dataset once
    assert all(r["step_tokens"] == res[0]["step_tokens"] for r in res)
    assert sum(res[0]["step_tokens"]) == n_tokens
