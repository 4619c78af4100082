"""Counting the records of input files and reading any range of them.

Sample ids need each file's record count before any work (a sample's id is its index in input
order), so the job first counts every file once, in parallel, and keeps the counts in its plan
(a resumed run does not recount). Counting costs a newline scan for JSON lines (also recording
the byte offset of every 1024th record, so a block can seek straight to its first record) and
only the footer for parquet; Arrow streams, ``.json`` files and compressed files are read
whole. An uncompressed ``.json`` file holding an array of records or JSON lines gets the same
seek points (its records are walked one by one), so a block parses only its own bytes. Reading
records [a, b) of a compressed file, or of a ``.json`` object holding a list of records,
decompresses/parses from the start: split big ones into several files, or leave them
uncompressed.

Blank lines are not records. Every record comes with its location (``file:line N`` for text
formats, ``file:row N`` for tabular ones, 1-based), used in every error message; a line that is
not UTF-8 or not JSON comes as a `BadRecord` (``invalid_utf8``, ``malformed_json``).
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from packshard.packers import url_to_fs
from packshard.packers.format import describe_error, lookup_failure, storage_errors_with
from packshard.packers.writer import is_local
from packshard.pipeline.inputs import InputError, InputFile, demo_params
from packshard.pipeline.samples import CANONICAL_FIELDS, BadRecord

STRIDE = 1024
TEXT_FORMATS = ("jsonl", "txt")
# What compressed data starts with; a file named as uncompressed text that starts so is
# refused before Ray starts: read as text, it would be a few "bad lines" instead of its records.
COMPRESSED_MAGIC = (
    (b"\x1f\x8b", "gzip", ".gz"),
    (b"\x28\xb5\x2f\xfd", "zstd", ".zst"),
    (b"\xfd7zXZ\x00", "xz", None),
    (b"BZh", "bzip2", None),  # then a digit and b"1AY&SY" (checked below)
)
MAGIC_BYTES = 10  # the longest: bzip2's "BZh" + digit + "1AY&SY"


def compressed_as(head: bytes) -> tuple[str, str | None] | None:
    """(compression, the extension packshard reads it by, or None) when `head` (a file's first
    bytes) starts like compressed data."""
    for magic, name, ext in COMPRESSED_MAGIC:
        if head.startswith(magic):
            if name == "bzip2" and not (head[3:4].isdigit() and head[4:MAGIC_BYTES] == b"1AY&SY"):
                continue
            return name, ext
    return None


Record = tuple[str, Any]  # (location, decoded record or BadRecord)


@functools.lru_cache(maxsize=2)
def demo_records_cached(url: str) -> tuple[dict[str, Any], ...]:
    """The built-in demo records of a ``demo://`` URL, made once per process (in the tasks
    that read them: nothing travels from the driver)."""
    from packshard.pipeline.demo import demo_records

    return tuple(demo_records(**demo_params(url)))


# ---- counting --------------------------------------------------------------------------


class _GzipReader(gzip.GzipFile):
    """A GzipFile that closes the file it decompresses: GzipFile leaves a `fileobj` it was
    given open, which would keep a local file descriptor, or a remote file's connection, until
    garbage collection."""

    def close(self) -> None:
        raw: Any = self.fileobj
        try:
            super().close()
        finally:
            if raw is not None:
                raw.close()


class _ZstdReader(io.RawIOBase):
    """The frames of a zstd file decompressed one after another (``zstd`` and ``pzstd`` write
    one or many; concatenated files are many) by pyarrow's streaming decompressor, in bounded
    memory whatever the ratio, closing the file with it. A file that ends inside a frame
    raises EOFError, as gzip does: zstandard's `stream_reader` ends cleanly there, and the
    records of the cut frame would be lost without a word."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._stream = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        try:
            data = self._stream.read(len(b))
        except OSError as e:
            if "runcated" in str(e):  # pyarrow's "Truncated compressed stream"
                raise EOFError("the zstd file ends inside a frame (it is truncated)") from None
            raise
        n = len(data)
        b[:n] = data
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._stream.close()
                self._raw.close()
            finally:
                super().close()


def _open(
    f: InputFile, storage_options: Mapping[str, Any] | None, block_size: int | None = None
) -> BinaryIO:
    fs, path = url_to_fs(f.url, storage_options)
    try:
        raw = fs.open(path, "rb", **({"block_size": block_size} if block_size else {}))
    except FileNotFoundError as e:
        cause = lookup_failure(e)
        if cause is not None:
            raise InputError(
                f"{f.display}: cannot be read now ({describe_error(cause)}); it was listed "
                "when the job started (a signed URL may have expired)"
            ) from None
        raise InputError(
            f"{f.display}: the input disappeared (it was listed when the job started)"
        ) from None
    except PermissionError as e:
        raise InputError(f"{f.display}: permission denied ({e})") from None
    try:
        _check_unchanged(f, fs, path, raw)
    except BaseException:
        raw.close()
        raise
    if f.compression == "gzip":
        return _GzipReader(fileobj=raw)  # type: ignore[return-value]
    if f.compression == "zstd":
        return io.BufferedReader(_ZstdReader(raw), 1 << 20)
    return raw


def _check_unchanged(f: InputFile, fs: Any, path: str, raw: Any = None) -> None:
    """Refuse a file whose size changed since the job listed it: its record count and seek
    points were taken from the bytes it had then, and records shifted by an edit would be read
    as others. The size of a remote file comes from the opened file's details (no extra
    request). Only the size: a task on another node reads that node's copy of a local path,
    which holds the same bytes under another modification time (Ray's working_dir unpacks
    without keeping it)."""
    if not f.size:  # listed without a size (an empty file, or built by hand)
        return
    details = fs.info(path) if is_local(fs) else getattr(raw, "details", None)
    size = details.get("size") if isinstance(details, Mapping) else None
    if isinstance(size, int) and size != f.size:
        raise InputError(
            f"{f.display}: changed since the job listed it ({f.size:,} bytes then, {size:,} "
            "now); its records were counted from the bytes it had then: rerun the job"
        )


def count_records(
    f: InputFile,
    storage_options: Mapping[str, Any] | None = None,
    sample_fields: Collection[str] = CANONICAL_FIELDS,
) -> InputFile:
    """`f` with `records` (and `checkpoints` for seekable text files) filled in. `sample_fields`:
    the raw names of sample fields (`samples.source_fields` of the column mapping), which tell a
    .json file holding one record from one holding a list of them (`_json_records`)."""
    if f.records >= 0:
        return f
    with _unreadable(f):
        if f.format in TEXT_FORMATS:
            return _count_lines(f, storage_options)
        if f.format == "json":
            return _count_json(f, storage_options, sample_fields)
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
    raise InputError(f"{f.display}: unknown format {f.format!r}")


@contextlib.contextmanager
def _unreadable(f: InputFile) -> Iterator[None]:
    """Errors of reading `f` whole or in part, as one InputError naming it."""
    try:
        yield
    except InputError:
        raise
    except storage_errors_with(EOFError, pa.ArrowInvalid, ValueError, zlib.error) as e:
        # a storage library's error (aiohttp's for a failed GET) may not pickle, which a Ray
        # task's error must: the InputError carries its line (`describe_error`), not the error
        raise InputError(
            f"{f.display}: unreadable {f.format} input ({describe_error(e)})"
        ) from None


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


def _json_records(
    f: InputFile, storage_options: Mapping[str, Any] | None, sample_fields: Collection[str]
) -> tuple[list[Any], list[int] | None]:
    """(records, their line numbers) of a .json file: a JSON document (an array of records, an
    object with no key among `sample_fields` holding one list of record objects, or one record;
    line numbers None), or JSON lines (a document that does not parse, does not open with a
    lone "[" or "{" line, and at least half of whose lines are objects: each line a record, one
    that does not parse a malformed_json BadRecord, as in .jsonl)."""
    with _open(f, storage_options) as fh:
        data = fh.read()
    return _parse_json_text(f, _json_text(f, data), sample_fields)


def _json_text(f: InputFile, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is not data
    except UnicodeDecodeError as e:
        raise InputError(f"{f.display}: not valid UTF-8 at byte {e.start}") from None


def _parse_json_text(
    f: InputFile, text: str, sample_fields: Collection[str]
) -> tuple[list[Any], list[int] | None]:
    """`_json_records` of the file's decoded text."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        # "\n" only: U+2028 and friends may stand raw inside JSON strings (str.splitlines
        # would cut there), and "\r" before it is whitespace to json.loads
        lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
        parsed = [_parse_json_line(line.removeprefix("\ufeff")) for _, line in lines]
        objects = sum(isinstance(r, dict) for r in parsed)
        opens_document = bool(lines) and lines[0][1].strip().lstrip("\ufeff") in ("[", "{")
        if len(lines) > 1 and not opens_document and 2 * objects >= len(lines):
            return parsed, [n for n, _ in lines]  # JSON lines in a .json file
        raise InputError(
            f"{f.display}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    if isinstance(doc, list):
        return doc, None
    if isinstance(doc, dict):
        lists = [v for v in doc.values() if isinstance(v, list)]
        if (
            len(lists) == 1
            and not set(doc) & set(sample_fields)  # a sample ({"messages": [...]}) is one record
            # its records: a stray non-object among them is that record's error (not_an_object),
            # not a reason to read the whole file as one record
            and (not lists[0] or any(isinstance(r, dict) for r in lists[0]))
        ):
            return lists[0], None
        return [doc], None
    raise InputError(f"{f.display}: the JSON document is a {type(doc).__name__}, not records")


def _json_location(f: InputFile, i: int, lines: list[int] | None) -> str:
    """Where record i of a .json file is: its line (JSON lines) or its place in the document."""
    return f"{f.display}:line {lines[i]}" if lines is not None else f"{f.display}:record {i + 1}"


_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_DECODER = json.JSONDecoder()


def _skip_ws(text: str, i: int) -> int:
    """The first index at or after `i` that is not JSON whitespace."""
    match = _WS.match(text, i)
    assert match is not None  # the pattern matches the empty string
    return match.end()


JSON_ARRAY, JSON_LINES = "array", "lines"  # InputFile.layout of a .json file with seek points


def _count_json(
    f: InputFile, storage_options: Mapping[str, Any] | None, sample_fields: Collection[str]
) -> InputFile:
    """`f` counted as `_json_records` reads it. An uncompressed array of records or JSON lines
    also gets seek points: the byte offset of record k * STRIDE with its number (its index in
    the array, or its line), and its `layout` ("array" / "lines")."""
    with _open(f, storage_options) as fh:
        data = fh.read()
    text = _json_text(f, data)
    walked = _array_starts(text)
    if walked is not None:
        records, starts = walked
        layout, numbers = JSON_ARRAY, [k * STRIDE for k in range(len(starts))]
    else:
        parsed, lines = _parse_json_text(f, text, sample_fields)
        if lines is None or f.compression is not None:  # one document, or no seeking
            return _replace(f, records=len(parsed))
        records, layout, numbers = len(parsed), JSON_LINES, lines[::STRIDE]
        starts = _line_starts(text, numbers)
    if f.compression is not None:  # no seeking in a compressed stream
        return _replace(f, records=records)
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    if len(data) == len(text) + bom:  # one byte a character
        offsets = [c + bom for c in starts]
    else:
        offsets, done, at = [], 0, bom
        for c in starts:
            at += len(text[done:c].encode())
            offsets.append(at)
            done = c
    return _replace(
        f, records=records, layout=layout, checkpoints=tuple(zip(offsets, numbers, strict=True))
    )


def _array_starts(text: str) -> tuple[int, list[int]] | None:
    """(records, the character offsets of records 0, STRIDE, 2 STRIDE, ...) of a text that
    holds one JSON array, walked a value at a time; None for any other text, a malformed one
    included (`_parse_json_text` then reads it whole, and names the error)."""
    i = _skip_ws(text, 0)
    if not text.startswith("[", i):
        return None
    i = _skip_ws(text, i + 1)
    if text.startswith("]", i):
        return (0, []) if _skip_ws(text, i + 1) == len(text) else None
    records, starts = 0, []
    try:
        while True:
            if records % STRIDE == 0:
                starts.append(i)
            _, i = _DECODER.raw_decode(text, i)
            records += 1
            i = _skip_ws(text, i)
            if text.startswith(",", i):
                i = _skip_ws(text, i + 1)
            elif text.startswith("]", i) and _skip_ws(text, i + 1) == len(text):
                return records, starts
            else:
                return None
    except json.JSONDecodeError:
        return None


def _line_starts(text: str, lines: Sequence[int]) -> list[int]:
    """The character offsets where the given lines (1-based, ascending) of `text` start."""
    out, at, line = [], 0, 1
    for wanted in lines:
        while line < wanted:
            at = text.index("\n", at) + 1
            line += 1
        out.append(at)
    return out


def _read_json_span(
    f: InputFile, start: int, stop: int, storage_options: Mapping[str, Any] | None
) -> Iterator[Record]:
    """Records [start, stop) of a .json file with seek points: only the bytes from the seek
    point at or before `start` to the one at or after `stop` are read and parsed."""
    k, after = start // STRIDE, -(-stop // STRIDE)
    offset, number = f.checkpoints[k]
    end = f.checkpoints[after][0] if after < len(f.checkpoints) else None
    with _open(f, storage_options) as fh:
        fh.seek(offset)
        data = fh.read() if end is None else fh.read(end - offset)
    changed = InputError(
        f"{f.display}: changed since it was counted (records {start + 1}-{stop} are not where "
        "they were); rerun the job"
    )
    try:
        text = data.decode("utf-8-sig" if offset == 0 else "utf-8")
    except UnicodeDecodeError:
        raise changed from None
    record = k * STRIDE
    if f.layout == JSON_LINES:
        for line_no, line in enumerate(text.split("\n"), number):
            if not line.strip():
                continue
            if record >= stop:
                return
            if record >= start:
                yield f"{f.display}:line {line_no}", _parse_json_line(line.removeprefix("\ufeff"))
            record += 1
        if record < stop:
            raise changed
        return
    i = 0
    while record < stop:
        try:
            value, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            raise changed from None
        if record >= start:
            yield f"{f.display}:record {record + 1}", value
        record += 1
        i = _skip_ws(text, i)
        if record < f.records and text.startswith(",", i):
            i = _skip_ws(text, i + 1)
        elif not (
            record == f.records and text.startswith("]", i) and _skip_ws(text, i + 1) == len(text)
        ):
            raise changed


# ---- peeking (the pre-flight check) -----------------------------------------------------

PEEK_BLOCK = 1 << 20  # bytes fetched to find a remote text file's first record
PEEK_JSON_MAX = 64 << 20  # a .json document is parsed whole: only peeked up to this size


@dataclass(frozen=True)
class Peek:
    """What a cheap look at one input shows: its columns (tabular formats), its first record
    (text formats; None when it holds none), and its record count where that is free."""

    columns: tuple[str, ...] | None = None
    first: Record | None = None
    records: int | None = None


def peek(
    f: InputFile,
    storage_options: Mapping[str, Any] | None = None,
    sample_fields: Collection[str] = CANONICAL_FIELDS,
) -> Peek:
    """Columns / first record of `f`, reading a footer or the first lines (InputError if
    unreadable); `sample_fields` as in `count_records`."""
    with _unreadable(f):
        if f.format in TEXT_FORMATS:
            with _open(f, storage_options, PEEK_BLOCK) as fh:
                for line_no, line in enumerate(fh, start=1):
                    if line_no == 1:  # the file's first bytes: no magic number holds a newline
                        _refuse_compressed(f, line)
                    if line.strip():
                        return Peek(
                            first=(f"{f.display}:line {line_no}", _decode_line(line, f.format))
                        )
            return Peek(records=0)
        if f.format == "json":
            with _open(f, storage_options, PEEK_BLOCK) as fh:
                _refuse_compressed(f, fh.read(MAGIC_BYTES))
            if f.size > PEEK_JSON_MAX:
                return Peek()
            recs, lines = _json_records(f, storage_options, sample_fields)
            return Peek(
                first=(_json_location(f, 0, lines), recs[0]) if recs else None,
                records=len(recs),
            )
        if f.format in ("parquet", "arrow", "arrow_stream"):
            with _open(f, storage_options, PEEK_BLOCK) as fh:
                if f.format == "parquet":
                    pf = pq.ParquetFile(fh)
                    return Peek(tuple(pf.schema_arrow.names), records=pf.metadata.num_rows)
                if f.format == "arrow":
                    reader = pa.ipc.open_file(fh)
                    empty = reader.num_record_batches == 0
                    return Peek(tuple(reader.schema.names), records=0 if empty else None)
                return Peek(tuple(pa.ipc.open_stream(fh).schema.names))
    return Peek()


def _refuse_compressed(f: InputFile, head: bytes) -> None:
    """InputError when `f`'s name says uncompressed text but its first bytes `head` (at least
    MAGIC_BYTES, or up to a newline) are compressed data."""
    if f.compression is not None:
        return
    found = compressed_as(head)
    if found is None:
        return
    name, ext = found
    fix = (
        f"name it with {ext} at the end (e.g. x.{f.format}{ext})"
        if ext
        else f"decompress it (packshard reads {f.format} plain, .gz or .zst)"
    )
    raise InputError(
        f"{f.display}: holds {name}-compressed data, but its name says plain {f.format}: {fix}"
    )


# ---- reading ---------------------------------------------------------------------------


def read_records(
    f: InputFile,
    start: int,
    stop: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    fields: Sequence[str] | None = None,
    sample_fields: Collection[str] = CANONICAL_FIELDS,
) -> Iterator[Record]:
    """Records [start, stop) of a counted file, with their locations; undecodable records come
    as BadRecord (invalid_utf8, malformed_json). `fields` projects columnar formats;
    `sample_fields` as in `count_records` (the same, or the counts would disagree)."""
    if not 0 <= start <= stop <= f.records:
        raise ValueError(f"{f.display}: records [{start}, {stop}) outside [0, {f.records})")
    if start == stop:
        return
    try:
        if f.format in TEXT_FORMATS:
            yield from _read_lines(f, start, stop, storage_options)
        elif f.format == "demo":
            recs = demo_records_cached(f.url)
            for i in range(start, stop):
                yield f"{f.display}:row {i + 1}", recs[i]
        elif f.format == "json" and f.checkpoints:
            yield from _read_json_span(f, start, stop, storage_options)
        elif f.format == "json":
            records, lines = _json_records(f, storage_options, sample_fields)
            if len(records) != f.records:
                raise InputError(
                    f"{f.display}: holds {len(records)} records now, {f.records} when counted "
                    "(the file changed)"
                )
            for i in range(start, stop):
                yield _json_location(f, i, lines), records[i]
        else:
            yield from _read_table(f, start, stop, storage_options, fields)
    except storage_errors_with(EOFError, pa.ArrowInvalid, zlib.error) as e:
        raise InputError(f"{f.display}: read failed ({describe_error(e)})") from None


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
                yield f"{f.display}:line {line_no}", _decode_line(line, f.format)
            record += 1
    if record < stop:
        raise InputError(
            f"{f.display}: holds {record} records now, {f.records} when counted (the file changed)"
        )


def _decode_line(line: bytes, fmt: str) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRecord("invalid_utf8", f"not valid UTF-8 at byte {e.start} of the line")
    text = text.removeprefix("\ufeff")  # a byte-order mark (a file's first line), as utf-8-sig
    if fmt == "txt":
        return {"text": text.rstrip("\r\n")}
    return _parse_json_line(text)


def _parse_json_line(text: str) -> Any:
    """One JSON line's record, or a malformed_json BadRecord."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:  # e.msg may end in "at" ("Unterminated string starting at")
        return BadRecord("malformed_json", f"{e.msg.removesuffix(' at')} at column {e.colno}")


TABLE_FORMATS = ("parquet", "arrow", "arrow_stream")


def read_tables(
    f: InputFile,
    start: int,
    stop: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    fields: Sequence[str] | None = None,
) -> Iterator[tuple[int, pa.Table]]:
    """Records [start, stop) of a tabular file as Arrow (first record index, table) pieces,
    never converted to Python objects: for readers that work column-wise (pre-tokenized ids
    are ~30x faster as arrays than as lists of Python ints)."""
    if f.format not in TABLE_FORMATS:
        raise ValueError(f"{f.display}: {f.format} is not a tabular format {TABLE_FORMATS}")
    try:
        yield from _table_pieces(f, start, stop, storage_options, fields)
    except storage_errors_with(EOFError, pa.ArrowInvalid, zlib.error) as e:
        raise InputError(f"{f.display}: read failed ({describe_error(e)})") from None


def _table_pieces(
    f: InputFile,
    start: int,
    stop: int,
    storage_options: Mapping[str, Any] | None,
    fields: Sequence[str] | None,
) -> Iterator[tuple[int, pa.Table]]:
    fs, path = url_to_fs(f.url, storage_options)
    mapped = is_local(fs) and f.format != "parquet"
    if mapped:
        _check_unchanged(f, fs, path)
    with pa.memory_map(path) if mapped else _open(f, storage_options) as fh:
        yield from _tables(f, fh, start, stop, fields)


def _read_table(
    f: InputFile,
    start: int,
    stop: int,
    storage_options: Mapping[str, Any] | None,
    fields: Sequence[str] | None,
) -> Iterator[Record]:
    for first, table in _table_pieces(f, start, stop, storage_options, fields):
        for i, rec in enumerate(table_records(table)):
            yield f"{f.display}:row {first + i + 1}", rec


def table_records(table: pa.Table) -> list[dict[str, Any]]:
    """The table's rows as dicts, their nested values as a JSON record would have them:

    - Arrow's JSON extension type (``arrow.json``, what 🤗 datasets 5 writes for values of mixed
      shape: tool schemas, messages) decoded: pyarrow gives such values as their JSON text,
      which would otherwise reach the chat template as strings;
    - a struct's null fields left out: Arrow gives all the records of a column one struct type,
      the union of their keys, so a tool call to ``get_weather(city)`` beside one to
      ``search(query, n)`` reads back as ``{"city": "Paris", "query": None, "n": None}``, and
      the chat template would render (and train) arguments nobody wrote. A null a record did
      write in a struct is indistinguishable from a missing key there, and goes too."""
    records = table.to_pylist()
    decoders = [
        (name, decode) for name, t in zip(table.column_names, table.schema.types, strict=True)
        if (decode := _json_decoder(t)) is not None
    ]  # fmt: skip
    for rec in records if decoders else ():
        for name, decode in decoders:
            rec[name] = decode(rec[name])
    return records


def _json_decoder(t: pa.DataType) -> Callable[[Any], Any] | None:
    """A function decoding the ``arrow.json`` values inside a value of type `t` (as pyarrow's
    to_pylist gives it) and leaving its structs' null fields out, or None when `t` holds
    neither: only the parts that hold JSON or structs are walked."""
    if isinstance(t, pa.BaseExtensionType):
        return _json_loads if t.extension_name == "arrow.json" else _json_decoder(t.storage_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = _json_decoder(t.value_type)
        return None if item is None else lambda v: None if v is None else [item(x) for x in v]
    if pa.types.is_map(t):
        entry = _json_decoder(t.item_type)
        return (
            None
            if entry is None
            else lambda v: None if v is None else [(k, entry(x)) for k, x in v]
        )
    if pa.types.is_struct(t):
        fields = {f.name: d for f in t if (d := _json_decoder(f.type)) is not None}
        return lambda v: (
            None
            if v is None
            else {k: fields[k](x) if k in fields else x for k, x in v.items() if x is not None}
        )
    return None


def _json_loads(value: Any) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value  # not JSON after all: the sample's own checks name the field


def _tables(
    f: InputFile, fh: Any, start: int, stop: int, fields: Sequence[str] | None
) -> Iterator[tuple[int, pa.Table]]:
    """(first record index, table) pieces covering records [start, stop)."""

    def project(t: pa.Table | pa.RecordBatch) -> pa.Table:
        t = t if isinstance(t, pa.Table) else pa.Table.from_batches([t])
        keep = [c for c in t.column_names if fields is None or c in fields]
        return t.select(keep) if keep else t  # none of ours: keep all, so errors can name them

    if f.format == "parquet":
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        # without any field packshard reads, keep every column: the bad record then names them
        cols = None if fields is None else [c for c in names if c in fields] or None
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
