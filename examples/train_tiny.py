"""Train a tiny causal LM on a packshard dataset with DP x CP on CPU: the shim in a plain loop.

    torchrun --nproc-per-node 4 examples/train_tiny.py --data OUT --cp 2 --steps 20
    # a dataset to try it on:  python -m packshard.trainer_shim.synthetic /tmp/tiny --seq-len 512 --pad-multiple 4

4 processes = dp 2 x cp 2 (gloo). Each rank gets its CP chunk of its DP rank's row from
`PackedShardStream`; attention all-gathers K/V across the CP group and masks them with the
shim's ks/ke (query t sees keys ks[t] <= s < ke[t]: its own document, causally), so the loss
of a packed, CP-split row is exactly the per-document loss. The labels are already shifted
(labels[t] is the target of position t), so the loss is plain cross-entropy with no shift.

Gradients: each rank backpropagates its summed token loss; the step all-reduces the gradients
and the loss-token count over the world and divides, which gives the mean over every loss
token of the step (CP ranks hold disjoint positions, so nothing is counted twice).

`--check-loss` recomputes step 0's loss on one process, document by document (each document
alone, Hugging Face style labels shifted inside), and fails unless it matches the distributed,
packed, CP-split loss to 1e-5.
The shim's part is marked `# shim`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from packshard.trainer_shim import (
    PackedShardStream,
    Position,
    Topology,
    TrainedTokenMeter,
    cp_positions,
)
from packshard.trainer_shim.meter import FlopsModel
from packshard.trainer_shim.topology import new_process_groups

log = logging.getLogger("train_tiny")


class _GatherCP(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward sums the gradients (all-reduce, which
    gloo has) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


class CPContext:
    """How to turn this rank's K/V chunk into the whole row's K/V (None: no CP)."""

    def __init__(self, group: object, rank: int, size: int, layout: str) -> None:
        self.group, self.rank, self.size, self.layout = group, rank, size, layout

    def gather(self, x: torch.Tensor, row_len: int) -> torch.Tensor:
        gathered = _GatherCP.apply(x, self.group, self.rank, self.size)
        order = torch.cat(
            [
                torch.from_numpy(cp_positions(row_len, self.size, r, self.layout))
                for r in range(self.size)
            ]
        )
        return gathered[torch.argsort(order)]  # row order


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(
        self,
        x: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        row_len: int,
        cp: CPContext | None,
    ) -> torch.Tensor:
        s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        if cp is not None:
            k, v = cp.gather(k, row_len), cp.gather(v, row_len)
        keys = torch.arange(k.shape[0])
        allowed = (keys[None, :] >= ks[:, None]) & (keys[None, :] < ke[:, None])
        empty = ~allowed.any(dim=1)  # padding queries (ks == ke): attend to key 0, output unused
        allowed[empty, 0] = True
        hd = d // self.heads
        q, k, v = (t.view(t.shape[0], self.heads, hd).transpose(0, 1) for t in (q, k, v))
        att = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        att = att.masked_fill(~allowed[None], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(0, 1).reshape(s, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_pos: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_pos, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        row_len: int,
        cp: CPContext | None = None,
    ) -> torch.Tensor:
        x = self.tok(ids % self.vocab) + self.pos(pos)
        for b in self.blocks:
            x = b(x, ks, ke, row_len, cp)
        return self.head(x)


def reference_step_loss(
    model: TinyLM, stream: PackedShardStream, step_rows: list[int]
) -> tuple[float, int]:
    """Sum of per-document losses of these rows, each document alone, HF-style shift."""
    total, count = 0.0, 0
    with torch.no_grad():
        for r in step_rows:
            row = stream.dataset.read_row(r)
            start = 0
            for n in row["doc_lens"].tolist():
                ids = torch.from_numpy(row["input_ids"][start : start + n].astype("int64"))
                mask = torch.from_numpy(row["loss_mask"][start : start + n].astype(bool))
                labels = torch.where(mask, ids % model.vocab, torch.full_like(ids, -100))
                logits = model(
                    ids,
                    torch.arange(n),
                    torch.zeros(n, dtype=torch.long),
                    torch.arange(1, n + 1),
                    n,
                )
                total += F.cross_entropy(
                    logits[:-1], labels[1:], ignore_index=-100, reduction="sum"
                ).item()
                count += int((labels[1:] != -100).sum())
                start += n
    return total, count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset URL (local path, s3://, ...)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (world = dp x cp)")
    p.add_argument("--cp-layout", default="contiguous", choices=["contiguous", "zigzag"])
    p.add_argument("--rows-per-step", type=int, default=4)
    p.add_argument(
        "--steps", type=int, default=10, help="stop after this many steps (the epoch may end first)"
    )
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument(
        "--vocab-size", type=int, default=4096, help="token ids are folded modulo this (tiny model)"
    )
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--check-loss",
        action="store_true",
        help="compare step 0's loss with a per-document reference",
    )
    p.add_argument(
        "--report",
        metavar="PREFIX",
        help="write PREFIX.rankN.json: the rows this rank trained on, and (rank 0) the meter's totals",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    topo = Topology.from_env(cp_size=args.cp)
    _, cp_group = new_process_groups(topo)
    cp = (
        CPContext(cp_group, topo.cp_rank, topo.cp_size, args.cp_layout)
        if topo.cp_size > 1
        else None
    )

    # shim: one stream per rank, ranks from the environment; a meter for trained tokens/s
    stream = PackedShardStream.from_env(
        args.data,
        cp_size=args.cp,
        rows_per_step=args.rows_per_step,
        cp_layout=args.cp_layout,
        epochs=args.epochs,
    )
    seq_len = int(stream.dataset.config["seq_len"])
    model = TinyLM(args.vocab_size, args.dim, heads=4, layers=args.layers, max_pos=seq_len)
    for prm in model.parameters():  # same initial weights everywhere
        dist.broadcast(prm.data, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = (
        sum(prm.numel() for prm in model.parameters())
        - model.tok.weight.numel()
        - model.pos.weight.numel()
    )
    meter = TrainedTokenMeter(
        dp_rank=topo.dp_rank, flops_model=FlopsModel(n_params, args.layers, args.dim)
    )  # shim

    loss_sum, n_loss = torch.zeros(()), torch.zeros(())
    rows_seen: list[int] = []
    for mb in stream:  # shim: this rank's micro-batches, in step order
        rows_seen.append(int(mb["row"]))
        labels = torch.where(mb["labels"] >= 0, mb["labels"] % args.vocab_size, -100)
        logits = model(
            mb["input_ids"], mb["position_ids"], mb["ks"], mb["ke"], mb["padded_len"], cp
        )
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        loss.backward()
        loss_sum += loss.detach()
        n_loss += (labels != -100).sum()
        meter.update(mb)  # shim
        if mb["micro_step"] < mb["num_micro_steps"] - 1:
            continue
        totals = torch.stack([loss_sum, n_loss])
        dist.all_reduce(totals)
        for prm in model.parameters():
            if prm.grad is not None:
                dist.all_reduce(prm.grad)
                prm.grad /= totals[1].clamp(min=1)
        step_loss = float(totals[0] / totals[1].clamp(min=1))
        if args.check_loss and mb["step"] == 0:
            rows = (
                stream.planner.plan(Position(0, 0, 0)).rows.ravel().tolist()
            )  # the step's rows, all ranks
            ref, ref_n = reference_step_loss(model, stream, [r for r in rows if r >= 0])
            ok = ref_n == int(totals[1]) and abs(ref / max(ref_n, 1) - step_loss) < 1e-5
            if topo.rank == 0:
                log.info("check-loss: packed+CP %.6f over %d tokens, per-document %.6f over %d: %s",
                         step_loss, int(totals[1]), ref / max(ref_n, 1), ref_n, "OK" if ok else "MISMATCH")  # fmt: skip
            if not ok:
                return 1
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum.zero_()
        n_loss.zero_()
        stats = meter.step(mb["step"])  # shim: collective over the world, each row counted once
        if topo.rank == 0:
            log.info("loss %.4f | %s", step_loss, stats.format())
        if mb["step"] + 1 >= args.steps:
            break
    if topo.rank == 0:
        log.info(
            "done: %d steps, %d trained tokens, %.0f tokens/s",
            len(meter.history),
            meter.total_tokens,
            meter.mean_tokens_per_s,
        )
    if args.report:
        report = {
            "rank": topo.rank,
            "dp_rank": topo.dp_rank,
            "cp_rank": topo.cp_rank,
            "rows": rows_seen,
        }
        if topo.rank == 0:
            report.update(steps=len(meter.history), trained_tokens=meter.total_tokens)
        with open(f"{args.report}.rank{topo.rank}.json", "w") as f:
            json.dump(report, f)
    stream.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
