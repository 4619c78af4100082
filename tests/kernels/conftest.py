"""Kernel tests run the Triton code on CPU through the Triton interpreter when no GPU is visible.

TRITON_INTERPRET must be set before any Triton kernel is decorated, so tests/conftest.py sets it
(where CUDA is absent) before any test module is imported; on a GPU machine the same tests run
the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
