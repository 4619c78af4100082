"""Helpers for integration tests that run pack jobs and Ray heads as real processes: a short
private Ray temp dir per run, and cleanup of exactly the processes a test started."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@contextmanager
def ray_tmpdir() -> Iterator[str]:
    """A short private directory for Ray's sessions (unix socket paths must stay < 108 chars);
    on exit, any process still running from it (ours by construction) is killed by pid."""
    path = tempfile.mkdtemp(prefix="psr", dir="/tmp")
    try:
        yield path
    finally:
        kill_processes_using(path)
        shutil.rmtree(path, ignore_errors=True)


def kill_processes_using(marker: str) -> list[int]:
    """Kill (by pid) the processes whose command line mentions `marker`; returns their pids."""
    victims = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(
                marker in part for part in proc.info["cmdline"] or []
            ):
                victims.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.kill()
    psutil.wait_procs(victims, timeout=10)
    return [p.pid for p in victims]


def pack_env(ray_tmp: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RAY_TMPDIR=ray_tmp,
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PACKSHARD_NO_PROGRESS="1",
        RAY_agent_register_timeout_ms="120000",
        **extra,
    )
    env.pop("RAY_ADDRESS", None)
    return env


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start a process in its own session (so the test can signal its whole group)."""
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 60) -> int:
    """Signal a process group the test started, and wait for its leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    return proc.wait(timeout=timeout)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def ray_node_logs(tmp: str, lines: int = 15) -> str:
    """The last lines of a node's own logs (raylet, agents) under its Ray temp dir: what a
    failure message needs, since the temp dir is removed when the test ends."""
    logs = Path(tmp) / "session_latest" / "logs"
    parts = []
    for name in ("raylet.out", "raylet.err", "dashboard_agent.log", "runtime_env_agent.log"):
        with contextlib.suppress(OSError):
            tail = (logs / name).read_text(errors="replace").splitlines()[-lines:]
            if tail:
                parts.append(f"--- {name}\n" + "\n".join(tail))
    return "\n".join(parts) or f"(no node logs under {logs})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_port_flags() -> list[str]:
    """`ray start` flags giving this node its own free ports where Ray has fixed defaults
    (dashboard agent 52365, metrics export, ray client 10001, runtime env agent): two nodes on one
    machine (another test's, another user's) would otherwise collide, and a head whose dashboard
    agent cannot bind its port never takes a job ("No available agent to submit job")."""
    flags = []
    for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                 "--metrics-export-port", "--runtime-env-agent-port"):  # fmt: skip
        flags += [flag, str(free_port())]
    return flags
