"""Input builders shared by the kernel tests: packed rows of documents and exact-arithmetic inputs."""

from __future__ import annotations

import dataclasses

import torch

from packshard.kernels import IndexerConfig, TopkConfig

# The fixed top-k's structure at small sizes, so that every path runs at test sizes: rows of
# n <= CAP take all (CAP = 2 * next_pow2(topk), at least 16), longer rows use the sampled
# threshold; `chunk=16` makes the staging write take several steps even at CAP 16. One program
# handles 256 rows so that the interpreter vectorises over rows, which takes the prefix-sum
# compaction (the ballots run one row a program; the interpreter runs the scan anyway).
SMALL_TOPK = TopkConfig(
    sample=64, block=64, min_cap=16, rows_per_program=256, chunk=16, compact="scan"
)
SMALL = IndexerConfig(topk=SMALL_TOPK)
# The same with the staging write in one step (chunk >= CAP).
SMALL_ONE_STEP = IndexerConfig(topk=dataclasses.replace(SMALL_TOPK, chunk=512))


def packed_ranges(doc_lens: list[int], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ks/ke for a row of documents back to back (causal inside each), then `pad` empty queries."""
    ks, ke = [], []
    start = 0
    for n in doc_lens:
        ks += [start] * n
        ke += list(range(start + 1, start + n + 1))
        start += n
    ks += [start] * pad
    ke += [start] * pad
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


def random_inputs(
    s: int, h: int, d: int, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 q [s, h, d], k [s, d] with a per-token spread of magnitudes; w [s, h] of both signs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, h, d, generator=g) * torch.exp(torch.randn(s, h, 1, generator=g))
    k = torch.randn(s, d, generator=g) * torch.exp(torch.randn(s, 1, generator=g))
    w = torch.randn(s, h, generator=g)
    return q.bfloat16().to(device), k.bfloat16().to(device), w.to(device)


def exact_inputs(
    s: int, h: int, d: int, seed: int, device: str = "cpu", levels: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs whose scores are exact in fp32 whatever the summation order (so ties are exact).

    Entries are small integers with amax 8 in every vector (fp8 stores 8 * 32 = 256 exactly,
    scale 2**-5); weights are small powers of two. `levels` small means many exactly equal keys.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-levels, levels + 1, (s, h, d), generator=g).float()
    k = torch.randint(-levels, levels + 1, (s, d), generator=g).float()
    q[..., 0] = 8.0
    k[..., 0] = 8.0
    w = 2.0 ** torch.randint(-2, 2, (s, h), generator=g).float()
    return q.bfloat16().to(device), k.bfloat16().to(device), w.to(device)
