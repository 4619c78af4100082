"""trainer_shim streaming s3:// from moto's server (real HTTP): range reads and the shard
cache give the same micro-batches as the local copy; corruption on the store is caught."""

from __future__ import annotations

from pathlib import Path

import boto3
import numpy as np
import pytest
import torch

from packshard.packers import FormatError, ShardDataset
from packshard.trainer_shim import PackedShardStream
from packshard.trainer_shim.synthetic import write_synthetic_dataset

pytestmark = pytest.mark.s3


@pytest.fixture(autouse=True, params=["arrow", "s3fs"])
def s3_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test reads through pyarrow's S3 client and through s3fs (packers.s3_reading)."""
    monkeypatch.setenv("PACKSHARD_S3_CLIENT", request.param)
    return request.param


LENGTHS = np.random.default_rng(4).integers(5, 300, 150)
KW = {"seq_len": 512, "pad_multiple": 4, "max_rows_per_shard": 12, "rows_per_batch": 4}
STREAM = {
    "dp_rank": 1,
    "dp_size": 2,
    "cp_rank": 0,
    "cp_size": 2,
    "rows_per_step": 4,
    "seed": 2,
    "cp_layout": "zigzag",
}


def micro_batches(url: str, **kw) -> list[dict]:
    with PackedShardStream(url, **STREAM, **kw) as s:
        return list(s)


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for k in x:
            assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k], k


def test_s3_stream_matches_local(s3_server, s3_bucket, tmp_path: Path):
    opts = s3_server["storage_options"]
    url = f"s3://{s3_bucket}/ds"
    write_synthetic_dataset(url, lengths=LENGTHS, storage_options=opts, **KW)
    write_synthetic_dataset(str(tmp_path / "local"), lengths=LENGTHS, **KW)
    local = micro_batches(str(tmp_path / "local"))
    with PackedShardStream(url, **STREAM, storage_options=opts) as remote:
        assert remote.prefetch_thread  # a remote dataset is read ahead on the thread
        assert_same(list(remote), local)
    cached = PackedShardStream(url, **STREAM, storage_options=opts, cache_dir=tmp_path / "cache")
    assert cached.prefetch_thread
    assert_same(list(cached), local)
    assert cached.cache is not None and cached.cache.downloads == len(cached.dataset.shards)
    # a second stream on the same cache downloads nothing
    again = PackedShardStream(url, **STREAM, storage_options=opts, cache_dir=tmp_path / "cache")
    assert_same(list(again), local)
    assert again.cache is not None and again.cache.downloads == 0


def test_s3_corruption_is_detected(s3_server, s3_bucket, tmp_path: Path):
    opts = s3_server["storage_options"]
    url = f"s3://{s3_bucket}/ds"
    manifest = write_synthetic_dataset(url, lengths=LENGTHS, storage_options=opts, **KW)
    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1")
    key = f"ds/{manifest['shards'][1]['path']}"
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    first_ids = (
        ShardDataset.open(url, storage_options=opts)
        .read_rows(1, [0], ["input_ids"])
        .column(0)[0]
        .values
    )
    at = bytes(data).find(np.asarray(first_ids, dtype=np.int32)[:8].tobytes())
    assert at > 0
    data[at + 5] ^= 0x04  # one bit of a token id of row 0
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    one_rank = {"dp_rank": 0, "dp_size": 1, "rows_per_step": 4, "storage_options": opts}
    with pytest.raises(FormatError, match=r"part-00001\.arrow: row 0 does not match its checksum"):
        list(PackedShardStream(url, **one_rank))
    with pytest.raises(FormatError, match=r"part-00001\.arrow: downloaded .* corrupted"):
        list(PackedShardStream(url, **one_rank, cache_dir=tmp_path / "c"))
