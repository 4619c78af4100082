"""Writing a shard dataset: shards (Arrow IPC files), then index.arrow, then manifest.json.

Building blocks, usable from one process or from many Ray tasks:

- `write_shard(fs, root, number, batches)` writes one shard file and returns its
  `ShardRecord` (manifest entry + per-row index columns). Rows go into record batches of
  `rows_per_batch` rows so a reader can fetch one row by reading one batch; the shard's
  checksum and size are computed while the bytes stream out (no second pass).
- `finalize_dataset(fs, root, config, shards, totals)` writes index.arrow and then, last,
  manifest.json: the commit point. A dataset without a manifest does not exist for readers.

`DatasetWriter` streams rows into shards in one process, rolling to a new shard at a row or
byte limit, and finalizes on `close()`. The fsspec filesystem comes from the URL, so local
paths, s3://, gs:// and any other fsspec protocol work the same way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from packshard.packers.arrays import column_numpy, numeric_array
from packshard.packers.format import (
    DEFAULT_CHECKSUM,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    INDEX_SCHEMA,
    MANIFEST_NAME,
    SHARD_SCHEMA,
    FormatError,
    HashingWriter,
    fs_url,
    protocols,
    shard_name,
)
from packshard.packers.manifest import ShardEntry, parse_config, shape_problems
from packshard.packers.rows import row_index_stats

log = logging.getLogger(__name__)

DEFAULT_BATCH_BYTES = 4 << 20
HISTOGRAM_BINS = 32


def rows_per_batch_for(seq_len: int, target_bytes: int = DEFAULT_BATCH_BYTES) -> int:
    """Rows per record batch so a full batch is about `target_bytes` (at least 1 row).

    A full row costs 4.125 bytes per token (int32 id + mask bit), so with the 4 MiB default a
    batch holds 124 rows at seq_len 8192 and 7 rows (0.53 MiB each) at 131072.
    """
    return max(1, target_bytes // max(1, seq_len * 4 + seq_len // 8))


def url_to_fs(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path without protocol) for any fsspec URL or local path."""
    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, path.rstrip("/") or path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` is the local filesystem (memory-mapped reads, real directories)."""
    return bool({"file", "local"} & set(protocols(fs)))


@dataclass(frozen=True)
class ShardRecord(ShardEntry):
    """A written shard: its manifest entry plus the index columns of its rows."""

    index: dict[str, np.ndarray] = field(repr=False, compare=False)

    def manifest_entry(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(ShardEntry)}

    @classmethod
    def from_entry(cls, entry: dict[str, Any], index: dict[str, np.ndarray]) -> ShardRecord:
        """The record of a shard whose manifest entry (`manifest_entry`) was kept elsewhere."""
        return cls(**{f.name: entry[f.name] for f in fields(ShardEntry)}, index=index)


INDEX_COLUMNS = tuple(k for k in INDEX_SCHEMA.names if k not in ("shard", "row"))


def index_columns(stats: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The index columns of a shard's rows from its batches' `row_index_stats`."""
    return {
        k: np.concatenate([s[k] for s in stats]) if stats else np.zeros(0, np.int64)
        for k in INDEX_COLUMNS
    }


def write_shard(
    fs: fsspec.AbstractFileSystem,
    root: str,
    number: int,
    batches: Iterable[pa.RecordBatch],
    *,
    rows_per_batch: int,
    checksum: str = DEFAULT_CHECKSUM,
) -> ShardRecord:
    """Write shard `number` under `root` from shard-schema batches (rows re-chunked to
    `rows_per_batch`). The file is written to a temporary name and moved into place, so a
    crash never leaves a half-written file under the final name."""
    rel = shard_name(number)
    final = f"{root}/{rel}"
    tmp = f"{final}.tmp"
    fs.makedirs(f"{root}/shards", exist_ok=True)
    stats: list[dict[str, np.ndarray]] = []
    totals = {"rows": 0, "num_tokens": 0, "padded_tokens": 0, "loss_tokens": 0}
    with fs.open(tmp, "wb") as raw:
        sink = HashingWriter(raw, checksum)
        with pa.ipc.new_file(sink, SHARD_SCHEMA) as writer:
            for chunk in _rechunk(batches, rows_per_batch):
                if chunk.schema != SHARD_SCHEMA:
                    raise ValueError(f"batch schema differs from the shard schema:\n{chunk.schema}")
                writer.write_batch(chunk)
                s = row_index_stats(chunk)
                stats.append(s)
                totals["rows"] += chunk.num_rows
                totals["num_tokens"] += int(s["num_tokens"].sum())
                totals["padded_tokens"] += int(s["padded_len"].sum())
                totals["loss_tokens"] += int(s["num_loss_tokens"].sum())
        size, digest = sink.bytes_written, sink.checksum
    fs.mv(tmp, final)
    return ShardRecord(
        path=rel,
        bytes=size,
        checksum=digest,
        rows_per_batch=rows_per_batch,
        index=index_columns(stats),
        **totals,
    )


def _rechunk(batches: Iterable[pa.RecordBatch], rows: int) -> Iterable[pa.RecordBatch]:
    """Yield batches of exactly `rows` rows (the last may be shorter)."""
    pending: list[pa.RecordBatch] = []
    have = 0
    for b in batches:
        if b.num_rows == 0:
            continue
        pending.append(b)
        have += b.num_rows
        while have >= rows:
            table = pa.Table.from_batches(pending)
            head, rest = table.slice(0, rows), table.slice(rows)
            yield head.combine_chunks().to_batches()[0]
            pending = rest.combine_chunks().to_batches() if rest.num_rows else []
            have = rest.num_rows
    if have:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]


def build_index(shards: list[ShardRecord]) -> pa.Table:
    """index.arrow's table: one row per packed row, in shard then row order."""
    cols: dict[str, list[np.ndarray]] = {name: [] for name in INDEX_SCHEMA.names}
    for number, shard in enumerate(shards):
        cols["shard"].append(np.full(shard.rows, number, dtype=np.int32))
        cols["row"].append(np.arange(shard.rows, dtype=np.int32))
        for name in INDEX_COLUMNS:
            cols[name].append(shard.index[name])
    arrays = [
        numeric_array(np.concatenate(cols[f.name]) if cols[f.name] else np.zeros(0), f.type)
        for f in INDEX_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=INDEX_SCHEMA)


def histogram(num_tokens: np.ndarray, seq_len: int, bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
    """Histogram of true row lengths over [0, seq_len] in `bins` equal bins."""
    edges = np.linspace(0, seq_len, bins + 1).round().astype(np.int64)
    counts, _ = np.histogram(num_tokens, bins=edges)
    return {"of": "num_tokens", "edges": edges.tolist(), "counts": counts.tolist()}


def finalize_dataset(
    fs: fsspec.AbstractFileSystem,
    root: str,
    config: Mapping[str, Any],
    shards: list[ShardRecord],
    totals: Mapping[str, Any],
    *,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write index.arrow, then manifest.json (last: the commit). Returns the manifest.

    `totals` holds the sample counts the writer cannot know: ``samples_in``,
    ``samples_kept``, ``dropped`` (reason -> count) and any other counters (truncation,
    splits); row and token totals are computed here from the shards.
    """
    for key in ("samples_in", "samples_kept", "dropped"):
        if key not in totals:
            raise ValueError(f"totals must hold {key!r}")
    index = build_index(shards)
    index_path = f"{root}/{INDEX_NAME}"
    with fs.open(index_path, "wb") as raw:
        sink = HashingWriter(raw)
        with pa.ipc.new_file(sink, INDEX_SCHEMA) as writer:
            writer.write_table(index)
    num_tokens = sum(s.num_tokens for s in shards)
    padded = sum(s.padded_tokens for s in shards)
    manifest: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "config": dict(config),
        "shards": [s.manifest_entry() for s in shards],
        "index": {
            "path": INDEX_NAME,
            "rows": index.num_rows,
            "bytes": sink.bytes_written,
            "checksum": sink.checksum,
        },
        "totals": {
            **dict(totals),
            "rows": sum(s.rows for s in shards),
            "num_tokens": num_tokens,
            "padded_tokens": padded,
            "loss_tokens": sum(s.loss_tokens for s in shards),
            "padding_fraction": (padded - num_tokens) / padded if padded else 0.0,
        },
        "histogram": histogram(column_numpy(index.column("num_tokens")), int(config["seq_len"])),
    }
    if extra:
        manifest.update(extra)
    write_json_atomic(fs, f"{root}/{MANIFEST_NAME}", manifest)
    log.info(
        "committed %s: %d shards, %d rows",
        fs_url(fs, root),
        len(shards),
        manifest["totals"]["rows"],
    )
    return manifest


def write_json_atomic(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    """Write JSON to `path` via a temporary name, so readers never see half a file."""
    data = json.dumps(obj, indent=2, sort_keys=False).encode() + b"\n"
    tmp = f"{path}.tmp"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


class DatasetWriter:
    """Stream shard-schema batches into a dataset in one process.

    Rolls to a new shard once a shard holds `max_rows` rows or about `max_bytes` bytes of
    token data. `close(totals)` writes the last shard, index.arrow and manifest.json.
    """

    def __init__(
        self,
        url: str,
        config: Mapping[str, Any],
        *,
        max_rows: int = 65536,
        max_bytes: int = 256 << 20,
        rows_per_batch: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        try:  # what readers check, and the shape rules verify reports
            parse_config({"config": dict(config)}, "config")
        except FormatError as e:
            raise ValueError(str(e)) from None
        shape = shape_problems(dict(config))
        if shape:
            raise ValueError(f"config: {'; '.join(shape)}")
        if max_rows < 1 or max_bytes < 1:
            raise ValueError(f"max_rows ({max_rows}) and max_bytes ({max_bytes}) must be >= 1")
        self.fs, self.root = url_to_fs(url, storage_options)
        self.config = dict(config)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.rows_per_batch = rows_per_batch or rows_per_batch_for(int(config["seq_len"]))
        self.shards: list[ShardRecord] = []
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._pending_bytes = 0
        self.fs.makedirs(self.root, exist_ok=True)

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Add rows; full shards are written as they fill."""
        batches = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        for b in batches:
            start = 0
            while start < b.num_rows:
                room = self.max_rows - self._pending_rows
                part = b.slice(start, room)
                self._pending.append(part)
                self._pending_rows += part.num_rows
                self._pending_bytes += part.nbytes
                start += part.num_rows
                if self._pending_rows >= self.max_rows or self._pending_bytes >= self.max_bytes:
                    self._flush()

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        record = write_shard(
            self.fs, self.root, len(self.shards), self._pending, rows_per_batch=self.rows_per_batch
        )
        self.shards.append(record)
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0

    def close(
        self, totals: Mapping[str, Any], *, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write the remaining rows, index.arrow and manifest.json; return the manifest."""
        self._flush()
        return finalize_dataset(self.fs, self.root, self.config, self.shards, totals, extra=extra)
