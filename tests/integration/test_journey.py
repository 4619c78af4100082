"""The newcomer's journey, as the README tells it, from a clean virtual environment:

1. `make install` into a fresh venv (what `make demo` / `make test` do first);
2. pack the real shared chat + GSM8K data with the Qwen2.5 tokenizer through
   `ray job submit --working-dir .` to a local Ray head this test starts (own ports, own
   temp dir, stopped by its pid);
3. `packshard stats --plot` and `packshard verify` on the result;
4. `torchrun --nproc-per-node 2 examples/train_tiny.py` for a few steps on it, and check that
   the meter's trained-token count equals the true tokens of the rows the ranks consumed
   (read from index.arrow).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.integration._procs import REPO, pack_env, ray_tmpdir, start

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.shared]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (
        f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    )
    return r


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory) -> Path:
    """A brand-new venv made by the README's set-up (the Makefile's install step)."""
    venv = tmp_path_factory.mktemp("journey") / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    _run(["make", "install", f"VENV={venv}"], env, timeout=1500)
    return venv / "bin"


def test_newcomer_journey(clean_venv: Path, shared_data: Path, tmp_path: Path):
    bin_ = clean_venv
    out = tmp_path / "sft"
    with ray_tmpdir() as rt:
        env = pack_env(rt, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        env["PATH"] = f"{bin_}{os.pathsep}{env['PATH']}"
        dash = _free_port()
        head = start(
            [str(bin_ / "ray"), "start", "--head", "--block", "--port", str(_free_port()),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--include-dashboard", "true",
             "--num-cpus", "2", "--temp-dir", rt, "--disable-usage-stats"],
            env,
            tmp_path / "head.log",
        )  # fmt: skip
        address = f"http://127.0.0.1:{dash}"
        try:
            deadline = time.monotonic() + 240
            while subprocess.run(
                [str(bin_ / "ray"), "job", "list", "--address", address],
                env=env,
                capture_output=True,
                timeout=60,
            ).returncode:
                assert head.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "head.log"
                ).read_text()[-3000:]
                time.sleep(1)
            # 2. pack through `ray job submit --working-dir .`
            chat = shared_data / "chat"
            submit = _run(
                [str(bin_ / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--",
                 "python", "-m", "packshard.pipeline.pack",
                 "--input", str(chat / "oasst_en_100_threads.messages.jsonl"),
                 "--input", str(chat / "glaive_toolcall_en_demo.messages.jsonl"),
                 "--input", str(shared_data / "gsm8k" / "test.jsonl"),
                 "--columns", "prompt=question,completion=answer",
                 "--output", str(out), "--tokenizer", str(shared_data / "tokenizers" / "qwen2.5-instruct"),
                 "--seq-len", "4096", "--cp", "2", "--no-progress"],
                env,
                timeout=900,
            )  # fmt: skip
            assert "Job 'raysubmit_" in submit.stdout and "succeeded" in submit.stdout, (
                submit.stdout[-3000:]
            )
        finally:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                head.kill()

    # 3. stats --plot and verify
    png = tmp_path / "sft.png"
    stats = _run([str(bin_ / "packshard"), "stats", str(out), "--plot", str(png)], env, timeout=300)
    assert "padding every row to seq_len would waste" in stats.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    verify = _run([str(bin_ / "packshard"), "verify", str(out), "--quiet"], env, timeout=600)
    assert "verify: OK" in verify.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    totals = manifest["totals"]
    assert totals["samples_in"] == 400 + 300 + 1319  # the three files' records
    assert totals["samples_kept"] + sum(totals["dropped"].values()) == totals["samples_in"]

    # 4. two processes train a few steps from it; the meter's count is the rows' true tokens
    report = tmp_path / "report"
    train_env = dict(env)
    train_env.pop("RAY_ADDRESS", None)
    _run(
        [str(bin_ / "torchrun"), "--nproc-per-node", "2", "--master-port", str(_free_port()),
         "examples/train_tiny.py", "--data", str(out), "--cp", "1", "--rows-per-step", "4", "--steps", "3",
         "--report", str(report)],
        train_env,
        timeout=600,
    )  # fmt: skip
    ranks = [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in range(2)]
    rows = [row for rank in ranks for row in rank["rows"] if row >= 0]
    assert len(rows) == 3 * 4 and len(set(rows)) == len(rows), rows
    with pa.ipc.open_file(out / "index.arrow") as f:
        num_tokens = f.read_all().column("num_tokens").to_numpy().astype(np.int64)
    assert ranks[0]["steps"] == 3
    assert ranks[0]["trained_tokens"] == int(num_tokens[rows].sum())
