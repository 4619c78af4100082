"""`packshard verify URL`: re-read a whole dataset and check everything the format promises.

Checks, each reported with the file (and row) it concerns:
- manifest.json parses, is format v1, has only relative paths (else the dataset is refused);
- index.arrow matches its checksum, has one row per shard row, and its per-shard sums match
  the manifest's shard entries; the manifest's totals match the shards;
- every shard's bytes hash to the manifest's checksum, its schema is v1's, and every row
  keeps the per-row invariants (packers.validate) and matches its index row (lengths,
  loss count, documents, attention cost, row checksum);
- every kept sample id appears in exactly one row (several pieces only under overlong=split),
  and the number of distinct sample ids equals totals.samples_kept.

Exit status 0 when nothing is wrong, 1 otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from packshard.packers import FormatError, ShardDataset, row_index_stats, row_problems
from packshard.packers.rows import list_parts

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
    """tqdm's bar, or none: verify is part of the core install, tqdm comes with [pack]."""
    if not show:
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
        index = ds.index
    except FormatError as e:
        return [str(e)]
    problems: list[str] = []
    cfg = ds.config
    seq_len, multiple, pad_id = (
        int(cfg["seq_len"]),
        int(cfg["pad_multiple"]),
        int(cfg["pad_token_id"]),
    )
    idx = {name: index.column(name).to_numpy() for name in index.column_names}
    sample_chunks: list[np.ndarray] = []
    bar = _progress_bar(ds.num_rows, progress)
    for s, entry in enumerate(ds.shards):
        where = f"{url}/{entry.path}"
        base = int(ds.shard_row_starts[s])
        try:
            ds.verify_shard(s)
        except FormatError as e:
            problems.append(str(e))
            continue
        if (
            not (idx["shard"][base : base + entry.rows] == s).all()
            or not (idx["row"][base : base + entry.rows] == np.arange(entry.rows)).all()
        ):
            problems.append(
                f"{url}/index.arrow: rows {base}..{base + entry.rows - 1} do not point at shard {s} rows 0..{entry.rows - 1}"
            )
        row = 0
        try:
            for batch in ds.iter_shard(s):
                found = row_problems(
                    batch,
                    seq_len=seq_len,
                    pad_multiple=multiple,
                    pad_token_id=pad_id,
                    first_row=row,
                )
                problems += [f"{where}: {p}" for p in found]
                stats = row_index_stats(batch)
                for name in INDEX_CHECKED:
                    if name not in idx:
                        continue
                    expect = idx[name][base + row : base + row + batch.num_rows]
                    bad = np.flatnonzero(expect != stats[name])
                    for i in bad[:5]:
                        problems.append(
                            f"{where}: row {row + int(i)}: {name} is {stats[name][i]} but index.arrow says {expect[i]}"
                        )
                off, sids = list_parts(batch.column("sample_ids"))
                sample_chunks.append(sids[off[0] : off[-1]])
                row += batch.num_rows
                bar.update(batch.num_rows)
        except FormatError as e:
            problems.append(str(e))
        if row != entry.rows:
            problems.append(f"{where}: holds {row} rows, the manifest says {entry.rows}")
        sums = {
            "num_tokens": int(idx["num_tokens"][base : base + entry.rows].sum()),
            "padded_tokens": int(idx["padded_len"][base : base + entry.rows].sum()),
            "loss_tokens": int(idx["num_loss_tokens"][base : base + entry.rows].sum()),
        }
        for key, got in sums.items():
            if getattr(entry, key) != got:
                problems.append(
                    f"{where}: manifest says {key}={getattr(entry, key)}, its rows hold {got}"
                )
    bar.close()
    if not problems:  # sample accounting is only meaningful once every shard was read whole
        problems += _check_totals(url, ds, sample_chunks)
    return problems


def _check_totals(url: str, ds: ShardDataset, sample_chunks: list[np.ndarray]) -> list[str]:
    problems = []
    totals = ds.manifest["totals"]
    where = f"{url}/manifest.json"
    for key, attr in (
        ("num_tokens", "num_tokens"),
        ("padded_tokens", "padded_tokens"),
        ("loss_tokens", "loss_tokens"),
        ("rows", "rows"),
    ):
        got = sum(getattr(s, attr) for s in ds.shards)
        if totals.get(key) != got:
            problems.append(f"{where}: totals.{key} is {totals.get(key)}, the shards hold {got}")
    ids = np.concatenate(sample_chunks) if sample_chunks else np.zeros(0, np.int64)
    uniq, counts = np.unique(ids, return_counts=True)
    if ds.config.get("overlong") != "split" and (counts > 1).any():
        dup = uniq[counts > 1]
        problems.append(
            f"{where}: {dup.size} sample ids appear in more than one document (e.g. {dup[:5].tolist()})"
        )
    if "samples_kept" in totals and uniq.size != totals["samples_kept"]:
        problems.append(
            f"{where}: totals.samples_kept is {totals['samples_kept']}, the rows hold {uniq.size} distinct samples"
        )
    dropped = totals.get("dropped", {})
    if (
        isinstance(dropped, dict)
        and "samples_in" in totals
        and "samples_kept" in totals
        and totals["samples_in"] != totals["samples_kept"] + sum(dropped.values())
    ):
        problems.append(
            f"{where}: samples_in {totals['samples_in']} != samples_kept {totals['samples_kept']} + dropped {sum(dropped.values())}"
        )
    return problems
