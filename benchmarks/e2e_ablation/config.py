"""Configuration of the end-to-end padding ablation: the model, the run, and the five arms.

Two presets. `h200` is what the device call runs (one H200, ~5.5 minutes for three workloads
under a 360 s deadline); `smoke` is the same code at toy sizes for CPU (the test in
tests/benchmarks runs it).

The h200 model (README.md has the FLOPs and why): 4 layers, d_model 1024, the Qwen2.5
vocabulary (151,936 rows, separate LM head), MLA-style attention run as MQA the way DSA runs
it (q from a 512-d latent, 16 heads, one shared 64-d latent key/value plus a 32-d RoPE key),
a lightning indexer of 32 heads x 128 selecting the top 2048 keys per query, and an MoE FFN
of 16 experts (top-2, SwiGLU 2048). About 0.73 B parameters, 0.07 B active per token plus the
0.16 B LM head. DeepSeek-V3 routing (sigmoid affinities, a selection bias balanced every step
over all tokens fed); token embeddings scaled by sqrt(d_model) on the way in.

The learning rate is 3e-5, a fine-tuning rate (this ablation is about post-training): at 3e-4
a router trained from scratch collapses onto one or two experts within 4-8 steps whatever
balances it (CPU runs in README.md), which would make the MoE cost the same in every arm.

Arms (`ARMS`): what differs is only how a row is padded and which indexer launches run; arm 5
(4') is arm 4 run again, the run-to-run control for the loss comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

ArmName = Literal[
    "pad_seq_token0", "pad_seq_own_tokens", "pad8_autotuned", "pad8_fixed", "pad8_fixed_control"
]
AttentionImpl = Literal["auto", "triton", "torch"]
IndexerImpl = Literal["kernel", "reference"]


@dataclass(frozen=True)
class Arm:
    """One arm of the ablation."""

    number: int
    name: ArmName
    label: str
    pad_to_seq_len: bool  # rows come from the dataset packed with --pad-multiple seq_len
    own_token_padding: bool  # replace the pad tokens by the row's own tokens (loss-masked)
    autotuned_indexer: bool  # retune the indexer for every new row length
    control_of: int | None = None  # a rerun of that arm (same data, init and code): the noise floor


ARMS: tuple[Arm, ...] = (
    Arm(1, "pad_seq_token0", "1: pad to seq_len, token 0", True, False, False),
    Arm(2, "pad_seq_own_tokens", "2: pad to seq_len, own tokens", True, True, False),
    Arm(3, "pad8_autotuned", "3: pad to x8, autotuned indexer", False, False, True),
    Arm(4, "pad8_fixed", "4: pad to x8, fixed indexer (packshard)", False, False, False),
    Arm(5, "pad8_fixed_control", "4': arm 4 again (control)", False, False, False, control_of=4),
)
ARM_BY_NUMBER = {a.number: a for a in ARMS}


@dataclass(frozen=True)
class ModelConfig:
    """A small DSA-style MoE causal LM (see the module docstring)."""

    vocab_size: int = 151_936
    d_model: int = 1024
    n_layers: int = 4
    q_rank: int = 512  # q latent (MLA's q_lora_rank); the indexer's queries come from it too
    n_heads: int = 16
    kv_dim: int = 64  # shared latent key = value per key (MQA), no RoPE
    rope_dim: int = 32  # RoPE part of q and k
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 2048
    n_experts: int = 16
    expert_topk: int = 2
    expert_dim: int = 2048
    capacity_multiple: int = 128  # expert buffers are padded to the max load, rounded up to this
    scale_embedding: bool = True  # x = embed[ids] * sqrt(d_model) (Vaswani et al., T5, Gemma)
    tie_embeddings: bool = False  # LM head = embedding (with scaling, loss ~19 at step 1: model.py)
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "d_model", "n_layers", "q_rank", "n_heads", "kv_dim", "rope_dim", "index_heads",
            "index_dim", "index_topk", "n_experts", "expert_topk", "expert_dim", "capacity_multiple",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)}: must be >= 1")
        for name in ("kv_dim", "rope_dim", "n_heads", "index_dim"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(
                    f"ModelConfig.{name}={v}: must be a power of two >= 16 (tensor-core tiles)"
                )
        if self.rope_dim % 2 or self.rope_dim > self.index_dim:
            raise ValueError(
                f"ModelConfig.rope_dim={self.rope_dim}: must be even and <= index_dim={self.index_dim}"
            )
        if self.expert_topk > self.n_experts:
            raise ValueError(
                f"ModelConfig.expert_topk={self.expert_topk}: must be <= n_experts={self.n_experts}"
            )

    @property
    def embed_multiplier(self) -> float:
        """What the embedding rows are multiplied by on the way in."""
        return math.sqrt(self.d_model) if self.scale_embedding else 1.0

    @property
    def head_dim(self) -> int:
        """Per-head query/key width: latent part + RoPE part."""
        return self.kv_dim + self.rope_dim


@dataclass(frozen=True)
class RunConfig:
    """The training run every arm does: same data, same init, same optimizer."""

    seq_len: int = 32768
    pad_multiple: int = 8  # as if cp = 8
    rows_per_step: int = 2  # micro-batches (one row each) per optimizer step
    steps: int = 20
    timed_from: int = 5  # steps timed_from..steps (1-based) are summed
    seed: int = 0
    lr: float = 3e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    router_bias_rate: float = 1e-3  # DeepSeek-V3's bias update per step (moe.py)
    router_aux_weight: float = 0.0  # weight of the sequence-wise balance loss (V3: 1e-4), 0 = off
    grad_clip: float = 1.0
    ce_chunk: int = 8192  # tokens per LM-head chunk of the fused cross entropy
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    attention: AttentionImpl = "auto"
    indexer: IndexerImpl = "kernel"
    arms: tuple[int, ...] = (1, 2, 3, 4, 5)
    loss_tolerance: float = 1e-3
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if self.seq_len % self.pad_multiple:
            raise ValueError(
                f"RunConfig.seq_len={self.seq_len}: must be a multiple of pad_multiple={self.pad_multiple}"
            )
        if self.steps < 1 or not 1 <= self.timed_from <= self.steps:
            raise ValueError(
                f"RunConfig.timed_from={self.timed_from}: must lie in [1, steps={self.steps}]"
            )
        if self.rows_per_step < 1:
            raise ValueError(f"RunConfig.rows_per_step={self.rows_per_step}: must be >= 1")
        bad = [a for a in self.arms if a not in ARM_BY_NUMBER]
        if bad or not self.arms:
            raise ValueError(f"RunConfig.arms={self.arms}: choose among {sorted(ARM_BY_NUMBER)}")
        if self.ce_chunk < 1:
            raise ValueError(f"RunConfig.ce_chunk={self.ce_chunk}: must be >= 1")

    @property
    def rows_needed(self) -> int:
        return self.steps * self.rows_per_step


H200 = RunConfig()

SMOKE = RunConfig(
    seq_len=256,
    pad_multiple=8,
    rows_per_step=2,
    steps=6,
    timed_from=5,
    lr=1e-3,
    warmup_steps=2,
    router_bias_rate=0.0,  # fp32 arms must agree exactly; the bias step has its own test
    ce_chunk=96,
    dtype="float32",
    attention="torch",
    indexer="reference",
    model=ModelConfig(
        vocab_size=512,
        d_model=64,
        n_layers=2,
        q_rank=32,
        n_heads=16,
        kv_dim=16,
        rope_dim=16,
        index_heads=16,
        index_dim=32,
        index_topk=24,
        n_experts=4,
        expert_topk=2,
        expert_dim=64,
        capacity_multiple=8,
    ),
)

PRESETS: dict[str, RunConfig] = {"h200": H200, "smoke": SMOKE}


def with_overrides(base: RunConfig, **changes: object) -> RunConfig:
    """`base` with the non-None `changes` applied (validated again)."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})
