"""Whether Triton runs its CPU interpreter (`TRITON_INTERPRET`).

Under the interpreter there is no inline PTX (the ballot compaction and the radix order take
their prefix-sum and torch paths) and fp8 casts inside Triton are wrong for some values (the
quantizer takes its torch path). Triton reads the variable when `@triton.jit` decorates a
function; this reads it at call time, which the tests keep equal (tests/conftest.py).
"""

from __future__ import annotations


def interpreting() -> bool:
    """Whether the variable is on as the installed Triton reads it: through its own knob
    (`triton.knobs.runtime.interpret`, in every Triton the kernels extra allows, >= 3.6), so the
    words it takes for on are its own (3.6 and 3.9 take 1/true/on/yes/y in any case) and a
    value set in code counts too."""
    from triton import knobs

    return bool(knobs.runtime.interpret)
