"""Which install extra provides which third-party module, and the ImportError that says so.

The core install (numpy, pyarrow, fsspec, xxhash) reads, verifies and describes a
dataset; each side adds an extra (pyproject.toml). A subpackage imported without its extra
fails at once with the command that fixes it, not deep inside a call with a bare
`ModuleNotFoundError: No module named 'torch'`.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

EXTRAS = {
    "train": ("torch",),
    "kernels": ("torch", "triton"),
    "pack": ("ray", "transformers", "tokenizers", "jinja2", "tqdm"),
    "hf": ("torch", "transformers", "accelerate"),
    "torchtitan": ("torch", "torchtitan"),
    "plot": ("matplotlib",),
}


class MissingExtraError(ImportError):
    """A module of an extra that is not installed; the message names `pip install` for it."""


def require(extra: str, module: str, what: str) -> ModuleType:
    """Import `module` (of `extra`) or raise MissingExtraError saying that `what` needs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module and not module.startswith(f"{e.name}."):
            raise  # the module is there but one of its own imports is missing: not ours to name
        fix = f"pip install 'packshard[{extra}]'"
        if module == "triton" and not sys.platform.startswith("linux"):  # [kernels] skips it
            fix = f"Triton is built for Linux only (this is {sys.platform})"
        raise MissingExtraError(
            f"{what} needs {module!r}, which is not installed: {fix}", name=module
        ) from e


def require_extra(extra: str, what: str) -> None:
    """Import every module of `extra` (see EXTRAS) or raise MissingExtraError for the first."""
    for module in EXTRAS[extra]:
        require(extra, module, what)
