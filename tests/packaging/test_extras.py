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
