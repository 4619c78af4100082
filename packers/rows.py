"""Building packed rows from tokenized pieces, fully vectorised (numpy gathers, no Python loop
per token or per sample).

`build_rows` takes the flat tokens of a window of samples (one concatenated int32 array plus
offsets), the bins from `plan_bins`, and writes each row's documents back to back followed by
padding up to the next multiple of `pad_multiple`. `pack_table` runs the whole path from an
Arrow table of tokenized samples (overlong policy, plan, build) and is what the in-process
demo and the packing benchmark use; the Ray job calls the same pieces per window.

The resulting `pa.RecordBatch` has the shard schema (packers.format.SHARD_SCHEMA).
`row_index_stats` derives the per-row index columns (index.arrow) from such a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import xxhash

from packers.bins import Algorithm, plan_bins
from packers.format import SHARD_SCHEMA
from packers.overlong import OverlongPolicy, OverlongResult, apply_overlong, padded_lengths


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32, copy=False)), pa.array(values, type=value_type)
    )


def build_rows(
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    piece_start: np.ndarray,
    piece_len: np.ndarray,
    piece_sample_id: np.ndarray,
    bins: list[np.ndarray],
    *,
    pad_multiple: int,
    pad_token_id: int,
) -> pa.RecordBatch:
    """Materialise packed rows.

    Piece j is ``tokens[piece_start[j] : piece_start[j] + piece_len[j]]`` (with its loss mask)
    and belongs to source sample `piece_sample_id[j]`; `bins` lists piece indices per row.
    """
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    tokens = np.asarray(tokens, dtype=np.int32)
    loss_mask = np.asarray(loss_mask, dtype=np.bool_)
    if tokens.shape != loss_mask.shape:
        raise ValueError(f"tokens {tokens.shape} and loss_mask {loss_mask.shape} differ in shape")
    piece_start = np.asarray(piece_start, dtype=np.int64)
    piece_len = np.asarray(piece_len, dtype=np.int64)
    if not bins:
        return pa.RecordBatch.from_pylist([], schema=SHARD_SCHEMA)
    row_sizes = np.fromiter((b.size for b in bins), dtype=np.int64, count=len(bins))
    order = np.concatenate(bins)
    doc_len = piece_len[order]
    doc_row = np.repeat(np.arange(len(bins), dtype=np.int64), row_sizes)

    row_true = np.bincount(doc_row, weights=doc_len, minlength=len(bins)).astype(np.int64)
    row_padded = padded_lengths(row_true, pad_multiple)
    row_out_start = np.concatenate(([0], np.cumsum(row_padded)))
    doc_cum = np.concatenate(([0], np.cumsum(doc_len)))
    row_doc_first = np.concatenate(([0], np.cumsum(row_sizes)))[:-1]
    doc_in_row = doc_cum[:-1] - np.repeat(doc_cum[row_doc_first], row_sizes)
    dest_start = row_out_start[:-1][doc_row] + doc_in_row

    total_true = int(doc_cum[-1])
    within = np.arange(total_true, dtype=np.int64) - np.repeat(doc_cum[:-1], doc_len)
    src = np.repeat(piece_start[order], doc_len) + within
    dest = np.repeat(dest_start, doc_len) + within

    out_ids = np.full(int(row_out_start[-1]), pad_token_id, dtype=np.int32)
    out_mask = np.zeros(int(row_out_start[-1]), dtype=np.bool_)
    out_ids[dest] = tokens[src]
    out_mask[dest] = loss_mask[src]
    num_loss = (
        np.add.reduceat(out_mask, row_out_start[:-1]).astype(np.int32)
        if out_mask.size
        else np.zeros(0, np.int32)
    )

    doc_offsets = np.concatenate(([0], np.cumsum(row_sizes)))
    return pa.RecordBatch.from_arrays(
        [
            _list_array(row_out_start, out_ids, pa.int32()),
            _list_array(row_out_start, out_mask, pa.bool_()),
            _list_array(doc_offsets, doc_len.astype(np.int32), pa.int32()),
            _list_array(
                doc_offsets, np.asarray(piece_sample_id, dtype=np.int64)[order], pa.int64()
            ),
            pa.array(row_true.astype(np.int32)),
            pa.array(num_loss),
        ],
        schema=SHARD_SCHEMA,
    )


@dataclass(frozen=True)
class PackReport:
    """What `pack_table` did: the overlong policy's effect and the fill."""

    overlong: OverlongResult
    rows: int
    num_tokens: int
    padded_tokens: int


def pack_table(
    table: pa.Table,
    *,
    seq_len: int,
    pad_multiple: int,
    pad_token_id: int,
    algorithm: Algorithm = "bfd",
    overlong: OverlongPolicy = "truncate",
    sample_id_offset: int = 0,
) -> tuple[pa.RecordBatch, PackReport]:
    """Pack a table of tokenized samples (`input_ids`, optional `loss_mask`) into rows.

    Sample ids are ``sample_id_offset + row number in the table``. Without a `loss_mask`
    column every token is a loss token.
    """
    if seq_len % pad_multiple:
        raise ValueError(f"seq_len={seq_len} is not a multiple of pad_multiple={pad_multiple}")
    ids_col = table.column("input_ids").combine_chunks()
    if isinstance(ids_col, pa.ChunkedArray):  # empty table
        ids_col = pa.array([], type=pa.list_(pa.int32()))
    offsets = ids_col.offsets.to_numpy().astype(np.int64)
    tokens = ids_col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    if "loss_mask" in table.column_names:
        mask_col = table.column("loss_mask").combine_chunks()
        mask = mask_col.values.to_numpy(zero_copy_only=False).astype(np.bool_)
    else:
        mask = np.ones(tokens.size, dtype=np.bool_)
    lengths = np.diff(offsets)
    result = apply_overlong(lengths, seq_len, overlong)
    bins = plan_bins(result.length, seq_len, algorithm)
    batch = build_rows(
        tokens,
        mask,
        offsets[:-1][result.sample] + result.start,
        result.length,
        result.sample + sample_id_offset,
        bins,
        pad_multiple=pad_multiple,
        pad_token_id=pad_token_id,
    )
    num_tokens = int(result.length.sum())
    padded = int(batch.column("input_ids").offsets[-1].as_py()) if batch.num_rows else 0
    return batch, PackReport(
        overlong=result, rows=batch.num_rows, num_tokens=num_tokens, padded_tokens=padded
    )


def list_parts(arr: pa.ListArray, dtype: type | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list array as numpy; offsets index into values (slices respected)."""
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    if dtype is not None:
        values = values.astype(dtype, copy=False)
    return offsets, values


def row_index_stats(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """Per-row index columns of a shard-schema batch: num_tokens, padded_len, num_loss_tokens,
    num_docs, attn_cost, row_checksum."""
    ids_off, ids = list_parts(batch.column("input_ids"), np.int32)
    mask_off, mask = list_parts(batch.column("loss_mask"), np.uint8)
    doc_off, doc_lens = list_parts(batch.column("doc_lens"), np.int32)
    sid_off, sample_ids = list_parts(batch.column("sample_ids"), np.int64)
    dl = doc_lens.astype(np.int64)
    sq = np.concatenate(([0], np.cumsum(dl * dl)))
    checksums = np.empty(batch.num_rows, dtype=np.uint64)
    for i in range(batch.num_rows):
        h = xxhash.xxh3_64()
        h.update(ids[ids_off[i] : ids_off[i + 1]].tobytes())
        h.update(mask[mask_off[i] : mask_off[i + 1]].tobytes())
        h.update(doc_lens[doc_off[i] : doc_off[i + 1]].tobytes())
        h.update(sample_ids[sid_off[i] : sid_off[i + 1]].tobytes())
        checksums[i] = h.intdigest()
    return {
        "num_tokens": batch.column("num_tokens").to_numpy().astype(np.int32),
        "padded_len": np.diff(ids_off).astype(np.int32),
        "num_loss_tokens": batch.column("num_loss_tokens").to_numpy().astype(np.int32),
        "num_docs": np.diff(doc_off).astype(np.int32),
        "attn_cost": (sq[doc_off[1:]] - sq[doc_off[:-1]]).astype(np.int64),
        "row_checksum": checksums,
    }


def row_checksum(
    input_ids: np.ndarray, loss_mask: np.ndarray, doc_lens: np.ndarray, sample_ids: np.ndarray
) -> int:
    """The index's row_checksum of one row given as numpy arrays."""
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    h.update(np.ascontiguousarray(doc_lens, dtype=np.int32).tobytes())
    h.update(np.ascontiguousarray(sample_ids, dtype=np.int64).tobytes())
    return h.intdigest()
