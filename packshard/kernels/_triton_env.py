"""Whether Triton runs its CPU interpreter (`TRITON_INTERPRET`).

Under the interpreter there is no inline PTX (the ballot compaction and the radix order take
their prefix-sum and torch paths) and fp8 casts inside Triton are wrong for some values (the
quantizer takes its torch path). Triton reads the variable when `@triton.jit` decorates a
function; this reads it at call time, which the tests keep equal (tests/conftest.py).
"""

from __future__ import annotations

import os

# What Triton versions without `triton.knobs` take for on (their C++ getBoolEnv)
_TRUTHY = ("1", "true", "on")


def interpreting() -> bool:
    """Whether the variable is on as the installed Triton reads it: through its own knob
    (`triton.knobs.runtime.interpret`, which also sees a value set in code), so the words it
    takes for on are its own (Triton 3.6 takes 1/true/on in any case; 3.9 also yes/y)."""
    try:
        from triton import knobs
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY
    return bool(knobs.runtime.interpret)
