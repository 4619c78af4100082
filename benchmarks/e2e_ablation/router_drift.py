"""CPU study of the router's balance over training: the evidence behind config.py's choices.

Trains the ablation's model (shrunk: vocabulary ids folded mod --vocab, d_model --d-model,
768-token windows cut from the middle of real `long` rows, 2 windows a step) with AdamW and
prints, per step, the busiest expert's real-token load over the mean, per layer (max over the
step's two windows), next to what a fixed hash of the token id would give on the same windows
(the balance floor of routing by token alone). Attention is dense and document-causal: with
top-k >= the window, DSA selects every key in range, so nothing is lost.

    PYTHONPATH=. .venv/bin/python benchmarks/e2e_ablation/router_drift.py --lr 3e-4 --steps 10
    PYTHONPATH=. .venv/bin/python benchmarks/e2e_ablation/router_drift.py --lr 3e-5 --d-model 1024

What it showed (2-core CPU, minutes per run; README.md "What changed"): at lr 3e-4 the router
collapses (one expert holding 4-8x the mean) by step 4-8 with V3's bias at 1e-3 or 3e-2 per
step or a balance loss of 0.01, embedding scaled or not; with the softmax router of the first
run and no scaling, from step 1. At lr 3e-5, scaled embedding, separate head, d_model 1024,
it stays within ~1.5x of the hash floor for the steps run (windows dominated by one repeated
token, like step 4's, are imbalanced in any routing).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.e2e_ablation.config import ARMS, H200, ModelConfig  # noqa: E402


def dense_attention(qn, qp, kc, kp, idx, nvalid, scale):  # type: ignore[no-untyped-def]
    """Document-causal dense MQA: key s is allowed for query t iff t - nvalid[t] < s <= t."""
    t = torch.arange(qn.shape[0])
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - nvalid[:, None].long())
    sc = (torch.einsum("thd,sd->hts", qn, kc) + torch.einsum("thd,sd->hts", qp, kp)) * scale
    p = torch.nan_to_num(torch.softmax(sc.masked_fill(~allowed[None], float("-inf")), -1))
    return torch.einsum("hts,sd->thd", p, kc)


def all_keys(q, k, w, ks, ke, topk):  # type: ignore[no-untyped-def]
    """An 'indexer' that selects every key in [ks, ke) (valid as long as topk >= the window)."""
    j = torch.arange(topk)[None, :]
    return torch.where(j < (ke - ks).long()[:, None], ks.long()[:, None] + j, q.shape[0]).int()


def hash_floor(ids: np.ndarray, experts: int, k: int, rng: np.random.Generator) -> float:
    """Mean over 20 random token->experts hashes of the busiest expert's load / mean."""
    vals, counts = np.unique(ids, return_counts=True)
    out = []
    for _ in range(20):
        top = np.argsort(-rng.standard_normal((len(vals), experts)), 1)[:, :k]
        load = np.zeros(experts)
        for j in range(k):
            np.add.at(load, top[:, j], counts)
        out.append(load.max() / load.mean())
    return float(np.mean(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO / ".bench" / "e2e_data" / "long")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, default=768)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--aux", type=float, default=0.0, help="balance-loss weight")
    p.add_argument("--softmax", action="store_true", help="the first run's softmax router")
    p.add_argument("--no-scale", action="store_true", help="embedding not scaled by sqrt(d)")
    p.add_argument("--tied", action="store_true", help="LM head tied to the embedding")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    import benchmarks.e2e_ablation.model as model_mod
    from benchmarks.e2e_ablation.arms import build_arms
    from benchmarks.e2e_ablation.moe import MoE

    model_mod.IMPLEMENTATIONS["torch"] = dense_attention
    if args.softmax:

        def route(self, x):  # type: ignore[no-untyped-def]
            probs = torch.softmax(x.float() @ self.router.float(), dim=-1)
            w, e = probs.topk(self.topk, dim=-1)
            return e, w / w.sum(-1, keepdim=True), probs

        MoE.route = route  # type: ignore[method-assign]
    run = replace(H200, steps=max(args.steps, 5))
    rows = build_arms(str(args.data / "pad8"), str(args.data / "padseq"), run, (ARMS[3],))[4]
    L, V = args.window, args.vocab
    windows = []
    for mb in rows[: 2 * args.steps]:
        n0 = mb.meta["num_tokens"]
        a = max(0, min(n0 - L, n0 // 2 - L // 2))
        t = {k: v[a : a + L].clone() for k, v in mb.tensors.items() if k != "cu_seqlens"}
        t["input_ids"] %= V
        t["labels"][t["labels"] >= 0] %= V
        t["ks"], t["ke"] = (t["ks"] - a).clamp_min(0), (t["ke"] - a).clamp(0, L)
        windows.append((t, min(L, n0 - a)))
    d = args.d_model
    cfg = ModelConfig(
        vocab_size=V, d_model=d, n_layers=4, q_rank=d // 2, n_heads=16, kv_dim=64, rope_dim=32,
        index_heads=16, index_dim=64, index_topk=L, n_experts=16, expert_topk=2, expert_dim=2 * d,
        capacity_multiple=8, scale_embedding=not args.no_scale, tie_embeddings=args.tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_mod.DSAModel(cfg)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    print("step  loss    busiest/mean per layer       hash floor (max of the 2 windows)")
    for s in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, s / 5)
        micro = windows[2 * (s - 1) : 2 * s]
        norm = max(1, sum(int((t["labels"] >= 0).sum()) for t, _ in micro))
        total = 0.0
        for t, n in micro:
            loss = model(t, loss_norm=norm, indexer=all_keys, attention="torch", dtype=torch.float32,
                         ce_chunk=1024, n_real=n)  # fmt: skip
            aux = model.aux_loss() if args.aux > 0 else None
            (loss if aux is None else loss + args.aux * aux / len(micro)).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_biases(args.bias_rate)
        imb = [
            max(float(c[1].max()) * cfg.n_experts / float(c[1].sum()) for c in calls)
            for calls in model.moe_stats()
        ]
        floor = max(hash_floor(t["input_ids"][:n].numpy(), 16, 2, rng) for t, n in micro)
        print(
            f"{s:4d}  {total:6.3f}  {' '.join(f'{x:5.2f}' for x in imb)}   {floor:.2f}", flush=True
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
