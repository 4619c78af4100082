"""Inputs: listing them, counting their records, and reading any range of records.

An input spec is a local path, a glob, a directory, or any fsspec URL (``s3://``, ``gs://``,
``hf://datasets/...``), a Hugging Face ``save_to_disk`` directory, a bare hub dataset name
(``org/name``, read through ``hf://`` where the hub is reachable), or ``demo://`` (the built-in
generated dataset, made inside the tasks that read it, so nothing travels from the driver).
Globs expand sorted; directories list their supported files recursively, sorted. Formats, by
extension: ``.jsonl``/``.ndjson`` (also ``.gz``, ``.zst``), ``.json`` (an array of records, an
object holding one list of records, or JSON lines), ``.parquet``, ``.arrow``/``.feather``/``.ipc``
(Arrow IPC file or stream format, detected), ``.txt`` (one ``{"text": line}`` per line).

Sample ids need each file's record count before any work (a sample's id is its index in input
order), so the job first counts every file once, in parallel, and keeps the counts in its plan
(a resumed run does not recount). Counting costs a newline scan for JSON lines (also recording
the byte offset of every 1024th record, so a block can seek straight to its first record) and
only the footer for parquet; Arrow streams, ``.json`` arrays and compressed files are read
whole. Reading records [a, b) of a compressed or ``.json`` file decompresses/parses from the
start: split big compressed inputs into several files, or leave them uncompressed.

Blank lines are not records. Every record comes with its location (``file:line N`` for text
formats, ``file:row N`` for tabular ones, 1-based), used in every error message.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.samples import BadRecord

STRIDE = 1024
DEMO_SCHEME = "demo://"
TEXT_FORMATS = ("jsonl", "txt")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".txt": "txt",
}
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


class InputError(ValueError):
    """An input cannot be listed or read (names the input and the fix)."""


@dataclass(frozen=True)
class InputFile:
    """One input file, as resolved and counted. `url` keeps its protocol (plain path if local)."""

    url: str
    format: str
    compression: str | None = None
    size: int = 0
    version: str = ""
    records: int = -1
    checkpoints: tuple[tuple[int, int], ...] = ()  # (byte offset, line number) of record k*STRIDE

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["checkpoints"] = [list(c) for c in self.checkpoints]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> InputFile:
        return cls(**{**d, "checkpoints": tuple(tuple(c) for c in d.get("checkpoints", ()))})


def _format_of(path: str) -> tuple[str, str | None] | None:
    name = posixpath.basename(path).lower()
    compression = None
    for ext, comp in _COMPRESSIONS.items():
        if name.endswith(ext):
            name, compression = name[: -len(ext)], comp
            break
    for ext, fmt in _EXTENSIONS.items():
        if name.endswith(ext):
            if compression and fmt in ("parquet", "arrow"):
                return None
            return fmt, compression
    return None


def _fs(
    url: str, storage_options: Mapping[str, Any] | None
) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **dict(storage_options or {}))


def _join(fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def _version(info: Mapping[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


def resolve_inputs(
    specs: Sequence[str], *, storage_options: Mapping[str, Any] | None = None, split: str = "train"
) -> list[InputFile]:
    """Every input file, in the order given (each glob / directory expanded sorted)."""
    files: list[InputFile] = []
    for spec in specs:
        found = _resolve_one(spec, storage_options, split)
        if not found:
            raise InputError(f"input {spec!r} matches no readable files")
        files.extend(found)
    if not files:
        raise InputError("no inputs given (pass --input, or --demo)")
    return files


def _resolve_one(
    spec: str, storage_options: Mapping[str, Any] | None, split: str
) -> list[InputFile]:
    if spec.startswith(DEMO_SCHEME):
        return [InputFile(url=spec, format="demo", records=demo_size(spec))]
    try:
        fs, path = _fs(spec, storage_options)
    except (ImportError, ValueError) as e:
        raise InputError(f"input {spec!r}: cannot open its filesystem ({e})") from None
    try:
        if any(c in path for c in "*?["):
            paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
            return [_file(fs, p, spec) for p in paths if _format_of(p)]
        if fs.isdir(path):
            return _directory(fs, path, spec, split)
        if fs.isfile(path):
            return [_file(fs, path, spec, strict=True)]
    except PermissionError as e:
        raise InputError(f"input {spec!r}: permission denied ({e})") from None
    except OSError as e:
        raise InputError(f"input {spec!r}: cannot be listed ({type(e).__name__}: {e})") from None
    if _looks_like_hub_name(spec):
        return _hub_dataset(spec, storage_options, split)
    raise InputError(f"input {spec!r} does not exist")


def _file(fs: fsspec.AbstractFileSystem, path: str, spec: str, strict: bool = False) -> InputFile:
    fmt = _format_of(path)
    if fmt is None:
        if strict:
            raise InputError(
                f"input {spec!r}: unsupported file type; packshard reads .jsonl/.ndjson (+.gz/.zst), .json, "
                ".parquet, .arrow/.feather/.ipc, .txt and Hugging Face save_to_disk directories"
            )
        raise AssertionError(path)
    info = fs.info(path)
    if fmt[0] == "arrow":
        with fs.open(path, "rb") as f:
            magic = f.read(6)
        fmt = ("arrow" if magic == b"ARROW1" else "arrow_stream", None)
    return InputFile(
        url=_join(fs, path),
        format=fmt[0],
        compression=fmt[1],
        size=int(info.get("size") or 0),
        version=_version(info),
    )


def _directory(fs: fsspec.AbstractFileSystem, path: str, spec: str, split: str) -> list[InputFile]:
    if fs.isfile(f"{path}/dataset_dict.json"):
        with fs.open(f"{path}/dataset_dict.json", "r") as f:
            splits = json.load(f).get("splits", [])
        if split not in splits:
            raise InputError(
                f"input {spec!r} is a DatasetDict without split {split!r} (it has {splits}); pass --split"
            )
        path = f"{path}/{split}"
    if fs.isfile(
        f"{path}/state.json"
    ):  # a Hugging Face save_to_disk dataset: its arrow files, in order
        with fs.open(f"{path}/state.json", "r") as f:
            state = json.load(f)
        names = [d["filename"] for d in state.get("_data_files", [])]
        if not names:
            raise InputError(f"input {spec!r}: state.json lists no data files")
        return [_file(fs, f"{path}/{n}", spec, strict=True) for n in names]
    paths = sorted(
        p
        for p in fs.find(path)
        if _format_of(p) and not posixpath.basename(p).startswith((".", "_"))
    )
    return [_file(fs, p, spec) for p in paths]


def _looks_like_hub_name(spec: str) -> bool:
    """`org/name` with no scheme, no leading ./ or /, and no file extension."""
    return (
        "://" not in spec
        and spec.count("/") == 1
        and not spec.startswith((".", "/"))
        and "." not in spec.rsplit("/", 1)[1]
    )


def _hub_dataset(
    name: str, storage_options: Mapping[str, Any] | None, split: str
) -> list[InputFile]:
    """A bare hub name `org/name`: its data files for `split` through the hf:// filesystem."""
    url = f"hf://datasets/{name}"
    try:
        fs, path = _fs(url, storage_options)
        paths = sorted(p for p in fs.find(path) if _format_of(p))
    except (
        Exception
    ) as e:  # the hub client raises its HTTP library's errors (not OSError): report them
        raise InputError(
            f"input {name!r} is not a local path, and the Hugging Face hub dataset of that name cannot "
            f"be listed ({type(e).__name__}: {e}); check the name and network access"
        ) from None
    chosen = [
        p for p in paths if f"/{split}" in p[len(path) :] or posixpath.basename(p).startswith(split)
    ]
    if not chosen:
        raise InputError(f"hub dataset {name!r} has no data files for split {split!r}")
    return [_file(fs, p, url) for p in chosen]


# ---- demo ------------------------------------------------------------------------------


def _demo_params(url: str) -> dict[str, int]:
    from urllib.parse import parse_qsl, urlsplit

    try:
        params = {k: int(v) for k, v in parse_qsl(urlsplit(url).query)}
    except ValueError:
        raise InputError(
            f"{url}: demo parameters are integers (seed, num_math, num_trajectories)"
        ) from None
    unknown = set(params) - {"seed", "num_math", "num_trajectories"}
    if unknown:
        raise InputError(f"{url}: unknown demo parameters {sorted(unknown)}")
    return params


def demo_size(url: str) -> int:
    """Records of ``demo://[?seed=N&num_math=N&num_trajectories=N]`` (none generated)."""
    from pipeline.demo import DEMO_NUM_MATH, DEMO_NUM_TRAJECTORIES

    params = _demo_params(url)
    return params.get("num_math", DEMO_NUM_MATH) + params.get(
        "num_trajectories", DEMO_NUM_TRAJECTORIES
    )


@functools.lru_cache(maxsize=2)
def demo_records_cached(url: str) -> tuple[dict[str, Any], ...]:
    """The built-in demo records of a ``demo://`` URL, made once per process (in the tasks
    that read them: nothing travels from the driver)."""
    from pipeline.demo import demo_records

    return tuple(demo_records(**_demo_params(url)))


# ---- counting --------------------------------------------------------------------------


def _open(f: InputFile, storage_options: Mapping[str, Any] | None) -> BinaryIO:
    fs, path = _fs(f.url, storage_options)
    try:
        raw = fs.open(path, "rb")
    except FileNotFoundError:
        raise InputError(
            f"{f.url}: the input disappeared (it was listed when the job started)"
        ) from None
    except PermissionError as e:
        raise InputError(f"{f.url}: permission denied ({e})") from None
    if f.compression == "gzip":
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    if f.compression == "zstd":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))  # type: ignore[return-value]
    return raw


def count_records(f: InputFile, storage_options: Mapping[str, Any] | None = None) -> InputFile:
    """`f` with `records` (and `checkpoints` for seekable text files) filled in."""
    if f.records >= 0:
        return f
    try:
        if f.format in TEXT_FORMATS:
            return _count_lines(f, storage_options)
        if f.format == "json":
            return _replace(f, records=len(_json_records(f, storage_options)))
        with _open(f, storage_options) as fh:
            if f.format == "parquet":
                return _replace(f, records=pq.ParquetFile(fh).metadata.num_rows)
            if f.format == "arrow":
                reader = pa.ipc.open_file(fh)
                return _replace(
                    f,
                    records=sum(
                        reader.get_batch(i).num_rows for i in range(reader.num_record_batches)
                    ),
                )
            if f.format == "arrow_stream":
                return _replace(f, records=sum(b.num_rows for b in pa.ipc.open_stream(fh)))
    except (OSError, EOFError, pa.ArrowInvalid, ValueError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(
            f"{f.url}: unreadable {f.format} input ({type(e).__name__}: {e})"
        ) from None
    raise InputError(f"{f.url}: unknown format {f.format!r}")


def _replace(f: InputFile, **changes: Any) -> InputFile:
    return InputFile(**{**asdict(f), **changes})


def _count_lines(f: InputFile, storage_options: Mapping[str, Any] | None) -> InputFile:
    seekable = f.compression is None
    checkpoints: list[tuple[int, int]] = []
    records = 0
    offset = 0
    with _open(f, storage_options) as fh:
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                if seekable and records % STRIDE == 0:
                    checkpoints.append((offset, line_no))
                records += 1
            offset += len(line)
    return _replace(f, records=records, checkpoints=tuple(checkpoints))


def _json_records(f: InputFile, storage_options: Mapping[str, Any] | None) -> list[Any]:
    with _open(f, storage_options) as fh:
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{f.url}: not valid UTF-8 at byte {e.start}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines in a .json file
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        raise InputError(
            f"{f.url}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict):
        lists = [v for v in doc.values() if isinstance(v, list)]
        if len(lists) == 1:
            return lists[0]
        return [doc]
    raise InputError(f"{f.url}: the JSON document is a {type(doc).__name__}, not records")


# ---- reading ---------------------------------------------------------------------------

Record = tuple[str, Any]  # (location, decoded record or BadRecord)


def read_records(
    f: InputFile,
    start: int,
    stop: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    fields: Sequence[str] | None = None,
) -> Iterator[Record]:
    """Records [start, stop) of a counted file, with their locations; undecodable records come
    as BadRecord (invalid_utf8, malformed_json). `fields` projects columnar formats."""
    if not 0 <= start <= stop <= f.records:
        raise ValueError(f"{f.url}: records [{start}, {stop}) outside [0, {f.records})")
    if start == stop:
        return
    try:
        if f.format in TEXT_FORMATS:
            yield from _read_lines(f, start, stop, storage_options)
        elif f.format == "demo":
            recs = demo_records_cached(f.url)
            for i in range(start, stop):
                yield f"{f.url}:row {i + 1}", recs[i]
        elif f.format == "json":
            recs = _json_records(f, storage_options)
            for i in range(start, stop):
                yield f"{f.url}:record {i + 1}", recs[i]
        else:
            yield from _read_table(f, start, stop, storage_options, fields)
    except (OSError, EOFError, pa.ArrowInvalid) as e:
        raise InputError(f"{f.url}: read failed ({type(e).__name__}: {e})") from None


def _read_lines(
    f: InputFile, start: int, stop: int, storage_options: Mapping[str, Any] | None
) -> Iterator[Record]:
    with _open(f, storage_options) as fh:
        record, line_no = 0, 0
        if f.checkpoints:
            offset, first_line = f.checkpoints[start // STRIDE]
            fh.seek(offset)
            record, line_no = (start // STRIDE) * STRIDE, first_line - 1
        for line in fh:
            line_no += 1
            if not line.strip():
                continue
            if record >= stop:
                return
            if record >= start:
                yield f"{f.url}:line {line_no}", _decode_line(line, f.format)
            record += 1
    if record < stop:
        raise InputError(
            f"{f.url}: holds {record} records now, {f.records} when counted (the file changed)"
        )


def _decode_line(line: bytes, fmt: str) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRecord("invalid_utf8", f"not valid UTF-8 at byte {e.start} of the line")
    if fmt == "txt":
        return {"text": text.rstrip("\r\n")}
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRecord("malformed_json", f"{e.msg} at column {e.colno}")


def _read_table(
    f: InputFile,
    start: int,
    stop: int,
    storage_options: Mapping[str, Any] | None,
    fields: Sequence[str] | None,
) -> Iterator[Record]:
    fs, path = _fs(f.url, storage_options)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    with (
        pa.memory_map(path) if local and f.format != "parquet" else _open(f, storage_options) as fh
    ):
        for first, table in _tables(f, fh, start, stop, fields):
            for i, rec in enumerate(table.to_pylist()):
                yield f"{f.url}:row {first + i + 1}", rec


def _tables(
    f: InputFile, fh: Any, start: int, stop: int, fields: Sequence[str] | None
) -> Iterator[tuple[int, pa.Table]]:
    """(first record index, table) pieces covering records [start, stop)."""

    def project(t: pa.Table | pa.RecordBatch) -> pa.Table:
        t = t if isinstance(t, pa.Table) else pa.Table.from_batches([t])
        keep = [c for c in t.column_names if fields is None or c in fields]
        return t.select(keep)

    if f.format == "parquet":
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        cols = None if fields is None else [c for c in names if c in fields]
        pos = 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if pos + n > start and pos < stop:
                t = pf.read_row_group(g, columns=cols)
                lo, hi = max(start, pos) - pos, min(stop, pos + n) - pos
                yield pos + lo, t.slice(lo, hi - lo)
            pos += n
        return
    batches = pa.ipc.open_file(fh) if f.format == "arrow" else pa.ipc.open_stream(fh)
    it = (
        (batches.get_batch(i) for i in range(batches.num_record_batches))
        if f.format == "arrow"
        else iter(batches)
    )
    pos = 0
    for b in it:
        n = b.num_rows
        if pos >= stop:
            break
        if pos + n > start:
            lo, hi = max(start, pos) - pos, min(stop, pos + n) - pos
            yield pos + lo, project(b.slice(lo, hi - lo))
        pos += n
