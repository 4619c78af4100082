"""`packshard verify URL`: re-read a whole dataset and check everything the format promises.

Checks, each reported with the file (and row) it concerns:
- manifest.json and index.arrow hold everything a reader relies on, with the types and ranges
  docs/FORMAT.md gives (packers.manifest: format v1, relative paths, counts that add up, the
  index's shard/row columns against each shard's rows, per-shard and total sums, row lengths
  against seq_len and pad_multiple, the histogram); a breach here stops the check;
- every shard's size and bytes match the manifest's `bytes` and checksum, its schema is v1's,
  its record batches are as many and as long as the manifest's `rows` and `rows_per_batch`
  say, Arrow's full validation passes (offsets inside their values), and every row keeps the
  per-row invariants (packers.validate) and matches its index row (lengths, loss count,
  documents, attention cost, row checksum);
- every kept sample id appears in exactly one row (several pieces only under overlong=split),
  and the number of distinct sample ids equals totals.samples_kept.

Each shard is read once (into memory, ~ its size). Every problem is a line naming the file;
nothing else escapes (a failing store is one line too). Exit status 0 when nothing is wrong,
1 otherwise.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from packshard.packers import FormatError, ShardDataset, row_index_stats, row_problems
from packshard.packers.manifest import shape_problems
from packshard.packers.rows import list_parts
from packshard.packers.shard_file import batches_from_bytes

log = logging.getLogger(__name__)
INDEX_CHECKED = (
    "num_tokens",
    "padded_len",
    "num_loss_tokens",
    "num_docs",
    "attn_cost",
    "row_checksum",
)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, show: bool) -> Any:
    """tqdm's bar on a terminal, else none (a log or CI output gets no carriage-return
    redraws); none without tqdm too: verify is part of the core install, tqdm comes with [pack]."""
    if not show or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        log.info("verify: no progress bar (tqdm comes with 'packshard[pack]')")
        return _NoBar()
    return tqdm(total=total, unit="row", desc="verify")


def verify_dataset(
    url: str, *, storage_options: Mapping[str, Any] | None = None, progress: bool = False
) -> list[str]:
    """All problems found in the dataset at `url` (empty list: the dataset is sound)."""
    try:
        ds = ShardDataset.open(url, storage_options=storage_options)
        ds.index  # noqa: B018 (reads and checks index.arrow against the manifest)
    except FormatError as e:
        return [str(e)]
    problems = [f"{ds.url}/manifest.json: config: {p}" for p in shape_problems(ds.config)]
    idx = {name: ds.index_column(name) for name in ds.index.column_names if name in INDEX_CHECKED}
    sample_chunks: list[np.ndarray] = []
    bar = _progress_bar(ds.num_rows, progress)
    for s, entry in enumerate(ds.shards):
        try:
            batches = batches_from_bytes(ds.shard_bytes(s), entry, f"{ds.url}/{entry.path}")
        except FormatError as e:
            problems.append(str(e))
            continue
        problems += _check_rows(ds, s, batches, idx, sample_chunks)
        bar.update(entry.rows)
    bar.close()
    if not problems:  # sample accounting is only meaningful once every shard was read whole
        problems += _check_totals(ds, sample_chunks)
    return problems


def _check_rows(
    ds: ShardDataset,
    shard: int,
    batches: list,
    idx: dict[str, np.ndarray],
    sample_chunks: list[np.ndarray],
) -> list[str]:
    """The per-row invariants of a shard's rows and their agreement with index.arrow."""
    cfg, where = ds.config, f"{ds.url}/{ds.shards[shard].path}"
    base, row, problems = int(ds.shard_row_starts[shard]), 0, []
    for batch in batches:
        found = row_problems(
            batch,
            seq_len=cfg["seq_len"],
            pad_multiple=cfg["pad_multiple"],
            pad_token_id=cfg["pad_token_id"],
            first_row=row,
        )
        problems += [f"{where}: {p}" for p in found]
        stats = row_index_stats(batch)
        for name, expected in idx.items():
            expect = expected[base + row : base + row + batch.num_rows]
            for i in np.flatnonzero(expect != stats[name])[:5]:
                problems.append(
                    f"{where}: row {row + int(i)}: {name} is {stats[name][i]} but index.arrow says {expect[i]}"
                )
        off, sids = list_parts(batch.column("sample_ids"))
        sample_chunks.append(sids[off[0] : off[-1]])
        row += batch.num_rows
    return problems


def _check_totals(ds: ShardDataset, sample_chunks: list[np.ndarray]) -> list[str]:
    """Sample accounting (the manifest's own sums were checked when it was opened)."""
    problems = []
    totals = ds.manifest["totals"]
    where = f"{ds.url}/manifest.json"
    ids = np.concatenate(sample_chunks) if sample_chunks else np.zeros(0, np.int64)
    uniq, counts = np.unique(ids, return_counts=True)
    if ds.config.get("overlong") != "split" and (counts > 1).any():
        dup = uniq[counts > 1]
        problems.append(
            f"{where}: {dup.size} sample ids appear in more than one document (e.g. {dup[:5].tolist()})"
        )
    if uniq.size != totals["samples_kept"]:
        problems.append(
            f"{where}: totals.samples_kept is {totals['samples_kept']}, the rows hold {uniq.size} distinct samples"
        )
    return problems
