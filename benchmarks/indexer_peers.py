"""The autotuned-per-length peer of kernels.fp8_indexer: the same kernels, tuned per row length.

This is the way an indexer is usually shipped: `triton.autotune` over a config space, keyed on
the exact lengths, so every new row length re-benchmarks every config before it runs (and a
length that changes the arguments' divisibility by 16 compiles again). Packed rows have a
different length almost every step, so the tuning cost is paid again and again; the issue
measured 16.8 s for ten 16K-32K rows against 0.27 s for one fixed config.

`autotuned_indexer_topk(q, k, w, ks, ke, topk)` has the signature and output of
`kernels.fp8_indexer.fp8_indexer_topk`: it runs the same quantizer, logits kernel and top-k,
except that the logits launch goes through the autotuner over `SWEEP_CONFIGS` with the key
count left unpadded. `SWEEP_CONFIGS` is also the "wider sweep" that bench_indexer.py compares
the fixed config against at every shape. The e2e ablation can import either function.

Autotuner state lives in `AutotunedLogits` instances (one per head count), never in a
module-level singleton: `fresh_autotuned_launcher()` returns one with an empty tuning cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton

from packshard.kernels.fp8_indexer import (
    FIXED_CONFIG,
    IndexerConfig,
    indexer_topk_prepared,
    prepare_inputs,
)
from packshard.kernels.logits import FIXED_LOGITS_CONFIG, LogitsConfig, _indexer_logits_kernel

# Earlier fixed configs, which the sweep, the final run and the probes compare against: v11's
# (the Triton kernel at every launch: no warp-specialised kernel from 2^28 scores), v10's (every
# launch in shared-tile pairs at H = 64, relu as x + |x|), v9's (relu as max) and the one-block
# kernel of v2-v8
V11_LOGITS_CONFIG = dataclasses.replace(FIXED_LOGITS_CONFIG, ws_min_scores=None)
V10_LOGITS_CONFIG = dataclasses.replace(V11_LOGITS_CONFIG, group_min_scores=None)
V9_LOGITS_CONFIG = dataclasses.replace(V10_LOGITS_CONFIG, pair_relu="max")
V8_LOGITS_CONFIG = LogitsConfig(128, 64, 4, 3)

# The config space: block_n (queries x heads per program), block_k, warps, stages. Every entry
# compiles without spills for H = 32 and 64, D = 128 on sm_90 (ptxas resource report). The
# first H200 run's three slowest (block_k 128 with 8 warps or 2 stages) made way for block_n 64
# and 2-stage variants of the winner.
SWEEP_CONFIGS: tuple[LogitsConfig, ...] = (
    FIXED_LOGITS_CONFIG,  # since v13: H=64 launches from 2^28 scores warp-specialised (sm_90)
    V11_LOGITS_CONFIG,
    V10_LOGITS_CONFIG,
    V9_LOGITS_CONFIG,
    LogitsConfig(128, 64, 4, 4, q_groups=2, pair_max_registers=168, pair_relu="abs"),
    LogitsConfig(128, 64, 4, 2, q_groups=2, pair_max_registers=168, pair_relu="abs"),
    LogitsConfig(64, 64, 4, 3, q_groups=2),  # 1-query blocks in pairs at H=64, 2-query at H=32
    V8_LOGITS_CONFIG,
    LogitsConfig(128, 64, 4, 2),
    LogitsConfig(128, 64, 4, 4),
    LogitsConfig(64, 64, 4, 3),
    LogitsConfig(64, 64, 4, 4),
    LogitsConfig(256, 64, 4, 3),
    LogitsConfig(256, 64, 4, 4),
    LogitsConfig(256, 64, 8, 3),
    LogitsConfig(256, 128, 8, 3),
    LogitsConfig(128, 128, 4, 3),
    LogitsConfig(512, 64, 8, 3),
    LogitsConfig(64, 128, 4, 3),
)


class AutotunedLogits:
    """A logits launcher (same signature as kernels.logits.launch_logits) that autotunes per length."""

    def __init__(self, configs: tuple[LogitsConfig, ...] = SWEEP_CONFIGS) -> None:
        self.configs = configs
        self._tuned: dict[int, Callable] = {}

    def _kernel(self, heads: int) -> Callable:
        if heads not in self._tuned:
            # one triton.Config a distinct kernel (a config with group_min_scores tunes as its
            # large launches' form, which the sweep also holds: v10's fixed config)
            params = {
                (tuple(meta.items()), tuple(options.items())): None
                for c in self.configs
                if c.block_n >= heads
                for meta, options in [c.kernel_params(heads)]
            }
            cfgs = [triton.Config(dict(meta), **dict(options)) for meta, options in params]
            # the exact key count: the last tile is masked unless S_k is a multiple of BLOCK_K
            even = triton.heuristics({"EVEN_K": lambda a: a["S_k"] % a["BLOCK_K"] == 0})
            self._tuned[heads] = triton.autotune(configs=cfgs, key=["n_rows", "S_k", "H"])(
                even(_indexer_logits_kernel)
            )
        return self._tuned[heads]

    def __call__(
        self,
        q8: torch.Tensor,
        wq: torch.Tensor,
        k8: torch.Tensor,
        k_scale: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        out: torch.Tensor,
        *,
        heads: int,
        row0: int,
        n_rows: int,
        col0: int,
        config: LogitsConfig | None = None,  # ignored: the autotuner picks
    ) -> None:
        if n_rows <= 0:
            return
        kernel = self._kernel(heads)
        grid = lambda meta: (triton.cdiv(triton.cdiv(n_rows, meta["BLOCK_Q"]), meta["GROUPS"]),)  # noqa: E731
        kernel[grid](
            q8, wq, k8, k_scale, ks, ke, out, row0, n_rows, k8.shape[0], col0, out.stride(0),
            H=heads, D=q8.shape[1],
        )  # fmt: skip

    def best_configs(self) -> dict[tuple, str]:
        """The config each (key) was tuned to, for reports."""
        return {k: str(v) for tuned in self._tuned.values() for k, v in tuned.cache.items()}


def fresh_autotuned_launcher() -> AutotunedLogits:
    """An autotuned launcher with nothing tuned yet (a fresh training process)."""
    return AutotunedLogits()


def autotuned_indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk: int,
    *,
    launcher: AutotunedLogits | None = None,
    config: IndexerConfig = FIXED_CONFIG,
) -> torch.Tensor:
    """fp8_indexer_topk with the logits autotuned per exact length (keys not padded to 16).

    Pass one `launcher` across calls, as a training loop would keep one; without it every call
    starts with an empty tuning cache.
    """
    launcher = launcher or fresh_autotuned_launcher()
    p = prepare_inputs(q, k, w, ks, ke)
    exact = dataclasses.replace(p, k8=p.k8[: p.s_k], k_scale=p.k_scale[: p.s_k])
    return indexer_topk_prepared(exact, topk, config, launch=launcher)
