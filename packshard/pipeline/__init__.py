"""packshard pipeline: the Ray pack job, input readers, tokenization, stats and verify CLIs.

The names below load on first use, so ``import packshard.pipeline`` imports neither Ray nor
transformers, and the core install (no ``[pack]`` extra) runs ``packshard stats`` / ``verify``.
`pack_main` needs ``pip install 'packshard[pack]'`` and says so when it is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packshard.pipeline.config import PackConfig, config_from_args
    from packshard.pipeline.inputs import (
        InputError,
        InputFile,
        redact_text,
        redact_url,
        resolve_inputs,
    )
    from packshard.pipeline.jobstate import OutputError
    from packshard.pipeline.pack import main as pack_main
    from packshard.pipeline.stats import dataset_stats, format_stats
    from packshard.pipeline.tokenizer_loading import TokenizerError
    from packshard.pipeline.verify import verify_dataset

_LAZY: dict[str, tuple[str, str]] = {
    "InputError": ("packshard.pipeline.inputs", "InputError"),
    "InputFile": ("packshard.pipeline.inputs", "InputFile"),
    "OutputError": ("packshard.pipeline.jobstate", "OutputError"),
    "PackConfig": ("packshard.pipeline.config", "PackConfig"),
    "TokenizerError": ("packshard.pipeline.tokenizer_loading", "TokenizerError"),
    "config_from_args": ("packshard.pipeline.config", "config_from_args"),
    "dataset_stats": ("packshard.pipeline.stats", "dataset_stats"),
    "format_stats": ("packshard.pipeline.stats", "format_stats"),
    "pack_main": ("packshard.pipeline.pack", "main"),
    "redact_text": ("packshard.pipeline.inputs", "redact_text"),
    "redact_url": ("packshard.pipeline.inputs", "redact_url"),
    "resolve_inputs": ("packshard.pipeline.inputs", "resolve_inputs"),
    "verify_dataset": ("packshard.pipeline.verify", "verify_dataset"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packshard.pipeline' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "InputError",
    "InputFile",
    "OutputError",
    "PackConfig",
    "TokenizerError",
    "config_from_args",
    "dataset_stats",
    "format_stats",
    "pack_main",
    "redact_text",
    "redact_url",
    "resolve_inputs",
    "verify_dataset",
]
