"""benchmarks/probes/ptx_identity.py: the PTX it hashes drops debug info only, and a run
compiles the fixed path's kernels for sm_90a on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.probes.ptx_identity import clean_ptx

REPO = Path(__file__).resolve().parents[2]


def test_clean_ptx_drops_debug_info_and_comments_only() -> None:
    ptx = "\n".join([
        ".version 8.7", "\t.file\t1 \"/a/b.py\"", ".entry k(", "\t.loc\t1 12 4",
        "\tld.global.b32 %r1, [%rd1]; // a comment", "}",
        "\t.section\t.debug_abbrev", "\t{", ".b8 1", "\t}", "ret;",
    ])  # fmt: skip
    assert clean_ptx(ptx).split("\n") == [
        ".version 8.7",
        ".entry k(",
        "\tld.global.b32 %r1, [%rd1];",
        "}",
        "ret;",
    ]
    moved = ptx.replace("\t.loc\t1 12 4", "\t.loc\t3 99 1").replace("/a/b.py", "/c/d.py")
    assert clean_ptx(moved) == clean_ptx(ptx)
    assert clean_ptx(ptx.replace("%r1", "%r2")) != clean_ptx(ptx)


@pytest.mark.slow
def test_probe_compiles_the_fixed_path_without_a_gpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/probes/ptx_identity.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    lines = [ln.split() for ln in out.stdout.splitlines() if not ln.startswith("#")]
    kernels = {name for _, name, _ in lines}
    assert {"_select_kernel", "_radix_order_kernel", "_indexer_logits_kernel"} <= kernels
    assert sum(name == "_select_kernel" for _, name, _ in lines) == 16  # 2 stages x 4 topk x 2
    assert all(len(h) == 16 for _, _, h in lines)
    assert len(list(tmp_path.glob("*.ptx"))) == len(lines)
