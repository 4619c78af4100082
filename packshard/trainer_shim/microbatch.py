"""One packed row -> the arrays a CP rank trains on: labels, position ids, cu_seqlens, ks/ke.

Conventions (the data contract the trainer, the fp8 indexer and the GPU ablation rely on):

- **Labels are already shifted.** ``labels[t]`` is the target of position t: the token at
  t+1 when t+1 is in the same document and ``loss_mask[t+1]`` is true, else -100
  (`IGNORE_INDEX`). So the last token of every document, every padding position and the row's
  last position hold -100, and a document's first token is never anybody's target (the label
  "at every document start" is dropped). The loss is ``cross_entropy(logits[t], labels[t])``
  with no shift in the trainer, which is what CP needs: a rank's last position's target lives
  in the next rank's chunk and is already in ``labels``.
  For a packed row this gives exactly the per-document losses: summed over the row it equals
  the sum, over its documents, of the usual Hugging Face causal-LM loss of each document alone
  (``labels = input_ids`` where ``loss_mask`` else -100, shifted inside the model), provided
  attention is masked per document and position ids restart (below).
- **num_loss_tokens** is the number of positions of the whole row with ``labels != -100``,
  i.e. index.arrow's ``num_loss_tokens`` minus the documents whose first token had loss on
  (equal for chat data, whose documents start with a prompt). Divide a summed loss by the sum
  of it over the DP group to get the per-token mean.
- **position_ids** restart at 0 at every document start; the padding at the row's end counts
  as one more segment (0, 1, ...).
- **cu_seqlens** (int32) are the segment boundaries of the whole row in row coordinates:
  ``[0, end of doc 0, ..., num_tokens]``, plus ``padded_len`` when the row has padding (the
  padding is its own segment, so ``cu_seqlens[-1]`` is always the row's length, as varlen
  attention kernels expect).
- **ks/ke** (int32), one per query position this rank holds, in whole-row key coordinates:
  query at row position p of a document starting at s may attend keys ``ks <= key < ke`` with
  ``ks = s`` and ``ke = p + 1`` (causal, inside its document). A padding position p gets the
  empty range ``ks = ke = p``: it selects no key (the indexer returns only its sentinel).
  `PackedShardStream` also hands out ``ks_host`` / ``ke_host``: the same ranges as CPU tensors
  (pinned when ``ks`` / ``ke`` went to a GPU; without a device the same tensors as ``ks`` /
  ``ke``). `kernels.fp8_indexer_topk` plans its chunks on the host
  from them without waiting for the GPU (with ``ks`` / ``ke`` on the GPU it must copy them back
  first, which waits for all work queued before the call).

Every array is computed for the whole row, then this rank's positions are taken
(`trainer_shim.cp`). All of it is vectorised numpy: ~15 array passes per row, no Python loop
per token or document.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from packshard.trainer_shim.cp import CpLayout, cp_slices

IGNORE_INDEX = -100
TENSOR_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "ks", "ke")


def cu_seqlens_of(doc_lens: np.ndarray, padded_len: int) -> np.ndarray:
    """[0, cumulative document ends..., padded_len] as int32 (see the module docstring; no
    padding segment when the documents fill the row). One cumulative sum written straight into
    the result, ~2 µs for a row of 15 documents: with so few elements each numpy call costs more
    than its work, so the row's total comes from it too. A row holds at most seq_len < 2^31
    tokens."""
    n = int(np.size(doc_lens))
    cu = np.empty(n + 2, dtype=np.int32)
    cu[0] = 0
    np.cumsum(doc_lens, out=cu[1 : n + 1])
    num_tokens = int(cu[n])
    if num_tokens > padded_len:
        raise ValueError(f"documents hold {num_tokens} tokens, more than the row's {padded_len}")
    if num_tokens == padded_len:
        return cu[: n + 1]
    cu[n + 1] = padded_len
    return cu


def position_ids_of(cu_seqlens: np.ndarray) -> np.ndarray:
    """Position within its segment of every position of the row (int64)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    return np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)


def labels_of(input_ids: np.ndarray, loss_mask: np.ndarray, doc_lens: np.ndarray) -> np.ndarray:
    """Shifted labels of the whole row (int64; see the module docstring)."""
    n = input_ids.size
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    if n < 2:
        return labels
    valid = np.array(loss_mask[1:], dtype=np.bool_)  # target of t is token t+1
    starts = np.cumsum(np.asarray(doc_lens, dtype=np.int64))[:-1]  # starts of docs 1..D-1
    valid[starts[starts < n] - 1] = False  # never predict the next document's first token
    labels[:-1][valid] = input_ids[1:][valid]
    return labels


def key_ranges(
    cu_seqlens: np.ndarray, num_tokens: int, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(ks, ke) int32 for the queries at `positions` (row coordinates)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    seg = np.searchsorted(cu, pos, side="right") - 1
    ks = cu[seg]
    ke = pos + 1
    pad = pos >= num_tokens
    ks = np.where(pad, pos, ks)
    ke = np.where(pad, pos, ke)
    return ks.astype(np.int32), ke.astype(np.int32)


def _sum_of_squares(doc_lens: np.ndarray) -> int:
    """sum(doc_lens**2) in int64 (a 131072-token document's square passes int32)."""
    d = doc_lens.astype(np.int64)
    return int(np.dot(d, d))  # np.dot: ~1.3 us for a few documents, `d @ d` ~2.1 us


_ARANGES: dict[type, np.ndarray] = {}


def _arange(n: int, dtype: type) -> np.ndarray:
    """A read-only view of 0..n-1, from one array per dtype kept for the longest row seen."""
    a = _ARANGES.get(dtype)
    if a is None or a.size < n:
        a = np.arange(max(n, 2 * (0 if a is None else a.size)), dtype=dtype)
        a.flags.writeable = False
        _ARANGES[dtype] = a
    return a[:n]


def build_microbatch(
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    doc_lens: np.ndarray,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: CpLayout = "contiguous",
    row: int = -1,
) -> dict[str, Any]:
    """This CP rank's arrays of one row (numpy), plus the whole row's counts.

    The same values as `labels_of`, `position_ids_of` and `key_ranges` (which tests use as the
    plain reference), computed in fewer passes: ~10 array passes over the row in all. The labels
    are the int64 token ids moved one left, with -100 where a target is not trained: one
    `np.where` over a view of the ids one slot on (~6 us for 8K positions; `np.putmask` over
    the shifted ids takes 17-28 us, depending on the mask).
    """
    input_ids = np.asarray(input_ids)
    length = int(input_ids.size)
    doc_lens = np.asarray(doc_lens)
    cu = cu_seqlens_of(doc_lens, length)
    num_tokens = int(cu[doc_lens.size])
    seg_start = np.repeat(cu[:-1], np.diff(cu))  # int32: start of each position's segment
    arange = _arange(length, np.int32)
    # the int64 ids and one slot more: ids_ext[t + 1] is the target of position t
    ids_ext = np.empty(length + 1, dtype=np.int64)
    ids_ext[:length] = input_ids
    ids_ext[length] = IGNORE_INDEX
    ids64 = ids_ext[:length]
    # trained[t]: position t has a target (t+1 has loss and does not start a document)
    trained = np.zeros(length, dtype=np.bool_)
    if length:
        trained[:-1] = loss_mask[1:]
        trained[cu[1 : doc_lens.size] - 1] = False  # a zero-length document clears only [-1]
    labels = np.where(trained, ids_ext[1:], IGNORE_INDEX)
    num_loss_tokens = int(np.count_nonzero(trained))
    pos_ids = _arange(length, np.int64) - seg_start  # int64 in one pass
    ks = seg_start
    ke = arange + 1
    ks[num_tokens:] = arange[num_tokens:]  # padding: the empty range [p, p)
    ke[num_tokens:] = arange[num_tokens:]
    if cp_size > 1:
        chunks = cp_slices(length, cp_size, cp_rank, cp_layout, row=row)
        take = (
            (lambda a: a[chunks[0]])
            if len(chunks) == 1
            else (lambda a: np.concatenate([a[c] for c in chunks]))
        )
        ids, labels, pos_ids, ks, ke = (
            take(ids64),
            take(labels),
            take(pos_ids),
            take(ks),
            take(ke),
        )
    else:
        ids = ids64
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos_ids,
        "cu_seqlens": cu,
        "ks": np.ascontiguousarray(ks),
        "ke": np.ascontiguousarray(ke),
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss_tokens,
        "padded_len": length,
        "attn_cost": _sum_of_squares(doc_lens),
        "row": row,
    }


def filler_microbatch(
    length: int,
    pad_token_id: int,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: CpLayout = "contiguous",
) -> dict[str, Any]:
    """A row of `length` padding tokens with no loss and no true tokens (row -1)."""
    ids = np.full(length, pad_token_id, dtype=np.int32)
    return build_microbatch(
        ids,
        np.zeros(length, np.bool_),
        np.zeros(0, np.int64),
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout,
    )
