"""Shard format v1: schemas, names, checksums and path rules shared by writer and reader.

See docs/FORMAT.md for the public description. A dataset under one URL `OUT`:

    OUT/manifest.json            written last; without it the dataset does not exist
    OUT/index.arrow              one row per packed row (planning without reading tokens)
    OUT/shards/part-NNNNN.arrow  Arrow IPC file format, record batches of `rows_per_batch` rows

Checksums are written ``"<algorithm>:<hex digest>"`` over a file's bytes; readers understand
``xxh3_128`` (what we write: ~30 GB/s, so checksumming costs nothing next to the I/O) and
``sha256``.

Errors: every problem a reader meets in a dataset is a `FormatError` naming the file (a
`ValueError`, so one ``except FormatError`` covers them all): `DatasetNotFoundError` when there
is no committed dataset at the URL (the path is missing, empty, holds an unfinished pack job or
other files), `StorageError` when the storage fails under a read (an unreachable endpoint,
refused credentials, a lost connection: the library's error is chained, its first line quoted).
`storage_errors()` lists the storage libraries' own error classes that fsspec lets through;
`unreachable_endpoint(fs)` says, after one TCP connect, that an explicit object-store endpoint
takes no connections (at once, instead of after the client's retries).
"""

from __future__ import annotations

import hashlib
import posixpath
import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import xxhash

from packshard.packers.urls import redact_text, redact_url

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

FORMAT_NAME = "packshard"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.arrow"
SHARDS_DIR = "shards"
DEFAULT_CHECKSUM = "xxh3_128"

SHARD_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("doc_lens", pa.list_(pa.int32()), nullable=False),
        pa.field("sample_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_loss_tokens", pa.int32(), nullable=False),
    ]
)

INDEX_SCHEMA = pa.schema(
    [
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("row", pa.int32(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("padded_len", pa.int32(), nullable=False),
        pa.field("num_loss_tokens", pa.int32(), nullable=False),
        pa.field("num_docs", pa.int32(), nullable=False),
        pa.field("attn_cost", pa.int64(), nullable=False),
        # Extension of v1 (readers ignore columns they do not know): xxh3_64 of the row's
        # input_ids, loss_mask (as uint8), doc_lens and sample_ids bytes, so a reader that
        # range-reads single rows still detects corruption without hashing the whole shard.
        pa.field("row_checksum", pa.uint64(), nullable=False),
    ]
)
INDEX_REQUIRED = (
    "shard",
    "row",
    "num_tokens",
    "padded_len",
    "num_loss_tokens",
    "num_docs",
    "attn_cost",
)


JOB_DIR = "_packshard"  # where an unfinished pack job keeps its bookkeeping (pipeline.jobstate)


class FormatError(ValueError):
    """A dataset breaks the shard format: missing, malformed, unknown version, bad checksum.
    URLs in the message are redacted (`packers.urls`), so it can be printed and logged as is."""

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(redact_text(str(message)), *args)


class DatasetNotFoundError(FormatError):
    """No committed dataset at the URL: nothing there, an empty directory, an unfinished pack
    job, or files that are not a packshard dataset."""


class StorageError(FormatError):
    """The storage failed while reading a dataset (unreachable, refused, interrupted)."""


_LIBRARY_ERRORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("botocore.exceptions", ("BotoCoreError", "ClientError")),
    ("aiohttp", ("ClientError",)),
    ("google.auth.exceptions", ("GoogleAuthError",)),
    ("httpx", ("HTTPError",)),
    ("httpx2", ("HTTPError",)),
)


def library_errors() -> tuple[type[BaseException], ...]:
    """Base error classes of the storage libraries imported in this process, which fsspec lets
    through untranslated (s3fs botocore's, gcsfs google-auth's, the http filesystem aiohttp's,
    the Hugging Face hub client its HTTP library's). A library not imported cannot have raised,
    so nothing is imported here (the check costs no start-up time)."""
    errors: list[type[BaseException]] = []
    for module_name, names in _LIBRARY_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None:
            errors += [
                getattr(module, n) for n in names if isinstance(getattr(module, n, None), type)
            ]
    return tuple(errors)


def storage_errors() -> tuple[type[BaseException], ...]:
    """OSError and `library_errors()`: what a failing store raises through fsspec."""
    return (OSError, *library_errors())


def storage_errors_with(*errors: type[BaseException]) -> tuple[type[BaseException], ...]:
    """`errors` and `storage_errors()`, for an ``except`` clause (``except
    storage_errors_with(ValueError) as e:``): evaluated when an exception is matched, so a
    storage library first imported inside the ``try`` counts."""
    return (*errors, *storage_errors())


def lookup_failure(e: FileNotFoundError) -> BaseException | None:
    """What made a lookup fail when it was no absence, else None. fsspec's HTTP client raises
    FileNotFoundError for any failed lookup, chained to the server's answer (a 5xx, an expired
    signature's 403) or to the connection's error (aiohttp's, an OSError): only a 404, or no
    such cause, means the file is not there."""
    cause = e.__cause__
    status = getattr(cause, "status", None)
    if cause is None or status == 404 or (status is None and not isinstance(cause, OSError)):
        return None
    return cause


CONNECT_TIMEOUT_S = 3.0


def unreachable_endpoint(fs: Any) -> str | None:
    """Why an object store's endpoint cannot be used: it does not accept a TCP connection
    within CONNECT_TIMEOUT_S. The endpoint is the one s3fs is given (``endpoint_url``, or in
    its ``client_kwargs``) or the one gcsfs talks to (its ``_location``: the given
    ``endpoint_url``, ``STORAGE_EMULATOR_HOST``, or https://storage.googleapis.com). None when
    it connects, when the filesystem names no endpoint (s3fs on AWS picks a regional one), or
    when its requests go through a proxy (a direct connection proves nothing then). Without
    this check an endpoint that refuses connections fails only after the client's retries:
    5-10 s for s3fs and botocore; gcsfs retries for ~30 s a request and then reads as "no such
    file"."""
    client_kwargs = getattr(fs, "client_kwargs", None)  # a dict, unless the user gave another
    endpoint = getattr(fs, "endpoint_url", None) or (
        client_kwargs.get("endpoint_url") if isinstance(client_kwargs, dict) else None
    )
    if not endpoint and "gcs" in protocols(fs):
        endpoint = getattr(fs, "_location", None)
    if not isinstance(endpoint, str) or "://" not in endpoint:
        return None
    parts = urllib.parse.urlsplit(endpoint)
    if _behind_proxy(fs, parts):
        return None  # the client reaches the endpoint through the proxy; a direct connect may not
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
            return None
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        return f"cannot connect to its endpoint {redact_url(endpoint)}: {why}"


def protocols(fs: Any) -> tuple[str, ...]:
    """The protocol names of an fsspec filesystem (its `protocol` is a str or a tuple)."""
    protocol = getattr(fs, "protocol", ())
    return protocol if isinstance(protocol, tuple) else (protocol,)


def fs_url(fs: Any, path: str) -> str:
    """`path` of `fs` as a user wrote it: a local path as it is, anything else with its scheme
    (``s3://bucket/key``, where fsspec's path is ``bucket/key``)."""
    return path if protocols(fs)[0] in ("file", "local") else fs.unstrip_protocol(path)


def _behind_proxy(fs: Any, parts: urllib.parse.SplitResult) -> bool:
    """The client's requests to this endpoint go through a proxy: one set in botocore's config
    (``config_kwargs={"proxies": ...}``) or in the environment (``HTTP(S)_PROXY``, unless
    ``NO_PROXY`` covers the host), as botocore and aiohttp honour them."""
    if (getattr(fs, "config_kwargs", None) or {}).get("proxies"):
        return True
    return bool(
        urllib.request.getproxies().get(parts.scheme)
        and not urllib.request.proxy_bypass(parts.hostname or "")
    )


def describe_error(e: BaseException) -> str:
    """One line for a library error: its type and the first line of its message, redacted (a
    storage library's error quotes the URL it read: aiohttp's, a signed URL's signature
    included)."""
    text = str(e).strip().splitlines()
    return redact_text(f"{type(e).__name__}: {text[0]}" if text else type(e).__name__)


@contextmanager
def reading(where: str) -> Iterator[None]:
    """Storage failures under the block as packshard errors naming `where`: a missing file is
    a `FormatError` (the manifest names it), any other a `StorageError` (the cause chained; an
    HTTP server's 5xx or 403 too, which fsspec's HTTP client raises as FileNotFoundError)."""
    try:
        yield
    except FileNotFoundError as e:
        cause = lookup_failure(e)
        if cause is not None:
            raise StorageError(f"{where}: the storage failed ({describe_error(cause)})") from cause
        raise FormatError(f"{where}: missing (the manifest names it)") from None
    except storage_errors() as e:
        raise StorageError(f"{where}: the storage failed ({describe_error(e)})") from e


def range_error(where: str, start: int, end: int, got: int) -> FormatError:
    """The error for a ranged read of bytes [start, end) that returned `got` bytes: more is a
    server that ignores HTTP Range requests (it sends the whole file; Python's http.server
    does), which packshard reads shards with; fewer is a file shorter than the manifest says."""
    if got > end - start:
        return StorageError(
            f"{where}: asked for bytes {start}..{end}, the server sent {got} bytes: it ignores "
            "HTTP Range requests, which packshard reads shards with (serve the dataset from a "
            "server that answers them, or from an object store)"
        )
    return FormatError(
        f"{where}: bytes {start}..{end} came back as {got} bytes (the file is shorter than the "
        "manifest says)"
    )


def shard_name(number: int) -> str:
    """Relative path of shard `number` inside a dataset."""
    return f"{SHARDS_DIR}/part-{number:05d}.arrow"


def check_relative_path(path: Any, where: str) -> str:
    """A manifest path must be relative, normalised and inside the dataset; else FormatError."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"{where}: path must be a non-empty string, got {path!r}")
    if path.startswith(("/", "\\")) or "://" in path or (len(path) > 1 and path[1] == ":"):
        raise FormatError(
            f"{where}: path {path!r} is absolute; manifests hold paths relative to the dataset"
        )
    parts = path.replace("\\", "/").split("/")
    if ".." in parts or posixpath.normpath(path) != path:
        raise FormatError(
            f"{where}: path {path!r} is not a plain relative path ('..' or '.' segments are refused)"
        )
    return path


class _Hasher(Protocol):
    def update(self, data: Buffer, /) -> None: ...
    def hexdigest(self) -> str: ...


HASHERS: dict[str, Callable[[], _Hasher]] = {
    "xxh3_128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}


def new_hasher(algorithm: str = DEFAULT_CHECKSUM) -> _Hasher:
    try:
        return HASHERS[algorithm]()
    except KeyError:
        raise FormatError(
            f"checksum algorithm {algorithm!r} is not known; readers understand {sorted(HASHERS)}"
        ) from None


def split_checksum(checksum: Any, where: str) -> tuple[str, str]:
    """'algo:hex' -> (algo, hex), with a clear error naming `where`."""
    if not isinstance(checksum, str) or ":" not in checksum:
        raise FormatError(
            f"{where}: checksum must be written '<algorithm>:<hex>', got {checksum!r}"
        )
    algorithm, digest = checksum.split(":", 1)
    if algorithm not in HASHERS:
        raise FormatError(
            f"{where}: checksum algorithm {algorithm!r} is not known; readers understand {sorted(HASHERS)}"
        )
    return algorithm, digest


def checksum_stream(
    read: Callable[[int], bytes], algorithm: str = DEFAULT_CHECKSUM, chunk: int = 8 << 20
) -> str:
    """Checksum of everything `read(chunk)` yields until it returns b''."""
    h = new_hasher(algorithm)
    while True:
        data = read(chunk)
        if not data:
            break
        h.update(data)
    return f"{algorithm}:{h.hexdigest()}"


class HashingWriter:
    """A write-only file wrapper that checksums and counts the bytes passing through it."""

    def __init__(self, raw: Any, algorithm: str = DEFAULT_CHECKSUM) -> None:
        self._raw = raw
        self._hasher = new_hasher(algorithm)
        self.algorithm = algorithm
        self.bytes_written = 0
        self.closed = False

    def write(self, data: bytes | memoryview) -> int:
        self._hasher.update(data)
        n = self._raw.write(data)
        self.bytes_written += len(data)
        return n if n is not None else len(data)

    def flush(self) -> None:
        self._raw.flush()

    def tell(self) -> int:
        return self.bytes_written

    @property
    def checksum(self) -> str:
        return f"{self.algorithm}:{self._hasher.hexdigest()}"

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
            self.closed = True

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False
