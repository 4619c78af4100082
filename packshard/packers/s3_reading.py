"""Reading a dataset on S3 through pyarrow's C++ S3 client instead of s3fs.

Why. A trainer's stream reads a shard as a few large concurrent byte ranges. s3fs does that on
aiobotocore in Python: its first request builds a botocore client (~0.11 s in a fresh process),
and every response is received under the GIL, taking turns with the trainer's own Python. The
AWS SDK under pyarrow builds its client in ~0.02 s and receives on its own threads without the
GIL. For bench_stream's 163 MB shard from a local S3 server, in fresh processes: s3fs 0.37-0.46
s (client, HEAD, six concurrent 27 MB ranges), pyarrow 0.17-0.21 s.

When. `reading_fs` gives this client for an ``s3://`` / ``s3a://`` dataset when it would read
what s3fs reads, from where s3fs would read it:
- the storage options translate in full: ``key``, ``secret``, ``token``, ``anon``,
  ``endpoint_url``, and ``client_kwargs`` holding only ``endpoint_url`` / ``region_name``
  (a profile, ``config_kwargs``, requester pays... keep s3fs);
- the endpoint is given (options, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``); on AWS
  itself (no endpoint, or an ``*.amazonaws.com`` one) only with ``client_kwargs={"region_name":
  ...}``: s3fs follows a bucket to its region, pyarrow's client does not, and the environment's
  region is the machine's, not the bucket's;
- credentials and endpoint given explicitly (``key`` / ``anon`` and an endpoint), or else no
  AWS setting that pyarrow's client would follow differently: ``AWS_PROFILE``,
  ``AWS_ROLE_ARN``, ``AWS_WEB_IDENTITY_TOKEN_FILE``, or an ``endpoint_url``, role, SSO or
  credential process in the AWS config files;
- no proxy in the environment (botocore honours ``HTTPS_PROXY``; pyarrow's client is not
  given it), and the process was not forked from one that used pyarrow's S3 client (its locks
  may be held: a request would hang).
It waits as botocore does (60 s to connect, 60 s for a response) and takes ``AWS_CA_BUNDLE``.
``PACKSHARD_S3_CLIENT=s3fs`` always uses s3fs; ``=arrow`` uses pyarrow's client or fails
saying why it cannot. Writing (the pack job) always uses s3fs.

The filesystem is fsspec's wrapper of pyarrow's (so everything else reads it as any fsspec
filesystem), with `cat_ranges` sending its ranges concurrently on a pool of threads.
"""

from __future__ import annotations

import os
import re
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
_TRANSLATED = frozenset({"key", "secret", "token", "anon", "endpoint_url", "client_kwargs"})
# settings of the AWS config files that pyarrow's client would not follow as botocore does
_CONFIG_FEATURES = ("endpoint_url", "role_arn", "credential_process", "sso_", "web_identity")
CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S = 60.0, 60.0  # botocore's defaults
_CLIENT_KWARGS = frozenset({"endpoint_url", "region_name"})

OPEN_OBJECTS = 64  # objects kept open per filesystem (an open is a HEAD request)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_arrow_pid = 0  # the process that first built a pyarrow S3 client (0: none yet)


class ArrowS3FileSystem(ArrowFSWrapper):
    """fsspec's wrapper of `pyarrow.fs.S3FileSystem`: concurrent `cat_ranges`, ranged
    `cat_file`, objects opened once (their size is what the open asks; a dataset does not
    change while it is read). Not usable in a forked child: pyarrow's S3 client holds locks
    that a fork taken mid-request leaves held, so a child's first request would hang; it raises
    instead (open the dataset again in the child: `reading_fs` gives it s3fs there)."""

    protocol = S3_PROTOCOLS
    cachable = False  # one instance per dataset opened: its options are in it, not in a token

    def __init__(self, arrow_kwargs: dict[str, Any], endpoint_url: str | None = None) -> None:
        global _arrow_pid
        from pyarrow import fs as pafs

        self._arrow_pid = os.getpid()
        super().__init__(pafs.S3FileSystem(**arrow_kwargs))
        _arrow_pid = _arrow_pid or os.getpid()
        self.endpoint_url = endpoint_url  # for format.unreachable_endpoint, as s3fs has it
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._files_lock = threading.Lock()

    @property
    def fs(self) -> Any:
        if self._arrow_pid != os.getpid():
            raise RuntimeError(
                f"an S3 dataset opened through pyarrow's S3 client in process {self._arrow_pid} "
                f"is used in process {os.getpid()}, forked from it: pyarrow's client cannot be "
                "used across a fork (a request in flight at the fork would leave it hanging). "
                "Open the dataset in the child (it then reads through s3fs), or start children "
                "with the spawn method"
            )
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
            f = self._files.setdefault(path, f)
            while len(self._files) > OPEN_OBJECTS:  # dropped, not closed: a reader may hold
                self._files.popitem(last=False)  # it still (it closes when unreferenced)
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
    """The process's pool of range-request threads."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(RANGE_THREADS, thread_name_prefix="packshard-s3-range")
        return _pool


def _aws_config_feature() -> str | None:
    """A setting of the AWS config files that botocore follows and pyarrow's client would not,
    or would follow differently (an endpoint, an assumed role, SSO, a credential process)."""
    env = os.environ
    for var in ("AWS_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        if env.get(var):
            return f"{var} is set"
    home = os.path.expanduser("~")
    for path in (
        env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
        env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
    ):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 20)
        except OSError:
            continue
        for key in _CONFIG_FEATURES:
            if re.search(rf"^\s*{key}\w*\s*=", text, re.MULTILINE):
                return f"{path} sets {key}"
    return None


def arrow_s3_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], str | None] | str:
    """(pyarrow S3FileSystem keyword arguments, the endpoint URL) for s3fs-style storage options,
    or why they cannot be translated (module docstring)."""
    extra = sorted(set(options) - _TRANSLATED)
    client = dict(options.get("client_kwargs") or {})
    extra += [f"client_kwargs.{k}" for k in sorted(set(client) - _CLIENT_KWARGS)]
    if extra:
        return f"storage options pyarrow's client does not take: {', '.join(extra)}"
    anon = options.get("anon", False)
    if not isinstance(anon, bool):
        return f"anon={anon!r} is not true or false"
    env = os.environ
    endpoint = (
        options.get("endpoint_url")
        or client.get("endpoint_url")
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
    )
    region = client.get("region_name")
    kw: dict[str, Any] = {}
    aws = not endpoint
    if endpoint:
        parts = urllib.parse.urlsplit(str(endpoint))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return f"an endpoint pyarrow's client cannot take: {parts.scheme}://..."
        aws = parts.hostname.endswith(".amazonaws.com")
        proxied = urllib.request.getproxies().get(parts.scheme)
        if proxied and not urllib.request.proxy_bypass(parts.hostname):
            return "a proxy is set in the environment"
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        host += f":{parts.port}" if parts.port else ""  # no user info: it would show in errors
        kw.update(endpoint_override=host + parts.path.rstrip("/"), scheme=parts.scheme)
    elif urllib.request.getproxies().get("https"):
        return "a proxy is set in the environment"
    if aws and not region:  # pyarrow's client does not follow a bucket to its region
        return "an AWS bucket without client_kwargs region_name (s3fs finds the bucket's region)"
    region = region or env.get("AWS_DEFAULT_REGION")  # botocore's order
    if region:
        kw["region"] = str(region)
    explicit = bool(endpoint) and (anon or options.get("key") is not None)
    feature = None if explicit else _aws_config_feature()
    if feature is not None:
        return f"an AWS setting pyarrow's client would not follow as botocore does ({feature})"
    if anon:  # s3fs ignores credentials when anonymous
        kw["anonymous"] = True
    else:
        for ours, theirs in (("key", "access_key"), ("secret", "secret_key"), ("token", "session_token")):  # fmt: skip
            if options.get(ours) is not None:
                kw[theirs] = str(options[ours])
    if env.get("AWS_CA_BUNDLE"):  # botocore's certificate bundle setting; pyarrow takes it so
        kw["tls_ca_file_path"] = env["AWS_CA_BUNDLE"]
    # botocore's patience: a store slow to answer is waited for (pyarrow's defaults give up
    # after 3 s without a byte)
    kw.update(connect_timeout=CONNECT_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S)
    return kw, (str(endpoint) if endpoint else None)


def reading_fs(
    url: str, storage_options: Mapping[str, Any] | None
) -> tuple[fsspec.AbstractFileSystem, str] | None:
    """(pyarrow-backed filesystem, path) for reading an s3:// dataset, or None for the one
    fsspec gives (any other URL, options pyarrow's client cannot take, or a process forked from
    one that used pyarrow's S3 client: module docstring)."""
    protocol, _, rest = url.partition("://")
    choice = os.environ.get(CLIENT_ENV, "auto").strip().lower() or "auto"
    if protocol.lower() not in S3_PROTOCOLS or choice == "s3fs":
        return None
    if choice not in ("auto", "arrow"):
        raise ValueError(f"{CLIENT_ENV}={choice!r}: use auto, arrow or s3fs")
    translated = arrow_s3_options(dict(storage_options or {}))
    if isinstance(translated, str):
        why = translated
    elif _arrow_pid not in (0, os.getpid()):
        why = "this process was forked from one that used pyarrow's S3 client"
    else:
        kw, endpoint = translated
        try:
            return ArrowS3FileSystem(kw, endpoint_url=endpoint), rest.rstrip("/") or rest
        except (ImportError, AttributeError) as e:  # a pyarrow built without S3
            why = f"pyarrow has no S3 support ({e})"
        except (ValueError, TypeError) as e:  # options its constructor refuses
            why = f"pyarrow's client refuses the options ({e})"
    if choice == "arrow":
        raise ValueError(f"{CLIENT_ENV}=arrow: {why}")
    return None
