"""Reading a shard dataset: manifest checks, the index, and random access to rows.

`ShardDataset.open(url)` reads and checks manifest.json (format name and version, relative
paths only, the keys readers rely on) and refuses anything else with a `FormatError` naming the
file. Rows are read by (shard, row): the reader opens the shard's Arrow IPC file once (local
file or a seekable fsspec remote file), computes which record batch holds the row from the
shard's `rows_per_batch`, and deserialises only that batch and only the requested columns.
Each row read is checked against its `row_checksum` in index.arrow unless `verify=False`;
`verify_shard` re-hashes a whole shard against the manifest.

Concurrency: one lock per shard (readers of different shards run in parallel, which is what
lets a trainer overlap range reads of several remote shards); local shards are memory-mapped,
so reading one row of a 4 MiB record batch touches only that row's pages. `read_rows_arrays`
is the trainer's fast path: numpy views per row, decoded batches of memory-mapped shards kept
(zero-copy) and the last `BATCH_ARRAYS_KEPT` batches kept as numpy, so a shuffled row costs
~50 µs (read + checksum) instead of ~1 ms of per-row Arrow objects (benchmarks/bench_stream.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from packshard.packers.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_REQUIRED,
    MANIFEST_NAME,
    SHARD_SCHEMA,
    FormatError,
    check_relative_path,
    checksum_stream,
    split_checksum,
)
from packshard.packers.rows import list_parts, row_checksum
from packshard.packers.writer import url_to_fs

MANIFEST_KEYS = ("format", "version", "config", "shards", "totals")
_LIST_COLUMNS = ("input_ids", "loss_mask", "doc_lens", "sample_ids")  # what a row checksum covers
BATCH_ARRAYS_KEPT = 32  # record batches kept as numpy for read_rows_arrays (~4 MiB of masks each)
CONFIG_KEYS = ("seq_len", "pad_multiple", "pad_token_id")
SHARD_KEYS = ("path", "rows", "num_tokens", "padded_tokens", "loss_tokens", "bytes", "checksum")


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest describes it."""

    path: str
    rows: int
    num_tokens: int
    padded_tokens: int
    loss_tokens: int
    bytes: int
    checksum: str
    rows_per_batch: int


def parse_manifest(manifest: Any, where: str) -> tuple[dict[str, Any], list[ShardEntry]]:
    """Check a decoded manifest; return (config, shards). Raises FormatError naming `where`."""
    if not isinstance(manifest, dict):
        raise FormatError(f"{where}: the manifest must be a JSON object")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise FormatError(f"{where}: missing keys {missing}")
    if manifest["format"] != FORMAT_NAME:
        raise FormatError(f"{where}: format is {manifest['format']!r}, not {FORMAT_NAME!r}")
    if manifest["version"] != FORMAT_VERSION:
        raise FormatError(
            f"{where}: format version {manifest['version']!r} is not known to this reader "
            f"(it reads version {FORMAT_VERSION}); upgrade packshard"
        )
    config = manifest["config"]
    if not isinstance(config, dict) or any(k not in config for k in CONFIG_KEYS):
        raise FormatError(f"{where}: config must be an object holding {list(CONFIG_KEYS)}")
    shards = []
    for i, s in enumerate(manifest["shards"]):
        here = f"{where}: shards[{i}]"
        if not isinstance(s, dict) or any(k not in s for k in SHARD_KEYS):
            raise FormatError(f"{here} must be an object holding {list(SHARD_KEYS)}")
        check_relative_path(s["path"], here)
        split_checksum(s["checksum"], here)
        shards.append(
            ShardEntry(
                **{k: s[k] for k in SHARD_KEYS}, rows_per_batch=int(s.get("rows_per_batch", 0))
            )
        )
    index = manifest.get("index", {"path": "index.arrow"})
    check_relative_path(index.get("path"), f"{where}: index")
    return config, shards


class ShardDataset:
    """A committed shard dataset opened for reading (thread-safe for concurrent row reads)."""

    def __init__(
        self, url: str, manifest: dict[str, Any], fs: fsspec.AbstractFileSystem, root: str
    ) -> None:
        self.url = url
        self.manifest = manifest
        self.fs = fs
        self.root = root
        self.config, self.shards = parse_manifest(manifest, f"{url}/{MANIFEST_NAME}")
        self._readers: dict[int, tuple[Any, pa.ipc.RecordBatchFileReader]] = {}
        self._lock = threading.Lock()  # guards _readers and _shard_locks
        self._shard_locks: dict[int, threading.Lock] = {}
        # decoded record batches of memory-mapped (local) shards: zero-copy views of the map,
        # so keeping them costs address space, not memory, and saves re-parsing per row read
        self._batches: dict[int, dict[int, pa.RecordBatch]] = {}
        self._arrays: OrderedDict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]] = (
            OrderedDict()
        )

    @classmethod
    def open(cls, url: str, *, storage_options: Mapping[str, Any] | None = None) -> ShardDataset:
        fs, root = url_to_fs(url, storage_options)
        path = f"{root}/{MANIFEST_NAME}"
        try:
            with fs.open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise FormatError(
                f"{url}: no {MANIFEST_NAME}; this is not a committed packshard dataset "
                "(a pack job that did not finish leaves none: rerun it to complete the dataset)"
            ) from None
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FormatError(f"{url}/{MANIFEST_NAME}: not valid JSON ({e})") from None
        return cls(url, manifest, fs, root)

    # ---- index -------------------------------------------------------------------------

    @cached_property
    def index(self) -> pa.Table:
        """index.arrow as a table (read once, checked against the manifest)."""
        entry = self.manifest.get("index", {"path": "index.arrow"})
        path = f"{self.root}/{entry['path']}"
        where = f"{self.url}/{entry['path']}"
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise FormatError(f"{where}: missing (the manifest names it)") from None
        if "checksum" in entry:
            algorithm, _digest = split_checksum(entry["checksum"], where)
            got = checksum_stream(_BytesReader(data).read, algorithm)
            if got != entry["checksum"]:
                raise FormatError(
                    f"{where}: checksum {got} does not match the manifest's {entry['checksum']}"
                )
        try:
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except pa.ArrowInvalid as e:
            raise FormatError(f"{where}: not an Arrow IPC file ({e})") from None
        missing = [c for c in INDEX_REQUIRED if c not in table.column_names]
        if missing:
            raise FormatError(f"{where}: missing columns {missing}")
        if table.num_rows != sum(s.rows for s in self.shards):
            raise FormatError(
                f"{where}: {table.num_rows} rows, but the manifest's shards hold {sum(s.rows for s in self.shards)}"
            )
        return table

    def index_column(self, name: str) -> np.ndarray:
        return self.index.column(name).to_numpy()

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @cached_property
    def shard_row_starts(self) -> np.ndarray:
        """Global row number of each shard's first row (plus the total at the end)."""
        return np.concatenate(([0], np.cumsum([s.rows for s in self.shards]))).astype(np.int64)

    def locate(self, global_row: int) -> tuple[int, int]:
        """(shard, row within shard) of a global row number (its position in index.arrow)."""
        if not 0 <= global_row < self.num_rows:
            raise IndexError(f"row {global_row} is outside [0, {self.num_rows})")
        shard = int(np.searchsorted(self.shard_row_starts, global_row, side="right") - 1)
        return shard, int(global_row - self.shard_row_starts[shard])

    # ---- rows --------------------------------------------------------------------------

    def _shard_lock(self, shard: int) -> threading.Lock:
        with self._lock:
            return self._shard_locks.setdefault(shard, threading.Lock())

    def _reader(self, shard: int) -> pa.ipc.RecordBatchFileReader:
        with self._shard_lock(shard):
            if shard not in self._readers:
                entry = self.shards[shard]
                path = f"{self.root}/{entry.path}"
                f = pa.memory_map(path) if _is_local(self.fs) else self.fs.open(path, "rb")
                try:
                    reader = pa.ipc.open_file(f)
                except (pa.ArrowInvalid, OSError) as e:
                    f.close()
                    raise FormatError(
                        f"{self.url}/{entry.path}: not a readable Arrow IPC file ({e})"
                    ) from None
                if not reader.schema.equals(SHARD_SCHEMA):
                    f.close()
                    raise FormatError(
                        f"{self.url}/{entry.path}: schema differs from shard format v{FORMAT_VERSION}"
                    )
                self._readers[shard] = (f, reader)
            return self._readers[shard][1]

    def read_rows(
        self,
        shard: int,
        rows: Sequence[int],
        columns: Sequence[str] | None = None,
        *,
        verify: bool = True,
    ) -> pa.Table:
        """Rows of one shard, in the order asked, reading only the batches that hold them.

        With `verify`, every row is checked against index.arrow's row_checksum (this needs all
        four list columns, which are then read whatever `columns` asks for).
        """
        entry = self.shards[shard]
        rows = [int(r) for r in rows]
        for r in rows:
            if not 0 <= r < entry.rows:
                raise IndexError(f"{self.url}/{entry.path}: row {r} is outside [0, {entry.rows})")
        names = list(columns) if columns is not None else list(SHARD_SCHEMA.names)
        unknown = [c for c in names if c not in SHARD_SCHEMA.names]
        if unknown:
            raise ValueError(f"unknown columns {unknown}; shard columns are {SHARD_SCHEMA.names}")
        needed = list(SHARD_SCHEMA.names) if verify else names
        per_batch = entry.rows_per_batch or entry.rows
        batches = {b: self._batch(shard, b) for b in sorted({r // per_batch for r in rows})}
        picked = pa.Table.from_batches(
            [batches[r // per_batch].slice(r % per_batch, 1).select(needed) for r in rows],
            schema=pa.schema([SHARD_SCHEMA.field(n) for n in needed]),
        )
        if verify:
            self._verify_rows(shard, rows, picked)
        return picked.select(names)

    def _batch(self, shard: int, b: int) -> pa.RecordBatch:
        """Record batch `b` of a shard (kept once decoded when the shard is memory-mapped)."""
        reader = self._reader(shard)
        with self._shard_lock(shard):
            cached = self._batches.get(shard, {}).get(b)
            if cached is not None:
                return cached
            try:
                batch = reader.get_batch(b)
            except (pa.ArrowInvalid, OSError, IndexError) as e:
                raise FormatError(
                    f"{self.url}/{self.shards[shard].path}: record batch {b} is unreadable ({e})"
                ) from None
            if _is_local(self.fs):
                self._batches.setdefault(shard, {})[b] = batch
            return batch

    def _batch_arrays(self, shard: int, b: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(offsets, values) numpy arrays of a batch's list columns, for the last
        `BATCH_ARRAYS_KEPT` batches used (int columns are views of the batch, loss_mask is
        unpacked from bits once per batch instead of once per row)."""
        key = (shard, b)
        with self._lock:
            hit = self._arrays.get(key)
            if hit is not None:
                self._arrays.move_to_end(key)
                return hit
        batch = self._batch(shard, b)
        arrays = {n: list_parts(batch.column(n)) for n in _LIST_COLUMNS}
        with self._lock:
            self._arrays[key] = arrays
            while len(self._arrays) > BATCH_ARRAYS_KEPT:
                self._arrays.popitem(last=False)
        return arrays

    def read_rows_arrays(
        self,
        shard: int,
        rows: Sequence[int] | np.ndarray,
        columns: Sequence[str] = ("input_ids", "loss_mask", "doc_lens"),
        *,
        verify: bool = True,
    ) -> dict[str, list[np.ndarray]]:
        """`read_rows` as numpy with no Arrow object per row (the trainer's fast path): for each
        list column, one array per row in the order asked, each a view of the record batch (no
        copy), checked against index.arrow's row checksums as `read_rows` does."""
        entry = self.shards[shard]
        rows_arr = np.asarray(rows, dtype=np.int64).reshape(-1)
        bad = rows_arr[(rows_arr < 0) | (rows_arr >= entry.rows)]
        if bad.size:
            raise IndexError(
                f"{self.url}/{entry.path}: row {int(bad[0])} is outside [0, {entry.rows})"
            )
        unknown = [c for c in columns if c not in _LIST_COLUMNS]
        if unknown:
            raise ValueError(
                f"read_rows_arrays reads the list columns {list(_LIST_COLUMNS)}, not {unknown}"
            )
        needed = _LIST_COLUMNS if verify else tuple(columns)
        per_batch = entry.rows_per_batch or entry.rows
        out: dict[str, list[np.ndarray]] = {n: [] for n in needed}
        for r in rows_arr.tolist():
            arrays = self._batch_arrays(shard, r // per_batch)
            i = r % per_batch
            for n in needed:
                off, values = arrays[n]
                out[n].append(values[off[i] : off[i + 1]])
        if verify and self._row_checksums is not None:
            self._check_row_checksums(shard, rows_arr, out)
        return {n: out[n] for n in columns}

    @cached_property
    def _row_checksums(self) -> np.ndarray | None:
        if "row_checksum" not in self.index.column_names:
            return None
        return self.index_column("row_checksum")

    def _check_row_checksums(
        self, shard: int, rows: Sequence[int] | np.ndarray, cols: Mapping[str, list[np.ndarray]]
    ) -> None:
        """Compare rows (one array per row and list column) with index.arrow's checksums."""
        expected = self._row_checksums
        if expected is None:
            return
        base = int(self.shard_row_starts[shard])
        for i, r in enumerate(rows):
            if row_checksum(*(cols[n][i] for n in _LIST_COLUMNS)) != int(expected[base + int(r)]):
                raise FormatError(
                    f"{self.url}/{self.shards[shard].path}: row {int(r)} does not match its checksum in index.arrow "
                    "(the shard is corrupted; run `packshard verify` and re-pack)"
                )

    def _verify_rows(self, shard: int, rows: list[int], table: pa.Table) -> None:
        if self._row_checksums is None:
            return
        table = table.combine_chunks()
        cols = {}
        for n in _LIST_COLUMNS:
            off, values = list_parts(table.column(n).chunk(0))
            cols[n] = [values[off[i] : off[i + 1]] for i in range(len(rows))]
        self._check_row_checksums(shard, rows, cols)

    def read_row(
        self, global_row: int, columns: Sequence[str] | None = None, *, verify: bool = True
    ) -> dict[str, Any]:
        """One row as a dict of numpy arrays / ints."""
        shard, row = self.locate(global_row)
        t = self.read_rows(shard, [row], columns, verify=verify)
        return {name: _to_numpy(t.column(name)) for name in t.column_names}

    def iter_shard(self, shard: int) -> Iterator[pa.RecordBatch]:
        """All record batches of one shard, in order (no row checksums: use verify_shard)."""
        reader = self._reader(shard)
        for b in range(reader.num_record_batches):
            with self._shard_lock(shard):
                yield reader.get_batch(b)

    def verify_shard(self, shard: int) -> None:
        """Re-hash the whole shard file and compare with the manifest; FormatError on mismatch."""
        entry = self.shards[shard]
        where = f"{self.url}/{entry.path}"
        algorithm, _ = split_checksum(entry.checksum, where)
        try:
            with self.fs.open(f"{self.root}/{entry.path}", "rb") as f:
                got = checksum_stream(f.read, algorithm)
                size = f.tell()
        except FileNotFoundError:
            raise FormatError(f"{where}: missing (the manifest names it)") from None
        if size != entry.bytes:
            raise FormatError(f"{where}: {size} bytes, the manifest says {entry.bytes}")
        if got != entry.checksum:
            raise FormatError(
                f"{where}: checksum {got} does not match the manifest's {entry.checksum}"
            )

    def close_shard(self, shard: int) -> None:
        """Close one shard's open file (it is reopened on the next read of that shard)."""
        with self._shard_lock(shard):
            opened = self._readers.pop(shard, None)
            self._batches.pop(shard, None)
        with self._lock:
            for key in [k for k in self._arrays if k[0] == shard]:
                del self._arrays[key]
        if opened is not None:
            opened[0].close()

    def close(self) -> None:
        with self._lock:
            opened = list(self._readers.values())
            self._readers.clear()
            self._batches.clear()
            self._arrays.clear()
        for f, _ in opened:
            f.close()

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def _to_numpy(col: pa.ChunkedArray) -> Any:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_list(arr.type):
        return arr.values.to_numpy(zero_copy_only=False)[
            arr.offsets[0].as_py() : arr.offsets[-1].as_py()
        ]
    return arr.to_numpy(zero_copy_only=False)[0]


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int) -> bytes:
        chunk = self._view[self._pos : self._pos + n]
        self._pos += len(chunk)
        return bytes(chunk)
