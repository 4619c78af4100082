"""The multi-GPU DP x CP benchmark's CPU (gloo) version, as real processes (issue 8).

`benchmarks/multigpu/launch.py --cpu` runs torchrun with 4 gloo ranks (dp 2 x cp 2, zigzag):
the e2e smoke preset's tiny DSA MoE model, the torch reference indexer over the CP-gathered
keys, three arms (padseq, count, cost) on a small long-trajectory mix, two steps each with
the top-k identity check on both. The test then checks, from the results it wrote:

- the top-k identity check ran on every layer of both steps, in every arm, and passed: same
  gathered keys on both CP ranks, the CP-split top-k equal to the whole row's, both ranks'
  whole-row top-k equal (and a broken split would fail it: `test_topk_check_catches_a_split`);
- the meter counts each row once: CP peers got the same rows, DP ranks disjoint ones, their
  union is the step's planned rows, and the meter's tokens are the sum of those rows' true
  tokens from index.arrow (not x cp);
- cost balance is no worse than count: at every step the planned max DP-rank cost and the
  meter's imbalance are <= count's (timing is reported, not asserted: 4 ranks share 2 loaded
  cores);
- the distributed, CP-split step-0 loss equals a one-process computation of the same rows with
  the same initial weights (cp 1), and the three arms' losses agree (same rows at every step).

~35-50 s on 2 busy cores (torchrun and 4 ranks importing torch and Triton dominate).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, ROWS_PER_RANK, STEPS = 256, 2, 2


def test_windowed_reference_equals_reference() -> None:
    """The CPU indexer of the benchmark is kernels.reference_indexer_topk, block by block."""
    from benchmarks.multigpu.cp_model import windowed_reference_topk
    from packshard.kernels import reference_indexer_topk

    g = torch.Generator().manual_seed(3)
    s, h, d, k = 300, 4, 32, 16
    q = torch.randn(s, h, d, generator=g).bfloat16()
    keys = torch.randn(s, d, generator=g).bfloat16()
    keys[40:60] = keys[7]  # ties
    w = torch.randn(s, h, generator=g)
    docs = [90, 3, 150]
    n = sum(docs)
    starts = np.repeat(np.cumsum([0, *docs[:-1]]), docs)
    ks = torch.tensor(np.concatenate([starts, np.arange(n, s)]), dtype=torch.int32)
    ke = torch.tensor(np.concatenate([np.arange(1, n + 1), np.arange(n, s)]), dtype=torch.int32)
    ref = reference_indexer_topk(q, keys, w, ks, ke, k)
    for block in (128, 37):
        assert torch.equal(windowed_reference_topk(q, keys, w, ks, ke, k, block=block), ref)


def test_topk_check_catches_a_split() -> None:
    """One process (cp 1), the row's queries indexed in two calls as CP ranks would: the check
    passes for the reference indexer and fails for one whose result for a query depends on
    which queries share the call."""
    from benchmarks.multigpu.cp_model import Captured, CPGroup, windowed_reference_topk
    from benchmarks.multigpu.topk_check import check_call

    g = torch.Generator().manual_seed(4)
    s, h, d, topk = 96, 4, 32, 8
    q, k, w = (
        torch.randn(s, h, d, generator=g),
        torch.randn(s, d, generator=g),
        torch.randn(s, h, generator=g),
    )
    ks = torch.zeros(s, dtype=torch.int32)
    ke = torch.arange(1, s + 1, dtype=torch.int32)
    cp = CPGroup(None, 0, 1, "zigzag", nccl=False)

    def split_dependent(q, k, w, ks, ke, topk):  # type: ignore[no-untyped-def]
        out = windowed_reference_topk(q, k, w, ks, ke, topk)
        return out if q.shape[0] == s else out.flip(1)  # right only when called on the whole row

    for fn, ok in ((windowed_reference_topk, True), (split_dependent, False)):
        halves = [fn(q[a:b], k, w[a:b], ks[a:b], ke[a:b], topk) for a, b in ((0, 48), (48, s))]
        res = check_call(Captured(0, q, k, w, ks, ke, torch.cat(halves)), cp, fn, topk)
        assert res["split_equals_whole"] is ok and res["ranks_agree"] and res["same_keys"]
        assert (res["diff_rows"] == 0) is ok


def _single_process_loss(result: dict, data: Path) -> float:
    """Step 0 of the pad8 rows, one process, cp 1, the run's initial weights."""
    from benchmarks.e2e_ablation.config import PRESETS
    from benchmarks.e2e_ablation.model import DSAModel
    from benchmarks.multigpu.cp_model import (
        CPAttention,
        CPGroup,
        CPIndexer,
        cp_loss,
        windowed_reference_topk,
    )
    from packshard.trainer_shim import PackedShardStream

    run = PRESETS["smoke"]
    torch.manual_seed(0)
    model = DSAModel(run.model)
    cp = CPGroup(None, 0, 1, "zigzag", nccl=False)
    stream = PackedShardStream(
        str(data / "pad8"), dp_rank=0, dp_size=1, rows_per_step=result["rows_per_step"], seed=0
    )
    mbs = [mb for mb, _ in zip(stream, range(stream.num_micro_steps), strict=False)]
    stream.close()
    norm = float(sum(int((mb["labels"] != -100).sum()) for mb in mbs))
    total = 0.0
    for mb in mbs:
        loss = cp_loss(model, mb, cp=cp, indexer=CPIndexer(windowed_reference_topk, cp), attention=CPAttention("torch", cp),
                       dtype=torch.float32, loss_norm=norm, ce_chunk=run.ce_chunk, ce_triton=False)  # fmt: skip
        total += float(loss.detach())
    return total


@pytest.mark.multiproc
@pytest.mark.slow
def test_cpu_gloo_dp2_cp2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "multigpu" / "launch.py"), "--cpu", "--out", str(out),
         "--seq-len", str(SEQ_LEN), "--rows-per-rank", str(ROWS_PER_RANK), "--steps", str(STEPS), "--warmup", "0",
         "--check-steps", "0,1"],
        env=env, capture_output=True, text=True, timeout=170, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "multigpu_results.json").read_text())
    assert result["topology"] == {"world": 4, "dp": 2, "cp": 2, "cp_layout": "zigzag"}
    assert result["same_rows_per_step"]
    records = {(r["arm"], r["step"]): r for r in result["records"]}
    assert set(records) == {(a, s) for a in ("padseq", "count", "cost") for s in range(STEPS)}
    layers = result["model"]["n_layers"]

    # top-k identity across each CP group, every layer of both steps, every arm
    for rec in records.values():
        views = rec["topk_checks"]
        assert len(views) == 2  # one per CP group (= per DP rank)
        for v in views:
            assert len(v["checks"]) == layers
            for c in v["checks"]:
                assert c["same_keys"] and c["split_equals_whole"] and c["ranks_agree"], c
                assert c["diff_rows"] == 0 and c["valid_slots"] > 0

    # the meter counts each row once
    from packshard.packers import ShardDataset

    ds = ShardDataset.open(str(out / "data" / "pad8"))
    true_tokens = np.asarray(ds.index_column("num_tokens"))
    ranks = sorted(result["rank_rows"], key=lambda v: v["rank"])
    for arm in ("padseq", "count", "cost"):
        for step in range(STEPS):
            by_rank = [r["rows"][arm][step] for r in ranks]
            assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3]  # CP peers: same rows
            step_rows = by_rank[0] + by_rank[2]
            assert len(set(step_rows)) == len(step_rows) == ROWS_PER_RANK * 2  # DP ranks: disjoint
            rec = records[(arm, step)]
            assert rec["rows"] == len(step_rows) and rec["fillers"] == 0
            assert rec["num_tokens"] == int(true_tokens[step_rows].sum())
    for step in range(STEPS):
        assert sorted(ranks[0]["rows"]["count"][step] + ranks[2]["rows"]["count"][step]) == sorted(
            ranks[0]["rows"]["cost"][step] + ranks[2]["rows"]["cost"][step]
        )

    # cost balance is no worse than count (planned costs; measured times are only reported)
    for step in range(STEPS):
        count, cost = records[("count", step)], records[("cost", step)]
        assert max(cost["rank_cost"]) <= max(count["rank_cost"]) + 1e-6
        assert cost["meter_imbalance"] <= count["meter_imbalance"] + 1e-9

    # the CP-split distributed loss is the one-process loss; the arms agree
    single = _single_process_loss(result, out / "data")
    assert abs(records[("cost", 0)]["loss"] - single) < 1e-5, (records[("cost", 0)]["loss"], single)
    for step in range(STEPS):
        ref = records[("cost", step)]["loss"]
        assert abs(records[("count", step)]["loss"] - ref) < 1e-4
        assert abs(records[("padseq", step)]["loss"] - ref) < 1e-4

    md = (out / "multigpu_results.md").read_text()
    assert "CPU/gloo proxy" in md and "| cost (balanced)" in md
    assert result["summary"]["arms"]["cost"]["topk_identical"] is True


def test_append_records_the_launch_command(tmp_path: Path, monkeypatch) -> None:
    import benchmarks._results as results
    from benchmarks.multigpu.launch import append

    monkeypatch.setattr(results, "RESULTS_MD", tmp_path / "RESULTS.md")
    monkeypatch.setattr(results, "HISTORY_DIR", tmp_path / "history")
    saved = {"markdown": "| arm |\n|---|\n| a |", "machine": "cpu box", "device": "cpu",
             "command": "python run.py --rank 0", "launch_command": "benchmarks/multigpu/launch.py --cpu",
             "date": "2026-12-02 18:44 UTC", "load": [1.0, 1.0, 1.0], "steps": 8}  # fmt: skip
    append(saved)
    (run,) = results.read_history("multigpu")
    assert run["command"] == "benchmarks/multigpu/launch.py --cpu" and run["data"]["steps"] == 8
    assert (
        "- command: `benchmarks/multigpu/launch.py --cpu`" in (tmp_path / "RESULTS.md").read_text()
    )
    with pytest.raises(ValueError, match="no 'markdown' key"):
        append({"machine": "x", "command": "y"})
