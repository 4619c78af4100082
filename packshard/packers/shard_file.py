"""One shard file read by rows: memory-mapped through pyarrow when local, by byte ranges when
remote; either way checked against the manifest before a row comes out.

`LocalShard` (memory-mapped) and `RemoteShard` (any fsspec filesystem) give a record batch's
list columns as numpy (`BatchArrays`: offsets and values, the loss mask as its bits), and
`BatchArrays.row(i)` one row's (input_ids, loss_mask, doc_lens, sample_ids) as views, the mask
unpacked (~2 µs a row at 8K tokens).

Checks, each a `FormatError` naming the file: the schema is v1's; the record batches are as many
as the manifest's `rows` and `rows_per_batch` need (all but the last exactly `rows_per_batch`
rows; without `rows_per_batch` their lengths must sum to `rows`); a batch's offsets rise from 0
inside its values and input_ids and loss_mask have the same row lengths. Row contents are
checked against index.arrow's row checksums by the caller (`ShardDataset`).

A `RemoteShard` reads a row's tokens and little else: per record batch, once, the message
metadata and the small buffers (offsets, the loss-mask bits, doc_lens, sample_ids: ~3% of the
batch at 8K tokens a row), then per row one range request of its input_ids. `fetch` takes a
window of rows at once and merges ranges less than `MAX_GAP` apart (a request costs about what
1 MiB costs to transfer from object storage; Arrow's S3 reader merges on the same principle),
so sparse rows cost a request each and rows dense in a batch one request; a batch whose wanted
rows hold `DENSE` of its bytes is read whole in one request (one round trip instead of two).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from packshard.packers import ipc
from packshard.packers.arrays import numpy_dtype
from packshard.packers.format import (
    SHARD_SCHEMA,
    FormatError,
    describe_error,
    range_error,
    reading,
)
from packshard.packers.manifest import ShardEntry

LIST_COLUMNS = ("input_ids", "loss_mask", "doc_lens", "sample_ids")
MAX_GAP = 1 << 20  # merge range requests closer than this
MAX_RANGE = 32 << 20  # but do not grow one past this
DENSE = 0.25  # a batch whose wanted rows hold this share of its bytes is read whole
TAIL_READ = 64 << 10  # first guess at footer + tail bytes
# one row: input_ids (int32), loss_mask (bool), doc_lens (int32), sample_ids (int64)
Row = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass
class BatchArrays:
    """A record batch's list columns as numpy; `ids` is None for a remote batch (its rows'
    tokens are fetched by range)."""

    length: int
    ids_off: np.ndarray
    ids: np.ndarray | None
    mask_off: np.ndarray
    mask_bits: np.ndarray
    mask_bit0: int
    doc_off: np.ndarray
    docs: np.ndarray
    sid_off: np.ndarray
    sids: np.ndarray
    ids_at: int = -1  # a remote batch: where its input_ids values start in the file

    def check(self, where: str) -> None:
        for name, off, n in (
            ("input_ids", self.ids_off, None if self.ids is None else self.ids.size),
            ("loss_mask", self.mask_off, self.mask_bits.size * 8 - self.mask_bit0),
            ("doc_lens", self.doc_off, self.docs.size),
            ("sample_ids", self.sid_off, self.sids.size),
        ):
            if off.size != self.length + 1 or off[0] < 0 or (np.diff(off) < 0).any():
                raise FormatError(f"{where}: {name} offsets are not ascending from 0")
            if n is not None and off[-1] > n:
                raise FormatError(f"{where}: {name} offsets pass the end of its values")
        if not np.array_equal(np.diff(self.ids_off), np.diff(self.mask_off)):
            raise FormatError(f"{where}: loss_mask and input_ids rows differ in length")

    def row_ids(self, i: int) -> np.ndarray:
        assert self.ids is not None
        return self.ids[self.ids_off[i] : self.ids_off[i + 1]]

    def without_ids(self) -> BatchArrays:
        """The same batch without its input_ids values (what a remote reader keeps)."""
        return dataclasses.replace(self, ids=None)

    def row(self, i: int, ids: np.ndarray | None = None) -> Row:
        """Row i of the batch (`ids`: its tokens, for a remote batch)."""
        if ids is None:
            assert self.ids is not None
            ids = self.ids[self.ids_off[i] : self.ids_off[i + 1]]
        a = int(self.mask_off[i]) + self.mask_bit0
        n = int(self.mask_off[i + 1]) + self.mask_bit0 - a
        bits = np.unpackbits(self.mask_bits[a >> 3 : (a + n + 7) >> 3], bitorder="little")
        mask = bits[a & 7 : (a & 7) + n].view(np.bool_)
        docs = self.docs[self.doc_off[i] : self.doc_off[i + 1]]
        return ids, mask, docs, self.sids[self.sid_off[i] : self.sid_off[i + 1]]


def _expected_starts(entry: ShardEntry, num_batches: int, where: str) -> np.ndarray | None:
    """Row starts of the batches as the manifest's rows and rows_per_batch give them (None when
    rows_per_batch is not recorded)."""
    per = entry.rows_per_batch
    if not per:
        return None
    need = math.ceil(entry.rows / per)
    if num_batches != need:
        raise FormatError(
            f"{where}: holds {num_batches} record batches, but the manifest's rows={entry.rows} and "
            f"rows_per_batch={per} need {need}"
        )
    return np.minimum(np.arange(need + 1, dtype=np.int64) * per, entry.rows)


def _starts_from_lengths(lengths: list[int], entry: ShardEntry, where: str) -> np.ndarray:
    if sum(lengths) != entry.rows:
        raise FormatError(f"{where}: holds {sum(lengths)} rows, the manifest says {entry.rows}")
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)


class _Shard:
    where: str
    starts: np.ndarray

    @property
    def num_batches(self) -> int:
        return self.starts.size - 1

    def batch_of(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, rows, side="right") - 1

    def check_length(self, b: int, length: int) -> None:
        want = int(self.starts[b + 1] - self.starts[b])
        if length != want:
            raise FormatError(
                f"{self.where}: record batch {b} holds {length} rows; the manifest's rows and "
                f"rows_per_batch put {want} there"
            )


class LocalShard(_Shard):
    """A memory-mapped local shard (pyarrow's IPC reader, zero-copy batches)."""

    def __init__(self, path: str, where: str, entry: ShardEntry) -> None:
        self.where = where
        try:
            self.file = pa.memory_map(path)
        except FileNotFoundError:
            raise FormatError(f"{where}: missing (the manifest names it)") from None
        except OSError as e:
            raise FormatError(f"{where}: cannot be opened ({describe_error(e)})") from None
        size = self.file.size()
        if size != entry.bytes:  # another file in its place (what row checksums would catch)
            self.file.close()
            raise FormatError(f"{where}: {size} bytes, the manifest says {entry.bytes}")
        try:
            self.reader = pa.ipc.open_file(self.file)
        except (pa.ArrowException, OSError) as e:
            self.file.close()
            raise FormatError(
                f"{where}: not a readable Arrow IPC file ({describe_error(e)})"
            ) from None
        if not self.reader.schema.equals(SHARD_SCHEMA):
            self.file.close()
            raise FormatError(f"{where}: schema differs from shard format v1")
        n = self.reader.num_record_batches
        starts = _expected_starts(entry, n, where)
        if starts is None:
            starts = _starts_from_lengths([self.record_batch(b, check=False).num_rows for b in range(n)], entry, where)  # fmt: skip
        self.starts = starts

    def record_batch(self, b: int, *, check: bool = True) -> pa.RecordBatch:
        try:
            batch = self.reader.get_batch(b)
        except (pa.ArrowException, OSError, IndexError) as e:
            raise FormatError(
                f"{self.where}: record batch {b} is unreadable ({describe_error(e)})"
            ) from None
        if check:
            self.check_length(b, batch.num_rows)
        return batch

    def arrays(self, b: int) -> BatchArrays:
        batch = self.record_batch(b)
        parts = {n: _list_buffers(batch.column(n), self.where) for n in LIST_COLUMNS}
        (ids_off, ids, _), (mask_off, bits, bit0), (doc_off, docs, _), (sid_off, sids, _) = (
            parts[n] for n in LIST_COLUMNS
        )
        out = BatchArrays(batch.num_rows, ids_off, ids, mask_off, bits, bit0, doc_off, docs, sid_off, sids)  # fmt: skip
        out.check(f"{self.where}: record batch {b}")
        return out

    def close(self) -> None:
        self.file.close()


def _list_buffers(arr: pa.ListArray, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(offsets, values, first bit) of a list column from its buffers, without pyarrow's
    to_numpy (which imports pandas on first use). For list<bool>, values are the bit bytes."""
    if arr.null_count:
        raise FormatError(f"{where}: a list column holds nulls")
    bufs, child = arr.buffers(), arr.values
    bits = pa.types.is_boolean(child.type)
    dtype = np.dtype(np.uint8) if bits else numpy_dtype(child.type)
    end = child.offset + len(child)
    need = (end + 7) // 8 if bits else end * dtype.itemsize
    if (
        bufs[1] is None
        or bufs[3] is None
        or bufs[1].size < 4 * (arr.offset + len(arr) + 1)
        or bufs[3].size < need
    ):
        raise FormatError(f"{where}: a list column's buffers are smaller than its length")
    off = np.frombuffer(bufs[1], np.int32, count=len(arr) + 1, offset=arr.offset * 4)
    if bits:
        return off.astype(np.int64), np.frombuffer(bufs[3], np.uint8), child.offset
    values = np.frombuffer(bufs[3], dtype, count=len(child), offset=child.offset * dtype.itemsize)
    return off.astype(np.int64), values, 0


class RemoteShard(_Shard):
    """A shard on object storage, read by byte ranges (see the module docstring)."""

    def __init__(
        self, fs: fsspec.AbstractFileSystem, path: str, where: str, entry: ShardEntry
    ) -> None:
        self.fs, self.path, self.where = fs, path, where
        with reading(where):
            size = int(fs.size(path))
        if size != entry.bytes:
            raise FormatError(f"{where}: {size} bytes, the manifest says {entry.bytes}")
        self.size = size
        try:
            head, tail = self.read([(0, min(size, 4096)), (max(0, size - TAIL_READ), size)])
            n = ipc.footer_length(tail, size)
            if n + ipc.TAIL > len(tail):
                tail = self.read([(size - n - ipc.TAIL, size)])[0]
            footer = tail[len(tail) - n - ipc.TAIL : len(tail) - ipc.TAIL]
            self.blocks = ipc.read_footer(footer, size)
            self._check_schema(head)
        except ipc.IpcLayoutError as e:
            raise FormatError(f"{where}: not a readable Arrow IPC file ({e})") from None
        starts = _expected_starts(entry, len(self.blocks), where)
        if starts is None:
            lengths = [lay.length for lay in self._metadata(list(range(len(self.blocks))))]
            starts = _starts_from_lengths(lengths, entry, where)
        self.starts = starts

    def read(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each [start, end) range, requested concurrently."""
        if not ranges:
            return []
        with reading(self.where):
            out = self.fs.cat_ranges(
                [self.path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges],
                on_error="raise",
            )  # fmt: skip
        for (a, b), data in zip(ranges, out, strict=True):
            if len(data) != b - a:
                raise range_error(self.where, a, b, len(data))
        return out

    def _check_schema(self, head: bytes) -> None:
        """The schema message that opens the file: magic, 2 bytes of padding, the message."""
        if len(head) < 16 or head[:6] != ipc.MAGIC:
            raise ipc.IpcLayoutError("the file does not start with the Arrow IPC magic")
        continued = head[8:12] == b"\xff\xff\xff\xff"
        need = (16 if continued else 12) + int.from_bytes(head[12:16] if continued else head[8:12], "little", signed=True)  # fmt: skip
        if not 16 < need <= self.size:
            raise ipc.IpcLayoutError("the schema message does not fit the file")
        if need > len(head):
            head = self.read([(0, need)])[0]
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(head[8:need]))
        except (pa.ArrowException, OSError) as e:
            raise ipc.IpcLayoutError(f"unreadable schema ({describe_error(e)})") from None
        if not schema.equals(SHARD_SCHEMA):
            raise FormatError(f"{self.where}: schema differs from shard format v1")

    def _metadata(self, batches: list[int]) -> list[ipc.BatchLayout]:
        """Record batches' layouts from their metadata alone (one request each)."""
        blocks = [self.blocks[b] for b in batches]
        heads = self.read_merged([(k.offset, k.body_offset) for k in blocks])
        try:
            return [
                ipc.parse_batch(ipc.message_flatbuffer(h, k.metadata_length), k.body_length)
                for h, k in zip(heads, blocks, strict=True)
            ]
        except ipc.IpcLayoutError as e:
            raise FormatError(
                f"{self.where}: a record batch's metadata is unreadable ({e})"
            ) from None

    def read_merged(self, spans: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each [start, end) span, from requests merged where spans lie less than
        MAX_GAP apart (each merged request at most MAX_RANGE long), all sent together."""
        order = sorted(range(len(spans)), key=spans.__getitem__)
        merged: list[list[int]] = []
        for k in order:
            a, e = spans[k]
            last = merged[-1] if merged else None
            if last and a - last[1] <= MAX_GAP and max(e, last[1]) - last[0] <= MAX_RANGE:
                last[1] = max(last[1], e)
            else:
                merged.append([a, e])
        data = [memoryview(d) for d in self.read([(a, e) for a, e in merged])]
        out: list[memoryview] = [memoryview(b"")] * len(spans)
        j = 0
        for k in order:
            a, e = spans[k]
            while not (merged[j][0] <= a and e <= merged[j][1]):
                j += 1
            out[k] = data[j][a - merged[j][0] : e - merged[j][0]]
        return out

    def _heads(self, batches: list[int]) -> dict[int, tuple[ipc.BatchLayout, np.ndarray]]:
        """Each batch's layout and input_ids offsets: one request a batch for its metadata and
        the offsets right after it (a second only when they are not where expected)."""
        guess = [8 + 4 * int(self.starts[b + 1] - self.starts[b] + 1) + 64 for b in batches]
        blocks = [self.blocks[b] for b in batches]
        heads = self.read_merged(
            [(k.offset, min(k.body_offset + g, k.body_offset + k.body_length)) for k, g in zip(blocks, guess, strict=True)]
        )  # fmt: skip
        out = {}
        for b, k, head in zip(batches, blocks, heads, strict=True):
            try:
                meta = ipc.message_flatbuffer(head, k.metadata_length)
                lay = ipc.parse_batch(meta, k.body_length)
            except ipc.IpcLayoutError as e:
                raise FormatError(
                    f"{self.where}: record batch {b}'s metadata is unreadable ({e})"
                ) from None
            self._check_layout(b, lay)
            at, size = lay.buffers[1]
            start, end = k.metadata_length + at, k.metadata_length + at + size
            raw = (
                head[start:end]
                if end <= len(head)
                else self.read([(k.offset + start, k.offset + end)])[0]
            )
            out[b] = (lay, np.frombuffer(raw, np.int32, count=lay.length + 1).astype(np.int64))
        return out

    def fetch(
        self, wanted: list[tuple[int, int]], known: dict[int, BatchArrays], row_bytes: list[int]
    ) -> tuple[dict[int, BatchArrays], list[np.ndarray]]:
        """input_ids of each (batch, row in batch), and the arrays of the batches not `known`
        (with their input_ids for a batch read whole, without them otherwise).

        A `known` batch that holds its input_ids (one read whole earlier) needs no request. A
        new batch whose wanted rows hold at least DENSE of its body (by `row_bytes`, the rows'
        sizes from index.arrow) is read whole, in one request; the others in two rounds: their
        metadata, then their small buffers with the rows' tokens. Requests are merged."""
        new = sorted({b for b, _ in wanted if b not in known})
        need: dict[int, int] = {}
        for (b, _), size in zip(wanted, row_bytes, strict=True):
            need[b] = need.get(b, 0) + size
        whole = [b for b in new if need[b] >= DENSE * self.blocks[b].body_length]
        arrays = self._whole(whole)
        heads = self._heads([b for b in new if b not in arrays])
        spans = []
        for b, (lay, _) in heads.items():
            body = self.blocks[b].body_offset
            spans.append((body + lay.buffers[4][0], body + lay.body_length))
        ids_at = {
            b: self.blocks[b].body_offset + lay.buffers[3][0] for b, (lay, _) in heads.items()
        }
        ids_at |= {b: a.ids_at for b, a in known.items()}
        ids_off = {b: off for b, (_, off) in heads.items()} | {
            b: a.ids_off for b, a in known.items()
        }
        held = {b for b, a in known.items() if a.ids is not None}
        remote = [(b, i) for b, i in wanted if b not in arrays and b not in held]
        for b, i in remote:
            spans.append(
                (ids_at[b] + 4 * int(ids_off[b][i]), ids_at[b] + 4 * int(ids_off[b][i + 1]))
            )
        data = self.read_merged(spans)
        for j, (b, (lay, off)) in enumerate(heads.items()):
            arrays[b] = self._arrays(b, lay, off, bytes(data[j]), ids_at[b])
        fetched = iter(data[len(heads) :])
        ids = [
            arrays[b].row_ids(i) if b in arrays and arrays[b].ids is not None
            else known[b].row_ids(i) if b in held
            else np.frombuffer(next(fetched), np.int32)
            for b, i in wanted
        ]  # fmt: skip
        return arrays, ids

    def _whole(self, batches: list[int]) -> dict[int, BatchArrays]:
        """Batches read whole (metadata and body in one request each), parsed here."""
        if not batches:
            return {}
        blocks = [self.blocks[b] for b in batches]
        data = self.read_merged([(k.offset, k.body_offset + k.body_length) for k in blocks])
        out = {}
        for b, k, raw in zip(batches, blocks, data, strict=True):
            try:
                lay = ipc.parse_batch(ipc.message_flatbuffer(raw, k.metadata_length), k.body_length)
            except ipc.IpcLayoutError as e:
                raise FormatError(
                    f"{self.where}: record batch {b}'s metadata is unreadable ({e})"
                ) from None
            self._check_layout(b, lay)
            body = raw[k.metadata_length :]
            at, size = lay.buffers[1]
            off = np.frombuffer(body[at : at + size], np.int32, count=lay.length + 1).astype(
                np.int64
            )
            arrays = self._arrays(
                b, lay, off, bytes(body[lay.buffers[4][0] :]), k.body_offset + lay.buffers[3][0]
            )
            at, size = lay.buffers[3]
            arrays.ids = np.frombuffer(body[at : at + size], np.int32, count=lay.nodes[1][0])
            out[b] = arrays
        return out

    def _arrays(
        self, b: int, lay: ipc.BatchLayout, ids_off: np.ndarray, tail: bytes, ids_at: int
    ) -> BatchArrays:
        n, base = lay.length, lay.buffers[4][0]

        def buf(k: int, dtype: Any, count: int) -> np.ndarray:
            return np.frombuffer(tail, dtype, count=count, offset=lay.buffers[k][0] - base)

        def offsets(k: int) -> np.ndarray:
            return buf(k, np.int32, n + 1).astype(np.int64)

        arrays = BatchArrays(
            n, ids_off, None,
            offsets(5), buf(7, np.uint8, (lay.nodes[3][0] + 7) // 8), 0,
            offsets(9), buf(11, np.int32, lay.nodes[5][0]),
            offsets(13), buf(15, np.int64, lay.nodes[7][0]),
            ids_at=ids_at,
        )  # fmt: skip
        arrays.check(f"{self.where}: record batch {b}")
        if arrays.ids_off[-1] > lay.nodes[1][0]:
            raise FormatError(f"{self.where}: record batch {b}: input_ids offsets pass its values")
        return arrays

    def _check_layout(self, b: int, lay: ipc.BatchLayout) -> None:
        self.check_length(b, lay.length)
        n, nodes, bufs = lay.length, lay.nodes, lay.buffers
        if len(nodes) != 10 or len(bufs) != 20 or any(nulls for _, nulls in nodes):
            raise FormatError(
                f"{self.where}: record batch {b} does not hold shard format v1's columns"
            )
        if any(nodes[k][0] != n for k in (0, 2, 4, 6, 8, 9)) or nodes[1][0] != nodes[3][0]:
            raise FormatError(f"{self.where}: record batch {b}: its columns' lengths disagree")
        sizes = {1: 4 * (n + 1), 3: 4 * nodes[1][0], 5: 4 * (n + 1), 7: (nodes[3][0] + 7) // 8,
                 9: 4 * (n + 1), 11: 4 * nodes[5][0], 13: 4 * (n + 1), 15: 8 * nodes[7][0]}  # fmt: skip
        small = any(bufs[k][1] < size for k, size in sizes.items())
        if small or bufs[4][0] < bufs[3][0] + bufs[3][1]:
            raise FormatError(f"{self.where}: record batch {b}: buffers smaller than their columns")

    def close(self) -> None:
        """Nothing stays open between requests."""


def _check_layouts(data: bytes, where: str) -> None:
    """Every record batch's message as the range reader parses it: a body Arrow reads but a
    remote reader cannot address (compressed, which shard format v1 rules out) fails here,
    not mid-training."""
    size = len(data)
    try:
        n = ipc.footer_length(data[-ipc.TAIL :], size)
        for b, k in enumerate(ipc.read_footer(data[size - ipc.TAIL - n : size - ipc.TAIL], size)):
            try:
                meta = ipc.message_flatbuffer(data[k.offset : k.body_offset], k.metadata_length)
                ipc.parse_batch(meta, k.body_length)
            except ipc.IpcLayoutError as e:
                raise FormatError(f"{where}: record batch {b}: {e}") from None
    except ipc.IpcLayoutError as e:
        raise FormatError(f"{where}: {e}") from None


def batches_from_bytes(data: bytes, entry: ShardEntry, where: str) -> list[pa.RecordBatch]:
    """Every record batch of a whole shard held in memory (`packshard verify`), each fully
    validated by Arrow (offsets inside their values, no nulls) and its length checked against
    the manifest's rows and rows_per_batch; FormatError naming `where`."""
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data))
        if not reader.schema.equals(SHARD_SCHEMA):
            raise FormatError(f"{where}: schema differs from shard format v1")
        batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
        for b, batch in enumerate(batches):
            batch.validate(full=True)
            if any(col.null_count for col in batch.columns):
                raise FormatError(f"{where}: record batch {b} holds nulls")
    except (pa.ArrowException, OSError) as e:
        raise FormatError(f"{where}: not a readable Arrow IPC file ({describe_error(e)})") from None
    _check_layouts(data, where)
    starts = _expected_starts(entry, len(batches), where)
    if starts is None:
        _starts_from_lengths([b.num_rows for b in batches], entry, where)
    else:
        for b, batch in enumerate(batches):
            if batch.num_rows != starts[b + 1] - starts[b]:
                raise FormatError(
                    f"{where}: record batch {b} holds {batch.num_rows} rows; the manifest's rows and "
                    f"rows_per_batch put {int(starts[b + 1] - starts[b])} there"
                )
    return batches
