"""Kernel tests run the Triton code on CPU through the Triton interpreter when no GPU is visible.

TRITON_INTERPRET must be set before `kernels` is imported (triton.jit reads it when a kernel is
decorated), so it is set here, at collection, and only where CUDA is absent: on a GPU machine the
same tests run the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
