"""Shard format round trip through s3:// on moto's standalone server (real HTTP)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from packshard.packers import DatasetWriter, ShardDataset, pack_table

pytestmark = pytest.mark.s3


@pytest.fixture(autouse=True, params=["arrow", "s3fs"])
def s3_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test reads through pyarrow's S3 client and through s3fs (packers.s3_reading)."""
    monkeypatch.setenv("PACKSHARD_S3_CLIENT", request.param)
    return request.param


def write_s3(url, s3_server, ids, seq_len, **writer_kw):
    """Pack token lists `ids` at `seq_len` and write them to `url`; (packed batch, manifest)."""
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))})
    batch, _ = pack_table(table, seq_len=seq_len, pad_multiple=4, pad_token_id=7)
    w = DatasetWriter(
        url,
        {"seq_len": seq_len, "pad_multiple": 4, "pad_token_id": 7, "cp": 4},
        storage_options=s3_server["storage_options"],
        **writer_kw,
    )
    w.write(batch)
    n = len(ids)
    return batch, w.close({"samples_in": n, "samples_kept": n, "dropped": {}})


def test_round_trip_s3(s3_server, s3_bucket, caplog):
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, 500, int(n)).astype(np.int32) for n in rng.integers(1, 900, 300)]
    url = f"s3://{s3_bucket}/run1"
    with caplog.at_level("INFO", logger="packshard.packers.writer"):
        batch, manifest = write_s3(url, s3_server, ids, 1024, max_rows=40)
    assert f"committed {url}: " in caplog.text  # the URL as given, scheme included
    assert len(manifest["shards"]) > 1
    ds = ShardDataset.open(url, storage_options=s3_server["storage_options"])
    for s in range(len(ds.shards)):
        ds.verify_shard(s)
    got = ds.read_rows(1, [3, 0], columns=["input_ids", "num_tokens"])
    expect = pa.Table.from_batches([batch]).slice(40, 4)
    assert got.column("input_ids")[0].as_py() == expect.column("input_ids")[3].as_py()
    assert got.column("input_ids")[1].as_py() == expect.column("input_ids")[0].as_py()
    assert got.column("num_tokens").to_pylist() == [
        expect.column("num_tokens")[3].as_py(),
        expect.column("num_tokens")[0].as_py(),
    ]


def test_batches_read_whole_serve_later_rows_without_requests(s3_server, s3_bucket, monkeypatch):
    """A window of rows dense in a batch reads the batch whole; a later window's rows of the
    same batches come from the kept tokens (no request), unless the byte budget is 0."""
    from packshard.packers.shard_file import RemoteShard

    rng = np.random.default_rng(2)
    ids = [rng.integers(0, 500, 200).astype(np.int32) for _ in range(120)]
    url = f"s3://{s3_bucket}/kept"
    batch, _ = write_s3(url, s3_server, ids, 256, rows_per_batch=10)
    n = batch.num_rows
    first, second = list(range(0, n, 2)), list(range(1, n, 2))  # every batch dense in both
    want = batch.column("input_ids").to_pylist()
    requested: list[int] = []
    real_read = RemoteShard.read

    def counting_read(self, ranges):
        if ranges:
            requested.append(sum(e - a for a, e in ranges))
        return real_read(self, ranges)

    monkeypatch.setattr(RemoteShard, "read", counting_read)
    for budget, second_requests in ((256 << 20, 0), (0, 1)):
        ds = ShardDataset.open(url, storage_options=s3_server["storage_options"])
        ds.whole_batch_bytes = budget
        got = ds.read_rows_arrays(0, first)["input_ids"]
        assert [g.tolist() for g in got] == [want[r] for r in first]
        requested.clear()
        got = ds.read_rows_arrays(0, second)["input_ids"]
        assert [g.tolist() for g in got] == [want[r] for r in second]
        assert (len(requested) > 0) == bool(second_requests), (budget, requested)
