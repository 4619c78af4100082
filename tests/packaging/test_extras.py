"""A module used without its extra says which extra to install (README: "A subpackage used
without its extra raises an ImportError naming it"), whatever it imports first."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCKED = """
import sys
for name in sys.argv[2].split(","):
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError, as when not installed
from packshard._extras import MissingExtraError
try:
    exec(sys.argv[1])
except MissingExtraError as e:
    print("MISSING", e)
"""


@pytest.mark.parametrize(
    ("statement", "blocked", "extra"),
    [
        ("from packshard.trainer_shim.hf import PackedShardDataset", "torch", "hf"),
        ("from packshard.trainer_shim.hf import PackedShardDataset", "transformers", "hf"),
        ("from packshard.trainer_shim.titan import PackedShardDataLoader", "torch", "torchtitan"),
        ("from packshard.trainer_shim import PackedShardStream", "torch", "train"),
        # the submodules themselves (examples import FlopsModel from the meter)
        ("from packshard.trainer_shim.meter import FlopsModel", "torch", "train"),
        ("import packshard.trainer_shim.stream", "torch", "train"),
        ("import packshard.trainer_shim.hf_dataset", "torch", "train"),
        ("import packshard.trainer_shim.flatten", "torch", "train"),
    ],
)
def test_a_missing_extra_is_named(statement: str, blocked: str, extra: str):
    r = subprocess.run(
        [sys.executable, "-c", BLOCKED, statement, blocked],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "MISSING" in r.stdout and f"pip install 'packshard[{extra}]'" in r.stdout, (
        r.stdout + r.stderr[-2000:]
    )


def test_sft_trainer_without_trl_names_it():
    statement = "from packshard.trainer_shim.hf import sft_trainer\nsft_trainer(None, args=None)"
    r = subprocess.run(
        [sys.executable, "-c", BLOCKED, statement, "trl,datasets"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "MISSING sft_trainer needs TRL" in r.stdout and "pip install 'trl" in r.stdout, (
        r.stdout + r.stderr[-2000:]
    )


def test_triton_off_linux_is_not_sent_to_the_extra(monkeypatch):
    """[kernels] installs triton on Linux only (its marker): elsewhere the extra cannot help."""
    from packshard._extras import MissingExtraError, require

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(MissingExtraError, match="Triton is built for Linux only") as e:
        require("kernels", "triton", "packshard.kernels")
    assert "packshard[kernels]" not in str(e.value)
