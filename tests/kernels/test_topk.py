"""Top-k order contract: reference agreement, exact ties, +-0, sentinels, padded keys, fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import (
    IndexerConfig,
    TopkConfig,
    fp8_indexer_logits,
    fp8_indexer_topk,
    indexer_topk_prepared,
    prepare_inputs,
    reference_indexer_topk,
    reference_topk,
    topk_from_logits,
)
from tests.kernels._cases import SMALL, SMALL_TOPK, exact_inputs, packed_ranges, random_inputs


@pytest.mark.parametrize(("topk", "select"), [(8, "radix"), (13, "radix"), (8, "bitwise")])
def test_topk_matches_reference_on_kernel_logits(topk: int, select: str, device: str) -> None:
    ks, ke = packed_ranges([120, 5, 90, 24], pad=3)
    s = ks.numel()
    q, k, w = random_inputs(s, 8, 64, seed=topk, device=device)
    ks, ke = ks.to(device), ke.to(device)
    stats: dict = {}
    cfg = IndexerConfig(topk=dataclasses.replace(SMALL_TOPK, select=select))
    got = indexer_topk_prepared(prepare_inputs(q, k, w, ks, ke), topk, cfg, stats=stats)
    logits = fp8_indexer_logits(q, k, w, ks, ke).cpu()
    assert torch.equal(got.cpu(), reference_topk(logits, ks.cpu(), ke.cpu(), topk))
    assert stats["fallback_rows"] == 0  # random scores: the sampled threshold always lands


def test_exact_ties_go_to_the_lower_key_index(device: str) -> None:
    ks, ke = packed_ranges([100, 77, 60])
    s = ks.numel()
    q, k, w = exact_inputs(s, 8, 32, seed=1, device=device, levels=1)
    k[1::2] = k[0::2][: k[1::2].shape[0]]  # every odd key repeats the even key before it
    ks, ke = ks.to(device), ke.to(device)
    got = fp8_indexer_topk(q, k, w, ks, ke, 16, config=SMALL).cpu()
    ref = reference_indexer_topk(q.cpu(), k.cpu(), w.cpu(), ks.cpu(), ke.cpu(), 16)
    assert torch.equal(got, ref)
    # the duplicates really tie and really are both selected somewhere, lower index first
    pairs = ((got[:, :-1] // 2 == got[:, 1:] // 2) & (got[:, :-1] < s)).sum().item()
    assert pairs > 50
    assert bool((got[:, 1:][got[:, :-1] // 2 == got[:, 1:] // 2] % 2 == 1).all())


def test_all_equal_scores_take_the_torch_path_and_keep_index_order(device: str) -> None:
    ks, ke = packed_ranges([150, 40])
    s = ks.numel()
    logits = torch.full((s, s), 3.0, device=device)
    stats: dict = {}
    got = topk_from_logits(logits, ks.to(device), ke.to(device), 8, config=SMALL, stats=stats).cpu()
    assert torch.equal(got, reference_topk(logits.cpu(), ks, ke, 8))
    assert stats["fallback_rows"] > 0  # rows longer than CAP: every score ties with the threshold
    assert got[149].tolist() == list(range(8))


def test_minus_zero_equals_plus_zero(device: str) -> None:
    row = torch.tensor([0.0, -0.0, -1.0, 0.0, -0.0, 2.0, -0.0, -3.0] * 5)
    logits = row.repeat(3, 1).to(device)
    ks = torch.tensor([0, 0, 3], dtype=torch.int32)
    ke = torch.tensor([40, 7, 40], dtype=torch.int32)
    got = topk_from_logits(logits, ks.to(device), ke.to(device), 6, config=SMALL).cpu()
    assert got[1].tolist() == [5, 0, 1, 3, 4, 6]
    assert got[0].tolist() == [5, 13, 21, 29, 37, 0]
    assert torch.equal(got, reference_topk(logits.cpu(), ks, ke, 6))


def test_sentinel_fills_short_and_empty_rows(device: str) -> None:
    ks = torch.tensor([0, 4, 9, 9, 0], dtype=torch.int32)
    ke = torch.tensor([3, 4, 10, 9, 20], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 20, generator=g).to(device)
    got = topk_from_logits(logits, ks.to(device), ke.to(device), 5, config=SMALL).cpu()
    assert (got[1] == 20).all() and (got[3] == 20).all()  # empty rows: all sentinel
    assert (got[0, 3:] == 20).all() and set(got[0, :3].tolist()) == {0, 1, 2}
    assert got[2].tolist() == [9, 20, 20, 20, 20]
    assert torch.equal(got, reference_topk(logits.cpu(), ks, ke, 5))


def test_padded_keys_are_never_selected(device: str) -> None:
    # Real scores all negative (negative weights, positive dots) while the zero keys that pad
    # S_k = 37 up to 48 would score 0: they must still never appear.
    s = 37
    q, k, _ = random_inputs(s, 4, 32, seed=2, device=device)
    q = q.abs()
    k = k.abs()
    w = -torch.rand(s, 4, device=device) - 0.1
    ks = torch.zeros(s, dtype=torch.int32, device=device)
    ke = torch.full((s,), s, dtype=torch.int32, device=device)
    got = fp8_indexer_topk(q, k, w, ks, ke, 40, config=SMALL).cpu()
    assert (got[:, :s] < s).all() and (got[:, s:] == s).all()
    ref = reference_indexer_topk(q.cpu(), k.cpu(), w.cpu(), ks.cpu(), ke.cpu(), 40)
    assert torch.equal(got, ref)


def test_rerank_and_fallback_paths_agree(device: str) -> None:
    # A one-pass budget and a single 16-score sample run force misses (flagged rows -> torch path); a wide
    # sample with three passes must give the same answer.
    ks, ke = packed_ranges([200])
    q, k, w = random_inputs(200, 4, 32, seed=11, device=device)
    ks, ke = ks.to(device), ke.to(device)
    p = prepare_inputs(q, k, w, ks, ke)
    rough = IndexerConfig(
        topk=TopkConfig(sample=16, block=32, min_cap=16, max_passes=1, rows_per_program=256)
    )
    stats: dict = {}
    a = indexer_topk_prepared(p, 8, rough, stats=stats)
    b = indexer_topk_prepared(p, 8, SMALL)
    assert stats["fallback_rows"] > 0
    assert torch.equal(a, b)
    assert SMALL_TOPK.max_passes == 3
