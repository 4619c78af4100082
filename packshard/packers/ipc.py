"""Where each record batch and each of its buffers sits in an Arrow IPC file, without pyarrow.

A remote shard is read one row at a time by range requests of only that row's bytes; that needs
the byte offsets pyarrow does not expose. They are in two flatbuffers of the IPC file format:

    file   = "ARROW1\\0\\0" | schema message | record batch messages ... | footer | int32 | "ARROW1"
    footer = Footer{schema, dictionaries: [Block], recordBatches: [Block]}
    Block  = struct {offset: int64, metaDataLength: int32, (pad), bodyLength: int64}   24 bytes
    message at Block.offset = [0xFFFFFFFF] int32 size | Message flatbuffer | padding | body
    Message{version, header_type, header: RecordBatch{length, nodes, buffers, compression}, bodyLength}
    FieldNode = struct {length: int64, null_count: int64}; Buffer = struct {offset, length: int64}

`read_footer(tail)` returns the record batches' blocks and `parse_batch(metadata)` a batch's
rows, field nodes and buffers (offsets relative to the body). Every offset is checked against
the bytes it points into; anything malformed raises `IpcLayoutError` (the reader turns it into a
`FormatError` naming the file). A compressed body raises `IpcLayoutError` too: its buffers are
not addressable by range (packshard writes uncompressed shards).

The flatbuffer rules used (flatbuffers.dev "internals"): a table starts with an int32 offset
back to its vtable; the vtable holds uint16 sizes and one uint16 offset per field (0: absent);
a reference field holds a uint32 offset forward from itself; a vector is a uint32 count then
its elements; a union is a uint8 type field followed by a reference field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"ARROW1"
TAIL = 10  # int32 footer length + magic
CONTINUATION = 0xFFFFFFFF
RECORD_BATCH = 3  # MessageHeader union: Schema=1, DictionaryBatch=2, RecordBatch=3


class IpcLayoutError(ValueError):
    """Bytes that are not the Arrow IPC layout they claim to be."""


@dataclass(frozen=True)
class Block:
    """A record batch message in the file: metadata at `offset`, body right after it."""

    offset: int
    metadata_length: int
    body_length: int

    @property
    def body_offset(self) -> int:
        return self.offset + self.metadata_length


@dataclass(frozen=True)
class BatchLayout:
    """A record batch: its row count, (length, null_count) per field node in schema order
    (depth first), and (offset, length) per buffer, offsets relative to the body."""

    length: int
    nodes: list[tuple[int, int]]
    buffers: list[tuple[int, int]]
    body_length: int


class _Table:
    """One flatbuffer table inside `buf`, with bounds-checked field access."""

    def __init__(self, buf: bytes | memoryview, pos: int) -> None:
        self.buf = buf
        self.pos = pos
        vt = pos - _i32(buf, pos)
        self.vtable = vt
        self.vsize = _u16(buf, vt)
        if self.vsize < 4 or vt + self.vsize > len(buf):
            raise IpcLayoutError(f"vtable at {vt} of size {self.vsize} is out of bounds")

    def _slot(self, field: int) -> int:
        at = 4 + 2 * field
        return _u16(self.buf, self.vtable + at) if at + 2 <= self.vsize else 0

    def scalar(self, field: int, fmt: str, default: int = 0) -> int:
        off = self._slot(field)
        return default if off == 0 else _unpack(fmt, self.buf, self.pos + off)

    def ref(self, field: int) -> int | None:
        """Absolute position a reference field points to (None when absent)."""
        off = self._slot(field)
        if off == 0:
            return None
        at = self.pos + off
        return at + _unpack("<I", self.buf, at)

    def table(self, field: int) -> _Table | None:
        at = self.ref(field)
        return None if at is None else _Table(self.buf, at)

    def structs(self, field: int, fmt: str) -> list[tuple[int, ...]]:
        """A vector of fixed-size structs, unpacked with `fmt` (little-endian)."""
        at = self.ref(field)
        if at is None:
            return []
        count = _unpack("<I", self.buf, at)
        size = struct.calcsize(fmt)
        start = at + 4
        if count > (len(self.buf) - start) // size:
            raise IpcLayoutError(f"a vector of {count} {size}-byte structs passes the end")
        return [struct.unpack_from(fmt, self.buf, start + i * size) for i in range(count)]


def _unpack(fmt: str, buf: bytes | memoryview, at: int) -> int:
    if at < 0 or at + struct.calcsize(fmt) > len(buf):
        raise IpcLayoutError(f"offset {at} is outside a {len(buf)}-byte flatbuffer")
    return struct.unpack_from(fmt, buf, at)[0]


def _i32(buf: bytes | memoryview, at: int) -> int:
    return _unpack("<i", buf, at)


def _u16(buf: bytes | memoryview, at: int) -> int:
    return _unpack("<H", buf, at)


def _root(buf: bytes | memoryview) -> _Table:
    return _Table(buf, _unpack("<I", buf, 0))


def footer_length(tail: bytes, file_size: int) -> int:
    """The footer's length from the file's last 10 bytes."""
    if len(tail) < TAIL or tail[-6:] != MAGIC:
        raise IpcLayoutError("the file does not end with the Arrow IPC magic 'ARROW1'")
    n = struct.unpack_from("<i", tail, len(tail) - TAIL)[0]
    if n <= 0 or n + TAIL + 8 > file_size:
        raise IpcLayoutError(f"footer length {n} does not fit a {file_size}-byte file")
    return n


def read_footer(footer: bytes, file_size: int) -> list[Block]:
    """The record batches' blocks from the footer flatbuffer (its bytes only)."""
    blocks = []
    for offset, meta, _pad, body in _root(footer).structs(3, "<qiiq"):
        if offset < 8 or meta < 8 or body < 0 or offset + meta + body > file_size:
            raise IpcLayoutError(
                f"record batch block (offset {offset}, metadata {meta}, body {body}) does not fit "
                f"the {file_size}-byte file"
            )
        blocks.append(Block(offset, meta, body))
    return blocks


def message_flatbuffer(prefix: bytes | memoryview, metadata_length: int) -> memoryview:
    """The Message flatbuffer inside a block's `metadata_length` bytes."""
    view = memoryview(prefix)[:metadata_length]
    first = _unpack("<I", view, 0)
    start, size = (8, _unpack("<i", view, 4)) if first == CONTINUATION else (4, first)
    if size <= 0 or start + size > len(view):
        raise IpcLayoutError(
            f"message metadata of {size} bytes does not fit its {len(view)}-byte block"
        )
    return view[start : start + size]


def parse_batch(metadata: bytes | memoryview, body_length: int) -> BatchLayout:
    """A record batch message's layout; its buffers checked to lie inside the body."""
    message = _root(metadata)
    if message.scalar(1, "<B") != RECORD_BATCH:
        raise IpcLayoutError("the block does not hold a record batch message")
    declared = message.scalar(3, "<q")
    if declared != body_length:
        raise IpcLayoutError(f"message body length {declared} != the block's {body_length}")
    batch = message.table(2)
    if batch is None:
        raise IpcLayoutError("record batch message without its header")
    if batch.ref(3) is not None:
        raise IpcLayoutError(
            "the record batch body is compressed (its buffers are not addressable)"
        )
    length = batch.scalar(0, "<q")
    nodes = [(n, nulls) for n, nulls in batch.structs(1, "<qq")]
    buffers = [(o, n) for o, n in batch.structs(2, "<qq")]
    if length < 0:
        raise IpcLayoutError(f"record batch length {length} < 0")
    for o, n in buffers:
        if o < 0 or n < 0 or o + n > body_length:
            raise IpcLayoutError(
                f"buffer (offset {o}, length {n}) is outside the {body_length}-byte body"
            )
    return BatchLayout(length, nodes, buffers, body_length)
