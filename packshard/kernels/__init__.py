"""Triton fp8 DSA indexer (logits + deterministic top-k) and its torch reference.

Imports nothing of packers, pipeline or trainer_shim. Needs the `packshard[kernels]` extra
(torch, triton): without it, importing this package raises an ImportError that names it. See
docs/KERNELS.md for the dtype, layout and block-size rules, the fixed config and the top-k order
contract.
"""

# ruff: noqa: E402 (the extra is checked before the imports that need it)

from packshard._extras import require_extra

require_extra("kernels", "packshard.kernels (the fp8 indexer)")

from packshard.kernels.chunks import plan_chunks
from packshard.kernels.fp8_indexer import (
    FIXED_CONFIG,
    IndexerConfig,
    fp8_indexer_logits,
    fp8_indexer_topk,
    indexer_topk_prepared,
    topk_from_logits,
)
from packshard.kernels.logits_config import FIXED_LOGITS_CONFIG, LogitsConfig
from packshard.kernels.prepare import PreparedInputs, prepare_inputs
from packshard.kernels.quant import quantize_fp8, quantize_fp8_torch
from packshard.kernels.reference import (
    reference_indexer_topk,
    reference_logits,
    reference_logits_fp8,
    reference_topk,
)
from packshard.kernels.topk import FIXED_TOPK_CONFIG, TopkConfig, topk_rows_torch

__all__ = [
    "FIXED_CONFIG",
    "FIXED_LOGITS_CONFIG",
    "FIXED_TOPK_CONFIG",
    "IndexerConfig",
    "LogitsConfig",
    "PreparedInputs",
    "TopkConfig",
    "fp8_indexer_logits",
    "fp8_indexer_topk",
    "indexer_topk_prepared",
    "plan_chunks",
    "prepare_inputs",
    "quantize_fp8",
    "quantize_fp8_torch",
    "reference_indexer_topk",
    "reference_logits",
    "reference_logits_fp8",
    "reference_topk",
    "topk_from_logits",
    "topk_rows_torch",
]
