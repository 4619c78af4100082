"""The two sides of bench_stream.py and what they run against: each epoch in a fresh process
(`_ours_runner.py` in our venv, `_mosaic_runner.py` in Mosaic's own venv), moto's S3 server in
a process of its own, and the Mosaic configurations swept before the head-to-head runs.

Mosaic's knobs, as its docs describe them (StreamingDataset's docstring, "Performance tuning"):
`predownload` (samples a worker reads ahead: 8 x batch_size by default, so 8 with
batch_size=1, which makes the epoch wait on its 7 ms polling ticks), `batch_size` (sizes the
partition and the default predownload), `num_workers` (DataLoader worker processes),
`cache_limit` (evicts shards when the cache would pass it; unset: keep everything),
`shuffle_algo` (py1e by default; py1s / py1br shuffle within shard-aligned blocks), and the
MDS shard size (the writer's `size_limit`). `SWEEP_LOCAL` / `SWEEP_S3` list the combinations
tried; the best median wins and plays the head-to-head runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / ".bench"
MOSAIC_VENV = BENCH / "mosaic-venv"
MOSAIC_RUNNER = REPO / "benchmarks" / "_mosaic_runner.py"
OURS_RUNNER = REPO / "benchmarks" / "_ours_runner.py"
MOTO_SERVER = REPO / "benchmarks" / "_moto_server.py"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
MDS_SIZES = {"8MiB": 1 << 23, "64MiB": 1 << 26}  # 64 MiB: MDSWriter's default size_limit


def mosaic_sweep(rows: int, remote: bool) -> list[dict]:
    """Mosaic configurations to try: `mds` names the shard size, the rest are read knobs.
    `rows` (the epoch) stands for "read ahead as far as it likes"."""
    base = [
        {"batch_size": 1},  # the defaults: predownload 8
        {"batch_size": 1, "predownload": 64},
        {"batch_size": 1, "predownload": 512},
        {"batch_size": 1, "predownload": rows},
        {"batch_size": 8, "predownload": rows},
        {"batch_size": 8, "predownload": rows, "num_workers": 1},
        {"batch_size": 8, "predownload": rows, "num_workers": 2},
        # py1s / py1br default to 64 canonical nodes, which pads this epoch with repeats
        {"batch_size": 1, "predownload": rows, "shuffle_algo": "py1s", "num_canonical_nodes": 1},
        {"batch_size": 1, "predownload": rows, "shuffle_algo": "py1br", "num_canonical_nodes": 1},
    ]
    configs = [{"mds": "64MiB", **c} for c in base]
    configs += [{"mds": "8MiB", "batch_size": 1, "predownload": rows}]
    if remote:
        configs += [
            {"mds": "8MiB", "batch_size": 8, "predownload": rows, "num_workers": 2},
            # the smallest cache Mosaic accepts is 4 shards; 8 MiB shards make it bite (reading
            # the whole epoch ahead under it evicts what is about to be read: it hung here once)
            {"mds": "8MiB", "batch_size": 1, "predownload": 64, "cache_limit": 4 << 23},
        ]
    return configs


def describe(config: dict) -> str:
    parts = [f"MDS {config['mds']}"] + [
        f"{k}={v}" for k, v in config.items() if k != "mds" and v is not None
    ]
    return ", ".join(parts)


def ensure_mosaic_venv() -> Path:
    """Mosaic's venv (mosaicml-streaming 0.13 needs transformers<5), made on first use."""
    py = MOSAIC_VENV / "bin" / "python"
    if py.exists():
        return py
    uv_bin = REPO / ".venv" / "bin" / "uv"
    uv = [str(uv_bin)] if uv_bin.exists() else [sys.executable, "-m", "uv"]
    links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    import torch

    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    print(f"creating {MOSAIC_VENV} (mosaicml-streaming 0.13, {torch_pin}, transformers<5) ...")
    subprocess.run([*uv, "venv", "-q", str(MOSAIC_VENV), "--python", sys.executable], check=True)
    pip = [*uv, "pip", "install", "-q", "--python", str(py), *links]
    deps = ["transformers<5", "numpy<2.2", "boto3", "xxhash", "zstd", "Brotli", "python-snappy"]
    subprocess.run([*pip, torch_pin, *deps, "tqdm", "catalogue", "matplotlib<4"], check=True)
    subprocess.run([*pip, "--no-deps", "mosaicml-streaming==0.13.0"], check=True)
    return py


RUN_TIMEOUT = 300  # seconds; an epoch takes ~0.1-1 s


def _run_json(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT
) -> dict:
    """The JSON line a runner prints; a run past `timeout` reads as 0 rows (`timed_out`)."""
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {
            "rows": 0,
            "tokens": 0,
            "seconds": timeout,
            "timed_out": True,
            "load": os.getloadavg()[0],
        }
    if out.returncode:
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... failed ({out.returncode}):\n{out.stderr[-3000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def mosaic_write(py: Path, raw: Path, out: Path, size_limit: int) -> dict:
    return _run_json([str(py), str(MOSAIC_RUNNER), "write", str(raw), str(out), "--size-limit", str(size_limit)])  # fmt: skip


def mosaic_read(
    py: Path, local: Path, config: dict, *, remote: str | None = None, build: bool = False,
    endpoint: str | None = None, timeout: float = RUN_TIMEOUT,
) -> dict:  # fmt: skip
    knobs = {k: v for k, v in config.items() if k != "mds"}
    cmd = [
        str(py),
        str(MOSAIC_RUNNER),
        "read",
        "--local",
        str(local),
        "--config",
        json.dumps(knobs),
    ]
    if remote:
        cmd += ["--remote", remote]
    if build:
        cmd.append("--build")
    return _run_json(cmd, {**S3_ENV, "S3_ENDPOINT_URL": endpoint} if endpoint else None, timeout)


def ours_read(
    url: str, *, storage_options: dict | None = None, s3_client: str | None = None, **kw: object
) -> dict:
    """One epoch of ours in a fresh process; `s3_client` sets PACKSHARD_S3_CLIENT (arrow /
    s3fs; packers/s3_reading.py), else its default (pyarrow's client where it applies)."""
    cmd = [sys.executable, str(OURS_RUNNER), url, "--kw", json.dumps(kw, default=str)]
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    env = dict(S3_ENV) if storage_options else {}
    if s3_client:
        env["PACKSHARD_S3_CLIENT"] = s3_client
    return _run_json(cmd, env or None)


class MotoServer:
    """moto's S3 server in a process of its own on 127.0.0.1 (stopped by `stop`, by its pid)."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **S3_ENV},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on port {self.port} did not start") from None
                time.sleep(0.2)

    @property
    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip

    def upload(self, bucket: str, prefix: str, root: Path) -> None:
        client = self.client()
        for path in sorted(root.rglob("*")):
            if path.is_file():
                key = f"{prefix}/{path.relative_to(root).as_posix()}"
                client.upload_file(str(path), bucket, key)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
