"""The four arms' micro-batches, read through the trainer shim, with the same rows in the same order.

Arms 3 and 4 train on the `pad8` dataset exactly as `trainer_shim.PackedShardStream` yields it
(labels shifted, position ids restarting per document, the indexer's [ks, ke) per query,
padding queries with empty ranges). Arms 1 and 2 read the `padseq` dataset (same plan, rows
padded to seq_len with token 0) through the same shim, then treat the padding the way
pad-to-seq_len trainers do: it is one more sequence in `cu_seqlens`, so its tokens run through
every layer, attend to each other causally and select keys among themselves (ks/ke of a
document), and carry no loss. Arm 2 replaces the pad tokens by the row's own tokens, repeated
(loss-masked), so they spread over the experts like real text instead of crowding.

Nothing real ever sees the padding (it sits after the last document, and ranges are per
document), so the four arms compute the same loss on the same model, up to floating point.
`check_same_rows` verifies the rows match, token for token, before anything is timed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.e2e_ablation.config import Arm, RunConfig

log = logging.getLogger(__name__)

META_KEYS = ("num_tokens", "num_loss_tokens", "padded_len", "attn_cost", "row")
MODEL_KEYS = ("input_ids", "labels", "position_ids", "ks", "ke")


@dataclass
class MicroBatch:
    """What the model consumes (`tensors`) and what the meter counts (`meta`)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, int]

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            {k: v.to(device, non_blocking=True) for k, v in self.tensors.items()}, dict(self.meta)
        )


def read_stream(url: str, run: RunConfig) -> list[MicroBatch]:
    """The first `run.rows_needed` micro-batches of the dataset at `url`, via the shim."""
    from packshard.trainer_shim import PackedShardStream

    need = run.rows_needed
    out: list[MicroBatch] = []
    stream = PackedShardStream(
        url,
        dp_rank=0,
        dp_size=1,
        rows_per_step=run.rows_per_step,
        seed=run.seed,
        epochs=1,
        shuffle=True,
        seq_len=run.seq_len,
    )
    try:
        for mb in stream:
            tensors = {k: mb[k] for k in MODEL_KEYS}
            tensors["cu_seqlens"] = mb["cu_seqlens"]
            out.append(MicroBatch(tensors, {k: int(mb[k]) for k in META_KEYS}))
            if len(out) == need:
                break
    finally:
        stream.close()
    if len(out) < need:
        raise ValueError(
            f"{url}: the stream gave {len(out)} rows but the run needs {need} ({run.steps} steps x {run.rows_per_step} rows); "
            f"prepare the data again with --rows {need} or more"
        )
    return out


def document_ranges(cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ks/ke for every position when every cu_seqlens segment (padding included) is a document."""
    cu = cu_seqlens.long()
    starts = torch.repeat_interleave(cu[:-1], torch.diff(cu))
    ke = torch.arange(1, length + 1, dtype=torch.int64)
    return starts.to(torch.int32), ke.to(torch.int32)


def pad_as_document(mb: MicroBatch, *, own_tokens: bool) -> MicroBatch:
    """Arm 1 (own_tokens=False) or arm 2 (True) from a padseq micro-batch."""
    t = dict(mb.tensors)
    n, length = mb.meta["num_tokens"], mb.meta["padded_len"]
    t["ks"], t["ke"] = document_ranges(t["cu_seqlens"], length)
    if own_tokens and length > n:
        ids = t["input_ids"].clone()
        reps = -(-(length - n) // n)
        ids[n:] = ids[:n].repeat(reps)[: length - n]
        t["input_ids"] = ids
    return MicroBatch(t, dict(mb.meta))


def check_same_rows(a: list[MicroBatch], b: list[MicroBatch], names: tuple[str, str]) -> None:
    """Raise ValueError unless both lists hold the same rows, token for token, in the same order."""
    if len(a) != len(b):
        raise ValueError(f"{names[0]} has {len(a)} micro-batches, {names[1]} has {len(b)}")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        n = x.meta["num_tokens"]
        same = (
            x.meta["row"] == y.meta["row"]
            and n == y.meta["num_tokens"]
            and x.meta["num_loss_tokens"] == y.meta["num_loss_tokens"]
        )
        same = same and all(
            torch.equal(x.tensors[k][:n], y.tensors[k][:n])
            for k in ("input_ids", "labels", "position_ids", "ks", "ke")
        )
        if not same:
            raise ValueError(
                f"micro-batch {i}: {names[0]} row {x.meta['row']} ({n} tokens) differs from {names[1]} row "
                f"{y.meta['row']} ({y.meta['num_tokens']} tokens); were both datasets packed from the same records and plan?"
            )


def align_by_row(reference: list[MicroBatch], other: list[MicroBatch]) -> list[MicroBatch]:
    """`other` reordered to `reference`'s row order (the two datasets number rows alike)."""
    by_row = {mb.meta["row"]: mb for mb in other}
    missing = [mb.meta["row"] for mb in reference if mb.meta["row"] not in by_row]
    if missing:
        raise ValueError(
            f"rows {missing[:5]} of the pad8 stream are missing from the padseq stream's first {len(other)}"
        )
    return [by_row[mb.meta["row"]] for mb in reference]


def build_arms(
    pad8_url: str, padseq_url: str, run: RunConfig, arms: tuple[Arm, ...]
) -> dict[int, list[MicroBatch]]:
    """{arm number: micro-batches in step order} for the requested arms."""
    pad8 = read_stream(pad8_url, run)
    out: dict[int, list[MicroBatch]] = {}
    if any(a.pad_to_seq_len for a in arms):
        padseq = read_stream(padseq_url, run)
        if [m.meta["row"] for m in padseq] != [m.meta["row"] for m in pad8]:
            log.warning(
                "the padseq stream orders rows differently from pad8; aligning by row index"
            )
            padseq = align_by_row(pad8, padseq)
        arm1 = [pad_as_document(m, own_tokens=False) for m in padseq]
        check_same_rows(pad8, arm1, ("pad8", "padseq"))
        for a in arms:
            if a.pad_to_seq_len:
                out[a.number] = (
                    arm1
                    if not a.own_token_padding
                    else [pad_as_document(m, own_tokens=True) for m in padseq]
                )
    for a in arms:
        if not a.pad_to_seq_len:
            out[a.number] = pad8
    for batches in out.values():
        add_pair_counts(batches, run.model.index_topk)
    return out


def add_pair_counts(batches: list[MicroBatch], topk: int) -> None:
    """Store each micro-batch's indexer (ranked) and attention (selected) pair counts in its meta."""
    from benchmarks.e2e_ablation.flops import pair_counts

    for mb in batches:
        if "ranked_pairs" not in mb.meta:
            mb.meta["ranked_pairs"], mb.meta["selected_pairs"] = pair_counts(
                mb.tensors["ks"], mb.tensors["ke"], topk
            )


def arm_summary(batches: list[MicroBatch]) -> dict[str, Any]:
    tokens = sum(m.meta["num_tokens"] for m in batches)
    padded = sum(m.meta["padded_len"] for m in batches)
    return {
        "rows": len(batches),
        "num_tokens": tokens,
        "padded_tokens": padded,
        "padding_fraction": (padded - tokens) / padded if padded else 0.0,
    }
