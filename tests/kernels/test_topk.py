"""Top-k order contract: reference agreement, exact ties, +-0, sentinels, padded keys, fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from packshard.kernels import (
    FIXED_CONFIG,
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
from tests.kernels._cases import (
    SMALL,
    SMALL_ONE_STEP,
    SMALL_TOPK,
    exact_inputs,
    packed_ranges,
    random_inputs,
)

BOTH = pytest.mark.parametrize("cfg", [SMALL, SMALL_ONE_STEP], ids=["chunk16", "one-step"])


@pytest.fixture(scope="module")
def kernel_logits_row(device: str) -> tuple:
    """A packed row of four documents and three empty queries: prepared inputs and its scores."""
    ks, ke = packed_ranges([120, 5, 90, 24], pad=3)
    q, k, w = random_inputs(ks.numel(), 8, 64, seed=8, device=device)
    ks, ke = ks.to(device), ke.to(device)
    return prepare_inputs(q, k, w, ks, ke), fp8_indexer_logits(q, k, w, ks, ke).cpu()


@pytest.mark.parametrize(("topk", "order"), [(8, "radix"), (13, "torch"), (40, "radix")])
def test_topk_matches_reference_on_kernel_logits(
    kernel_logits_row: tuple, topk: int, order: str
) -> None:
    p, logits = kernel_logits_row
    stats: dict = {}
    topk_cfg = dataclasses.replace(SMALL_TOPK, order=order)
    got = indexer_topk_prepared(p, topk, IndexerConfig(topk=topk_cfg), stats=stats)
    assert torch.equal(got.cpu(), reference_topk(logits, p.ks.cpu(), p.ke.cpu(), topk))
    assert stats["fallback_rows"] == 0  # random scores: the sampled threshold always lands


@BOTH
def test_exact_ties_go_to_the_lower_key_index(cfg: IndexerConfig, device: str) -> None:
    ks, ke = packed_ranges([100, 77, 60])
    s = ks.numel()
    q, k, w = exact_inputs(s, 8, 32, seed=1, device=device, levels=1)
    k[1::2] = k[0::2][: k[1::2].shape[0]]  # every odd key repeats the even key before it
    ks, ke = ks.to(device), ke.to(device)
    got = fp8_indexer_topk(q, k, w, ks, ke, 16, config=cfg).cpu()
    ref = reference_indexer_topk(q.cpu(), k.cpu(), w.cpu(), ks.cpu(), ke.cpu(), 16)
    assert torch.equal(got, ref)
    # the duplicates really tie and really are both selected somewhere, lower index first
    pairs = ((got[:, :-1] // 2 == got[:, 1:] // 2) & (got[:, :-1] < s)).sum().item()
    assert pairs > 50
    assert bool((got[:, 1:][got[:, :-1] // 2 == got[:, 1:] // 2] % 2 == 1).all())


@BOTH
def test_all_equal_scores_take_the_torch_path_and_keep_index_order(
    cfg: IndexerConfig, device: str
) -> None:
    ks, ke = packed_ranges([150, 40])
    s = ks.numel()
    logits = torch.full((s, s), 3.0, device=device)
    stats: dict = {}
    got = topk_from_logits(logits, ks.to(device), ke.to(device), 8, config=cfg, stats=stats).cpu()
    assert torch.equal(got, reference_topk(logits.cpu(), ks, ke, 8))
    assert stats["fallback_rows"] > 0  # rows longer than CAP: every score ties with the threshold
    assert got[149].tolist() == list(range(8))


@BOTH
def test_minus_zero_equals_plus_zero(cfg: IndexerConfig, device: str) -> None:
    row = torch.tensor([0.0, -0.0, -1.0, 0.0, -0.0, 2.0, -0.0, -3.0] * 5)
    logits = row.repeat(3, 1).to(device)
    ks = torch.tensor([0, 0, 3], dtype=torch.int32)
    ke = torch.tensor([40, 7, 40], dtype=torch.int32)
    got = topk_from_logits(logits, ks.to(device), ke.to(device), 6, config=cfg).cpu()
    assert got[1].tolist() == [5, 0, 1, 3, 4, 6]
    assert got[0].tolist() == [5, 13, 21, 29, 37, 0]
    assert torch.equal(got, reference_topk(logits.cpu(), ks, ke, 6))


@BOTH
def test_sentinel_fills_short_and_empty_rows(cfg: IndexerConfig, device: str) -> None:
    ks = torch.tensor([0, 4, 9, 9, 0], dtype=torch.int32)
    ke = torch.tensor([3, 4, 10, 9, 20], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 20, generator=g).to(device)
    got = topk_from_logits(logits, ks.to(device), ke.to(device), 5, config=cfg).cpu()
    assert (got[1] == 20).all() and (got[3] == 20).all()  # empty rows: all sentinel
    assert (got[0, 3:] == 20).all() and set(got[0, :3].tolist()) == {0, 1, 2}
    assert got[2].tolist() == [9, 20, 20, 20, 20]
    assert torch.equal(got, reference_topk(logits.cpu(), ks, ke, 5))


@BOTH
def test_padded_keys_are_never_selected(cfg: IndexerConfig, device: str) -> None:
    # Real scores all negative (negative weights, positive dots) while the zero keys that pad
    # S_k = 37 up to 48 would score 0: they must still never appear.
    s = 37
    q, k, _ = random_inputs(s, 4, 32, seed=2, device=device)
    q = q.abs()
    k = k.abs()
    w = -torch.rand(s, 4, device=device) - 0.1
    ks = torch.zeros(s, dtype=torch.int32, device=device)
    ke = torch.full((s,), s, dtype=torch.int32, device=device)
    got = fp8_indexer_topk(q, k, w, ks, ke, 40, config=cfg).cpu()
    assert (got[:, :s] < s).all() and (got[:, s:] == s).all()
    ref = reference_indexer_topk(q.cpu(), k.cpu(), w.cpu(), ks.cpu(), ke.cpu(), 40)
    assert torch.equal(got, ref)


@pytest.mark.parametrize(
    "kernel",
    [
        {"compact": "scan"},
        # on the GPU: warp ballots (the interpreter runs the scan: same positions)
        {"compact": "ballot", "block": 128, "rows_per_program": 1},
    ],
    ids=["scan", "ballot"],
)
def test_rerank_and_fallback_paths_agree(kernel: dict, device: str) -> None:
    # A one-pass budget and a single 16-score sample run force misses (flagged rows -> torch path); a wide
    # sample with three passes must give the same answer.
    ks, ke = packed_ranges([200])
    q, k, w = random_inputs(200, 4, 32, seed=11, device=device)
    ks, ke = ks.to(device), ke.to(device)
    p = prepare_inputs(q, k, w, ks, ke)
    rough_topk = {
        "sample": 16,
        "block": 32,
        "min_cap": 16,
        "max_passes": 1,
        "rows_per_program": 256,
    }
    rough = IndexerConfig(topk=TopkConfig(**{**rough_topk, **kernel}))
    stats: dict = {}
    a = indexer_topk_prepared(p, 8, rough, stats=stats)
    b = indexer_topk_prepared(p, 8, SMALL)
    assert stats["fallback_rows"] > 0
    assert torch.equal(a, b)
    assert SMALL_TOPK.max_passes == 3


@pytest.mark.parametrize("fast", [{}, {"compact": "ballot", "block": 128}], ids=["scan", "ballot"])
def test_one_row_programs_and_unaligned_rows_agree(fast: dict, device: str) -> None:
    # The GPU geometry of the select (one row a program) and both load paths: the
    # indexer's 16-aligned chunk rows (vector loads of whole 16-score groups, scores outside
    # [ks, ke) read and ignored: here +inf, which would win if selected) and an unaligned
    # 37-wide matrix (exact masks).
    g = torch.Generator().manual_seed(12)
    ks = torch.tensor([0, 3, 5, 17, 1, 30], dtype=torch.int32)
    ke = torch.tensor([37, 20, 6, 33, 37, 30], dtype=torch.int32)
    logits = torch.randn(6, 48, generator=g)
    cols = torch.arange(48)[None, :]
    outside = (cols < ks[:, None].long()) | (cols >= ke[:, None].long())
    logits = torch.where(outside, torch.full_like(logits, float("inf")), logits).to(device)
    ref = reference_topk(logits[:, :37].cpu(), ks, ke, 12)
    one_row = IndexerConfig(
        topk=dataclasses.replace(SMALL_TOPK, **{"rows_per_program": 1, "block": 16, **fast})
    )
    aligned = topk_from_logits(logits, ks.to(device), ke.to(device), 12, config=one_row)
    unaligned = topk_from_logits(
        logits[:, :37].contiguous(), ks.to(device), ke.to(device), 12, config=one_row
    )
    assert torch.equal(aligned.cpu().clamp_max(37), ref)  # sentinel 48 vs 37
    assert torch.equal(unaligned.cpu(), ref)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("order", "bitonic"),
        ("warp_max_registers", 300),
        ("chunk", 24),
        ("sample", 8),
        ("ratio", 2.0),
        ("max_passes", 0),
        ("compact", "prefix"),
        ("compact_max_registers", 8),
    ],
)
def test_topk_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"TopkConfig\.{field}"):
        TopkConfig(**{field: value})


def test_default_topk_config_is_the_fixed_one() -> None:
    assert TopkConfig() == FIXED_CONFIG.topk
    assert FIXED_CONFIG.topk.label == (
        "warp block=512 prefetch split/96r ballot early sample=2048, radix order"
    )


def test_threshold_sample_stays_inside_the_row(device: str) -> None:
    # Rows a little longer than the candidate buffer (CAP = 16 here) but shorter than the
    # 2048-score sample: its last runs of 16 used to start within 15 of the row's end and read
    # past ke (on the GPU an illegal address at the end of the logits buffer). Scores outside
    # the rows are NaN: at topk 1 the sample's rank (4-5) lies among the 7-8 NaNs such reads
    # bring in, the threshold is NaN, the one pass allowed misses and the row falls back.
    g = torch.Generator().manual_seed(3)
    ks = torch.tensor([0, 0, 200, 16], dtype=torch.int32)
    ke = torch.tensor([1000, 600, 1000, 1008], dtype=torch.int32)
    logits = torch.randn(4, 1024, generator=g)
    cols = torch.arange(1024)[None, :]
    outside = (cols < ks[:, None].long()) | (cols >= ke[:, None].long())
    logits = torch.where(outside, torch.full_like(logits, float("nan")), logits).to(device)
    stats: dict = {}
    cfg = IndexerConfig(topk=dataclasses.replace(FIXED_CONFIG.topk, min_cap=16, max_passes=1))
    got = topk_from_logits(logits, ks.to(device), ke.to(device), 1, config=cfg, stats=stats)
    assert torch.equal(got.cpu(), reference_topk(logits.cpu().nan_to_num(-1e30), ks, ke, 1))
    assert stats["fallback_rows"] == 0
