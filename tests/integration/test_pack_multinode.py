"""The pack job on a multi-node Ray cluster on one machine: a head (no CPUs: it holds the GCS
and the driver) plus two worker nodes joined with `ray start --address`, each with one CPU, its
own custom resource, ports and `--temp-dir` (so each is a distinct node with its own raylet and
object store). Every process is stopped by pid at the end, never by a bare `ray stop`.

- the job's tasks run on both worker nodes (the manifest's ``job.nodes`` says so) and the
  shards and index are byte-identical to a one-worker run;
- a worker node killed (SIGKILL of its raylet, object store and workers) while the job runs:
  the job finishes on the node left (tasks retried, lost blocks recomputed), or a rerun of the
  same command does, with every sample exactly once and the bytes of the reference run.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import psutil
import pytest

from packshard.pipeline.verify import verify_dataset
from tests.integration._procs import (
    BIN,
    free_port,
    kill_processes_using,
    pack_env,
    ray_node_logs,
    ray_port_flags,
    ray_tmpdir,
    start,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Node death is noticed after 3 failed health checks 0.5 s apart (Ray's default is minutes'
# worth on a loaded machine); a killed raylet refuses the check at once, so this cannot
# mistake a slow node for a dead one.
HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}
JOB_ARGS = [
    "--input", "demo://?num_math=1500&num_trajectories=16", "--tokenizer", "packshard:demo",
    "--seq-len", "16384", "--cp", "8", "--window", "1", "--shard-tokens", "40000", "--no-progress",
]  # fmt: skip


class Cluster:
    """A head and two worker nodes; `workers[name]` is (process, temp dir) of node `name`."""

    # `ray start` gives a node's raylet 30 s to register with the GCS, then exits 1. On the
    # 2-core CI machine that happened now and then to a worker node started together with the
    # head and the other node (about 1 start in 40). Nodes start one at a time, and one that
    # still fails is started anew with fresh ports (its agent ports are picked free here and
    # bound later, so another process can take one meanwhile), at most this many times; each
    # failed attempt is a warning carrying the node's own logs, which go with its temp dir.
    NODE_ATTEMPTS = 3

    def __init__(self, stack: ExitStack, logs: Path) -> None:
        self.stack = stack
        self.head_tmp = stack.enter_context(ray_tmpdir())
        self.env = pack_env(
            self.head_tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), **HEALTH
        )
        self.gcs = f"127.0.0.1:{free_port()}"
        self.logs = logs
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[str, tuple[subprocess.Popen, str]] = {}
        # one node at a time, the head first
        self.head = self._start("head", self.head_tmp, "--head", "--port", self.gcs.split(":")[1],
                                "--num-cpus", "0", "--include-dashboard", "false",
                                "--ray-client-server-port", str(free_port()))  # fmt: skip
        wait_for(lambda: self._up("head"), 120, "the Ray head", self.head)
        for name in ("a", "b"):
            self.workers[name] = self._start_worker(name)

    def _start_worker(self, name: str) -> tuple[subprocess.Popen, str]:
        failures = []
        for attempt in range(1, self.NODE_ATTEMPTS + 1):
            tmp = self.stack.enter_context(ray_tmpdir())
            log_name = f"{name}-{attempt}"
            proc = self._start(log_name, tmp, "--address", self.gcs, "--num-cpus", "1",
                               "--resources", json.dumps({f"packshard_node_{name}": 1}))  # fmt: skip
            try:
                wait_for(lambda n=log_name: self._up(n), 120, f"worker node {name}", proc)
                return proc, tmp
            except AssertionError as e:
                if proc.poll() is None:  # not the port race: still starting after 120 s
                    raise
                start_log = (self.logs / f"{log_name}.log").read_text(errors="replace")
                failures.append(
                    f"attempt {attempt}: {e}\n{start_log[-1500:]}\n{ray_node_logs(tmp)}"
                )
                kill_processes_using(tmp)
                warnings.warn(f"worker node {name} did not start; {failures[-1]}", stacklevel=1)
        raise AssertionError("\n\n".join(failures))

    def _start(self, name: str, tmp: str, *args: str) -> subprocess.Popen:
        cmd = [
            str(BIN / "ray"), "start", "--block", "--temp-dir", tmp, "--disable-usage-stats",
            *ray_port_flags(), *args,
        ]  # fmt: skip
        proc = start(cmd, {**self.env, "RAY_TMPDIR": tmp}, self.logs / f"{name}.log")
        self.procs.append(proc)
        return proc

    def _up(self, log_name: str) -> bool:
        # `ray start` prints this once its node has registered with the GCS
        return "Ray runtime started" in (self.logs / f"{log_name}.log").read_text(errors="replace")

    def running_tasks(self, name: str) -> list[str]:
        """Titles of worker processes of node `name` running a task now (`ray::pack_shard`..:
        Ray renames an idle worker `ray::IDLE`); workers are children of the node's raylet."""
        titles = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if not (
                cmd and cmd[0].endswith("raylet") and any(self.workers[name][1] in c for c in cmd)
            ):
                continue
            for child in proc.children():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    title = " ".join(child.cmdline())
                    if title.startswith("ray::") and "IDLE" not in title:
                        titles.append(title)
        return titles

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL every process of worker node `name` (its `ray start`, raylet, store, workers)."""
        return kill_processes_using(self.workers[name][1])

    def stop(self) -> None:
        for proc in reversed(self.procs):  # `ray start --block` stops what it started on SIGTERM
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("nodes")
    with ExitStack() as stack:  # the temp dirs' leftover processes are killed by pid on exit
        c = Cluster(stack, logs)
        try:
            yield c
        finally:
            c.stop()


def _job(cluster: Cluster, out: Path, workers: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "packshard.pipeline.pack", *JOB_ARGS, "--output", str(out),
           "--num-workers", str(workers)]  # fmt: skip
    # as under `ray job submit`: the driver joins the cluster (on the head, whose node it prefers)
    return start(cmd, {**cluster.env, "RAY_ADDRESS": cluster.gcs}, log)


def _finish(proc: subprocess.Popen, log: Path) -> None:
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]


def _fingerprint(out: Path) -> list[str]:
    m = json.loads((out / "manifest.json").read_text())
    return [s["checksum"] for s in m["shards"]] + [m["index"]["checksum"]]


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset written by one worker (one task at a time) on the same cluster."""
    out = tmp_path_factory.mktemp("ref") / "out"
    log = out.parent / "ref.log"
    _finish(_job(cluster, out, 1, log), log)
    return out


def test_tasks_run_on_both_worker_nodes_and_the_bytes_match_one_worker(
    cluster: Cluster, reference: Path, tmp_path: Path
):
    out, log = tmp_path / "out", tmp_path / "job.log"
    _finish(_job(cluster, out, 2, log), log)
    assert _fingerprint(out) == _fingerprint(reference)
    job = json.loads((out / "manifest.json").read_text())["job"]
    ran = {n["node_id"]: n["tasks"] for n in job["nodes"]}
    assert len(ran) == 2, job["nodes"]  # the head has no CPU: both tasks ran on worker nodes
    assert all(t["tokenize"] >= 1 for t in ran.values()), job["nodes"]
    assert sum(t["pack"] for t in ran.values()) == len(
        json.loads((out / "manifest.json").read_text())["shards"]
    )
    assert all(n["address"] for n in job["nodes"])


def _markers(out: Path) -> int:
    d = out / "_packshard" / "shards"
    return len(list(d.glob("part-*.json"))) if d.is_dir() else 0


def test_a_worker_node_killed_mid_job_loses_nothing_and_adds_nothing(
    cluster: Cluster, reference: Path, tmp_path: Path
):
    out, log = tmp_path / "out", tmp_path / "job.log"
    total = len(json.loads((reference / "manifest.json").read_text())["shards"])
    proc = _job(cluster, out, 2, log)
    wait_for(
        lambda: _markers(out) >= 1 and cluster.running_tasks("b"),
        300,
        "node b running a task",
        proc,
    )
    assert _markers(out) < total, "the job ended before the node was killed; make it longer"
    assert cluster.kill_node("b")
    if proc.wait(timeout=300) != 0:  # the node's loss can fail the job: then a rerun finishes it
        rerun = _job(cluster, out, 2, tmp_path / "rerun.log")
        _finish(rerun, tmp_path / "rerun.log")
    assert _fingerprint(out) == _fingerprint(reference), log.read_text()[-3000:]
    assert verify_dataset(str(out)) == []
    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["samples_in"] == m["totals"]["samples_kept"] == 1516
    assert not (out / "_packshard").exists()
