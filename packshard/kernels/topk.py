"""Deterministic per-row top-k over indexer logits: the order contract, the select's launch,
its workspace and the exact torch path.

Order contract (shared with the torch fallback and the reference): higher score first, ties by
lower key index; -0.0 equals +0.0; slots past a row's valid keys hold the sentinel S_k. Only keys
in [ks[t], ke[t]) are read, so whatever lies outside them in the logits buffer is ignored.

A call runs, per chunk of rows:
- the select (`kernels.select_kernel`, two launches): a sampled threshold, one compaction pass
  over the row, an exact select among the <= CAP candidates; it writes each row's
  min(topk, n) winners in index order to a [rows, K2] staging pair (key32, index) and flags
  the rows whose candidate count missed its window after `max_passes` passes;
- the order step (`kernels.order`): each staging row by key descending, ties by index (a
  stable radix sort a warp on the GPU, a stable torch.sort elsewhere);
- flagged rows are finished by `topk_rows_torch` (exact and deterministic, slower; rare: rows
  of 256K keys sample 2048 of their scores, and about 1 in 512 of them falls back on the H200).

No atomics and no data-dependent reduction order anywhere, so the output is a pure function of
the scores. Why a threshold and a select rather than a sort of the candidates inside the
kernel: a 4096-wide int64 bitonic top-k compiles to ~23K SASS lines a row (about 5.8M
thread-instructions: ~12 ms a 64K rows) and 50-110 s of compile time; the selects cost 32
counts of CAP values and compile in seconds.

H200, S = 64K, H = 64, causal, topk 2048 (`FIXED_TOPK_CONFIG`): the select reads the 8.6 GB of
in-range scores in 5.9 ms, the radix order takes 0.43 ms for 16K rows of 2048 (docs/KERNELS.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from packshard.kernels._triton_env import interpreting
from packshard.kernels.ballot import BALLOT_BLOCKS
from packshard.kernels.select_kernel import _select_kernel
from packshard.kernels.topk_config import FIXED_TOPK_CONFIG, TopkConfig

__all__ = [
    "FIXED_TOPK_CONFIG",
    "TopkConfig",
    "TopkWorkspace",
    "launch_select",
    "packed_keys_torch",
    "topk_rows_torch",
]

IDX_MAX = 2**31 - 1


@dataclass
class TopkWorkspace:
    """Buffers for up to `rows` rows of one chunk (reused across chunks)."""

    cand: torch.Tensor  # [rows * CAP] int64, read as [rows, 2 CAP] int32 (key, index) pairs
    skey: torch.Tensor  # [rows, K2] int32
    sidx: torch.Tensor  # [rows, K2] int32
    status: torch.Tensor  # [rows] int32
    count: torch.Tensor  # [rows] int32: candidates a row (between the select's two launches)

    @classmethod
    def allocate(
        cls, rows: int, topk: int, config: TopkConfig, device: torch.device
    ) -> TopkWorkspace:
        k2, cap = config.sizes(topk)
        return cls(
            cand=torch.empty(rows * cap, dtype=torch.int64, device=device),
            skey=torch.empty((rows, k2), dtype=torch.int32, device=device),
            sidx=torch.empty((rows, k2), dtype=torch.int32, device=device),
            status=torch.empty(rows, dtype=torch.int32, device=device),
            count=torch.empty(rows, dtype=torch.int32, device=device),
        )

    def with_status(self, status: torch.Tensor) -> TopkWorkspace:
        """The same buffers, flags written to `status` (e.g. a slice of a per-call array)."""
        return dataclasses.replace(self, status=status)

    @staticmethod
    def bytes_per_row(topk: int, config: TopkConfig) -> int:
        """Workspace bytes per row, sort temporaries included (values + int64 indices)."""
        k2, cap = config.sizes(topk)
        return 8 * cap + 8 * k2 + 12 * k2 + 8


def _use_ballot(config: TopkConfig, aligned: bool) -> bool:
    """Whether the compaction takes its positions from warp ballots.

    `compact="ballot"` on the GPU, for 16-aligned rows (the indexer's chunks always are): the
    asm relies on the 4-score runs a lane that 16-byte vector loads give (`ballot_asm`).
    Unaligned rows and Triton's CPU interpreter (no inline PTX) run the prefix sum, which
    gives the same positions."""
    return config.compact == "ballot" and aligned and not interpreting()


def launch_select(
    logits: torch.Tensor,
    col0: int,
    ks: torch.Tensor,
    ke: torch.Tensor,
    ws: TopkWorkspace,
    *,
    topk: int,
    row0: int,
    n_rows: int,
    sentinel: int,
    config: TopkConfig = FIXED_TOPK_CONFIG,
) -> None:
    """The select for chunk rows [row0, row0 + n_rows): logits row i is query row0 + i.

    Two launches of `_select_kernel`: steps 1-2 at `config.compact_max_registers` registers,
    then step 3 at `config.warp_max_registers`; the staging rows and flags land in `ws`."""
    k2, cap = config.sizes(topk)
    if n_rows <= 0:
        return
    target = round(config.ratio * topk)
    aligned = col0 % 16 == 0 and logits.stride(0) % 16 == 0 and logits.shape[1] % 16 == 0
    rows = config.rows_per_program
    grid = (triton.cdiv(n_rows, rows),)
    args = (
        logits, logits.stride(0), col0 // 16 if aligned else col0, ks, ke, row0, n_rows,
        ws.cand.view(torch.int32), ws.skey, ws.sidx, ws.status, sentinel, topk, target,
    )  # fmt: skip
    chunk = min(cap, config.chunk)
    ballot = _use_ballot(config, aligned)
    meta = dict(
        ROWS=rows, K2=k2, CAP=cap, SAMPLE=config.sample, BLOCK=config.block,
        MAX_PASSES=config.max_passes, CHUNK=chunk, ALIGNED=aligned, BALLOT=ballot,
        # the staging write's ballots take CHUNK-wide steps: 128-1024 (a small topk's
        # candidate buffer, CAP < 128, is written with the prefix sum)
        BALLOT_STAGING=ballot and chunk in BALLOT_BLOCKS, num_warps=1,
    )  # fmt: skip
    for stage, regs in ((1, config.compact_max_registers), (2, config.warp_max_registers)):
        _select_kernel[grid](*args, **meta, STAGE=stage, count_ptr=ws.count, maxnreg=regs)


def packed_keys_torch(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 sort key: larger = earlier in the output (score, then lower index); -0.0 == +0.0."""
    v = torch.where(values == 0, torch.zeros_like(values), values.float())
    b = v.view(torch.int32)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (key.to(torch.int64) << 32) | (IDX_MAX - index.to(torch.int64))


def topk_rows_torch(
    logits: torch.Tensor, col0: int, ks: torch.Tensor, ke: torch.Tensor, topk: int, sentinel: int
) -> torch.Tensor:
    """Exact top-k of rows logits[i, ks[i]-col0 : ke[i]-col0] under the contract; [rows, topk] int32."""
    rows = logits.shape[0]
    out = torch.full((rows, topk), sentinel, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    lo = int(ks.min())
    hi = max(int(ke.max()), lo)
    if hi == lo:
        return out
    cols = torch.arange(lo, hi, device=logits.device)
    inr = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    keys = packed_keys_torch(logits[:, lo - col0 : hi - col0], cols.expand(rows, -1))
    keys = torch.where(inr, keys, torch.full_like(keys, torch.iinfo(torch.int64).min))
    m = min(topk, hi - lo)
    top = torch.sort(keys, dim=1, descending=True).values[:, :m]
    idx = (IDX_MAX - (top & 0xFFFFFFFF)).to(torch.int32)
    n = (ke.long() - ks.long()).clamp_min(0)
    valid = torch.arange(m, device=logits.device)[None, :] < n[:, None]
    out[:, :m] = torch.where(valid, idx, torch.full_like(idx, sentinel))
    return out
