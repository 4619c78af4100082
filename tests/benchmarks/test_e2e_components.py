"""Pieces of the e2e ablation's model: sparse attention, dropless MoE, fused LM-head loss.

- The torch sparse attention equals dense softmax attention under the mask "key selected by
  the indexer" (an independent formulation), gradients included.
- The Triton kernels (sparse attention fwd + bwd with atomics; the cross-entropy rows kernel)
  equal their torch versions; they run through the Triton interpreter in a subprocess
  (TRITON_INTERPRET must be set before triton.jit decorates anything, and other test modules
  may already have imported Triton kernels), and each self-check must also catch a broken
  kernel.
- The MoE output of a token does not depend on what else is routed with it (dropless: crowding
  costs time, never changes values), while its capacity follows the most loaded expert; the
  DeepSeek-V3 bias step counts every token fed (padding too), lowers the busy experts' bias,
  changes which experts are picked but not how the picked ones are mixed; the balance loss is
  1 under uniform affinities and grows with imbalance.
- The fused linear cross entropy equals F.cross_entropy on full logits, value and gradients,
  and its loss-only path gives the same value.
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

from benchmarks.e2e_ablation.loss import IGNORE_INDEX, fused_linear_cross_entropy
from benchmarks.e2e_ablation.moe import MoE
from benchmarks.e2e_ablation.sparse_attention import random_problem, sparse_mqa_reference

REPO = Path(__file__).resolve().parents[2]


def _interpreted(code: str) -> str:
    """Run `code` in a fresh Python under the Triton interpreter; its stdout (fails on rc != 0)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


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
    # float64 and seeded output gradients: the two formulations sum in different orders, and
    # in float32 one element in ~1000 landed 1.3e-6 apart (the unseeded gradients made that
    # a flake); in float64 the same tolerance leaves no room for rounding noise to matter
    qn, qp, kc, kp, idx, nvalid = random_problem(
        70, 4, 16, 8, 12, docs=[30, 25, 10], seed=3, dtype=torch.float64
    )  # 5 empty queries
    assert int((nvalid == 0).sum()) == 5
    scale = 1 / math.sqrt(24)
    g = torch.Generator().manual_seed(4)
    grads = torch.randn(70, 4, 16, generator=g, dtype=torch.float64)
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
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
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
    assert "matches the reference" in _interpreted(code)


def test_moe_is_dropless_and_capacity_follows_the_hottest_expert() -> None:
    torch.manual_seed(0)
    moe = MoE(32, 4, 2, 48, capacity_multiple=8, init_std=0.2)
    x = torch.randn(40, 32)
    alone = moe(x)
    ((loads_alone, real_alone),) = moe.take_stats()
    crowd = x[:1].expand(200, 32)  # 200 identical tokens: all on the same two experts
    together = moe(torch.cat([x, crowd]), n_real=40)
    ((loads, real),) = moe.take_stats()
    torch.testing.assert_close(together[:40], alone, rtol=1e-5, atol=1e-6)
    assert torch.equal(real, real_alone), "real-token loads must not see the crowd"
    assert int(loads.sum()) == 2 * 240 and int(loads.max()) >= 200
    assert moe.capacity_of(loads) >= int(loads.max()) > moe.capacity_of(loads_alone)
    together[:40].sum().backward()
    assert moe.w_in.grad is not None and torch.isfinite(moe.w_in.grad).all()
    assert moe.router.grad is not None and moe.router.grad.abs().sum() > 0


def test_moe_bias_step_counts_every_token_and_only_selects() -> None:
    torch.manual_seed(1)
    moe = MoE(16, 4, 2, 8, capacity_multiple=4, init_std=0.3)
    x = torch.randn(30, 16)
    pads = x[:1].expand(90, 16)  # identical "pads" crowd two experts
    with torch.no_grad():
        moe(torch.cat([x, pads]), n_real=30)
        _, _, scores = moe.route(pads[:1])
    (loads,) = moe.take_stats()
    busy = scores[0].topk(2).indices
    assert int(moe.step_loads.sum()) == 2 * 120 and torch.equal(moe.step_loads, loads[0])
    moe.update_bias(0.01)
    assert int(moe.step_loads.sum()) == 0
    torch.testing.assert_close(moe.expert_bias[busy], torch.full((2,), -0.01))
    assert float(moe.expert_bias.sum()) > -0.02, "under-loaded experts must go up"
    # a bias large enough moves the pick; the mixing weights stay the affinities of the picked
    moe.expert_bias.zero_()
    moe.expert_bias[busy[0]] = -10.0
    experts, weights, scores = moe.route(x)
    assert not bool((experts == busy[0]).any())
    picked = scores.gather(1, experts)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
    moe.update_bias(0.0)  # rate 0: statistics reset, bias unchanged
    assert float(moe.expert_bias[busy[0]]) == -10.0


def test_moe_balance_loss_is_one_when_uniform_and_grows_with_crowding() -> None:
    moe = MoE(8, 4, 2, 8, capacity_multiple=4, init_std=0.0)  # router 0: affinities all 0.5
    x = torch.randn(64, 8)
    moe(x)
    assert abs(float(moe.aux_loss.detach()) - 1.0) < 1e-6
    torch.manual_seed(2)
    moe = MoE(8, 4, 2, 8, capacity_multiple=4, init_std=1.0)
    spread = torch.randn(64, 8)
    moe(spread)
    balanced = float(moe.aux_loss.detach())
    moe(torch.cat([spread, spread[:1].expand(192, 8)]))
    assert float(moe.aux_loss.detach()) > balanced
    moe.aux_loss.backward()
    assert moe.router.grad is not None and moe.router.grad.abs().sum() > 0
    with torch.no_grad():
        moe(spread)
    assert moe.aux_loss is None


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
    with torch.no_grad():
        only = fused_linear_cross_entropy(h, w, labels, norm, chunk=16, with_grad=False)
    torch.testing.assert_close(only, ref.detach(), rtol=1e-5, atol=1e-6)


def test_triton_cross_entropy_matches_torch_in_interpreter() -> None:
    code = (  # 1,024-wide blocks over a 5,000 vocabulary: several blocks and a masked tail
        "import torch\n"
        "import benchmarks.e2e_ablation.loss as L\n"
        "L.BLOCK_V = 1024\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    ok, msg = L.self_check(torch.device('cpu'), dt, vocab=5000, rows=24)\n"
        "    print(msg)\n"
        "    assert ok, msg\n"
        "x = torch.randn(6, 5000)\n"
        "y = torch.tensor([1, -100, 4999, 0, 7, 2500])\n"
        "with torch.no_grad():\n"
        "    lo = L.ce_rows_triton(x.clone(), y, 1.0, with_grad=False)\n"
        "ref = torch.nn.functional.cross_entropy(x, y, ignore_index=-100, reduction='none')\n"
        "torch.testing.assert_close(lo, ref, rtol=1e-5, atol=1e-5)\n"
        "good = L.ce_rows_triton\n"
        "L.ce_rows_triton = lambda x, y, c, with_grad: good(x, y, 1.01 * c, with_grad=with_grad)\n"
        "ok, msg = L.self_check(torch.device('cpu'), torch.float32, vocab=5000, rows=24)\n"
        "print('BROKEN', ok, msg)\n"
        "assert not ok\n"
    )
    out = _interpreted(code)
    assert out.count("matches torch") == 2 and "BROKEN False" in out


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


@pytest.mark.gpu
def test_triton_cross_entropy_on_gpu_bf16() -> None:
    """The compiled rows kernel at the h200 preset's vocabulary (151,936), bf16 logits."""
    from benchmarks.e2e_ablation.loss import self_check

    ok, msg = self_check(torch.device("cuda"), torch.bfloat16, vocab=151_936)
    assert ok, msg
