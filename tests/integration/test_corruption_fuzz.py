"""Corruption fuzz: a small dataset damaged at random, read by the shim, `packshard stats` and
`packshard verify`. Each damaged copy must either raise one packshard error (a `FormatError`)
or give exactly the original data: never other data, never a raw pyarrow / numpy / OS error.

Damage (seeded, so a failing case replays from its number): byte flips and truncations of
manifest.json, index.arrow and the shards; edits of one manifest value (numbers nudged, scaled,
zeroed, negated; types changed to strings, floats, booleans, nulls, lists; keys removed; paths
pointed at another shard, outside the dataset or at nothing). Oracles:

- the shim (`PackedShardStream`, one rank, one row per step: no filler rows) yields the
  original micro-batches, all of them, or raises `FormatError`;
- `dataset_stats` returns the original numbers about the data (rows, tokens, documents,
  padding, lengths, histogram, sample counts; not what only the manifest declares: byte sizes,
  the tokenizer's name, cp, pad_multiple) or raises `FormatError`;
- `verify_dataset` returns a list of problems (never raises), non-empty for any damage to index
  or shard bytes (every byte is under a checksum); when it returns none, the shim gave the
  original data.

`PACKSHARD_FUZZ_CASES` (default 90: ~5 s here) sets the number of cases per kind of damage
divided by three.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from packshard.packers import FormatError, ShardDataset
from packshard.pipeline.stats import dataset_stats
from packshard.pipeline.verify import verify_dataset
from packshard.trainer_shim import PackedShardStream
from packshard.trainer_shim.synthetic import write_synthetic_dataset

CASES = int(os.environ.get("PACKSHARD_FUZZ_CASES", "90"))
STATS_DECLARED = {"url", "bytes", "tokenizer", "packing", "cp", "pad_multiple"}


def _stream(url: str) -> list[dict[str, Any]]:
    with PackedShardStream(url, dp_rank=0, dp_size=1, rows_per_step=1, seed=5) as s:
        return list(s)


def _same_batches(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        for k in x:
            if isinstance(x[k], torch.Tensor):
                if not torch.equal(x[k], y[k]):
                    return False
            elif x[k] != y[k]:
                return False
    return True


def _stats(url: str) -> dict[str, Any]:
    with ShardDataset.open(url) as ds:
        st = dataset_stats(ds)
    return {k: v for k, v in st.items() if k not in STATS_DECLARED}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzz") / "ds"
    lengths = np.random.default_rng(11).integers(3, 70, 60)
    write_synthetic_dataset(
        str(root), lengths=lengths, seq_len=64, pad_multiple=4, max_rows_per_shard=9,
        rows_per_batch=4, vocab_size=500,
    )  # fmt: skip
    assert verify_dataset(str(root)) == []
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return {"root": root, "files": files, "batches": _stream(str(root)), "stats": _stats(str(root))}


def _copy(original: dict[str, Any], tmp: Path, name: str) -> Path:
    out = tmp / name
    shutil.copytree(original["root"], out)
    return out


def _check(original: dict[str, Any], url: Path, case: str, *, must_fail_verify: bool) -> None:
    """The oracles of the module docstring; any other exception fails the test (unwrapped)."""
    try:
        batches = _stream(str(url))
    except FormatError:
        batches = None
    if batches is not None:
        assert _same_batches(batches, original["batches"]), f"{case}: the shim gave other data"
    try:
        stats = _stats(str(url))
    except FormatError:
        stats = None
    if stats is not None:
        assert stats == original["stats"], f"{case}: stats gave other numbers"
    problems = verify_dataset(str(url))
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems), case
    if must_fail_verify:
        assert problems, f"{case}: verify found nothing"
    if not problems:
        assert batches is not None, f"{case}: verify passed a dataset the shim refuses"


def _pick_file(rng: np.random.Generator, files: list[str]) -> str:
    # a third of the cases on each of: the manifest, the index, a shard
    kind = int(rng.integers(3))
    shards = [f for f in files if f.startswith("shards/")]
    return ["manifest.json", "index.arrow", shards[int(rng.integers(len(shards)))]][kind]


@pytest.mark.parametrize("seed", range(CASES // 3))
def test_byte_flip(original, tmp_path, seed):
    rng = np.random.default_rng(1000 + seed)
    rel = _pick_file(rng, original["files"])
    url = _copy(original, tmp_path, "ds")
    path = url / rel
    data = bytearray(path.read_bytes())
    at = int(rng.integers(len(data)))
    data[at] ^= int(rng.integers(1, 256))
    path.write_bytes(bytes(data))
    case = f"flip of byte {at} of {rel} (seed {seed})"
    _check(original, url, case, must_fail_verify=rel != "manifest.json")


@pytest.mark.parametrize("seed", range(CASES // 3))
def test_truncation(original, tmp_path, seed):
    rng = np.random.default_rng(2000 + seed)
    rel = _pick_file(rng, original["files"])
    url = _copy(original, tmp_path, "ds")
    path = url / rel
    data = path.read_bytes()
    keep = int(rng.integers(len(data)))
    path.write_bytes(data[:keep])
    _check(
        original,
        url,
        f"{rel} cut to {keep} of {len(data)} bytes (seed {seed})",
        must_fail_verify=True,
    )


def _leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every value in a JSON object (containers included), root excluded."""
    out = []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        out.append((*path, k))
        out += _leaves(v, (*path, k))
    return out


def _edit(manifest: dict, rng: np.random.Generator) -> str:
    """Change one value of the manifest at random; returns what was done."""
    paths = _leaves(manifest)
    path = paths[int(rng.integers(len(paths)))]
    parent = manifest
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    where = "/".join(map(str, path))
    op = int(rng.integers(4))
    if op == 0 and isinstance(parent, dict):
        del parent[key]
        return f"removed {where}"
    if isinstance(old, int | float) and not isinstance(old, bool) and op in (1, 2):
        new = [old + 1, old - 1, old * 2, 0, -old, old + 10**9][int(rng.integers(6))]
    elif isinstance(old, str) and op in (1, 2):
        shards = [s["path"] for s in manifest.get("shards", []) if isinstance(s, dict)]
        choices = [
            *shards,
            "index.arrow",
            "shards/../index.arrow",
            "/etc/passwd",
            "nothing.arrow",
            old + "x",
            "",
        ]
        new = choices[int(rng.integers(len(choices)))]
    else:
        new = [str(old), 1.5, True, None, [old], {"x": old}][int(rng.integers(6))]
    parent[key] = new
    return f"set {where} from {old!r} to {new!r}"


@pytest.mark.parametrize("seed", range(CASES - 2 * (CASES // 3)))
def test_manifest_edit(original, tmp_path, seed):
    rng = np.random.default_rng(3000 + seed)
    url = _copy(original, tmp_path, "ds")
    path = url / "manifest.json"
    manifest = json.loads(path.read_text())
    what = _edit(manifest, rng)
    path.write_text(json.dumps(manifest))
    _check(original, url, f"manifest edit: {what} (seed {seed})", must_fail_verify=False)
