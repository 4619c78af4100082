"""Logits kernel against the fp32 torch reference on dequantized inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from packshard.kernels import (
    FIXED_LOGITS_CONFIG,
    LogitsConfig,
    fp8_indexer_logits,
    prepare_inputs,
    reference_logits,
)
from packshard.kernels.logits import launch_logits
from tests.kernels._cases import exact_inputs, packed_ranges, random_inputs


@pytest.mark.parametrize(
    ("h", "d", "docs"),
    [
        (8, 128, [70, 3, 90, 29]),
        (4, 32, [45, 1, 100, 50]),
        (8, 64, [197]),
        (6, 48, [60, 41, 20]),
        (32, 64, [70, 3, 51]),  # H >= 16: the head-sum chain splits 2 (H=32) or 3 (H=64) times
        (64, 32, [45, 20]),
    ],
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
        # H=8: query blocks of 2 at block_n 16, so two blocks a program share each key tile
        (LogitsConfig(16, 64, 4, 3, q_groups=2), 256),
        (LogitsConfig(16, 64, 4, 3, q_groups=2, pair_max_registers=168), 197),  # masked tile, cap
        (LogitsConfig(16, 128, 4, 3, q_groups=2), 256),
        (LogitsConfig(head_sum="chain", key_mask="always"), 256),  # the fma-chain head sum
        (LogitsConfig(head_sum="chain", schedule="pipelined"), 197),
        (LogitsConfig(16, 64, 4, 3, q_groups=2, head_sum="chain"), 256),
        # relu as x + |x| with halved weights (the fixed config's two-block programs)
        (LogitsConfig(16, 64, 4, 3, q_groups=2, pair_relu="abs"), 256),
        (LogitsConfig(16, 64, 4, 3, q_groups=2, pair_max_registers=168, pair_relu="abs"), 197),
    ],
    ids=[
        "pipelined",
        "serial-masked",
        "pipelined-197-keys",
        "pipelined-n64-k128",
        "g2",
        "g2-197-keys-r168",
        "g2-k128",
        "chain-masked",
        "chain-pipelined-197-keys",
        "chain-g2",
        "g2-abs",
        "g2-abs-197-keys-r168",
    ],
)
def test_schedules_and_key_masks_give_identical_scores(
    prepared_row: tuple, config: LogitsConfig, keys: int
) -> None:
    # The schedule, the key mask, shared key tiles and register caps do not change the
    # per-score arithmetic: bitwise equal to the plain serial kernel with the same block sizes
    # and head sum, and within the fp32 tolerance of the reference. The row has 197 queries:
    # 99 blocks of 2 at block_n 16, so q_groups=2 also runs a program whose second block is
    # past the last row.
    p, ref = prepared_row
    assert p.k8.shape[0] == 256  # keys padded to a multiple of KEY_PAD = 128
    got = _run(p, config, keys)
    plain = dataclasses.replace(
        config,
        schedule="serial",
        key_mask="auto",
        q_groups=1,
        pair_max_registers=None,
        pair_relu="max",
    )
    assert plain != config
    base = _run(p, plain, 256)
    assert torch.equal(got.view(torch.int32), base.view(torch.int32))
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert ((got[fin] - ref[fin]).norm() / ref[fin].norm()).item() <= 1e-5


@pytest.mark.parametrize(
    "config",
    [
        LogitsConfig(),
        LogitsConfig(16, 64, 4, 3, q_groups=2),
        LogitsConfig(16, 64, 4, 3, q_groups=2, pair_relu="abs"),
    ],
    ids=["g1", "g2", "g2-abs"],
)
def test_row_windows_equal_the_whole_matrix(prepared_row: tuple, config: LogitsConfig) -> None:
    # Chunks launch with row0 / n_rows / col0 offsets (odd row counts, 16-aligned key windows):
    # each window's scores are bitwise the whole launch's.
    p, _ = prepared_row
    _assert_windows_equal(p, config, _run(p, config, 256))


def _assert_windows_equal(p, config: LogitsConfig, whole: torch.Tensor) -> None:
    """Launches over three row windows (16-aligned key windows) give `whole`'s scores bitwise."""
    for r0, r1 in ((0, 37), (37, 120), (120, 197)):
        lo = int(p.ks[r0:r1].min()) // 16 * 16
        part = torch.full((r1 - r0, 256 - lo), float("-inf"))
        launch_logits(
            p.q8, p.wq, p.k8, p.k_scale, p.ks, p.ke, part,
            heads=p.heads, row0=r0, n_rows=r1 - r0, col0=lo, config=config,
        )  # fmt: skip
        want = whole[r0:r1, lo:]
        assert torch.equal(part[:, : want.shape[1]].view(torch.int32), want.view(torch.int32))


@pytest.fixture(scope="module")
def prepared_row_h16() -> tuple:
    """prepared_row's documents at H=16: 1-query blocks at block_n 16 (4 a program at q_groups=4)."""
    ks, ke = packed_ranges([70, 3, 90, 29], pad=5)
    q, k, w = random_inputs(ks.numel(), 16, 64, seed=37)
    p = prepare_inputs(q, k, w, ks, ke)
    return p, reference_logits(q, k, w, ks, ke)


@pytest.mark.parametrize(
    ("config", "keys"),
    [
        (LogitsConfig(16, 64, 4, 3, q_groups=4), 256),
        (LogitsConfig(16, 64, 4, 3, q_groups=4, pair_relu="abs"), 256),
        (LogitsConfig(16, 64, 4, 3, q_groups=4, pair_max_registers=128, pair_relu="abs"), 197),
        (LogitsConfig(32, 64, 4, 3, q_groups=4, pair_relu="abs"), 256),  # 2-query blocks: g2
    ],
    ids=["g4", "g4-abs", "g4-abs-197-keys-r128", "g4-n32-runs-g2"],
)
def test_four_block_programs_give_identical_scores(
    prepared_row_h16: tuple, config: LogitsConfig, keys: int
) -> None:
    # 197 1-query blocks: 50 programs of 4, the last with 3 blocks past the last row. Bitwise
    # equal to the one-block kernel with the same block_n, within tolerance of the reference,
    # and each row window of a chunked launch bitwise equal to the whole launch.
    p, ref = prepared_row_h16
    assert config.groups(p.heads) == 4 // config.block_q(p.heads)
    got = _run(p, config, keys)
    plain = dataclasses.replace(config, q_groups=1, pair_max_registers=None, pair_relu="max")
    assert torch.equal(got.view(torch.int32), _run(p, plain, 256).view(torch.int32))
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert ((got[fin] - ref[fin]).norm() / ref[fin].norm()).item() <= 1e-5
    _assert_windows_equal(p, config, got)


def test_chain_and_tree_head_sums_both_match_the_reference(prepared_row: tuple) -> None:
    # The two head sums round differently (so one is not a copy of the other) and both stay
    # within the fp32 tolerance.
    p, ref = prepared_row
    chain, tree = _run(p, LogitsConfig(head_sum="chain"), 256), _run(p, LogitsConfig(), 256)
    fin = torch.isfinite(ref)
    assert not torch.equal(chain.view(torch.int32), tree.view(torch.int32))
    for got in (chain, tree):
        assert ((got[fin] - ref[fin]).norm() / ref[fin].norm()).item() <= 1e-5


def test_logits_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"LogitsConfig\.schedule"):
        LogitsConfig(schedule="async")
    with pytest.raises(ValueError, match=r"LogitsConfig\.key_mask"):
        LogitsConfig(key_mask="never")
    with pytest.raises(ValueError, match=r"LogitsConfig\.head_sum"):
        LogitsConfig(head_sum="sorted")
    with pytest.raises(ValueError, match=r"LogitsConfig\.q_groups=3: must be 1, 2 or 4"):
        LogitsConfig(q_groups=3)
    with pytest.raises(ValueError, match=r"q_groups=2 needs schedule='serial'"):
        LogitsConfig(q_groups=2, schedule="pipelined")
    with pytest.raises(ValueError, match=r"q_groups=4 needs schedule='serial'"):
        LogitsConfig(q_groups=4, schedule="pipelined")
    with pytest.raises(ValueError, match=r"LogitsConfig\.pair_max_registers=300"):
        LogitsConfig(q_groups=2, pair_max_registers=300)
    with pytest.raises(ValueError, match=r"pair_max_registers needs q_groups 2 or 4"):
        LogitsConfig(pair_max_registers=168)
    assert LogitsConfig(q_groups=2, head_sum="chain", pair_max_registers=168).label == (
        "n128/k64/w4/s3/g2/chain/r168"
    )
    # a program holds at most 4 queries: q_groups pairs up blocks of at most 2 queries (H >= 64
    # at block_n 128), and 4 blocks a program need 1-query blocks
    assert [LogitsConfig(q_groups=2).groups(h) for h in (128, 64, 32, 8)] == [2, 2, 1, 1]
    assert LogitsConfig(16, q_groups=2).groups(8) == 2
    assert [LogitsConfig(64, q_groups=4).groups(h) for h in (64, 32, 16)] == [4, 2, 1]
    assert LogitsConfig(64, q_groups=4, pair_relu="abs").label == "n64/k64/w4/s3/g4/abs"
    g4 = LogitsConfig(64, q_groups=4, pair_max_registers=128, pair_relu="abs")
    assert [g4.max_registers(h) for h in (64, 32, 16)] == [128, 128, None]
    assert [g4.abs_relu(h) for h in (64, 32, 16)] == [True, True, False]
    # the cap reaches two-block programs only (under it ptxas grows the H=32 kernel past 128)
    fixed = LogitsConfig(q_groups=2, pair_max_registers=168)
    assert [fixed.max_registers(h) for h in (64, 32)] == [168, None]
    assert LogitsConfig(schedule="pipelined", key_mask="always").label == "n128/k64/w4/s3/pipe/mask"
    with pytest.raises(ValueError, match=r"LogitsConfig\.pair_relu='min'"):
        LogitsConfig(q_groups=2, pair_relu="min")
    abs_needs = r"pair_relu='abs' needs q_groups 2 or 4 and head_sum='tree'"
    with pytest.raises(ValueError, match=abs_needs):
        LogitsConfig(pair_relu="abs")
    with pytest.raises(ValueError, match=abs_needs):
        LogitsConfig(q_groups=2, head_sum="chain", pair_relu="abs")
    # small launches run the one-block form of a multi-block config
    small = LogitsConfig(q_groups=2, pair_max_registers=168, pair_relu="abs", group_min_scores=64)
    assert small.label == "n128/k64/w4/s3/g2/r168/abs/g>=64"
    assert small.for_launch(8, 8) is small and small.for_launch(2, 64) is small
    assert small.for_launch(7, 9) == LogitsConfig()
    assert FIXED_LOGITS_CONFIG.for_launch(4096, 8192) is FIXED_LOGITS_CONFIG
    assert FIXED_LOGITS_CONFIG.for_launch(4096, 4096) == LogitsConfig()
    assert LogitsConfig(q_groups=2, group_min_scores=1 << 25).label.endswith("/g2/g>=32M")
    with pytest.raises(ValueError, match=r"LogitsConfig\.group_min_scores=0: must be >= 1"):
        LogitsConfig(group_min_scores=0)
    # x + |x| reaches the two-block programs only (the one-block H=32 kernel lost with it)
    assert [FIXED_LOGITS_CONFIG.abs_relu(h) for h in (64, 32)] == [True, False]
    assert FIXED_LOGITS_CONFIG.label == "n128/k64/w4/s3/g2/r168/abs/g>=32M/ws>=256M"
    # from 2^28 scores H=64 launches run the warp-specialised kernel, on sm_90 GPUs only: never
    # on the CPU (the interpreter runs the Triton kernel), nor below the threshold
    with pytest.raises(ValueError, match=r"LogitsConfig\.ws_min_scores=0: must be >= 1"):
        LogitsConfig(ws_min_scores=0)
    fp8 = torch.float8_e4m3fn
    q8, k8 = torch.zeros(64, 128, dtype=fp8), torch.zeros(1 << 14, 128, dtype=fp8)
    assert not FIXED_LOGITS_CONFIG.runs_warp_specialised(q8, k8, 64, 1 << 14, 0)
    assert FIXED_LOGITS_CONFIG.for_launch(4096, 4096).ws_min_scores is None


def test_warp_specialised_launcher_rejects_what_its_kernel_cannot_run() -> None:
    # kernels.logits_ws runs on sm_90 only; its launcher's checks run before any launch, so
    # that a bad argument is a ValueError, not a crash in a TMA descriptor or wrong scores
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from packshard.kernels.logits_ws import launch_logits_ws, queries_per_cta

    fp8 = torch.float8_e4m3fn
    q8 = torch.zeros(8 * 64, 128, dtype=fp8)
    k8 = torch.zeros(256, 128, dtype=fp8)
    f32 = torch.zeros(8 * 64)
    ks = ke = torch.zeros(8, dtype=torch.int32)
    out = torch.zeros(8, 256)
    args = (q8, f32, k8, torch.zeros(256), ks, ke, out)
    common = {"row0": 0, "n_rows": 8, "col0": 0}
    # nothing to do: no check of the tensors, but of the heads and the ring
    assert launch_logits_ws(*args, heads=64, row0=0, n_rows=0, col0=0) is None
    for heads in (16, 48, 128):
        with pytest.raises(ValueError, match=rf"heads={heads}: must be 32 or 64"):
            launch_logits_ws(*args, heads=heads, row0=0, n_rows=0, col0=0)
    for stages, lag in ((4, 4), (4, 0), (5, 2), (6, 2)):  # 6/2 wrote wrong scores on the H200
        with pytest.raises(ValueError, match=rf"stages={stages}, lag={lag}: need stages 3 or 4"):
            launch_logits_ws(*args, heads=64, stages=stages, lag=lag, **common)
    with pytest.raises(ValueError, match=r"epilogue='tree': one of \['direct', 'convert'"):
        launch_logits_ws(*args, heads=64, epilogue="tree", **common)
    for align in (8, 32, 128):
        with pytest.raises(ValueError, match=rf"start_align={align}: 16 or 64"):
            launch_logits_ws(*args, heads=64, start_align=align, **common)
    for regs in (112, 124, 152):
        with pytest.raises(ValueError, match=rf"worker_regs={regs}: 120 or 128"):
            launch_logits_ws(*args, heads=64, worker_regs=regs, **common)
    # the tensors (on the CPU here: every check but the last runs without a GPU)
    with pytest.raises(ValueError, match=r"q8 is torch.bfloat16 on cpu: need torch.float8"):
        launch_logits_ws(q8.to(torch.bfloat16), *args[1:], heads=64, **common)
    with pytest.raises(ValueError, match=r"ks is torch.int64"):
        launch_logits_ws(*args[:4], ks.long(), *args[5:], heads=64, **common)
    with pytest.raises(ValueError, match=r"out is torch.bfloat16"):
        launch_logits_ws(*args[:6], out.to(torch.bfloat16), heads=64, **common)
    with pytest.raises(ValueError, match=r"k8 \(256, 64\): need D = 128"):
        launch_logits_ws(q8, f32, k8[:, :64], *args[3:], heads=64, **common)
    with pytest.raises(ValueError, match=r"q8, k8 and wq must be contiguous"):
        launch_logits_ws(q8.t().contiguous().t(), *args[1:], heads=64, **common)
    with pytest.raises(ValueError, match=r"keys=200: keys must be padded to a multiple of 64"):
        launch_logits_ws(q8, f32, k8[:200], torch.zeros(200), ks, ke, out, heads=64, **common)
    with pytest.raises(ValueError, match=r"rows \[4, 12\) exceed q8, wq, ks or ke"):
        launch_logits_ws(*args, heads=64, row0=4, n_rows=8, col0=0)
    with pytest.raises(ValueError, match=r"out \(8, 256\): need"):
        launch_logits_ws(*args[:6], out.t().contiguous().t(), heads=64, **common)
    with pytest.raises(ValueError, match=r"col0=8: must be a non-negative multiple of 16"):
        launch_logits_ws(*args, heads=64, row0=0, n_rows=8, col0=8)
    with pytest.raises(ValueError, match=r"tensors on cpu: need a CUDA device"):
        launch_logits_ws(*args, heads=64, **common)
    # four warpgroups of 128 (query, head) columns: 8 queries a CTA at H=64, 16 at H=32
    assert [queries_per_cta(h) for h in (64, 32)] == [8, 16]
