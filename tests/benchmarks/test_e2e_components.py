"""Pieces of the e2e ablation's model: sparse attention, dropless MoE, fused LM-head loss.

- The torch sparse attention equals dense softmax attention under the mask "key selected by
  the indexer" (an independent formulation), gradients included.
- The Triton sparse attention (fwd + bwd with atomics) equals the torch one; it runs through
  the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton.jit
  decorates anything, and other test modules may already have imported Triton kernels).
- The MoE output of a token does not depend on what else is routed with it (dropless: crowding
  costs time, never changes values), while its capacity follows the most loaded expert.
- The fused linear cross entropy equals F.cross_entropy on full logits, value and gradients.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.e2e_ablation.model import IGNORE_INDEX, fused_linear_cross_entropy
from benchmarks.e2e_ablation.moe import MoE
from benchmarks.e2e_ablation.sparse_attention import random_problem, sparse_mqa_reference

REPO = Path(__file__).resolve().parents[2]


def _dense_masked(qn, qp, kc, kp, idx, nvalid, scale):  # type: ignore[no-untyped-def]
    s = qn.shape[0]
    allowed = torch.zeros(s, s + 1, dtype=torch.bool)
    slots = torch.arange(idx.shape[1])[None, :] < nvalid[:, None]
    allowed.scatter_(1, torch.where(slots, idx.long(), s), True)
    allowed = allowed[:, :s]
    scores = (torch.einsum("thd,sd->ths", qn, kc) + torch.einsum("thd,sd->ths", qp, kp)) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(scores, dim=-1))
    return torch.einsum("ths,sd->thd", p, kc)


def test_reference_sparse_attention_is_masked_dense_attention() -> None:
    qn, qp, kc, kp, idx, nvalid = random_problem(
        70, 4, 16, 8, 12, docs=[30, 25, 10], seed=3
    )  # 5 empty queries
    assert int((nvalid == 0).sum()) == 5
    scale = 1 / math.sqrt(24)
    grads = torch.randn(70, 4, 16)
    outs = []
    for fn in (sparse_mqa_reference, _dense_masked):
        leaves = [x.clone().requires_grad_(True) for x in (qn, qp, kc, kp)]
        out = (
            fn(*leaves, idx, nvalid, scale)
            if fn is _dense_masked
            else fn(*leaves, idx, nvalid, scale, chunk=16)
        )
        out.backward(grads)
        outs.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert bool((outs[0][0][65:] == 0).all()), "queries with no selected key must output zeros"


def test_triton_sparse_attention_matches_reference_in_interpreter() -> None:
    code = (  # 16-key blocks so queries walk up to 3 blocks (online softmax across blocks, atomics per block)
        "import torch\n"
        "import benchmarks.e2e_ablation.sparse_attention as sa\n"
        "sa.BLOCK_KEYS = 16\n"
        "ok, msg = sa.self_check(torch.device('cpu'), torch.float32, h=16, dc=16, dr=16, topk=40, s=96, docs=[50, 30, 10])\n"
        "print(msg)\n"
        "raise SystemExit(0 if ok else 1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "matches the reference" in proc.stdout


def test_moe_is_dropless_and_capacity_follows_the_hottest_expert() -> None:
    torch.manual_seed(0)
    moe = MoE(32, 4, 2, 48, capacity_multiple=8, init_std=0.2)
    x = torch.randn(40, 32)
    alone = moe(x)
    cap_alone = moe.last_capacity
    crowd = x[:1].expand(200, 32)  # 200 identical tokens: all on the same two experts
    together = moe(torch.cat([x, crowd]))
    torch.testing.assert_close(together[:40], alone, rtol=1e-5, atol=1e-6)
    assert moe.last_max_load >= 200 and moe.last_capacity >= moe.last_max_load > cap_alone
    together[:40].sum().backward()
    assert moe.w_in.grad is not None and torch.isfinite(moe.w_in.grad).all()


def test_fused_linear_cross_entropy_matches_full_logits() -> None:
    torch.manual_seed(1)
    h = torch.randn(50, 16, requires_grad=True)
    w = torch.randn(97, 16, requires_grad=True)
    labels = torch.randint(0, 97, (50,))
    labels[::7] = IGNORE_INDEX
    norm = 33.0
    loss = fused_linear_cross_entropy(h, w, labels, norm, chunk=16)
    (2 * loss).backward()
    h2, w2 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(h2 @ w2.t(), labels, ignore_index=IGNORE_INDEX, reduction="sum") / norm
    (2 * ref).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_triton_sparse_attention_on_gpu_bf16() -> None:
    """The compiled kernels at the h200 preset's shapes (16 heads, 64 + 32 dims, top-2048)."""
    from benchmarks.e2e_ablation.sparse_attention import self_check

    ok, msg = self_check(
        torch.device("cuda"),
        torch.bfloat16,
        h=16,
        dc=64,
        dr=32,
        topk=2048,
        s=2056,
        docs=[1500, 500],
    )
    assert ok, msg
