"""Reading a window of global rows for one rank: grouped by shard, shards in parallel, through
the optional shard cache, every row checked against its checksum.

`RowReader.read(rows)` takes the global rows (index.arrow positions) a rank needs next, groups
them by shard (one `ShardDataset.read_rows_arrays` per shard: numpy views, no Arrow object per
row), and reads the shards of the window on `threads` threads, which overlaps the latency of
remote range reads or shard downloads (the reader keeps one lock per shard). With a
`ShardCache`, each shard is leased while it is read, so eviction never removes it under a read;
a cached copy that fails its read (evicted by another rank sharing the cache_dir, or damaged on
disk) is discarded and read once more from a fresh, verified download, so only a shard that is
bad in the store itself raises.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from packshard.packers import FormatError, ShardDataset
from packshard.trainer_shim.cache import ShardCache

ROW_COLUMNS = ("input_ids", "loss_mask", "doc_lens")
SETTLE_S = 10.0  # a failed window waits this long for its shard reads still running
Row = tuple[np.ndarray, np.ndarray, np.ndarray]  # input_ids, loss_mask, doc_lens


class RowReader:
    """Reads rows of `dataset` (or of its cached copy) for one rank; `close()` ends its threads."""

    def __init__(
        self,
        dataset: ShardDataset,
        *,
        cache: ShardCache | None = None,
        threads: int = 4,
        verify: bool = True,
        on_progress: Callable[[], None] | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.dataset = dataset
        self.cache = cache
        self.verify = verify
        self.on_progress = on_progress  # called as each shard's part of a read completes
        self._starts = dataset.shard_row_starts
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="packshard-read")
            if threads > 1
            else None
        )

    def read(self, rows: list[int] | np.ndarray) -> dict[int, Row]:
        """{global row: (input_ids, loss_mask, doc_lens)} for these rows (duplicates allowed)."""
        arr = np.asarray(rows, dtype=np.int64)
        if arr.size == 0:
            return {}
        shard_of = np.searchsorted(self._starts, arr, side="right") - 1
        groups = {int(s): arr[shard_of == s] for s in np.unique(shard_of)}
        out: dict[int, Row] = {}
        if self._pool is None or len(groups) == 1:
            for shard, members in groups.items():
                out.update(self._read_shard(shard, members))
            return out
        futures = [self._pool.submit(self._read_shard, s, m) for s, m in groups.items()]
        try:
            for future in futures:
                out.update(future.result())
        except BaseException:
            # the window failed (a bad shard, Ctrl-C, close() ending the pool): the reads still
            # running finish before the error goes on, so none opens a shard after the caller
            # has closed the dataset (one hung past SETTLE_S is left to close its own)
            for future in futures:
                future.cancel()
            wait(futures, timeout=SETTLE_S)
            raise
        return out

    def _read_shard(self, shard: int, members: np.ndarray) -> dict[int, Row]:
        local_rows = members - self._starts[shard]
        if self.cache is not None:
            cols = self._read_cached(shard, local_rows)
        else:
            cols = self.dataset.read_rows_arrays(shard, local_rows, ROW_COLUMNS, verify=self.verify)
        if self.on_progress is not None:
            self.on_progress()
        return {
            int(g): row
            for g, row in zip(
                members, zip(*(cols[c] for c in ROW_COLUMNS), strict=True), strict=True
            )
        }

    def _read_cached(self, shard: int, local_rows: np.ndarray) -> dict[str, list[np.ndarray]]:
        """Read from the cached copy; if the copy fails (not its download: that raises when
        the lease makes the shard local), discard it and read a fresh, verified download."""
        assert self.cache is not None
        with self.cache.lease(shard) as source:
            try:
                return source.read_rows_arrays(shard, local_rows, ROW_COLUMNS, verify=self.verify)
            except FormatError as e:
                failure = e
        self.cache.discard(shard, str(failure))
        with self.cache.lease(shard) as source:
            return source.read_rows_arrays(shard, local_rows, ROW_COLUMNS, verify=self.verify)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
