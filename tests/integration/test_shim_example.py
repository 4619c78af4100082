"""examples/train_tiny.py under torchrun, 4 CPU ranks as dp=2 x cp=2 (gloo): the packed,
CP-split loss of step 0 equals the per-document reference (the example's --check-loss)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from packshard.trainer_shim.synthetic import write_synthetic_dataset

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_train_tiny_dp2_cp2_loss_matches_per_document(tmp_path: Path):
    url = tmp_path / "ds"
    lengths = np.random.default_rng(5).integers(8, 200, 80)
    write_synthetic_dataset(str(url), lengths=lengths, seq_len=256, pad_multiple=4)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(REPO / "examples" / "train_tiny.py"), "--data", str(url), "--cp", "2", "--cp-layout", "zigzag",
        "--steps", "2", "--check-loss", "--dim", "32", "--layers", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "check-loss: packed+CP" in log and ": OK" in log, log[-4000:]
    assert "step 1:" in log and "tok/s" in log
