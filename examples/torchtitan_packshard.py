"""torchtitan training configs that read a packshard dataset (torchtitan 0.3's config registry).

    PACKSHARD_DATA=s3://bucket/packed/run1 torchrun --nproc-per-node 8 -m torchtitan.train \
        --module examples.torchtitan_packshard --config llama3_debugmodel_packshard \
        --hf_assets_path /path/to/tokenizer    # torchtitan still builds its tokenizer

Run from the repository root (so `examples` imports). The config is torchtitan's own
``llama3_debugmodel_varlen_attn`` (document-masked varlen attention, built from the position ids
the loader hands over) with `packshard.trainer_shim.titan.PackedShardDataLoader` in place of its
text loader: each rank of the "batch" mesh (dp_replicate x dp_shard) reads only its rows,
cost-balanced across ranks per step; CP ranks get the same rows and torchtitan splits them
(pack with ``--pad-multiple 2*cp``); the loader's state goes into torchtitan's DCP checkpoints.
Pack with ``--seq-len`` at most ``training.seq_len`` (the loader checks). The debug model has
a vocabulary of 2,048 tokens: for a dataset packed with a real tokenizer, set the model's
``vocab_size`` to at least the tokenizer's (ids past it fail in the embedding lookup).
The loader's planning step is torchtitan's batch (``rows_per_rank`` left at its default, which
follows ``--training.local_batch_size``).
"""

from __future__ import annotations

import os

from torchtitan.models.llama3.config_registry import llama3_debugmodel_varlen_attn
from torchtitan.trainer import Trainer

from packshard.trainer_shim.titan import PackedShardDataLoader


def llama3_debugmodel_packshard() -> Trainer.Config:
    config = llama3_debugmodel_varlen_attn()
    config.dataloader = PackedShardDataLoader.Config(
        dataset_path=os.environ.get("PACKSHARD_DATA", ""),
        cache_dir=os.environ.get("PACKSHARD_CACHE"),
    )
    config.validator.enable = False  # torchtitan's validator reads its own text datasets
    return config
