"""Logits kernel against the fp32 torch reference on dequantized inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_indexer_logits, reference_logits
from tests.kernels._cases import exact_inputs, packed_ranges, random_inputs


@pytest.mark.parametrize(
    ("h", "d", "docs"),
    [(8, 128, [70, 3, 90, 29]), (4, 32, [45, 1, 100, 50]), (8, 64, [197]), (6, 48, [60, 41, 20])],
)
def test_logits_match_reference(h: int, d: int, docs: list[int], device: str) -> None:
    ks, ke = packed_ranges(docs, pad=5)  # 5 padding queries with empty ranges
    s = ks.numel()
    assert s % 16  # keys not a multiple of 16
    q, k, w = random_inputs(s, h, d, seed=h * d, device=device)
    ks, ke = ks.to(device), ke.to(device)
    got = fp8_indexer_logits(q, k, w, ks, ke)
    ref = reference_logits(q.cpu(), k.cpu(), w.cpu(), ks.cpu(), ke.cpu())
    got = got.cpu()
    assert got.shape == ref.shape == (s, s)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)), "the -inf mask differs"
    assert bool((got[~fin] == float("-inf")).all())
    rel = ((got[fin] - ref[fin]).norm() / ref[fin].norm()).item()
    assert rel <= 1e-5, rel


def test_logits_exact_inputs_are_bitwise_equal(device: str) -> None:
    ks, ke = packed_ranges([40, 57, 30])
    s = ks.numel()
    q, k, w = exact_inputs(s, 8, 64, seed=3, device=device)
    got = fp8_indexer_logits(q, k, w, ks.to(device), ke.to(device)).cpu()
    ref = reference_logits(q.cpu(), k.cpu(), w.cpu(), ks, ke)
    assert torch.equal(got, ref)


def test_keys_beyond_queries_and_windows(device: str) -> None:
    # More keys than queries (a CP rank's queries against the whole row), arbitrary windows.
    g = torch.Generator().manual_seed(7)
    s_q, s_k = 40, 203
    ks = torch.randint(0, 150, (s_q,), generator=g, dtype=torch.int32)
    ke = torch.minimum(
        ks + torch.randint(0, 80, (s_q,), generator=g, dtype=torch.int32), torch.tensor(s_k)
    )
    q, _, w = random_inputs(s_q, 4, 64, seed=8, device=device)
    _, k, _ = random_inputs(s_k, 4, 64, seed=9, device=device)
    got = fp8_indexer_logits(q, k, w, ks.to(device), ke.to(device)).cpu()
    ref = reference_logits(q.cpu(), k.cpu(), w.cpu(), ks, ke)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert ((got[fin] - ref[fin]).norm() / ref[fin].norm()).item() <= 1e-5
