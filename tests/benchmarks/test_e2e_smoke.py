"""The e2e padding ablation's CPU smoke path: all four arms train the same model on the same rows.

Runs `benchmarks/e2e_ablation/run.py --smoke` in a subprocess (toy model, synthetic rows packed
with packers, read through trainer_shim.PackedShardStream, torch reference indexer and sparse
attention, fp32). In a subprocess because the run imports `kernels`, whose Triton functions
must see TRITON_INTERPRET at decoration (tests/kernels/conftest.py sets it for its own
collection); here the smoke path never launches a Triton kernel.

fp32 on CPU computes every real token identically in every arm, so the arms' losses must agree
to ~1e-6 (the GPU run's bf16 target is 1e-3): padding that leaked into a real token's
attention, a loss normalised by padded instead of loss tokens, labels on padding or an MoE
that dropped tokens under crowding would all show up here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_arms_agree(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "e2e_ablation" / "run.py"), "--smoke", "--workloads", "long", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "e2e_results.json").read_text())
    assert (out / "e2e_step_times.png").stat().st_size > 10_000
    assert "| 4: pad to x8, fixed indexer (packshard) |" in (out / "e2e_results.md").read_text()

    (w,) = result["workloads"]
    steps = result["run"]["steps"]
    arms = {a["number"]: a for a in w["arms"]}
    assert sorted(arms) == [1, 2, 3, 4]
    assert all(len(a["losses"]) == steps and a["error"] is None for a in arms.values())
    assert w["loss_check"]["passed"]
    assert w["loss_check"]["max_spread"] <= 1e-5, w["loss_check"]["per_step_spread"]
    assert arms[1]["losses"][-1] < arms[1]["losses"][0], "the model did not learn"

    # same true tokens everywhere; padding to seq_len in arms 1-2 only
    rows = {r["arm"]: r for r in w["summary"]}
    assert len({tuple(a["num_tokens"]) for a in arms.values()}) == 1
    assert rows[1]["padding_fraction"] == rows[2]["padding_fraction"] > 0.05
    assert rows[3]["padding_fraction"] == rows[4]["padding_fraction"] < rows[1]["padding_fraction"]
    assert all(
        p == result["run"]["seq_len"] * result["run"]["rows_per_step"]
        for p in arms[1]["padded_tokens"]
    )
    assert all(r["expert_slots_per_pair"] >= 1.0 for r in rows.values())  # capacity >= every load
    # arm 3 retuned for new row lengths, the fixed arm never did
    assert arms[3]["indexer"]["tunings"] > 1 and arms[4]["indexer"]["tunings"] == 0

    # --append-results: the section lands in RESULTS.md with the run's own machine and command
    import benchmarks._results as results_module
    from benchmarks.e2e_ablation.report import TITLE, append_results_file

    target = tmp_path / "RESULTS.md"
    saved = results_module.RESULTS_MD
    results_module.RESULTS_MD = target
    try:
        append_results_file(out / "e2e_results.json")
    finally:
        results_module.RESULTS_MD = saved
    text = target.read_text()
    assert f"## {TITLE}" in text and result["machine"] in text and "--smoke" in text
    assert "| 3: pad to x8, autotuned indexer |" in text
