"""Per-row invariants of shard format v1, checked vectorised over a record batch.

`row_problems(batch, ...)` returns one message per broken rule and row (empty when the batch is
sound). The rules (docs/FORMAT.md): padded_len is a multiple of pad_multiple and at most
seq_len; padding is shorter than pad_multiple and sits only at the end, holding the pad token
with loss off; doc_lens are positive and sum to num_tokens; one sample id per document;
loss_mask has input_ids' length and num_loss_tokens counts it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from packshard.packers.arrays import column_numpy
from packshard.packers.rows import list_parts

MAX_MESSAGES = 20


def row_problems(
    batch: pa.RecordBatch, *, seq_len: int, pad_multiple: int, pad_token_id: int, first_row: int = 0
) -> list[str]:
    """Messages naming each broken invariant (row numbers start at `first_row`)."""
    ids_off, ids = list_parts(batch.column("input_ids"))
    mask_off, mask = list_parts(batch.column("loss_mask"), np.bool_)
    doc_off, doc_lens = list_parts(batch.column("doc_lens"), np.int64)
    sid_off, _ = list_parts(batch.column("sample_ids"))
    num_tokens = column_numpy(batch.column("num_tokens")).astype(np.int64)
    num_loss = column_numpy(batch.column("num_loss_tokens")).astype(np.int64)
    padded = np.diff(ids_off)
    n = batch.num_rows
    problems: list[str] = []

    def flag(bad: np.ndarray, what: str | Callable[[int], str]) -> None:
        for i in np.flatnonzero(bad)[: MAX_MESSAGES - len(problems)]:
            problems.append(f"row {first_row + int(i)}: {what(int(i)) if callable(what) else what}")

    flag(
        padded % pad_multiple != 0,
        lambda i: f"padded length {padded[i]} is not a multiple of {pad_multiple}",
    )
    flag(padded > seq_len, lambda i: f"padded length {padded[i]} exceeds seq_len {seq_len}")
    flag(num_tokens < 1, lambda i: f"num_tokens {num_tokens[i]} < 1 (empty row)")
    flag(
        (padded - num_tokens >= pad_multiple) | (padded < num_tokens),
        lambda i: f"padding {padded[i] - num_tokens[i]} is not in [0, {pad_multiple})",
    )
    flag(
        np.diff(mask_off) != padded,
        lambda i: (
            f"loss_mask length {mask_off[i + 1] - mask_off[i]} != input_ids length {padded[i]}"
        ),
    )
    flag(np.diff(sid_off) != np.diff(doc_off), "sample_ids and doc_lens differ in length")
    # prefix sums, not reduceat: reduceat runs the last segment to the end of the values buffer,
    # which is wrong for a zero-copy slice of a larger batch
    doc_cum = np.concatenate(([0], np.cumsum(doc_lens)))
    doc_sum = doc_cum[doc_off[1:]] - doc_cum[doc_off[:-1]]
    flag(
        doc_sum != num_tokens,
        lambda i: f"doc_lens sum to {doc_sum[i]}, num_tokens is {num_tokens[i]}",
    )
    if doc_lens.size and (doc_lens[doc_off[0] : doc_off[-1]] < 1).any():
        row_of_doc = np.repeat(np.arange(n), np.diff(doc_off))
        flag(
            np.isin(np.arange(n), row_of_doc[doc_lens[doc_off[0] : doc_off[-1]] < 1]),
            "a document has length < 1",
        )
    if problems:
        return problems  # the checks below assume consistent lengths

    # Only the padding is visited: the last padded - num_tokens (< pad_multiple) positions of
    # each row; loss counts come from one prefix sum. (Per-token row and position arrays, three
    # np.repeat passes over every token, took 0.12-0.27 s of an 11M-token shard's write; this
    # takes 0.04 s.)
    rel = ids_off - ids_off[0]
    tok = ids[ids_off[0] : ids_off[-1]]
    m = mask[mask_off[0] : mask_off[-1]]
    pad_len = padded - num_tokens
    pad_rows = np.repeat(np.arange(n), pad_len)
    first = np.cumsum(pad_len) - pad_len  # each row's first entry in pad_rows
    pad_at = np.repeat(rel[:-1] + num_tokens - first, pad_len) + np.arange(pad_rows.size)
    bad_pad = np.zeros(n, bool)
    bad_pad[pad_rows[tok[pad_at] != pad_token_id]] = True
    flag(bad_pad, f"padding holds a token other than pad_token_id {pad_token_id}")
    bad_mask = np.zeros(n, bool)
    bad_mask[pad_rows[m[pad_at]]] = True
    flag(bad_mask, "loss_mask is true on padding")
    csum = np.zeros(int(rel[-1]) + 1, dtype=np.int64)
    np.cumsum(m, out=csum[1:])
    loss_count = csum[rel[1:]] - csum[rel[:-1]]
    flag(
        loss_count != num_loss,
        lambda i: f"num_loss_tokens {num_loss[i]} but loss_mask counts {loss_count[i]}",
    )
    return problems
