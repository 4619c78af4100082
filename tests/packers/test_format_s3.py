"""Shard format round trip through s3:// on moto's standalone server (real HTTP)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from packshard.packers import DatasetWriter, ShardDataset, pack_table

pytestmark = pytest.mark.s3


def test_round_trip_s3(s3_server, s3_bucket):
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, 500, int(n)).astype(np.int32) for n in rng.integers(1, 900, 300)]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))})
    batch, _ = pack_table(table, seq_len=1024, pad_multiple=4, pad_token_id=7)
    url = f"s3://{s3_bucket}/run1"
    w = DatasetWriter(
        url,
        {"seq_len": 1024, "pad_multiple": 4, "pad_token_id": 7, "cp": 4},
        max_rows=40,
        storage_options=s3_server["storage_options"],
    )
    w.write(batch)
    manifest = w.close({"samples_in": 300, "samples_kept": 300, "dropped": {}})
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
