"""The README's main command (`make demo` runs it): `packshard pack --demo --output DIR
--overwrite` packs the built-in mix on a local Ray, prints the job summary and the dataset's
stats, and `packshard verify` passes on the result."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.integration._procs import BIN, REPO, pack_env, ray_tmpdir

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_readme_main_command(tmp_path: Path):
    makefile = (REPO / "Makefile").read_text()
    assert "packshard pack --demo --output $(DEMO_OUT) --overwrite" in makefile
    out = tmp_path / "demo_out"
    with ray_tmpdir() as rt:
        r = subprocess.run(
            [str(BIN / "packshard"), "pack", "--demo", "--output", str(out), "--overwrite"],
            cwd=REPO,
            env=pack_env(rt),
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout
    # the job summary
    assert f"packshard pack: committed {out}" in text
    assert "samples   in 3,040  kept 3,040  dropped 0 (none)" in text
    # the dataset's stats (pipeline.stats.format_stats)
    assert "config       seq_len 32,768  cp 8  pad_multiple 8  tokenizer packshard:demo" in text
    assert "samples      in 3,040  kept 3,040  dropped: none" in text
    padding = float(re.search(r"padding\s+([\d.]+)% of padded tokens", text).group(1))
    waste = float(re.search(r"padding every row to seq_len would waste ([\d.]+)%", text).group(1))
    assert padding < 0.1 < waste  # rows padded to a multiple of cp, not to seq_len
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["totals"]["samples_kept"] == 3040
        and manifest["config"]["inputs"][0]["url"] == "demo://"
    )
    v = subprocess.run(
        [str(BIN / "packshard"), "verify", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert v.returncode == 0 and "verify: OK" in v.stdout, v.stdout + v.stderr


IN_PROCESS = """
import os, sys
from packshard.pipeline.pack import main
before = dict(os.environ)
rc = main(["--demo", "--output", sys.argv[1], "--no-progress", "--num-cpus", "1"])
ours = ("PYTHONPATH", "RAY_agent_register_timeout_ms")  # ray.init sets others of its own
print("RC", rc, "changed", [k for k in ours if before.get(k) != os.environ.get(k)])
"""


def test_an_in_process_job_leaves_the_environment_as_it_was(tmp_path: Path):
    """The local Ray's workers get the checkout on their PYTHONPATH; the calling process, which
    may start other Pythons later, keeps its own."""
    with ray_tmpdir() as rt:
        skip = ("PYTHONPATH", "RAY_agent_register_timeout_ms")
        env = {k: v for k, v in pack_env(rt).items() if k not in skip}
        r = subprocess.run(
            [str(BIN / "python"), "-c", IN_PROCESS, str(tmp_path / "out")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert "RC 0 changed []" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
