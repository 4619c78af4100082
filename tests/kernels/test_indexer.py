"""Public API: input checks, NaN policy, chunking, determinism within and across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from packshard.kernels import (
    IndexerConfig,
    fp8_indexer_logits,
    fp8_indexer_topk,
    indexer_topk_prepared,
    plan_chunks,
    prepare_inputs,
)
from packshard.kernels.logits import launch_logits
from packshard.kernels.topk import TopkConfig, TopkWorkspace
from tests.kernels._cases import SMALL, SMALL_TOPK, packed_ranges, random_inputs

REPO = Path(__file__).resolve().parents[2]


def _case(device: str, s_docs: list[int] = (90, 60, 47)) -> tuple:
    ks, ke = packed_ranges(list(s_docs))
    q, k, w = random_inputs(ks.numel(), 4, 32, seed=21, device=device)
    return q, k, w, ks.to(device), ke.to(device)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("where", ["q", "k", "w"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_inputs_raise(where: str, bad: float, device: str) -> None:
    q, k, w, ks, ke = _case(device)
    x = {"q": q, "k": k, "w": w}[where]
    x.view(-1)[17] = bad
    with pytest.raises(ValueError, match=f"non-finite values .* in {where}"):
        fp8_indexer_topk(q, k, w, ks, ke, 8, config=SMALL)  # checked at the end of the call
    with pytest.raises(ValueError, match=f"non-finite values .* in {where}"):
        prepare_inputs(q, k, w, ks, ke)  # checked at once
    p = prepare_inputs(q, k, w, ks, ke, defer_finite_check=True)
    with pytest.raises(ValueError, match=f"non-finite values .* in {where}"):
        indexer_topk_prepared(p, 8, SMALL)


def test_bad_shapes_and_ranges_raise(device: str) -> None:
    q, k, w, ks, ke = _case(device)
    with pytest.raises(ValueError, match="q must be"):
        fp8_indexer_topk(q[0], k, w, ks, ke, 8)
    with pytest.raises(ValueError, match="w must be"):
        fp8_indexer_topk(q, k, w[:, :2], ks, ke, 8)
    with pytest.raises(ValueError, match="ks must be int32"):
        fp8_indexer_topk(q, k, w, ks.long(), ke, 8)
    with pytest.raises(ValueError, match="leaves the keys"):
        fp8_indexer_topk(q, k[:100], w, ks, ke, 8)
    with pytest.raises(ValueError, match="topk=0"):
        fp8_indexer_topk(q, k, w, ks, ke, 0)
    # ks/ke on q's device or on the CPU, both on the same one
    meta = torch.empty(ks.shape, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"ks and ke must both be on q's device .* or both on"):
        fp8_indexer_topk(q, k, w, meta, ke, 8)
    with pytest.raises(ValueError, match=r"q, k, w must share one device"):
        fp8_indexer_topk(q, k.to("meta"), w, ks, ke, 8)
    with pytest.raises(ValueError, match=r"D >= 1 dims"):
        fp8_indexer_topk(q[..., :0], k[:, :0], w, ks, ke, 8)
    many = q[:, :1].expand(-1, 129, -1)
    with pytest.raises(ValueError, match=r"the logits kernel takes at most 128 heads"):
        fp8_indexer_topk(many, k, w[:, :1].expand(-1, 129), ks, ke, 8)


def test_topk_is_an_integer_within_the_kernels_limit(device: str, monkeypatch) -> None:
    import numpy as np

    q, k, w, ks, ke = _case(device)
    want = fp8_indexer_topk(q, k, w, ks, ke, 8, config=SMALL)
    for k8 in (np.int64(8), torch.tensor(8)):  # what min() over numpy values gives
        assert torch.equal(fp8_indexer_topk(q, k, w, ks, ke, k8, config=SMALL), want)
    with pytest.raises(TypeError, match="topk must be an int, got float"):
        fp8_indexer_topk(q, k, w, ks, ke, 8.0)
    with pytest.raises(ValueError, match=r"topk=524289: at most 524,288"):
        fp8_indexer_topk(q, k, w, ks, ke, 2**19 + 1)
    if device == "cpu":  # without the interpreter Triton finds no driver; say what to do
        monkeypatch.setenv("TRITON_INTERPRET", "true")  # on, as Triton reads it
        assert torch.equal(fp8_indexer_topk(q, k, w, ks, ke, 8, config=SMALL), want)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            fp8_indexer_topk(q, k, w, ks, ke, 8)
        from packshard.kernels.fp8_indexer import topk_from_logits

        with pytest.raises(ValueError, match=r"logits on the CPU: .*TRITON_INTERPRET=1"):
            topk_from_logits(torch.zeros(len(ks), 8), ks.clamp(max=8), ke.clamp(max=8), 2)


def _check_plan(chunks, ks, ke, extra: int, bound: int, align: int) -> None:
    """The chunks tile the rows in order, whole query blocks but the last, their windows hold
    every live row's range, and the largest chunk's logits plus the largest chunk's rows of
    workspace (the buffers reused across chunks) fit the bound."""
    assert chunks[0][0] == 0 and chunks[-1][1] == len(ks)
    assert [c[1] for c in chunks[:-1]] == [c[0] for c in chunks[1:]]
    assert all((r1 - r0) % align == 0 for r0, r1, _, _ in chunks[:-1])
    for r0, r1, col0, width in chunks:
        assert col0 % 16 == 0 and width % 16 == 0 and r1 > r0
        live = [(s, e) for s, e in zip(ks[r0:r1], ke[r0:r1], strict=True) if e > s]
        assert all(col0 <= s and e <= col0 + width for s, e in live)
    logits = max(4 * (r1 - r0) * w for r0, r1, _, w in chunks)
    assert logits + max(r1 - r0 for r0, r1, _, _ in chunks) * extra <= bound


@pytest.mark.parametrize("value", ["1", "true", "On", "yes", "y", "0", "2", ""])
def test_interpreting_is_what_the_installed_triton_reads(value: str, monkeypatch) -> None:
    """The paths that avoid inline PTX follow Triton's own reading of TRITON_INTERPRET (the
    words it takes for on are its version's), and a knob set in code without touching the
    environment."""
    from triton import knobs

    from packshard.kernels._triton_env import interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == bool(knobs.runtime.interpret)
    monkeypatch.setattr(knobs, "propagate_env", False)
    flipped = value not in ("1", "true", "On")
    knobs.runtime.interpret = flipped  # an override of the environment's value ...
    try:
        assert interpreting() == flipped
    finally:
        del knobs.runtime.interpret  # ... dropped again: the environment's value rules
    assert interpreting() == bool(knobs.runtime.interpret)


def test_plan_chunks_is_pure_bounded_and_sized_by_key_windows() -> None:
    ks, ke = packed_ranges([500, 300, 224])
    ks, ke = ks.tolist(), ke.tolist()
    bound = 4 * 1024 * 128  # 128 rows of all 1024 keys
    chunks = plan_chunks(ks, ke, 1024, 0, max_chunk_bytes=bound)
    _check_plan(chunks, ks, ke, 0, bound, 64)
    assert chunks == plan_chunks(ks, ke, 1024, 0, max_chunk_bytes=bound)
    # windows narrower than all keys: fewer than the 8 chunks of 128 all-key rows
    assert len(chunks) < 8
    # the first document's causal rows while their window fits: 320 x 320 floats (384 x 384
    # would not)
    assert chunks[0] == (0, 320, 0, 320)
    # with workspace and a causal row (windows growing to all keys); empty rows do not widen
    n = 4096
    ks = [0] * n
    ke = [i + 1 if i % 7 else 0 for i in range(n)]
    for extra, align in ((0, 64), (3000, 64), (3000, 1), (10**5, 64)):
        bound = 4 * n * 300 + 200 * extra
        chunks = plan_chunks(ks, ke, n, extra, max_chunk_bytes=bound, align=align)
        _check_plan(chunks, ks, ke, extra, bound, align)
        uniform = -(-n // max(align, bound // (4 * n + extra) // align * align))
        # never more chunks than rows of all keys; fewer unless the workspace takes the bound
        assert len(chunks) < uniform if extra < 10**5 else len(chunks) == uniform
    # a bound smaller than one block: one block a chunk, over the bound
    chunks = plan_chunks(ks, ke, n, 3000, max_chunk_bytes=1000)
    assert [r1 - r0 for r0, r1, _, _ in chunks] == [64] * (n // 64)
    assert plan_chunks([], [], 128, 0, 1 << 20) == []


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_plan_chunks_on_int32_and_int64_ranges_with_empty_rows(dtype) -> None:
    # The shim's ks_host is int32 and every packed row ends in cp padding (empty ranges); a
    # leading empty block too. The plan is the same for both dtypes and for Python lists, no
    # window starts below 0 or reaches past the keys, and an all-empty block gets a 16-key
    # window at column 0.
    n = 300
    ks = np.zeros(n, dtype=np.int64)
    ke = np.arange(1, n + 1, dtype=np.int64)
    ke[:70] = ks[:70] = 0  # rows 0-69 have no keys (the first 64-row block is all empty)
    ks[290:] = ke[290:] = 290  # cp padding: empty ranges at the row's end
    want = plan_chunks(ks.tolist(), ke.tolist(), n, 64, max_chunk_bytes=4 * 64 * n)
    got = plan_chunks(ks.astype(dtype), ke.astype(dtype), n, 64, max_chunk_bytes=4 * 64 * n)
    assert got == want
    _check_plan(got, ks.tolist(), ke.tolist(), 64, 4 * 64 * n, 64)
    assert all(col0 >= 0 and col0 + width <= n + 16 for _, _, col0, width in got)
    first = plan_chunks(ks[:64].astype(dtype), ke[:64].astype(dtype), n, 0, 1 << 20)
    assert first == [(0, 64, 0, 16)]


def test_chunked_equals_unchunked(device: str) -> None:
    q, k, w, ks, ke = _case(device)
    p = prepare_inputs(q, k, w, ks, ke)
    per_row = 4 * p.k8.shape[0] + TopkWorkspace.bytes_per_row(8, SMALL_TOPK)
    # 64 rows a chunk of all keys; the documents' windows are narrower: 3 chunks of 197 rows
    chunked = IndexerConfig(topk=SMALL_TOPK, max_chunk_bytes=64 * per_row)
    stats: dict = {}
    a = indexer_topk_prepared(p, 8, chunked, stats=stats)
    b = indexer_topk_prepared(p, 8, SMALL)
    assert stats["chunks"] == 3
    assert torch.equal(a, b)


# One-pass select with a 16-score sample: many rows miss their window and are flagged, so the
# deferred exact path (logits recomputed after the last chunk) runs for rows of every chunk.
ROUGH_TOPK = TopkConfig(
    sample=16, block=32, min_cap=16, max_passes=1, rows_per_program=256, compact="scan"
)


@pytest.mark.parametrize("overlap", ["none", "stream", "priority"])
def test_flagged_rows_across_chunks_equal_the_unchunked_answer(overlap: str, device: str) -> None:
    q, k, w, ks, ke = _case(device)
    p = prepare_inputs(q, k, w, ks, ke)
    per_row = 4 * p.k8.shape[0] + TopkWorkspace.bytes_per_row(8, ROUGH_TOPK)
    cfg = IndexerConfig(topk=ROUGH_TOPK, max_chunk_bytes=2 * 64 * per_row, overlap=overlap)
    stats: dict = {}
    got = indexer_topk_prepared(p, 8, cfg, stats=stats)
    assert stats["chunks"] in (2, 4)  # 197 queries: 128 (one stream) or 64 (two) rows a chunk
    flagged = stats["fallback_rows"]
    assert 0 < flagged < 197  # both paths ran, in more than one run of consecutive rows
    assert torch.equal(got, indexer_topk_prepared(p, 8, SMALL))


def test_chunks_run_heaviest_first(device: str) -> None:
    # causal rows: 64-row chunks hold 2080, 6176, 10272 and (5 rows) 975 in-range scores
    q, k, w, ks, ke = _case(device, s_docs=[197])
    p = prepare_inputs(q, k, w, ks, ke)
    per_row = 4 * p.k8.shape[0] + TopkWorkspace.bytes_per_row(8, SMALL_TOPK)
    row0s: list[int] = []

    def launch(*args, row0: int, **kw) -> None:
        row0s.append(row0)
        launch_logits(*args, row0=row0, **kw)

    cfg = IndexerConfig(topk=SMALL_TOPK, max_chunk_bytes=64 * per_row, overlap="none")
    stats: dict = {}
    got = indexer_topk_prepared(p, 8, cfg, launch=launch, stats=stats)
    assert row0s[:4] == [128, 64, 0, 192]
    # then one launch per run of consecutive flagged rows, in row order
    assert row0s[4:] == sorted(row0s[4:]) and len(row0s[4:]) <= stats["fallback_rows"]
    assert torch.equal(got, indexer_topk_prepared(p, 8, SMALL))


def test_config_rejects_unknown_overlap() -> None:
    with pytest.raises(ValueError, match="overlap"):
        IndexerConfig(overlap="threads")


def test_repeated_calls_are_bitwise_identical(device: str) -> None:
    q, k, w, ks, ke = _case(device)
    a = fp8_indexer_topk(q, k, w, ks, ke, 8, config=SMALL)
    b = fp8_indexer_topk(q, k, w, ks, ke, 8, config=SMALL)
    la = fp8_indexer_logits(q, k, w, ks, ke)
    lb = fp8_indexer_logits(q, k, w, ks, ke)
    assert torch.equal(a, b)
    assert torch.equal(la.view(torch.int32), lb.view(torch.int32))


_CHILD = """
import hashlib, torch
from packshard.kernels import fp8_indexer_logits, fp8_indexer_topk
from packshard.kernels.topk import TopkWorkspace
from tests.kernels._cases import SMALL, packed_ranges, random_inputs
dev = "cuda" if torch.cuda.is_available() else "cpu"
ks, ke = packed_ranges([90, 60, 47])
q, k, w = random_inputs(ks.numel(), 4, 32, seed=21, device=dev)
ks, ke = ks.to(dev), ke.to(dev)
idx = fp8_indexer_topk(q, k, w, ks, ke, 8, config=SMALL).cpu()
lg = fp8_indexer_logits(q, k, w, ks, ke).cpu()
print(hashlib.sha256(idx.numpy().tobytes() + lg.numpy().tobytes()).hexdigest())
"""


def test_identical_across_processes(device: str) -> None:
    q, k, w, ks, ke = _case(device)
    idx = fp8_indexer_topk(q, k, w, ks, ke, 8, config=SMALL).cpu()
    lg = fp8_indexer_logits(q, k, w, ks, ke).cpu()
    mine = hashlib.sha256(idx.numpy().tobytes() + lg.numpy().tobytes()).hexdigest()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == mine
