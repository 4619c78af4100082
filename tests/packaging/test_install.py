"""The built wheel, installed as users install it: beside Hugging Face's `kernels` and TRL, and
with only the core and `[train]` extras.

transformers 5.x requires Hugging Face's `kernels` package; a wheel of ours that owned a
top-level `kernels` (or `pipeline`, `packers`) would collide with it: imports from inside and
outside the checkout would pick one or the other, and installing or uninstalling either would
delete the other's files. These tests build the wheel from the checkout, install it into fresh
virtual environments (from the package registry, as CI's clean machine does) and import and run
it there, from a directory outside the checkout and from the checkout root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.install]


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc.stdout


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv (installed by `make install`)")
    return uv


def _torch_spec() -> str:
    """The torch that `make` installed (the small CPU build where the machine has it)."""
    constraints = REPO / ".venv" / "constraints.txt"
    if constraints.is_file():
        return constraints.read_text().split()[0]
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def _venv(path: Path, *requirements: str) -> Path:
    """A fresh venv at `path` with `requirements`; torch (when asked for) is the one `make`
    installed, through pip, which finds the CPU build on this machine's disk (uv does not)."""
    _run([sys.executable, "-m", "venv", str(path)])
    python = path / "bin" / "python"
    torch = _torch_spec()
    if any(r.startswith("torch") or "[train" in r or "[kernels" in r for r in requirements):
        _run([str(python), "-m", "pip", "install", "-q", torch])
    constraint = path / "constraints.txt"
    constraint.write_text(torch + "\n")
    _run([_uv(), "pip", "install", "-q", "--python", str(python), "--constraint",
          str(constraint), *requirements])  # fmt: skip
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([_uv(), "build", "--wheel", "--out-dir", str(out), str(REPO)])
    (built,) = out.glob("packshard-*.whl")
    return built


def test_the_wheel_holds_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"packshard"}, tops
    # Apache-2.0 asks for its text to travel with the code
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


CHECK_BESIDE_HF = """
import json, sys, kernels, packshard
from kernels import get_kernel
from trl.data_utils import pack_dataset
from packshard.kernels import fp8_indexer_topk
print(json.dumps({"kernels": kernels.__file__, "packshard": packshard.__file__,
                  "get_kernel": get_kernel.__module__}))
"""

RECORD_INTACT = """
import importlib.metadata, json
print(json.dumps([str(f) for f in importlib.metadata.files("packshard") if not f.locate().exists()]))
"""

RUN_INDEXER = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from packshard import fp8_indexer_topk
torch.manual_seed(0)
s, h, d = 64, 4, 32
q = torch.randn(s, h, d).bfloat16()
k = torch.randn(s, d).bfloat16()
w = torch.rand(s, h)
ks = torch.zeros(s, dtype=torch.int32)
ke = torch.arange(1, s + 1, dtype=torch.int32)
ke[s - 8:] = ks[s - 8:] = s - 8  # padding: empty ranges
out = fp8_indexer_topk(q, k, w, ks, ke, 16)
assert out.shape == (s, 16) and int(out[0, 0]) == 0 and (out[s - 8:] == s).all(), out
print("indexer ok")
"""


def test_installs_beside_hugging_face_kernels_and_trl(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    python = _venv(venv, f"packshard[kernels] @ {wheel.as_uri()}")
    # Hugging Face's kernels (which transformers requires) and TRL, installed after packshard
    _run([_uv(), "pip", "install", "-q", "--python", str(python), "--constraint",
          str(venv / "constraints.txt"), "kernels", "trl"])  # fmt: skip
    site = venv / "lib"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cwd in (outside, REPO):
        got = json.loads(_run([str(python), "-c", CHECK_BESIDE_HF], cwd=cwd, env=env))
        assert Path(got["kernels"]).is_relative_to(site), (cwd, got)  # Hugging Face's
        assert got["get_kernel"].startswith("kernels"), got
        if cwd == outside:
            assert Path(got["packshard"]).is_relative_to(site), got
    assert "indexer ok" in _run([str(python), "-c", RUN_INDEXER], cwd=outside, env=env)
    # uninstalling Hugging Face's kernels leaves every file of ours in place
    _run([_uv(), "pip", "uninstall", "-q", "--python", str(python), "kernels"])
    assert "indexer ok" in _run([str(python), "-c", RUN_INDEXER], cwd=outside, env=env)
    missing = _run([str(python), "-c", RECORD_INTACT], cwd=outside, env=env)
    assert missing.strip() == "[]", f"files of ours gone with Hugging Face's kernels: {missing}"


STREAM = """
import importlib.util, json, sys
heavy = [m for m in ("ray", "transformers", "matplotlib", "triton", "datasets")
         if importlib.util.find_spec(m) is not None]
from packshard import PackedShardStream
rows, tokens = [], 0
for mb in PackedShardStream(sys.argv[1], dp_rank=0, dp_size=1, rows_per_step=2, shuffle=False):
    rows.append(int(mb["row"]))
    tokens += int(mb["num_tokens"])
print(json.dumps({"heavy": heavy, "rows": rows, "tokens": tokens}))
"""


def test_core_and_train_extras_stream_a_dataset(wheel: Path, tmp_path: Path) -> None:
    from packshard.trainer_shim.synthetic import write_synthetic_dataset

    url = tmp_path / "ds"
    lengths = np.random.default_rng(0).integers(5, 60, size=40)
    write_synthetic_dataset(str(url), lengths=lengths, seq_len=128, pad_multiple=8)

    # the oldest pyarrow packshard takes: pyarrow < 26 imports pandas (which the core install
    # lacks) in DataType.to_pandas_dtype, and Python 3.10 gets pyarrow 25 at the newest
    python = _venv(tmp_path / "venv", f"packshard[train] @ {wheel.as_uri()}", "pyarrow==17.0.0")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = json.loads(_run([str(python), "-c", STREAM, str(url)], cwd=tmp_path, env=env))
    assert got["heavy"] == [], f"the [train] extra pulled in {got['heavy']}"
    assert got["tokens"] == int(lengths.sum())
    assert sorted(got["rows"]) == list(range(len(got["rows"])))
    # the core install verifies and describes it; packing says which extra it needs
    bin_dir = python.parent
    assert "verify: OK" in _run([str(bin_dir / "packshard"), "verify", str(url)], env=env)
    assert "rows" in _run([str(bin_dir / "packshard"), "stats", str(url)], env=env)
    proc = subprocess.run([str(bin_dir / "packshard"), "pack", "--demo", "--output",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env)  # fmt: skip
    assert proc.returncode != 0 and "packshard[pack]" in proc.stdout + proc.stderr, proc
    # its flags are readable there all the same
    helped = _run([str(bin_dir / "packshard"), "pack", "--help"], env=env)
    assert "--output URL" in helped and "packshard[pack]" in helped, helped
