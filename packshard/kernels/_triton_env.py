"""Whether Triton runs its CPU interpreter (`TRITON_INTERPRET=1`).

Under the interpreter there is no inline PTX (the ballot compaction and the radix order take
their prefix-sum and torch paths) and fp8 casts inside Triton are wrong for some values (the
quantizer takes its torch path). Triton reads the variable when `@triton.jit` decorates a
function; this reads it at call time, which the tests keep equal (tests/conftest.py).
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether the variable is on as Triton reads it (1, true, yes, on, y; any case)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
        "y",
    )
