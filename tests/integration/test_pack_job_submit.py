"""`ray job submit --working-dir . -- python pipeline/pack.py ...` against a Ray head this test
starts (`ray start --head --block` on its own ports and temp dir) and stops by its pid."""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.verify import verify_dataset
from tests.integration._procs import BIN, REPO, kill_processes_using, pack_env, ray_tmpdir, start

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jobs_api_up(address: str, env: dict[str, str]) -> bool:
    r = subprocess.run(
        [str(BIN / "ray"), "job", "list", "--address", address],
        env=env,
        capture_output=True,
        timeout=60,
    )
    return r.returncode == 0


@pytest.fixture
def ray_head(tmp_path: Path):
    with ray_tmpdir() as rt:
        # Ray >= 2.50 protects a cluster started by `ray start` with a token; give it ours, so the
        # jobs CLI and the job's driver can authenticate (nothing is read from or written to ~/.ray).
        env = pack_env(rt, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        dash = _free_port()
        head = start(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                "--block",
                "--port",
                str(_free_port()),
                "--dashboard-host",
                "127.0.0.1",
                "--dashboard-port",
                str(dash),
                "--include-dashboard",
                "true",
                "--num-cpus",
                "2",
                "--temp-dir",
                rt,
                "--disable-usage-stats",
            ],
            env,
            tmp_path / "head.log",
        )
        address = f"http://127.0.0.1:{dash}"
        try:
            deadline = time.monotonic() + 240
            while not _jobs_api_up(address, env):
                if head.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "the Ray head did not come up:\n"
                        + (tmp_path / "head.log").read_text()[-3000:]
                    )
                time.sleep(1)
            yield address, env
        finally:
            head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:
                head.wait(timeout=30)
            except subprocess.TimeoutExpired:
                head.kill()
            kill_processes_using(rt)  # anything of this head's temp dir that outlived it


def test_job_submit_runs_the_pack_job_on_the_cluster(ray_head, tmp_path: Path):
    address, env = ray_head
    out = tmp_path / "out"
    cmd = [
        str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--",
        "python", "pipeline/pack.py", "--input", "demo://?num_math=300&num_trajectories=3",
        "--tokenizer", "packshard:demo", "--output", str(out), "--seq-len", "8192", "--cp", "8",
        "--window", "4", "--shard-tokens", "60000", "--no-progress",
    ]  # fmt: skip
    for _ in range(30):  # the head's job agent registers a little after the jobs API answers
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in r.stderr:
            break
        time.sleep(2)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "packshard pack: committed" in r.stdout and "succeeded" in r.stdout
    assert verify_dataset(str(out)) == []
    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["samples_in"] == 303 and len(m["shards"]) >= 2
