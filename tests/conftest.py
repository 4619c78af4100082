"""Session-wide test configuration: markers that skip cleanly, and the path to ../shared/data."""

from __future__ import annotations

import atexit
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# The Triton interpreter runs `tl.dot` through numpy's OpenBLAS, whose optimised sgemm kernels
# (Haswell, Zen: what this machine's environment selects) sum a dot product's terms in an order
# that depends on the matrices' shapes and the CPU's caches. The kernel tests that compare block
# configurations bitwise would then compare BLAS kernels instead of ours: they fail on AMD EPYC
# and pass on Intel. OpenBLAS's Prescott kernel (SSE3, on every x86-64 CPU) sums each dot in one
# order whatever the shapes. OpenBLAS reads the variable when it loads, so it is set here, before
# anything imports numpy, and overrides the environment's choice; subprocesses inherit it. Only the
# interpreter needs it: on a GPU the kernels run compiled (a plugin there may import numpy first).
_X86 = platform.machine() in ("x86_64", "AMD64")
_BLAS_PINNED = _X86 and "numpy" not in sys.modules
if _BLAS_PINNED:
    os.environ["OPENBLAS_CORETYPE"] = "Prescott"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when the module that
# defines it is first imported, by whichever test module happens to import it first (the e2e
# benchmark tests import Triton kernels too). So it is set here, before any test module is
# imported, and only where no GPU is visible: there the kernels run on CPU through the
# interpreter; on a GPU machine the same tests run the compiled kernels.
if not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"
    if _X86 and not _BLAS_PINNED and os.environ.get("OPENBLAS_CORETYPE") != "Prescott":
        raise RuntimeError(
            "numpy was imported before tests/conftest.py could pin OpenBLAS's kernel, which the "
            "Triton interpreter's bitwise kernel tests need: run pytest without the plugin that "
            "imports numpy, or with OPENBLAS_CORETYPE=Prescott set"
        )


# The pack job's driver keeps checked tokenizers in a cache (`pipeline.tokenizer_cache`, by
# default under ~/.cache). The suite uses a directory of its own instead, never the user's: set
# here, before any job runs, so that Ray drivers and CLIs in subprocesses share it, and removed
# when the session ends. Tests of the cache itself point it elsewhere.
_CACHE = tempfile.mkdtemp(prefix="packshard-test-cache-")
os.environ["PACKSHARD_CACHE_DIR"] = _CACHE
os.environ.pop("PACKSHARD_TOKENIZER_CACHE", None)
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_shared = pytest.mark.skip(
        reason=f"needs ../shared/data beside the checkout ({SHARED_DATA} is absent)"
    )
    has_gpu = _has_cuda()
    has_shared = SHARED_DATA.is_dir()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "shared" in item.keywords and not has_shared:
            item.add_marker(skip_shared)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data; tests using it must also carry the `shared` marker so they skip without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"needs ../shared/data ({SHARED_DATA} is absent)")
    return SHARED_DATA


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server on 127.0.0.1 (real HTTP), stopped at the end of the session.

    Yields {"endpoint_url": ..., "storage_options": {...}} for s3fs; credentials are dummies
    set in the environment so boto3/s3fs in subprocesses (Ray workers, CLIs) work too.
    """
    import os

    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    try:
        yield {
            "endpoint_url": endpoint,
            "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
        }
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh, empty bucket on the moto server (created with boto3; s3fs's mkdir sends a
    location constraint that moto rejects). Yields its name."""
    import re
    import uuid

    import boto3

    name = (
        re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
        + "-"
        + uuid.uuid4().hex[:8]
    )
    client = boto3.client(
        "s3",
        endpoint_url=s3_server["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    yield name
