"""Interrupt a real pack job (SIGTERM as `ray job stop` sends, then SIGKILL as a crash does),
rerun the same command, and get the very bytes of an uninterrupted run."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from pipeline.verify import verify_dataset
from tests.integration._procs import pack_env, ray_tmpdir, start, stop_group, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ARGS = [
    "--input",
    "demo://?num_math=2400&num_trajectories=24",
    "--tokenizer",
    "packshard:demo",
    "--seq-len",
    "16384",
    "--cp",
    "8",
    "--window",
    "2",
    "--shard-tokens",
    "60000",
    "--num-cpus",
    "1",
]


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "pipeline/pack.py", *ARGS, "--output", str(out)]


def _markers(out: Path) -> int:
    d = out / "_packshard" / "shards"
    return len(list(d.glob("part-*.json"))) if d.is_dir() else 0


def _fingerprint(out: Path) -> list[str]:
    m = json.loads((out / "manifest.json").read_text())
    return [s["checksum"] for s in m["shards"]] + [m["index"]["checksum"]]


def test_stop_and_crash_then_rerun_gives_the_uninterrupted_dataset(tmp_path: Path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    with ray_tmpdir() as rt:
        env = pack_env(rt)
        proc = start(_cmd(ref), env, tmp_path / "ref.log")
        assert proc.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-3000:]

        # 1. `ray job stop` sends SIGTERM: the job cancels its tasks and exits 143, resumable
        proc = start(_cmd(out), env, tmp_path / "a.log")
        wait_for(lambda: _markers(out) >= 2, 600, "two shards", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
        log = (tmp_path / "a.log").read_text()
        assert "stopped by SIGTERM" in log and "Run the same command again" in log
        assert not (out / "manifest.json").exists()
        first = _markers(out)

        # 2. a crash: SIGKILL of the driver and everything it started, after more shards
        proc = start(_cmd(out), env, tmp_path / "b.log")
        wait_for(lambda: _markers(out) >= first + 2, 600, "two more shards", proc)
        stop_group(proc, signal.SIGKILL)
        assert not (out / "manifest.json").exists()
        kept = _markers(out)

        # 3. the same command again finishes the job, keeping what was verified
        proc = start(_cmd(out), env, tmp_path / "c.log")
        assert proc.wait(timeout=600) == 0, (tmp_path / "c.log").read_text()[-3000:]
    log = (tmp_path / "c.log").read_text()
    assert f"kept {kept} verified shards" in log
    assert _fingerprint(out) == _fingerprint(ref)
    assert verify_dataset(str(out)) == []
    assert not (out / "_packshard").exists()
