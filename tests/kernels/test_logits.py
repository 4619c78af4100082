"""Logits kernel against the fp32 torch reference on dequantized inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import LogitsConfig, fp8_indexer_logits, prepare_inputs, reference_logits
from kernels.logits import launch_logits
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


@pytest.fixture(scope="module")
def prepared_row() -> tuple:
    """A packed row (4 documents + 5 empty queries; 197 keys, padded to 256) and its scores."""
    ks, ke = packed_ranges([70, 3, 90, 29], pad=5)
    q, k, w = random_inputs(ks.numel(), 8, 64, seed=31)
    p = prepare_inputs(q, k, w, ks, ke)
    ref = reference_logits(q, k, w, ks, ke)
    return p, ref


def _run(p, config: LogitsConfig, keys: int) -> torch.Tensor:
    """Scores of the whole row through `config`, with only the first `keys` keys passed."""
    out = torch.full((p.s_q, keys), float("-inf"))
    launch_logits(
        p.q8, p.wq, p.k8[:keys], p.k_scale[:keys], p.ks, p.ke, out,
        heads=p.heads, row0=0, n_rows=p.s_q, col0=0, config=config,
    )  # fmt: skip
    return out[:, : p.s_k]


@pytest.mark.parametrize(
    ("config", "keys"),
    [
        (LogitsConfig(schedule="pipelined"), 256),  # whole tiles: unmasked key loads
        (LogitsConfig(key_mask="always"), 256),  # the masked kernel of the first H200 runs
        (LogitsConfig(schedule="pipelined"), 197),  # 197 keys: the last tile is masked
        (LogitsConfig(64, 128, 4, 3, schedule="pipelined"), 256),  # 8 queries a program
    ],
    ids=["pipelined", "serial-masked", "pipelined-197-keys", "pipelined-n64-k128"],
)
def test_schedules_and_key_masks_give_identical_scores(
    prepared_row: tuple, config: LogitsConfig, keys: int
) -> None:
    # The schedule and the key mask do not change the per-score arithmetic: bitwise equal to
    # the fixed config at the same block sizes (other block sizes may sum in another order),
    # and within the fp32 tolerance of the reference.
    p, ref = prepared_row
    assert p.k8.shape[0] == 256  # keys padded to a multiple of KEY_PAD = 128
    got = _run(p, config, keys)
    if (config.block_n, config.block_k) == (128, 64):
        base = _run(p, LogitsConfig(), 256)
        assert torch.equal(got.view(torch.int32), base.view(torch.int32))
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert ((got[fin] - ref[fin]).norm() / ref[fin].norm()).item() <= 1e-5


def test_logits_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"LogitsConfig\.schedule"):
        LogitsConfig(schedule="async")
    with pytest.raises(ValueError, match=r"LogitsConfig\.key_mask"):
        LogitsConfig(key_mask="never")
    assert LogitsConfig(schedule="pipelined", key_mask="always").label == "n128/k64/w4/s3/pipe/mask"
