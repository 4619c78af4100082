"""Several packed rows -> one flat training sequence, in the forms trainers feed models.

A trainer that takes a batch of B packed rows (a Hugging Face ``data_collator``, a torchtitan
dataloader) gets them here as ONE sequence of shape [1, sum of the rows' lengths], the
padding-free layout Hugging Face models and TRL's ``padding_free`` train on: documents are told
apart by ``position_ids`` restarting at 0 (each row's padding is one more segment), never by an
attention mask, so nothing is padded to a common length.

Labels come in both conventions, from the rows' already-shifted labels S (`microbatch.py`:
``S[t]`` is the target of position t):

- ``labels`` (unshifted, what a causal LM's own loss takes and shifts itself): ``U[0] = -100``,
  ``U[t] = S[t-1]``. The model's shift gives back exactly S. At a row boundary ``U[start] =
  S[end of the previous row] = -100`` because a row's last position never has a target, so no
  row predicts the next one's first token; inside a row no document predicts the next
  document's first token (S already holds -100 there).
- ``shift_labels`` (= S): for losses that take pre-shifted labels (Hugging Face's
  ``ForCausalLMLoss(shift_labels=...)``, TRL's fused LM head, context parallelism, where a
  rank's last target lives in the next rank's chunk), and for torchtitan, whose loss never shifts.

``cu_seqlens`` are the segment boundaries of the flat sequence (int32, as flash-attention's
varlen kernels take them) and ``max_seqlen`` the longest segment. Cost: one `torch.cat` per
field, ~20 µs for 8 rows of 8K tokens; no Python loop over tokens or documents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from packshard._extras import require
from packshard.trainer_shim.microbatch import IGNORE_INDEX

require("train", "torch", "packshard.trainer_shim.flatten")  # before torch is imported
import torch  # noqa: E402

ROW_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens")


def _field(rows: Sequence[Mapping[str, Any]], key: str) -> list[torch.Tensor]:
    out = []
    for i, r in enumerate(rows):
        try:
            v = r[key]
        except KeyError:
            raise KeyError(
                f"row {i} of the batch has no {key!r} (it has {sorted(r)}): pass the items of a "
                "PackedShardDataset / PackedShardStream whole; a collator that drops unused columns "
                "(Trainer's remove_unused_columns) must not see them"
            ) from None
        out.append(torch.as_tensor(v))
    return out


def flatten_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The rows back to back: ``input_ids``, ``position_ids``, ``labels`` (unshifted),
    ``shift_labels`` (shifted) as int64 [1, N]; ``cu_seqlens`` int32 [segments + 1];
    ``max_seqlen`` int; ``num_rows``. Each row needs ``input_ids``, ``labels`` (shifted),
    ``position_ids`` and ``cu_seqlens`` as `PackedShardStream` hands them out (cp_size 1)."""
    if isinstance(rows, Mapping):
        raise TypeError(
            "packed rows are collated as a list of items (a DataLoader batch); got one item: use "
            "a batch_size of 1 or more, not batch_size=None"
        )
    if not rows:
        raise ValueError("cannot collate an empty batch of packed rows")
    ids = _field(rows, "input_ids")
    shifted = _field(rows, "labels")
    positions = _field(rows, "position_ids")
    cus = _field(rows, "cu_seqlens")
    for i, (a, s, p, c) in enumerate(zip(ids, shifted, positions, cus, strict=True)):
        n = a.numel()
        if a.dim() != 1 or c.dim() != 1 or s.shape != a.shape or p.shape != a.shape:
            raise ValueError(
                f"row {i}: input_ids {tuple(a.shape)}, labels {tuple(s.shape)}, position_ids "
                f"{tuple(p.shape)}, cu_seqlens {tuple(c.shape)}: a packed row's fields are 1-D, "
                "of one length (pass the items of a PackedShardDataset / PackedShardStream whole)"
            )
        if int(c[-1]) != n:
            raise ValueError(
                f"row {i}: cu_seqlens ends at {int(c[-1])}, input_ids has {n} tokens: not one whole "
                "row (a CP chunk cannot be flattened: stream it with cp_size=1)"
            )
    flat_ids = torch.cat(ids).to(torch.int64)
    shift = torch.cat(shifted).to(torch.int64)
    labels = torch.full_like(shift, IGNORE_INDEX)
    labels[1:] = shift[:-1]
    offsets = torch.tensor([0] + [a.numel() for a in ids[:-1]], dtype=torch.int64).cumsum(0)
    cu = torch.cat(
        [torch.zeros(1, dtype=torch.int64)]
        + [c[1:].to(torch.int64) + o for c, o in zip(cus, offsets.tolist(), strict=True)]
    )
    return {
        "input_ids": flat_ids[None],
        "position_ids": torch.cat(positions).to(torch.int64)[None],
        "labels": labels[None],
        "shift_labels": shift[None],
        "cu_seqlens": cu.to(torch.int32),
        "max_seqlen": int((cu[1:] - cu[:-1]).max()),
        "num_rows": len(rows),
    }
