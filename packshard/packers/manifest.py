"""manifest.json and index.arrow of shard format v1, checked for everything a reader relies on.

`parse_manifest(obj, where)` takes a decoded manifest and returns a `Manifest` whose every field
has the type and range docs/FORMAT.md gives it, or raises `FormatError` naming the file and the
key (``shards[3].rows must be an int >= 0, got '12'``). `check_index(table, manifest, where)`
then cross-checks index.arrow against it, vectorised (a million rows in ~20 ms): the `shard` /
`row` columns against each shard's `rows`; per-shard and total sums of tokens, padded tokens and
loss tokens against the manifest; every row's lengths against `seq_len` and `pad_multiple`; the
histogram's counts; and the sample accounting of `totals`. A manifest edited by hand or damaged
in storage so fails at open with one clear error, before any shard is read, instead of as an
`IndexError` or a pyarrow error deep in a read; `packshard stats` (which reads only these two
files) so never prints numbers the index contradicts.

What cannot be checked without reading the shards (file sizes and checksums, the rows' contents
and sample ids) is checked by the shard reader (record batches against `rows` and
`rows_per_batch`, each row against its checksum in the index) and by `packshard verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from packshard.packers.arrays import column_numpy
from packshard.packers.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    INDEX_REQUIRED,
    INDEX_SCHEMA,
    FormatError,
    check_relative_path,
    split_checksum,
)

MANIFEST_KEYS = ("format", "version", "config", "shards", "totals")
CONFIG_KEYS = ("seq_len", "pad_multiple", "pad_token_id")
SHARD_KEYS = ("path", "rows", "num_tokens", "padded_tokens", "loss_tokens", "bytes", "checksum")
TOTALS_COUNTS = ("rows", "num_tokens", "padded_tokens", "loss_tokens")
# what the pack job's overlong policy did, per shard and in the totals (pipeline.tasks counts
# them, scheduler.merge_counters sums them, stats and the job's summary print them): optional,
# and counts when present
OVERLONG_COUNTS = (
    "truncated_samples", "truncated_tokens", "split_samples", "extra_pieces", "dropped_tokens",
    "lossless_pieces", "lossless_piece_tokens",
)  # fmt: skip


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest describes it. `rows_per_batch` is 0 when the manifest does not
    record it (the reader then takes the record batches' lengths from the file)."""

    path: str
    rows: int
    num_tokens: int
    padded_tokens: int
    loss_tokens: int
    bytes: int
    checksum: str
    rows_per_batch: int


@dataclass(frozen=True)
class IndexEntry:
    """Where index.arrow is and, when recorded, its size, row count and checksum."""

    path: str
    rows: int | None
    bytes: int | None
    checksum: str | None


@dataclass(frozen=True)
class Manifest:
    """A checked manifest: the raw object plus the fields readers use."""

    raw: dict[str, Any]
    config: dict[str, Any]
    shards: list[ShardEntry]
    index: IndexEntry
    totals: dict[str, Any]


INT32_MAX = 2**31 - 1  # row lengths, offsets and token ids are int32 in format v1
INT64_MAX = 2**63 - 1  # counts and sizes: readers compute with them in int64


def _int(
    obj: Any,
    key: str,
    where: str,
    *,
    low: int = 0,
    high: int = INT64_MAX,
    optional: bool = False,
) -> Any:
    """obj[key] as an int in [low, high] (bool is not an int here); None when optional and
    absent. The upper bound keeps a number JSON allows (10**30) from reaching numpy."""
    if key not in obj:
        if optional:
            return None
        raise FormatError(f"{where}: missing key {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise FormatError(f"{where}: {key} must be an int >= {low}, got {value!r}")
    if value > high:
        raise FormatError(f"{where}: {key} must be an int <= {high:,}, got {value!r}")
    return value


def _object(obj: Any, key: str, where: str) -> dict[str, Any]:
    value = obj.get(key)
    if not isinstance(value, dict):
        raise FormatError(f"{where}: {key} must be a JSON object, got {type(value).__name__}")
    return value


def parse_manifest(manifest: Any, where: str) -> Manifest:
    """Check a decoded manifest (see the module docstring); FormatError naming `where`."""
    if not isinstance(manifest, dict):
        raise FormatError(f"{where}: the manifest must be a JSON object")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise FormatError(f"{where}: missing keys {missing}")
    if manifest["format"] != FORMAT_NAME:
        raise FormatError(f"{where}: format is {manifest['format']!r}, not {FORMAT_NAME!r}")
    if manifest["version"] != FORMAT_VERSION or isinstance(manifest["version"], bool):
        raise FormatError(
            f"{where}: format version {manifest['version']!r} is not known to this reader "
            f"(it reads version {FORMAT_VERSION}); upgrade packshard"
        )
    config = parse_config(manifest, where)
    if not isinstance(manifest["shards"], list):
        raise FormatError(f"{where}: shards must be a list")
    shards = [_parse_shard(s, f"{where}: shards[{i}]") for i, s in enumerate(manifest["shards"])]
    paths = [s.path for s in shards]
    if len(set(paths)) != len(paths):
        raise FormatError(f"{where}: shards name a file twice")
    index = _parse_index(manifest, where, sum(s.rows for s in shards))
    if index.path in paths:
        raise FormatError(f"{where}: index.path {index.path!r} is also a shard")
    totals = _parse_totals(manifest, where, shards)
    examples = manifest.get("skipped_examples")
    if examples is not None and not (
        isinstance(examples, list) and all(isinstance(e, list) for e in examples)
    ):
        raise FormatError(f"{where}: skipped_examples must be a list of lists")
    return Manifest(manifest, config, shards, index, totals)


def parse_config(manifest: dict[str, Any], where: str) -> dict[str, Any]:
    """manifest['config'] with the fields readers rely on checked (the writer checks it too)."""
    config = _object(manifest, "config", where)
    here = f"{where}: config"
    _int(config, "seq_len", here, low=1, high=INT32_MAX)
    _int(config, "pad_multiple", here, low=1, high=INT32_MAX)
    _int(config, "pad_token_id", here, high=INT32_MAX)  # a token id, as the rows' ids
    if config.get("cp") is not None:
        _int(config, "cp", here, low=1, high=INT32_MAX)
    tokenizer = config.get("tokenizer")
    if tokenizer is not None and not (
        isinstance(tokenizer, dict) and isinstance(tokenizer.get("name", ""), str | None)
    ):
        raise FormatError(
            f"{here}: tokenizer must be an object with a string name, got {tokenizer!r}"
        )
    return config


def shape_problems(config: dict[str, Any]) -> list[str]:
    """Where a (parsed) config breaks the shape rules the pack job keeps: seq_len a multiple of
    pad_multiple, pad_multiple a multiple of cp (rows split into cp or 2*cp equal chunks).
    The writer refuses such a config and `verify` reports it; readers still open a dataset
    written before the writer checked, since its rows read the same."""
    seq_len, multiple, cp = config["seq_len"], config["pad_multiple"], config.get("cp")
    out = []
    if seq_len % multiple:
        out.append(f"seq_len {seq_len} is not a multiple of pad_multiple {multiple}")
    if cp is not None and multiple % cp:
        out.append(f"pad_multiple {multiple} is not a multiple of cp {cp}")
    return out


def _parse_shard(s: Any, here: str) -> ShardEntry:
    if not isinstance(s, dict):
        raise FormatError(f"{here} must be a JSON object holding {list(SHARD_KEYS)}")
    missing = [k for k in SHARD_KEYS if k not in s]
    if missing:
        raise FormatError(f"{here}: missing keys {missing}")
    check_relative_path(s["path"], here)
    split_checksum(s["checksum"], here)
    counts = {k: _int(s, k, here) for k in ("rows", "num_tokens", "padded_tokens", "loss_tokens")}
    size = _int(s, "bytes", here, low=1)
    per_batch = _int(s, "rows_per_batch", here, low=1, optional=True) or 0
    return ShardEntry(
        path=s["path"], **counts, bytes=size, checksum=s["checksum"], rows_per_batch=per_batch
    )


def _parse_index(manifest: dict[str, Any], where: str, rows: int) -> IndexEntry:
    if "index" not in manifest:
        return IndexEntry(INDEX_NAME, None, None, None)
    entry = _object(manifest, "index", where)
    here = f"{where}: index"
    path = check_relative_path(entry.get("path"), here)
    n = _int(entry, "rows", here, optional=True)
    if n is not None and n != rows:
        raise FormatError(f"{here}: rows is {n}, but the shards hold {rows}")
    size = _int(entry, "bytes", here, low=1, optional=True)
    checksum = entry.get("checksum")
    if checksum is not None:
        split_checksum(checksum, here)
    return IndexEntry(path, n, size, checksum)


def _parse_totals(manifest: dict[str, Any], where: str, shards: list[ShardEntry]) -> dict[str, Any]:
    totals = _object(manifest, "totals", where)
    here = f"{where}: totals"
    for key in TOTALS_COUNTS:
        got = _int(totals, key, here)
        want = sum(getattr(s, key) for s in shards)
        if got != want:
            raise FormatError(f"{here}: {key} is {got}, but the shards hold {want}")
    for key in OVERLONG_COUNTS:
        _int(totals, key, here, optional=True)
    samples_in = _int(totals, "samples_in", here)
    kept = _int(totals, "samples_kept", here)
    dropped = _object(totals, "dropped", here)
    for reason in dropped:
        _int(dropped, reason, f"{here}.dropped")
    if samples_in != kept + sum(dropped.values()):
        raise FormatError(
            f"{here}: samples_in is {samples_in}, but samples_kept is {kept} and dropped "
            f"{sum(dropped.values())}: they do not add up"
        )
    fraction = totals.get("padding_fraction")
    padded, true = totals["padded_tokens"], totals["num_tokens"]
    want = (padded - true) / padded if padded else 0.0
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, int | float)
        or abs(fraction - want) > 1e-9
    ):
        raise FormatError(
            f"{here}: padding_fraction is {fraction!r}, the token counts give {want!r}"
        )
    return totals


def check_index(table: pa.Table, manifest: Manifest, where: str) -> dict[str, np.ndarray]:
    """index.arrow's columns as numpy, checked against the manifest (FormatError naming
    `where`); returns {column: array} for the columns of INDEX_SCHEMA present."""
    missing = [c for c in INDEX_REQUIRED if c not in table.column_names]
    if missing:
        raise FormatError(f"{where}: missing columns {missing}")
    cols: dict[str, np.ndarray] = {}
    for field in INDEX_SCHEMA:
        if field.name not in table.column_names:
            continue
        col = table.column(field.name)
        if col.type != field.type or col.null_count:
            raise FormatError(
                f"{where}: column {field.name} must be non-null {field.type}, is {col.type}"
            )
        cols[field.name] = column_numpy(col)
    shards = manifest.shards
    rows = np.array([s.rows for s in shards], dtype=np.int64)
    if table.num_rows != rows.sum():
        raise FormatError(
            f"{where}: {table.num_rows} rows, but the manifest's shards hold {rows.sum()}"
        )
    starts = np.concatenate(([0], np.cumsum(rows)))
    expect_shard = np.repeat(np.arange(len(shards), dtype=np.int64), rows)
    expect_row = np.arange(table.num_rows, dtype=np.int64) - np.repeat(starts[:-1], rows)
    bad = np.flatnonzero((cols["shard"] != expect_shard) | (cols["row"] != expect_row))
    if bad.size:
        r = int(bad[0])
        raise FormatError(
            f"{where}: row {r} points at shard {cols['shard'][r]} row {cols['row'][r]}, but the manifest's "
            f"shard rows put it at shard {expect_shard[r]} row {expect_row[r]}"
        )
    _check_rows(cols, manifest, where)
    for key, col in (("num_tokens", "num_tokens"), ("padded_tokens", "padded_len"), ("loss_tokens", "num_loss_tokens")):  # fmt: skip
        sums = (
            np.add.reduceat(cols[col].astype(np.int64), starts[:-1])
            if table.num_rows
            else np.zeros(0)
        )
        sums = np.where(rows > 0, sums, 0)
        for i in np.flatnonzero(sums != [getattr(s, key) for s in shards])[:1]:
            raise FormatError(
                f"{where}: the rows of shard {int(i)} ({shards[int(i)].path}) sum to {key} "
                f"{int(sums[i])}, the manifest says {getattr(shards[int(i)], key)}"
            )
    _check_histogram(manifest, cols["num_tokens"], where)
    return cols


def _check_rows(cols: dict[str, np.ndarray], manifest: Manifest, where: str) -> None:
    """What readers rely on per row (the other row rules are `packshard verify`'s)."""
    seq_len, multiple = manifest.config["seq_len"], manifest.config["pad_multiple"]
    tokens, padded = cols["num_tokens"].astype(np.int64), cols["padded_len"].astype(np.int64)
    rules = (
        ((padded < 1) | (padded > seq_len), f"padded_len outside [1, seq_len {seq_len}]"),
        (padded % multiple != 0, f"padded_len not a multiple of pad_multiple {multiple}"),
        ((tokens < 0) | (tokens > padded), "num_tokens outside [0, padded_len]"),
        (cols["num_loss_tokens"] < 0, "num_loss_tokens < 0"),
        (cols["num_docs"] < 0, "num_docs < 0"),
        (cols["attn_cost"] < 0, "attn_cost < 0"),
    )
    for bad, what in rules:
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise FormatError(f"{where}: row {r} has {what} (and {int(bad.sum()) - 1} more rows)")


def _check_histogram(manifest: Manifest, num_tokens: np.ndarray, where: str) -> None:
    if "histogram" not in manifest.raw:
        return
    hist = manifest.raw["histogram"]
    here = f"{where.rsplit('/', 1)[0]}/manifest.json: histogram"
    if not isinstance(hist, dict):
        raise FormatError(f"{here} must be a JSON object")
    edges, counts = hist.get("edges"), hist.get("counts")
    if not (
        isinstance(edges, list) and isinstance(counts, list) and len(edges) == len(counts) + 1 >= 2
    ):
        raise FormatError(f"{here}: edges and counts must be lists, one more edge than counts")
    if not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT64_MAX
        for x in edges + counts
    ):
        raise FormatError(f"{here}: edges and counts must be ints in [0, {INT64_MAX:,}]")
    e = np.asarray(edges, dtype=np.int64)
    seq_len = manifest.config["seq_len"]
    if not np.array_equal(e, np.linspace(0, seq_len, e.size).round()):
        raise FormatError(
            f"{here}: edges must cut [0, seq_len {seq_len}] into {e.size - 1} equal bins "
            "(rounded to integers)"
        )
    got, _ = np.histogram(num_tokens, bins=e)
    if got.tolist() != counts:
        raise FormatError(
            f"{here}: counts {counts} do not match index.arrow's rows ({got.tolist()})"
        )
