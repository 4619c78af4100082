"""The pack job against a real Ray cluster this module starts (`ray start --head --block` on its
own ports and temp dir, stopped by its pid at the end). The head is started with another Python
first on its PATH (the interpreter this venv was made from, without our dependencies), as when
a head was not started from packshard's environment:

- `ray job submit --working-dir . -- python -m packshard.pipeline.pack ...` then stops at once,
  naming the Python that lacks the dependencies and the fix (docs/OPERATIONS.md);
- with that fix, `--runtime-env-json` naming the venv (PATH for the entrypoint's `python`,
  `py_executable` for the workers), it succeeds and the dataset verifies;
- a job stopped by SIGTERM (what `ray job stop` sends) and then killed by SIGKILL (a crash),
  rerun with the same command, gives the very bytes of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from packshard.pipeline.verify import verify_dataset
from tests.integration._procs import (
    BIN,
    REPO,
    free_port,
    kill_processes_using,
    pack_env,
    ray_node_logs,
    ray_port_flags,
    ray_tmpdir,
    start,
    stop_group,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


# the interpreter this venv was made from: no numpy, pyarrow or Ray of ours
BASE_PYTHON = Path(getattr(sys, "_base_executable", sys.executable)).resolve()


def _lacks_dependencies(python: Path) -> bool:
    probe = "import importlib.util as u; print(all(u.find_spec(m) for m in ('pyarrow', 'ray')))"
    r = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() != "True"


def _jobs_api_up(address: str, env: dict[str, str]) -> bool:
    r = subprocess.run(
        [str(BIN / "ray"), "job", "list", "--address", address],
        env=env,
        capture_output=True,
        timeout=60,
    )
    return r.returncode == 0


HEAD_ATTEMPTS = 3  # a head that exits before it is up is started anew with fresh ports


def _start_head(
    rt: str, head_env: dict[str, str], env: dict[str, str], log: Path
) -> tuple[subprocess.Popen, int, int]:
    """(process, GCS port, dashboard port) of a head whose jobs API answers.

    `ray start` exits 1 when its raylet does not register within 30 s, and the agent ports
    picked free here are bound later (another process can take one meanwhile): a head that
    exits before it is up is started again with fresh ports, each failure a warning carrying
    its output and the node's logs (test_pack_multinode.py does the same for its nodes)."""
    failures = []
    for attempt in range(1, HEAD_ATTEMPTS + 1):
        gcs, dash = free_port(), free_port()
        attempt_log = log.with_name(f"{log.stem}-{attempt}.log")
        head = start(
            [
                str(BIN / "ray"), "start", "--head", "--block", "--port", str(gcs),
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                "--include-dashboard", "true", "--num-cpus", "2", "--temp-dir", rt,
                "--disable-usage-stats", "--ray-client-server-port", str(free_port()),
                *ray_port_flags(),
            ],
            head_env,
            attempt_log,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while not _jobs_api_up(f"http://127.0.0.1:{dash}", env):
            if head.poll() is not None:
                failures.append(
                    f"attempt {attempt}: the head exited ({head.returncode}):\n"
                    f"{attempt_log.read_text(errors='replace')[-1500:]}\n{ray_node_logs(rt)}"
                )
                kill_processes_using(rt)
                warnings.warn(f"the Ray head did not start; {failures[-1]}", stacklevel=1)
                break
            if time.monotonic() > deadline:
                head.kill()
                raise AssertionError(
                    "the Ray head did not come up in 240 s:\n" + attempt_log.read_text()[-3000:]
                )
            time.sleep(1)
        else:
            return head, gcs, dash
    raise AssertionError("\n\n".join(failures))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """(dashboard address, GCS address, environment) of a 2-CPU head."""
    log = tmp_path_factory.mktemp("head") / "head.log"
    with ray_tmpdir() as rt:
        # Ray >= 2.50 protects a cluster started by `ray start` with a token; give it ours, so the
        # jobs CLI and the drivers can authenticate (nothing is read from or written to ~/.ray).
        env = pack_env(rt, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        # the head's PATH: a `python` without our dependencies first, no venv
        other = tmp_path_factory.mktemp("other-python")
        (other / "python").symlink_to(BASE_PYTHON)
        path = [p for p in env["PATH"].split(os.pathsep) if Path(p) != BIN]
        head_env = {**env, "PATH": os.pathsep.join([str(other), *path])}
        head, gcs, dash = _start_head(rt, head_env, env, log)
        address = f"http://127.0.0.1:{dash}"
        try:
            yield address, f"127.0.0.1:{gcs}", env
        finally:
            head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:
                head.wait(timeout=30)
            except subprocess.TimeoutExpired:
                head.kill()
            kill_processes_using(rt)  # anything of this head's temp dir that outlived it


def _submit(address: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", *args]
    for _ in range(30):  # the head's job agent registers a little after the jobs API answers
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in r.stderr:
            return r
        time.sleep(2)
    return r


JOB = [
    "--", "python", "-m", "packshard.pipeline.pack", "--input", "demo://?num_math=300&num_trajectories=3",
    "--tokenizer", "packshard:demo", "--seq-len", "8192", "--cp", "8",
    "--window", "4", "--shard-tokens", "60000", "--no-progress",
]  # fmt: skip


def test_a_head_started_from_another_python_is_named_with_the_fix(cluster, tmp_path: Path):
    if not _lacks_dependencies(BASE_PYTHON):
        pytest.skip(f"{BASE_PYTHON} has packshard's dependencies: nothing to show")
    address, _, env = cluster
    r = _submit(address, env, *JOB, "--output", str(tmp_path / "out"))
    assert r.returncode != 0, r.stdout[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("packshard pack: error:")]
    # one line (the CLI prints the job's log and its status message: twice), no traceback
    assert len(set(lines)) == 1, r.stdout[-3000:]
    assert "the pack job needs" in lines[0] and "pyarrow" in lines[0]
    assert re.search(r"which this Python \(\S*other-python\d*/python\) lacks", lines[0]), lines[0]
    assert "--runtime-env-json" in lines[0] and "Traceback" not in r.stdout
    assert not (tmp_path / "out").exists()


def test_job_submit_runs_the_pack_job_on_the_cluster(cluster, tmp_path: Path):
    address, _, env = cluster
    out = tmp_path / "out"
    runtime_env = {"env_vars": {"PATH": f"{BIN}:${{PATH}}"}, "py_executable": str(BIN / "python")}
    r = _submit(
        address, env, "--runtime-env-json", json.dumps(runtime_env), *JOB, "--output", str(out)
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "packshard pack: committed" in r.stdout and "succeeded" in r.stdout
    assert verify_dataset(str(out)) == []
    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["samples_in"] == 303 and len(m["shards"]) >= 2


RESUME_ARGS = [
    "--input",
    "demo://?num_math=1200&num_trajectories=12",
    "--tokenizer",
    "packshard:demo",
]
RESUME_ARGS += ["--seq-len", "16384", "--cp", "8", "--window", "1", "--shard-tokens", "30000"]


def _pack_cmd(out: Path, workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "packshard.pipeline.pack",
        *RESUME_ARGS,
        "--num-workers",
        str(workers),
        "--output",
        str(out),
    ]


def _markers(out: Path) -> int:
    d = out / "_packshard" / "shards"
    return len(list(d.glob("part-*.json"))) if d.is_dir() else 0


def _fingerprint(out: Path) -> list[str]:
    m = json.loads((out / "manifest.json").read_text())
    return [s["checksum"] for s in m["shards"]] + [m["index"]["checksum"]]


def test_stop_and_crash_then_rerun_gives_the_uninterrupted_dataset(cluster, tmp_path: Path):
    _, gcs, env = cluster
    env = {**env, "RAY_ADDRESS": gcs}  # as under `ray job submit`: the driver joins the cluster
    ref, out = tmp_path / "ref", tmp_path / "out"
    proc = start(_pack_cmd(ref, workers=2), env, tmp_path / "ref.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-3000:]

    # 1. `ray job stop` sends SIGTERM: the job cancels its tasks and exits 143, resumable
    proc = start(_pack_cmd(out, workers=1), env, tmp_path / "a.log")
    wait_for(lambda: _markers(out) >= 2, 600, "two shards", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    log = (tmp_path / "a.log").read_text()
    assert "stopped by SIGTERM" in log and "Run the same command again" in log
    assert not (out / "manifest.json").exists()
    first = _markers(out)

    # 2. a crash: SIGKILL of the driver process group, after more shards
    proc = start(_pack_cmd(out, workers=1), env, tmp_path / "b.log")
    wait_for(lambda: _markers(out) >= first + 2, 600, "two more shards", proc)
    stop_group(proc, signal.SIGKILL)
    assert not (out / "manifest.json").exists()

    at_kill = _markers(out)

    # 3. the same command again finishes the job, keeping what was verified
    proc = start(_pack_cmd(out, workers=1), env, tmp_path / "c.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "c.log").read_text()[-3000:]
    log = (tmp_path / "c.log").read_text()
    kept = re.search(r"kept (\d+) verified shards", log)
    assert kept and int(kept.group(1)) >= at_kill >= first + 2, log[-2000:]
    assert _fingerprint(out) == _fingerprint(ref)
    assert verify_dataset(str(out)) == []
    assert not (out / "_packshard").exists()
