"""Reading a shard dataset: the manifest and index checked, rows by random access.

`ShardDataset.open(url)` reads manifest.json and checks every field a reader relies on
(`packers.manifest`); a URL without a committed dataset raises `DatasetNotFoundError` saying
what is there instead (nothing, an empty directory, an unfinished pack job, other files), a
failing store `StorageError` (an explicit endpoint that takes no connection at once, after one
TCP connect: `format.unreachable_endpoint`). `index` reads index.arrow once and checks it
against the manifest.
Every problem met later (a damaged shard, a row that does not match its checksum, a store that
stops answering) is a `FormatError` naming the file: no pyarrow, numpy or botocore error
reaches the caller.

Rows are read by (shard, row) through `packers.shard_file`: local shards are memory-mapped
(reading a row touches only its pages), remote shards are read by byte ranges of only the rows'
tokens plus, once per record batch, its small buffers (no download, ~1x the bytes of the rows
read). `read_rows_arrays` is the trainer's fast path: numpy views per row, no Arrow object per
row, every row checked against its `row_checksum` in index.arrow (~5 µs a row at 8K tokens),
the batches' arrays kept in an LRU (`BATCH_ARRAYS_KEPT`; a remote batch read whole keeps its
tokens too, within `whole_batch_bytes`: see `_keep`). `read_rows` returns an Arrow table
(any columns); `verify_shard` re-hashes a whole shard against the manifest.

Concurrency: one lock per shard, so readers of different shards run in parallel (what lets a
trainer overlap the range reads of several remote shards).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import xxhash

from packshard._extras import MissingExtraError
from packshard.packers.arrays import column_numpy
from packshard.packers.format import (
    INDEX_NAME,
    JOB_DIR,
    MANIFEST_NAME,
    SHARD_SCHEMA,
    SHARDS_DIR,
    DatasetNotFoundError,
    FormatError,
    StorageError,
    checksum_stream,
    describe_error,
    reading,
    split_checksum,
    storage_errors,
    storage_errors_with,
    unreachable_endpoint,
)
from packshard.packers.manifest import (
    Manifest,
    ShardEntry,
    check_index,
    parse_manifest,
)
from packshard.packers.s3_reading import reading_fs
from packshard.packers.shard_file import LIST_COLUMNS, BatchArrays, LocalShard, RemoteShard, Row
from packshard.packers.urls import dataset_url, redact_text, redact_url
from packshard.packers.writer import is_local, url_to_fs

BATCH_ARRAYS_KEPT = 256  # record batches kept as numpy views (local: of the map; remote: ~3%)
WHOLE_BATCH_BYTES = 256 << 20  # remote batches read whole, kept with their tokens (see below)


class ShardDataset:
    """A committed shard dataset opened for reading (thread-safe for concurrent row reads)."""

    def __init__(
        self, url: str, manifest: dict[str, Any], fs: fsspec.AbstractFileSystem, root: str
    ) -> None:
        self.url = redact_url(url)  # for messages and stats; fs and root read the real one
        self.manifest = manifest
        self.fs = fs
        self.root = root
        self.parsed: Manifest = parse_manifest(manifest, f"{self.url}/{MANIFEST_NAME}")
        self.config = self.parsed.config
        self.shards: list[ShardEntry] = self.parsed.shards
        self.local = is_local(fs)
        self._files: dict[int, LocalShard | RemoteShard] = {}
        self._lock = threading.Lock()  # guards _files, _shard_locks, _arrays and _whole
        self._shard_locks: dict[int, threading.Lock] = {}
        self._arrays: OrderedDict[tuple[int, int], BatchArrays] = OrderedDict()
        self._whole: OrderedDict[tuple[int, int], BatchArrays] = OrderedDict()
        self._whole_bytes = 0
        self.whole_batch_bytes = WHOLE_BATCH_BYTES

    @classmethod
    def open(
        cls, url: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
    ) -> ShardDataset:
        url = dataset_url(url)
        shown = redact_url(url)
        try:
            fs, root = reading_fs(url, storage_options) or url_to_fs(url, storage_options)
        except ValueError as e:  # fsspec: an unknown protocol, a bad storage option
            raise StorageError(
                f"{shown}: cannot open its filesystem ({redact_text(str(e))})"
            ) from None
        except ImportError as e:  # its backend (s3fs, gcsfs, ...) is not installed
            raise MissingExtraError(f"{shown}: {e}", name=getattr(e, "name", None)) from None
        except storage_errors_with(TypeError) as e:  # a bad option; ftp:// connects here
            raise StorageError(
                f"{shown}: cannot open its filesystem ({describe_error(e)})"
            ) from None
        why = unreachable_endpoint(fs)  # at once, not after the client's retries (5-10 s)
        if why is not None:
            raise StorageError(f"{shown}: {why}")
        try:
            raw = fs.cat_file(f"{root}/{MANIFEST_NAME}")
        except (FileNotFoundError, NotADirectoryError):
            raise _no_dataset(shown, fs, root) from None
        except storage_errors_with(TypeError) as e:  # TypeError: an option the client refuses
            # only at its first request (s3fs, fsspec's http: bogus=1)
            raise StorageError(f"{shown}: cannot read {MANIFEST_NAME} ({describe_error(e)})") from e
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad JSON or text; an int of 4300+ digits;
            # arrays nested past the recursion limit
            raise FormatError(f"{shown}/{MANIFEST_NAME}: not valid JSON ({e})") from None
        return cls(url, manifest, fs, root)

    # ---- index -------------------------------------------------------------------------

    @cached_property
    def index(self) -> pa.Table:
        """index.arrow as a table (read once, checked against the manifest)."""
        return self._index[0]

    @cached_property
    def _index(self) -> tuple[pa.Table, dict[str, np.ndarray]]:
        entry = self.parsed.index
        where = f"{self.url}/{entry.path}"
        data = self._read_whole(entry.path)
        if entry.bytes is not None and len(data) != entry.bytes:
            raise FormatError(f"{where}: {len(data)} bytes, the manifest says {entry.bytes}")
        if entry.checksum is not None:
            algorithm, _ = split_checksum(entry.checksum, where)
            got = checksum_stream(_BytesReader(data).read, algorithm)
            if got != entry.checksum:
                raise FormatError(
                    f"{where}: checksum {got} does not match the manifest's {entry.checksum}"
                )
        try:
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except (pa.ArrowException, OSError) as e:
            raise FormatError(
                f"{where}: not a readable Arrow IPC file ({describe_error(e)})"
            ) from None
        return table, check_index(table, self.parsed, where)

    def _read_whole(self, rel: str) -> bytes:
        where = f"{self.url}/{rel}"
        with reading(where):
            return self.fs.cat_file(f"{self.root}/{rel}")

    def index_column(self, name: str) -> np.ndarray:
        """One index.arrow column as numpy (read-only, checked)."""
        cols = self._index[1]
        if name not in cols:
            raise KeyError(f"index.arrow has no column {name!r}; it has {sorted(cols)}")
        return cols[name]

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

    # ---- shards ------------------------------------------------------------------------

    def _shard_lock(self, shard: int) -> threading.Lock:
        with self._lock:
            return self._shard_locks.setdefault(shard, threading.Lock())

    def _file(self, shard: int) -> LocalShard | RemoteShard:
        with self._shard_lock(shard):
            opened = self._files.get(shard)
            if opened is None:
                entry = self.shards[shard]
                path, where = f"{self.root}/{entry.path}", f"{self.url}/{entry.path}"
                if self.local:
                    opened = LocalShard(path, where, entry)
                else:
                    opened = RemoteShard(self.fs, path, where, entry)
                self._files[shard] = opened
            return opened

    def _kept(self, shard: int, batches: list[int]) -> dict[int, BatchArrays]:
        """The arrays of these batches that the LRUs hold (with their tokens where a remote
        batch read whole is still kept)."""
        out = {}
        with self._lock:
            for b in batches:
                for lru in (self._whole, self._arrays):
                    hit = lru.get((shard, b))
                    if hit is not None:
                        lru.move_to_end((shard, b))
                        out[b] = hit
                        break
        return out

    def _keep(self, shard: int, arrays: dict[int, BatchArrays], *, remote: bool) -> None:
        """Remember batches' arrays. A remote batch that came with its tokens (read whole) also
        goes, tokens included, into an LRU of `whole_batch_bytes`: a shuffled epoch asks for
        the batch's other rows in later windows, and reading the batch again for each (as
        each window's dense read would) multiplies the bytes read (3x on a 158 MiB shard read
        in 64 MiB windows). The tokens are views of the request's buffer, so a batch evicted
        while a neighbour from the same request stays keeps that buffer alive."""
        with self._lock:
            for b, a in arrays.items():
                if remote and a.ids is not None:
                    old = self._whole.pop((shard, b), None)
                    self._whole_bytes += _ids_bytes(a) - (_ids_bytes(old) if old else 0)
                    self._whole[(shard, b)] = a
                    a = a.without_ids()
                self._arrays[(shard, b)] = a
            while self._whole and self._whole_bytes > self.whole_batch_bytes:
                self._whole_bytes -= _ids_bytes(self._whole.popitem(last=False)[1])
            while len(self._arrays) > BATCH_ARRAYS_KEPT:
                self._arrays.popitem(last=False)

    def read_rows_arrays(
        self,
        shard: int,
        rows: Sequence[int] | np.ndarray,
        columns: Sequence[str] = ("input_ids", "loss_mask", "doc_lens"),
        *,
        verify: bool = True,
    ) -> dict[str, list[np.ndarray]]:
        """For each list column, one numpy array per row in the order asked (views, no copy),
        every row checked against index.arrow's row checksum unless `verify` is false."""
        entry = self.shards[shard]
        rows_arr = np.asarray(rows, dtype=np.int64).reshape(-1)
        bad = rows_arr[(rows_arr < 0) | (rows_arr >= entry.rows)]
        if bad.size:
            raise IndexError(
                f"{self.url}/{entry.path}: row {int(bad[0])} is outside [0, {entry.rows})"
            )
        unknown = [c for c in columns if c not in LIST_COLUMNS]
        if unknown:
            raise ValueError(
                f"read_rows_arrays reads the list columns {list(LIST_COLUMNS)}, not {unknown}"
            )
        f = self._file(shard)
        batch_of = f.batch_of(rows_arr).tolist()
        within = (rows_arr - f.starts[batch_of]).tolist()
        arrays = self._kept(shard, sorted(set(batch_of)))
        if isinstance(f, RemoteShard):
            sizes = (
                4 * self.index_column("padded_len")[rows_arr + self.shard_row_starts[shard]]
            ).tolist()
            new, ids = f.fetch(list(zip(batch_of, within, strict=True)), arrays, sizes)
            self._keep(shard, new, remote=True)
            arrays |= new
            got = [arrays[b].row(i, x) for b, i, x in zip(batch_of, within, ids, strict=True)]
        else:
            with self._shard_lock(shard):
                new = {b: f.arrays(b) for b in sorted(set(batch_of)) if b not in arrays}
            self._keep(shard, new, remote=False)
            arrays |= new
            got = [arrays[b].row(i) for b, i in zip(batch_of, within, strict=True)]
        if verify:
            self._check_row_checksums(shard, rows_arr, got)
        return {c: [row[LIST_COLUMNS.index(c)] for row in got] for c in columns}

    @property
    def has_row_checksums(self) -> bool:
        """Whether index.arrow holds `row_checksum` (format v1's extension): without it a row
        read in place cannot be checked, only a whole shard against the manifest."""
        return self._row_checksums is not None

    @cached_property
    def _row_checksums(self) -> np.ndarray | None:
        cols = self._index[1]
        return cols.get("row_checksum")

    def _check_row_checksums(self, shard: int, rows: np.ndarray, got: list[Row]) -> None:
        expected = self._row_checksums
        if expected is None:
            return
        base = int(self.shard_row_starts[shard])
        for r, row in zip(rows.tolist(), got, strict=True):
            if _row_digest(row) != int(expected[base + r]):
                raise FormatError(
                    f"{self.url}/{self.shards[shard].path}: row {r} does not match its checksum in "
                    "index.arrow (the shard is corrupted; run `packshard verify` and re-pack)"
                )

    def record_batch(self, shard: int, b: int) -> pa.RecordBatch:
        """Record batch `b` of a shard as Arrow (its length checked against the manifest)."""
        f = self._file(shard)
        if isinstance(f, LocalShard):
            return f.record_batch(b)
        where = f"{self.url}/{self.shards[shard].path}"
        try:
            with (
                reading(where),
                self.fs.open(f"{self.root}/{self.shards[shard].path}", "rb") as raw,
            ):
                batch = pa.ipc.open_file(raw).get_batch(b)
        except (pa.ArrowException, IndexError) as e:
            raise FormatError(
                f"{where}: record batch {b} is unreadable ({describe_error(e)})"
            ) from None
        f.check_length(b, batch.num_rows)
        return batch

    def read_rows(
        self,
        shard: int,
        rows: Sequence[int],
        columns: Sequence[str] | None = None,
        *,
        verify: bool = True,
    ) -> pa.Table:
        """Rows of one shard as an Arrow table, in the order asked, reading only the batches
        that hold them; with `verify`, each row checked against its checksum."""
        entry = self.shards[shard]
        rows = [int(r) for r in rows]
        for r in rows:
            if not 0 <= r < entry.rows:
                raise IndexError(f"{self.url}/{entry.path}: row {r} is outside [0, {entry.rows})")
        names = list(columns) if columns is not None else list(SHARD_SCHEMA.names)
        unknown = [c for c in names if c not in SHARD_SCHEMA.names]
        if unknown:
            raise ValueError(f"unknown columns {unknown}; shard columns are {SHARD_SCHEMA.names}")
        f = self._file(shard)
        batch_of = f.batch_of(np.asarray(rows, dtype=np.int64)).tolist()
        batches = {b: self.record_batch(shard, b) for b in sorted(set(batch_of))}
        picked = pa.Table.from_batches(
            [batches[b].slice(r - int(f.starts[b]), 1).select(names) for r, b in zip(rows, batch_of, strict=True)],
            schema=pa.schema([SHARD_SCHEMA.field(n) for n in names]),
        )  # fmt: skip
        if verify and rows:
            self.read_rows_arrays(shard, rows, LIST_COLUMNS, verify=True)
        return picked

    def read_row(
        self, global_row: int, columns: Sequence[str] | None = None, *, verify: bool = True
    ) -> dict[str, Any]:
        """One row as a dict of numpy arrays / ints."""
        shard, row = self.locate(global_row)
        t = self.read_rows(shard, [row], columns, verify=verify)
        return {name: _to_numpy(t.column(name)) for name in t.column_names}

    def iter_shard(self, shard: int) -> Iterator[pa.RecordBatch]:
        """All record batches of one shard in order, their lengths checked against the
        manifest (no row checksums: `packshard verify` compares rows with the index)."""
        for b in range(self._file(shard).num_batches):
            yield self.record_batch(shard, b)

    def shard_bytes(self, shard: int) -> bytes:
        """A whole shard file, checked against the manifest's size and checksum."""
        entry = self.shards[shard]
        where = f"{self.url}/{entry.path}"
        algorithm, _ = split_checksum(entry.checksum, where)
        data = self._read_whole(entry.path)
        _check_whole(where, entry, len(data), checksum_stream(_BytesReader(data).read, algorithm))
        return data

    def verify_shard(self, shard: int) -> None:
        """Re-hash the whole shard file and compare with the manifest; FormatError on mismatch."""
        entry = self.shards[shard]
        where = f"{self.url}/{entry.path}"
        algorithm, _ = split_checksum(entry.checksum, where)
        with reading(where), self.fs.open(f"{self.root}/{entry.path}", "rb") as f:
            got = checksum_stream(f.read, algorithm)
            size = f.tell()
        _check_whole(where, entry, size, got)

    def shard_file_problems(self) -> list[str]:
        """Shards whose file is missing or not the manifest's size, from one listing per shard
        directory (one request on object storage; no shard is opened). Where a directory
        cannot be listed (an HTTP server without index pages, a key that may read but not
        list), each of its shards is asked for its size instead; a shard the store will not
        say anything about is not reported. `verify` is the full check; this is the cheap one
        `packshard stats` runs."""
        sizes: dict[str, int | None] = {}
        unlisted: set[str] = set()
        for folder in sorted({e.path.rpartition("/")[0] for e in self.shards}):
            try:
                listed = self.fs.ls(f"{self.root}/{folder}".rstrip("/"), detail=True)
            except storage_errors():  # FileNotFoundError included (an OSError)
                listed = []
            if not listed:
                unlisted.add(folder)
            for info in listed:
                name = str(info["name"]).rstrip("/").rpartition("/")[2]
                size = info.get("size")
                sizes[f"{folder}/{name}" if folder else name] = None if size is None else int(size)
        problems = []
        for e in self.shards:
            if e.path not in sizes and e.path.rpartition("/")[0] in unlisted:
                try:
                    size = self.fs.info(f"{self.root}/{e.path}").get("size")
                except FileNotFoundError:
                    pass
                except storage_errors():
                    continue  # the store says nothing: not reported
                else:
                    sizes[e.path] = None if size is None else int(size)
            if e.path not in sizes:
                problems.append(f"{self.url}/{e.path}: missing (the manifest names it)")
            elif sizes[e.path] is not None and sizes[e.path] != e.bytes:
                problems.append(
                    f"{self.url}/{e.path}: {sizes[e.path]:,} bytes, the manifest says {e.bytes:,}"
                )
        return problems

    def open_shard_file(self, shard: int, path: str) -> None:
        """Read `shard` of this local dataset from the file at `path` from now on, opened here
        (memory-mapped: it stays readable after a rename or unlink). The shard cache opens a
        verified download under its temporary name before renaming it into place, so another
        process evicting that name cannot remove it under this one's next read."""
        entry = self.shards[shard]
        opened = LocalShard(path, f"{self.url}/{entry.path}", entry)
        with self._shard_lock(shard):
            before = self._files.pop(shard, None)
            self._files[shard] = opened
        with self._lock:
            for key in [k for k in self._arrays if k[0] == shard]:
                del self._arrays[key]
        if before is not None:
            before.close()

    def close_shard(self, shard: int) -> None:
        """Close one shard's open file (it is reopened on the next read of that shard)."""
        with self._shard_lock(shard):
            opened = self._files.pop(shard, None)
        with self._lock:
            for key in [k for k in self._arrays if k[0] == shard]:
                del self._arrays[key]
        if opened is not None:
            opened.close()

    def close(self) -> None:
        with self._lock:
            opened = list(self._files.values())
            self._files.clear()
            self._arrays.clear()
        for f in opened:
            f.close()

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row_digest(row: Row) -> int:
    """index.arrow's row_checksum of a row read here, hashed in place: the arrays are already
    contiguous int32 / bool / int32 / int64 (rows.row_checksum copies each to bytes first)."""
    h = xxhash.xxh3_64()
    for part in row:
        h.update((part.view(np.uint8) if part.dtype == np.bool_ else part).data)
    return h.intdigest()


def _check_whole(where: str, entry: ShardEntry, size: int, checksum: str) -> None:
    if size != entry.bytes:
        raise FormatError(f"{where}: {size} bytes, the manifest says {entry.bytes}")
    if checksum != entry.checksum:
        raise FormatError(
            f"{where}: checksum {checksum} does not match the manifest's {entry.checksum}"
        )


def _no_dataset(url: str, fs: fsspec.AbstractFileSystem, root: str) -> FormatError:
    """Why there is no manifest.json at `url`: the clearest error for what is there."""
    try:
        if not fs.exists(root):
            return DatasetNotFoundError(f"{url} does not exist (no file or directory there)")
        if fs.isfile(root):
            return DatasetNotFoundError(f"{url} is a file, not a packshard dataset directory")
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    except storage_errors() as e:
        return StorageError(f"{url}: cannot list it ({describe_error(e)})")
    if not names:
        return DatasetNotFoundError(f"{url} is an empty directory: no packshard dataset there")
    if JOB_DIR in names:
        return DatasetNotFoundError(
            f"{url} holds an unfinished pack job, not a dataset yet (no {MANIFEST_NAME}): rerun the "
            "pack command that wrote it to finish it"
        )
    if names & {SHARDS_DIR, INDEX_NAME}:
        return DatasetNotFoundError(
            f"{url} holds shards but no {MANIFEST_NAME}: a write that stopped before its commit; "
            "rerun the pack command that wrote it"
        )
    return DatasetNotFoundError(
        f"{url} holds no packshard dataset (no {MANIFEST_NAME} among its {len(names)} entries)"
    )


def _ids_bytes(arrays: BatchArrays) -> int:
    """Bytes of a batch's kept input_ids (what `_keep` counts against `whole_batch_bytes`)."""
    return arrays.ids.nbytes if arrays.ids is not None else 0


def _to_numpy(col: pa.ChunkedArray) -> Any:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_list(arr.type):
        child = arr.values
        lo, hi = arr.offsets[0].as_py(), arr.offsets[-1].as_py()
        return column_numpy(child.slice(lo, hi - lo))
    return column_numpy(arr)[0].item()


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int) -> bytes:
        chunk = self._view[self._pos : self._pos + n]
        self._pos += len(chunk)
        return bytes(chunk)
