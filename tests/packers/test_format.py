"""Shard format v1 through a local directory: round trip, random access, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from packshard.packers import FORMAT_VERSION, DatasetWriter, FormatError, ShardDataset, pack_table
from packshard.packers.format import check_relative_path

CONFIG = {"seq_len": 512, "cp": 4, "pad_multiple": 4, "pad_token_id": 3, "overlong": "truncate"}


def _make(tmp_path, n=400, max_rows=25, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(10, 900, int(k)).astype(np.int32) for k in rng.integers(1, 400, n)]
    masks = [rng.random(len(x)) < 0.6 for x in ids]
    table = pa.table(
        {
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.bool_())),
        }
    )
    batch, _ = pack_table(table, seq_len=512, pad_multiple=4, pad_token_id=3)
    url = str(tmp_path / "ds")
    w = DatasetWriter(url, CONFIG, max_rows=max_rows, rows_per_batch=7)
    for start in range(0, batch.num_rows, 11):  # arrive in odd-sized pieces
        w.write(batch.slice(start, 11))
    manifest = w.close({"samples_in": n, "samples_kept": n, "dropped": {}})
    return url, batch, manifest


def test_round_trip_and_random_access(tmp_path):
    url, batch, manifest = _make(tmp_path)
    assert manifest["format"] == "packshard" and manifest["version"] == FORMAT_VERSION
    assert manifest["totals"]["rows"] == batch.num_rows
    assert [s["rows"] for s in manifest["shards"]][:-1] == [25] * (len(manifest["shards"]) - 1)
    with ShardDataset.open(url) as ds:
        assert ds.num_rows == batch.num_rows
        rows = batch.to_pylist()
        for g in [0, 6, 7, 24, 25, batch.num_rows - 1]:
            got = ds.read_row(g)
            assert got["input_ids"].tolist() == rows[g]["input_ids"]
            assert got["loss_mask"].tolist() == rows[g]["loss_mask"]
            assert got["sample_ids"].tolist() == rows[g]["sample_ids"]
            assert got["num_tokens"] == rows[g]["num_tokens"]
        t = ds.read_rows(1, [9, 2, 9], columns=["num_tokens"])
        assert t.column_names == ["num_tokens"]
        assert t.column("num_tokens").to_pylist() == [
            rows[25 + 9]["num_tokens"],
            rows[25 + 2]["num_tokens"],
            rows[34]["num_tokens"],
        ]
        idx = ds.index
        assert idx.column("num_tokens").to_pylist() == [r["num_tokens"] for r in rows]
        assert idx.column("attn_cost").to_pylist() == [
            sum(d * d for d in r["doc_lens"]) for r in rows
        ]
        for s in range(len(ds.shards)):
            ds.verify_shard(s)


def test_reader_reads_only_needed_batches(tmp_path, monkeypatch):
    url, _, _ = _make(tmp_path)
    with ShardDataset.open(url) as ds:
        reader = ds._file(0).reader
        calls = []
        orig = type(reader).get_batch
        monkeypatch.setattr(
            type(reader), "get_batch", lambda self, i: calls.append(i) or orig(self, i)
        )
        ds.read_rows(0, [15], verify=False)
        assert calls == [2]  # rows_per_batch 7: row 15 is in batch 2


def _rewrite_manifest(url, change):
    path = Path(url) / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m.update(version=2), "version 2 is not known"),
        (lambda m: m.update(format="other"), "format is 'other'"),
        (lambda m: m["shards"][0].update(path="../evil.arrow"), r"'\.\.' or '\.' segments"),
        (lambda m: m["shards"][0].update(path="/etc/passwd"), "absolute"),
        (lambda m: m["shards"][0].update(path="s3://x/y"), "absolute"),
        (lambda m: m["shards"][0].update(checksum="md5:00"), "not known"),
        (lambda m: m.pop("totals"), "missing keys"),
    ],
)
def test_refuses_bad_manifests(tmp_path, change, match):
    url, _, _ = _make(tmp_path, n=60)
    _rewrite_manifest(url, change)
    with pytest.raises(FormatError, match=match) as e:
        ShardDataset.open(url)
    assert "manifest.json" in str(e.value)


def test_refuses_missing_manifest(tmp_path):
    url, _, _ = _make(tmp_path, n=60)
    (tmp_path / "ds" / "manifest.json").unlink()
    with pytest.raises(FormatError, match=r"no manifest\.json"):
        ShardDataset.open(url)


def test_corrupted_row_is_caught_by_row_checksum(tmp_path):
    url, _, manifest = _make(tmp_path, n=120)
    path = tmp_path / "ds" / manifest["shards"][0]["path"]
    data = bytearray(path.read_bytes())
    with ShardDataset.open(url) as ds:
        target = ds.read_row(0)["input_ids"]
    # flip a byte inside the first row's token values
    needle = target[:4].astype("<i4").tobytes()
    at = data.find(needle)
    assert at > 0
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with ShardDataset.open(url) as ds:
        with pytest.raises(FormatError, match="row 0 does not match its checksum"):
            ds.read_rows(0, [0])
        with pytest.raises(FormatError, match=r"checksum .* does not match the manifest"):
            ds.verify_shard(0)


def test_row_checksums_follow_the_format_definition(tmp_path):
    """index.arrow's row_checksum is xxh3_64 over the row's int32 ids, one byte per mask value,
    int32 doc_lens and int64 sample_ids (docs/FORMAT.md); `rows.row_checksum` is that
    definition written out, and the writer and the reader's in-place digest agree with it."""
    from packshard.packers.reader import _row_digest
    from packshard.packers.rows import row_checksum

    url, batch, _ = _make(tmp_path, n=150)
    with ShardDataset.open(url) as ds:
        index = ds.index.to_pydict()
        base = 0
        for shard, entry in enumerate(ds.shards):
            rows = list(range(entry.rows))
            cols = ("input_ids", "loss_mask", "doc_lens", "sample_ids")
            got = ds.read_rows_arrays(shard, rows, cols)
            for r in rows:
                parts = [got[c][r] for c in cols]
                want = index["row_checksum"][base + r]
                assert row_checksum(*parts) == _row_digest(tuple(parts)) == want
            base += entry.rows
    assert base == batch.num_rows


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "./a", "a//b", "C:/x", "http://h/p", "a/."])
def test_check_relative_path_refuses(bad):
    with pytest.raises(FormatError):
        check_relative_path(bad, "where")


def test_check_relative_path_accepts():
    assert check_relative_path("shards/part-00000.arrow", "w") == "shards/part-00000.arrow"


def test_required_shard_keys_are_the_shard_entry_fields_but_the_optional_one():
    from dataclasses import fields

    from packshard.packers.manifest import SHARD_KEYS, ShardEntry

    assert {*SHARD_KEYS, "rows_per_batch"} == {f.name for f in fields(ShardEntry)}


def test_numpy_dtypes_of_arrow_types():
    """The mapping itself; that it needs no pandas is tests/packaging's core install, which
    runs the oldest pyarrow we take (pyarrow < 26 imports pandas in to_pandas_dtype)."""
    from packshard.packers.arrays import numpy_dtype

    for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
              pa.uint32(), pa.uint64(), pa.float16(), pa.float32(), pa.float64()):  # fmt: skip
        assert numpy_dtype(t) == np.dtype(t.to_pandas_dtype()), t
    with pytest.raises(TypeError, match="not a fixed-width numeric type"):
        numpy_dtype(pa.string())
