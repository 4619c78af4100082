"""Triton fp8 DSA indexer (logits + deterministic top-k) and its torch reference.

Imports nothing of packers, pipeline or trainer_shim. See docs/KERNELS.md for the dtype,
layout and block-size rules, the fixed config's sweep and the top-k order contract.
"""

from kernels.fp8_indexer import (
    FIXED_CONFIG,
    IndexerConfig,
    PreparedInputs,
    fp8_indexer_logits,
    fp8_indexer_topk,
    indexer_topk_prepared,
    plan_chunks,
    prepare_inputs,
    topk_from_logits,
)
from kernels.logits import FIXED_LOGITS_CONFIG, LogitsConfig
from kernels.quant import quantize_fp8, quantize_fp8_torch
from kernels.reference import (
    reference_indexer_topk,
    reference_logits,
    reference_logits_fp8,
    reference_topk,
)
from kernels.topk import FIXED_TOPK_CONFIG, TopkConfig, topk_rows_torch

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
