"""A size-bounded local cache of whole shards, for remote datasets (s3://, gs://, ...).

Without a cache, a rank reads its rows straight from the object store by range requests of
only their bytes (packers.shard_file: ~1x the rank's data, one request per row or per run of
nearby rows, plus ~3% of each record batch touched). With a cache, the first use of a shard
downloads the whole file once, in 32 MiB range requests four at a time, checks it against the
manifest's checksum (a mismatch raises `FormatError` naming the shard and nothing is kept), and
later reads memory-map the local copy: worth it when a rank reads the dataset more than once
or the store charges per request. When the cache would pass `limit_bytes`, the least
recently used shards not being read at that moment are deleted (a read holds a `lease` on its
shard; at most `read_threads` shards are leased at once, so the bound holds whenever the limit
is at least that many shards).

Sizing: the step plan shuffles rows over the whole dataset, so every rank reads from every
shard each epoch. A cache that holds the whole dataset downloads each shard once per node
and rank; a smaller one re-downloads evicted shards when their rows come up again (about
rows-in-shard / rows-read-per-visit times per epoch). Size it to the dataset where disk allows;
a tight bound trades object-store traffic for disk.

Layout: ``<cache_dir>/<dataset fingerprint>/{index.arrow, shards/part-NNNNN.arrow}``, a mirror
of the dataset, so different datasets never share files. A file appears under its final name
only after it was verified (download to a unique temporary name, then an atomic rename), so
several ranks of one node may share a cache_dir: the worst case is a shard downloaded twice at
once. The bound is kept per process over the files that process sees, so give each node's
ranks a limit that sums to the disk you want to use; a rank may then evict a shard another
rank holds. A cached copy that cannot be read (evicted by another rank, or damaged on disk
since it was verified) is deleted and downloaded again, verified (`discard`, called by
`reading.RowReader`); a download is opened (memory-mapped) before it takes its final name, so
the read that follows cannot lose it to another rank's eviction. A copy of index.arrow that
fails the manifest's checks is copied again when the cache opens.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from packshard.packers import FormatError, ShardDataset
from packshard.packers.format import (
    StorageError,
    describe_error,
    new_hasher,
    range_error,
    reading,
    split_checksum,
)

log = logging.getLogger(__name__)

PART = 32 << 20  # bytes per range request of a shard download
PARTS_AT_ONCE = 4  # requested together
WRITES_BEHIND = 2  # parts hashed and waiting for the disk (so at most 6 parts, 192 MiB, in memory)


@contextmanager
def _writing(root: Path, name: str) -> Iterator[None]:
    """A local write of the cache that fails (a full disk, a quota, permissions) as one
    StorageError naming the cache and the file; errors of the remote reads pass through."""
    try:
        yield
    except FormatError:
        raise
    except OSError as e:
        raise StorageError(
            f"shard cache {root}: cannot write {name} ({describe_error(e)}); free space there, "
            "lower cache_limit_bytes or give another cache_dir"
        ) from e


class ShardCache:
    """Local whole-shard copies of `remote`, at most `limit_bytes` on disk (None: unbounded)."""

    def __init__(
        self,
        remote: ShardDataset,
        cache_dir: str | os.PathLike[str],
        *,
        fingerprint: str,
        limit_bytes: int | None = None,
    ) -> None:
        largest = max((s.bytes for s in remote.shards), default=0)
        if limit_bytes is not None and limit_bytes < largest:
            raise ValueError(
                f"cache_limit_bytes={limit_bytes} is smaller than the largest shard of {remote.url} "
                f"({largest} bytes); raise it to at least {largest} (a few shards' worth is better)"
            )
        self.remote = remote
        self.limit_bytes = limit_bytes
        if not os.fspath(cache_dir).strip():  # an unset setting, not "here"
            raise ValueError(
                f"cache_dir={os.fspath(cache_dir)!r}: give a directory (None: no shard cache)"
            )
        slug = "".join(c if c.isalnum() else "-" for c in fingerprint)[:48]
        self.root = Path(cache_dir).expanduser().resolve() / slug
        try:
            (self.root / "shards").mkdir(parents=True, exist_ok=True)
        except OSError as e:  # exists as a file, permissions, a read-only filesystem, ...
            raise ValueError(
                f"cache_dir={os.fspath(cache_dir)!r} cannot hold the shard cache: "
                f"{type(e).__name__}: {e.strerror} ({e.filename}); give a writable directory"
            ) from None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._reserved = 0  # bytes of downloads in flight
        self._shard_locks = [threading.Lock() for _ in remote.shards]
        self._lru: OrderedDict[int, int] = OrderedDict()  # shard -> bytes, oldest first
        self._leases: Counter[int] = Counter()
        self.downloads = 0
        self.evictions = 0
        self._copy_index()
        self._adopt_existing()
        self.local = self._open_local()

    def _copy_index(self) -> None:
        entry = self.remote.parsed.index
        target = self.root / entry.path
        if target.exists() and (entry.bytes is None or target.stat().st_size == entry.bytes):
            return
        tmp = target.with_name(f"{target.name}.{uuid.uuid4().hex}.tmp")
        with reading(f"{self.remote.url}/{entry.path}"):
            data = self.remote.fs.cat_file(f"{self.remote.root}/{entry.path}")
        try:
            with _writing(self.root, entry.path):
                tmp.write_bytes(data)
                os.replace(tmp, target)  # `_open_local` checks it against the manifest
        finally:
            tmp.unlink(missing_ok=True)

    def _open_local(self) -> ShardDataset:
        """The cached copy as a dataset, its index.arrow checked against the manifest (bytes,
        checksum, columns); a copy that fails (damaged on disk since) is copied again."""

        def local() -> ShardDataset:
            ds = ShardDataset(
                str(self.root), self.remote.manifest, LocalFileSystem(), str(self.root)
            )
            ds.index  # noqa: B018 (reads and checks index.arrow)
            return ds

        try:
            return local()
        except FormatError as e:
            log.warning("shard cache %s: %s; copying index.arrow again", self.root, e)
        (self.root / self.remote.parsed.index.path).unlink(missing_ok=True)
        self._copy_index()
        return local()

    def _adopt_existing(self) -> None:
        """Count verified copies a previous run left (only verified files carry final names)."""
        found = []
        for number, entry in enumerate(self.remote.shards):
            try:  # one stat: a rank sharing the cache_dir may evict the file at any moment
                st = (self.root / entry.path).stat()
            except FileNotFoundError:
                continue
            if st.st_size == entry.bytes:
                found.append((st.st_mtime, number, entry.bytes))
        for _, number, size in sorted(found):
            self._lru[number] = size

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._lru.values())

    def cached(self, shard: int) -> bool:
        with self._lock:
            return shard in self._lru

    @property
    def complete(self) -> bool:
        """Every shard of the dataset is here (reads from now on are local)."""
        with self._lock:
            return len(self._lru) == len(self.remote.shards)

    @contextmanager
    def lease(self, shard: int) -> Iterator[ShardDataset]:
        """Make `shard` local (download + verify if needed) and keep it from eviction while the
        block runs; yields the local dataset to read it from."""
        with self._lock:
            self._leases[shard] += 1
        try:
            self._ensure(shard)
            yield self.local
        finally:
            with self._cond:
                self._leases[shard] -= 1
                if not self._leases[shard]:
                    del self._leases[shard]
                self._cond.notify_all()

    def _ensure(self, shard: int) -> None:
        with self._shard_locks[shard]:
            with self._lock:
                if shard in self._lru:
                    self._lru.move_to_end(shard)
                    return
            entry = self.remote.shards[shard]
            self._make_room(shard, entry.bytes)
            done = False
            try:
                self._download(shard)
                done = True
            finally:
                with self._cond:
                    self._reserved -= entry.bytes
                    if done:
                        self._lru[shard] = entry.bytes
                        self.downloads += 1
                    self._cond.notify_all()

    def discard(self, shard: int, why: str) -> None:
        """Forget and delete the cached copy of `shard` (a read of it failed: `why`), once no
        other read of this process holds it; the next lease downloads it again, verified."""
        with self._cond:
            while self._leases[shard]:
                self._cond.wait(timeout=1.0)
            self._lru.pop(shard, None)
            self.local.close_shard(shard)
            (self.root / self.remote.shards[shard].path).unlink(missing_ok=True)
        log.warning(
            "shard cache %s: the cached copy of %s could not be read (%s); downloading it again",
            self.root, self.remote.shards[shard].path, why,
        )  # fmt: skip

    def _make_room(self, shard: int, need: int) -> None:
        """Reserve `need` bytes for `shard`, evicting unleased LRU shards; while the only way
        to free room is for another read or download to finish, wait for it."""
        with self._cond:
            while True:
                used = sum(self._lru.values()) + self._reserved
                if self.limit_bytes is None or used + need <= self.limit_bytes:
                    break
                victim = next((s for s in self._lru if s not in self._leases), None)
                if victim is not None:
                    del self._lru[victim]
                    self.evictions += 1
                    self.local.close_shard(victim)
                    (self.root / self.remote.shards[victim].path).unlink(missing_ok=True)
                    continue
                others_busy = self._reserved > 0 or sum(self._leases.values()) > self._leases[shard]
                if not others_busy:
                    log.warning(
                        "shard cache %s: %d bytes over its %d-byte limit while every cached shard is being read; "
                        "raise cache_limit_bytes to at least read_threads shards",
                        self.root, used + need - self.limit_bytes, self.limit_bytes,
                    )  # fmt: skip
                    break
                self._cond.wait(timeout=1.0)
            self._reserved += need

    def _download(self, shard: int) -> None:
        """Copy a shard here in parts of PART bytes, PARTS_AT_ONCE requested at a time (one
        request per 32 MiB instead of a sequential read of 8 MiB blocks). Parts are hashed in
        order as they arrive and handed to one writer thread, a new request going out as each
        part is hashed: the disk absorbs a part (0.005-0.09 s for 32 MiB on a slow virtual
        disk) while the next ones download, with at most WRITES_BEHIND parts waiting for it.
        The file takes its final name only once its `bytes` bytes match the manifest's checksum
        (a longer object is cut to them, a shorter one fails)."""
        entry = self.remote.shards[shard]
        where = f"{self.remote.url}/{entry.path}"
        path = f"{self.remote.root}/{entry.path}"
        algorithm, _ = split_checksum(entry.checksum, where)
        target = self.root / entry.path
        tmp = target.with_name(f"{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        hasher = new_hasher(algorithm)
        fs = self.remote.fs
        size = entry.bytes  # a longer object is cut here; a shorter one comes back short

        def part(a: int, e: int) -> bytes:
            with reading(where):
                return fs.cat_file(path, start=a, end=e)

        parts = deque((a, min(a + PART, size)) for a in range(0, size, PART))
        pool = ThreadPoolExecutor(PARTS_AT_ONCE, thread_name_prefix="packshard-download")
        writer = ThreadPoolExecutor(1, thread_name_prefix="packshard-cache-write")
        inflight: deque[tuple[int, int, Future[bytes]]] = deque()
        writes: deque[Future[int]] = deque()
        try:
            with _writing(self.root, entry.path), open(tmp, "wb") as dst:
                try:
                    while parts or inflight:
                        while parts and len(inflight) < PARTS_AT_ONCE:
                            a, e = parts.popleft()
                            inflight.append((a, e, pool.submit(part, a, e)))
                        a, e, future = inflight.popleft()
                        data = future.result()
                        if len(data) != e - a:
                            raise range_error(where, a, e, len(data))
                        hasher.update(data)
                        writes.append(writer.submit(dst.write, data))  # in order: one writer
                        while len(writes) > WRITES_BEHIND or (writes and writes[0].done()):
                            writes.popleft().result()
                finally:  # the file closes only once no write is in flight (errors: the first)
                    wait(writes)
                for w in writes:
                    w.result()
            digest = f"{algorithm}:{hasher.hexdigest()}"
            if digest != entry.checksum:
                raise FormatError(
                    f"{where}: downloaded {size} bytes with checksum {digest}; the manifest says {entry.checksum}. "
                    f"The shard is corrupted: run `packshard verify {self.remote.url}` and re-pack."
                )
            # Open it before it takes its name: a rank sharing this cache_dir may evict the
            # name at once (each process bounds the files it knows), and the open copy stays
            # readable for this one.
            self.local.open_shard_file(shard, str(tmp))
            try:
                with _writing(self.root, entry.path):
                    os.replace(tmp, target)
            except BaseException:
                self.local.close_shard(shard)
                raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            writer.shutdown(wait=True, cancel_futures=True)
            tmp.unlink(missing_ok=True)
        log.debug("cached %s (%d bytes)", where, size)

    def close(self) -> None:
        self.local.close()
