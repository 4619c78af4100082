"""Reading a dataset on S3 through pyarrow's C++ S3 client instead of s3fs.

Why. A trainer's stream reads a shard as a few large concurrent byte ranges. s3fs does that on
aiobotocore in Python: its first request builds a botocore client (~0.11 s in a fresh process),
and every response is received under the GIL, taking turns with the trainer's own Python. The
AWS SDK under pyarrow builds its client in ~0.02 s and receives on its own threads without the
GIL. For bench_stream's 163 MB shard from a local S3 server, in fresh processes: s3fs 0.37-0.46
s (client, HEAD, six concurrent 27 MB ranges), pyarrow 0.17-0.21 s.

When. `reading_fs` gives this client for an ``s3://`` / ``s3a://`` dataset whose storage options
it can translate in full: ``key``, ``secret``, ``token``, ``anon``, ``endpoint_url`` (also in
``client_kwargs``, with ``region_name``) and ``region``. It also needs to know where requests
go without asking: an endpoint (the options, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``) or
a region (the options, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``): s3fs follows a bucket to its
region, pyarrow does not. Any other option (a profile, ``config_kwargs``, requester pays...), or a
proxy in the environment (botocore honours ``HTTPS_PROXY``; pyarrow's client is not given it),
keeps s3fs, as do an AWS endpoint without a region and an ``anon`` that is not a bool.
Credentials not in the options come from the same places for both (environment, AWS config
files, instance metadata; ``AWS_CA_BUNDLE`` is passed on). ``PACKSHARD_S3_CLIENT=s3fs`` always
uses s3fs; ``=arrow`` uses pyarrow's client or fails saying why it cannot. Writing (the pack
job) always uses s3fs.

The filesystem is fsspec's wrapper of pyarrow's (so everything else reads it as any fsspec
filesystem), with `cat_ranges` sending its ranges concurrently on a pool of threads.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
from fsspec.implementations.arrow import ArrowFSWrapper

S3_PROTOCOLS = ("s3", "s3a")
CLIENT_ENV = "PACKSHARD_S3_CLIENT"
RANGE_THREADS = 16  # concurrent range requests of all readers of a process
_TRANSLATED = frozenset({"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "region"})  # fmt: skip
_CLIENT_KWARGS = frozenset({"endpoint_url", "region_name"})

OPEN_OBJECTS = 64  # objects kept open per filesystem (an open is a HEAD request)

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


class ArrowS3FileSystem(ArrowFSWrapper):
    """fsspec's wrapper of `pyarrow.fs.S3FileSystem`: concurrent `cat_ranges`, ranged
    `cat_file`, objects opened once (their size is what the open asks; a dataset does not
    change while it is read), and a new client in a forked child (the AWS SDK's threads do
    not survive a fork)."""

    protocol = S3_PROTOCOLS
    cachable = False  # one instance per dataset opened: its options are in it, not in a token

    def __init__(self, arrow_kwargs: dict[str, Any], endpoint_url: str | None = None) -> None:
        from pyarrow import fs as pafs

        self._arrow_kwargs = dict(arrow_kwargs)
        self._arrow_pid = os.getpid()
        super().__init__(pafs.S3FileSystem(**self._arrow_kwargs))
        self.endpoint_url = endpoint_url  # for format.unreachable_endpoint, as s3fs has it
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._files_lock = threading.Lock()

    @property
    def fs(self) -> Any:
        if self._arrow_pid != os.getpid():  # a forked child: its own client and open objects
            from pyarrow import fs as pafs

            self._fs = pafs.S3FileSystem(**self._arrow_kwargs)
            self._arrow_pid = os.getpid()
            self._files = OrderedDict()
            self._files_lock = threading.Lock()
        return self._fs

    @fs.setter
    def fs(self, value: Any) -> None:
        self._fs = value

    def _input_file(self, path: str) -> Any:
        """The object opened for ranged reads (one HEAD request the first time)."""
        arrow_fs = self.fs
        with self._files_lock:
            f = self._files.get(path)
            if f is not None:
                self._files.move_to_end(path)
                return f
        f = arrow_fs.open_input_file(path)
        with self._files_lock:
            self._files[path] = f
            while len(self._files) > OPEN_OBJECTS:
                self._files.popitem(last=False)[1].close()
        return f

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        """The object's bytes [start, end) (fsspec's meaning: negative counts from the end)."""
        path = self._strip_protocol(path)
        if not start and end is None:
            with self.fs.open_input_stream(path) as f:
                return bytes(f.read())
        return _read_range(self._input_file(path), start, end)

    def cat_ranges(
        self,
        paths: list[str],
        starts: list[int] | int | None,
        ends: list[int] | int | None,
        max_gap: int | None = None,
        on_error: str = "return",
        **kwargs: Any,
    ) -> list[Any]:
        """The bytes of each (path, start, end), requested concurrently; with ``on_error=
        "return"`` a failed range is its exception, as in fsspec."""
        n = len(paths)
        firsts: list[int | None] = list(starts) if isinstance(starts, list) else [starts] * n
        lasts: list[int | None] = list(ends) if isinstance(ends, list) else [ends] * n

        def one(k: int) -> Any:
            try:
                return _read_range(
                    self._input_file(self._strip_protocol(paths[k])), firsts[k], lasts[k]
                )
            except Exception as e:
                if on_error == "raise":
                    raise
                return e

        if n == 1:
            return [one(0)]
        return list(_range_pool().map(one, range(n)))


def _read_range(f: Any, start: int | None, end: int | None) -> bytes:
    """Bytes [start, end) of an open pyarrow file, clipped to it (negative: from the end)."""
    size = f.size()
    a = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
    b = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
    return bytes(f.read_at(b - a, a)) if b > a else b""


def _range_pool() -> ThreadPoolExecutor:
    """The process's pool of range-request threads (a forked child makes its own)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(RANGE_THREADS, thread_name_prefix="packshard-s3-range")
            _pool_pid = os.getpid()
        return _pool


def arrow_s3_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], str | None] | str:
    """(pyarrow S3FileSystem keyword arguments, the endpoint URL) for s3fs-style storage options,
    or why they cannot be translated (module docstring)."""
    extra = sorted(set(options) - _TRANSLATED)
    client = dict(options.get("client_kwargs") or {})
    extra += [f"client_kwargs.{k}" for k in sorted(set(client) - _CLIENT_KWARGS)]
    if extra:
        return f"storage options pyarrow's client does not take: {', '.join(extra)}"
    env = os.environ
    endpoint = (
        options.get("endpoint_url")
        or client.get("endpoint_url")
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
    )
    region = (
        options.get("region")
        or client.get("region_name")
        or env.get("AWS_REGION")
        or env.get("AWS_DEFAULT_REGION")
    )
    anon = options.get("anon", False)
    if not isinstance(anon, bool):
        return f"anon={anon!r} is not true or false"
    kw: dict[str, Any] = {}
    if endpoint:
        parts = urllib.parse.urlsplit(str(endpoint))
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return f"an endpoint pyarrow's client cannot take: {parts.scheme}://..."
        if not region and (parts.hostname or "").endswith("amazonaws.com"):
            return "an AWS endpoint without a region (s3fs finds the bucket's)"
        proxied = urllib.request.getproxies().get(parts.scheme)
        if proxied and not urllib.request.proxy_bypass(parts.hostname or ""):
            return "a proxy is set in the environment"
        kw.update(endpoint_override=parts.netloc + parts.path.rstrip("/"), scheme=parts.scheme)
    elif not region:
        return "neither an endpoint nor a region is known (s3fs finds a bucket's region)"
    elif urllib.request.getproxies().get("https"):
        return "a proxy is set in the environment"
    if region:
        kw["region"] = str(region)
    if anon:
        kw["anonymous"] = True
    if env.get("AWS_CA_BUNDLE"):  # botocore's certificate bundle setting; pyarrow takes it so
        kw["tls_ca_file_path"] = env["AWS_CA_BUNDLE"]
    for ours, theirs in (("key", "access_key"), ("secret", "secret_key"), ("token", "session_token")):  # fmt: skip
        if options.get(ours) is not None:
            kw[theirs] = str(options[ours])
    return kw, (str(endpoint) if endpoint else None)


def reading_fs(
    url: str, storage_options: Mapping[str, Any] | None
) -> tuple[fsspec.AbstractFileSystem, str] | None:
    """(pyarrow-backed filesystem, path) for reading an s3:// dataset, or None for the one
    fsspec gives (any other URL, or options pyarrow's client cannot take: module docstring)."""
    protocol, _, rest = url.partition("://")
    choice = os.environ.get(CLIENT_ENV, "auto").strip().lower() or "auto"
    if protocol.lower() not in S3_PROTOCOLS or choice == "s3fs":
        return None
    if choice not in ("auto", "arrow"):
        raise ValueError(f"{CLIENT_ENV}={choice!r}: use auto, arrow or s3fs")
    translated = arrow_s3_options(dict(storage_options or {}))
    if isinstance(translated, str):
        if choice == "arrow":
            raise ValueError(f"{CLIENT_ENV}=arrow: {translated}")
        return None
    kw, endpoint = translated
    try:
        fs = ArrowS3FileSystem(kw, endpoint_url=endpoint)
    except (ImportError, AttributeError) as e:  # a pyarrow built without S3
        if choice == "arrow":
            raise ValueError(f"{CLIENT_ENV}=arrow: pyarrow has no S3 support ({e})") from None
        return None
    return fs, rest.rstrip("/") or rest
