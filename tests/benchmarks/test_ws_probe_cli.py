"""logits_ws_probe.py's command line on CPU: --shapes parsing and the host-time table."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_indexer import parse_shapes
from benchmarks.logits_ws_probe import FIXED_NAME, markdown


def test_shapes_parse_and_bad_items_are_named() -> None:
    assert parse_shapes("64:4096:packed, 32:8192:causal") == ((64, 4096, True), (32, 8192, False))
    for bad in ("64:4096", "64:4k:causal", "64:4096:dense", "16:4096:causal", "32:2560:causal",
                "32:0:packed"):  # fmt: skip
        with pytest.raises(SystemExit, match=re.escape(f"{bad!r} is not H:S:causal|packed")):
            parse_shapes(f"32:2048:causal,{bad}")


def test_markdown_reports_host_microseconds_per_call() -> None:
    ok = {"same_written": True, "deterministic": True, "max_rel_diff": 0.0, "written": 5,
          "bitwise_equal_fixed": False, "bitwise_equal_first_variant": True}  # fmt: skip
    shape = {
        "shape": "H=64 S=4K packed x6",
        "ms": {FIXED_NAME: 0.045, "ws, fixed launch": 0.068},
        "tflops": {FIXED_NAME: 655.0, "ws, fixed launch": 436.0},
        "host_ms": {FIXED_NAME: 0.0501, "ws, fixed launch": 0.0834},
        "gpu_only_ms": {FIXED_NAME: 0.0435, "ws, fixed launch": 0.0407},
        "check": {"ws, fixed launch": ok},
    }
    big = dict(shape, shape="H=64 S=64K causal", gpu_only_ms={})  # over GPU_ONLY_MAX_MS
    # a saved run from before every runner was timed GPU-only together: no fixed-config time
    uneven = dict(shape, shape="H=32 S=16K causal", gpu_only_ms={"ws, fixed launch": 0.9})
    breakdown = {
        64: {"two TMA descriptors": 9.0, FIXED_NAME: 29.4},
        32: {"two TMA descriptors": 4.6, FIXED_NAME: 29.1},
    }
    md = markdown({"date": "d", "shapes": [shape, big, uneven], "host_breakdown_us": breakdown})
    assert "| ws, fixed launch | 0.068 (1.511), 436 |" in md
    assert f"| {FIXED_NAME} | 50 |" in md and "| ws, fixed launch | 83 |" in md
    assert "within fp32 rounding" in md
    gpu_table = md.split("GPU-only ms")[1].split("Host µs of one launch")[0]
    assert "| ws, fixed launch | 0.0407 (0.936) |" in gpu_table
    assert "H=64 S=64K causal" not in gpu_table  # only shapes timed GPU-only get a column
    assert "| ws, fixed launch | 0.0407 (0.936) | - |" in gpu_table  # no base, no ratio
    assert "| part | H=64 | H=32 |" in md and "| two TMA descriptors | 9.0 | 4.6 |" in md
