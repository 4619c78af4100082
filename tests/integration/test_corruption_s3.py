"""Corruption and failing storage over S3 (moto's server, real HTTP): an unreachable endpoint,
missing objects, and damaged shards read by byte ranges (the remote reader's own parsing), each
one clear packshard error naming the URL, never a botocore or pyarrow error."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import boto3
import numpy as np
import pytest

from packshard.packers import DatasetNotFoundError, FormatError, ShardDataset, StorageError
from packshard.pipeline.cli import main as cli
from packshard.pipeline.verify import verify_dataset
from packshard.trainer_shim import PackedShardStream
from packshard.trainer_shim.hf import PackedShardDataset
from packshard.trainer_shim.synthetic import write_synthetic_dataset

pytestmark = pytest.mark.s3

LENGTHS = np.random.default_rng(7).integers(3, 70, 60)
KW = {"seq_len": 64, "pad_multiple": 4, "max_rows_per_shard": 9, "rows_per_batch": 4, "vocab_size": 500}  # fmt: skip
ONE_RANK = {"dp_rank": 0, "dp_size": 1, "rows_per_step": 1, "seed": 5}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dataset(s3_server, s3_bucket, tmp_path: Path):
    opts = s3_server["storage_options"]
    url = f"s3://{s3_bucket}/ds"
    manifest = write_synthetic_dataset(url, lengths=LENGTHS, storage_options=opts, **KW)
    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1")
    return url, opts, manifest, client, s3_bucket


def test_unreachable_endpoint(s3_server, capsys):
    """An endpoint that refuses connections is one clear error from the stream, `verify` and
    `stats`, after one TCP connect: the message names the endpoint, which only the direct check
    does (without it, each waits 5-10 s for botocore's and s3fs's retries, as no retry config is
    given here). s3_server only for its dummy credentials in the environment (the CLI uses those)."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    url = "s3://bucket/ds"
    refused = f"s3://bucket/ds: cannot connect to its endpoint {endpoint}"
    with pytest.raises(StorageError, match=re.escape(refused)):
        PackedShardStream(url, **ONE_RANK, storage_options=opts)
    with pytest.raises(StorageError, match=re.escape(refused)):
        PackedShardDataset(url, storage_options=opts)
    assert verify_dataset(url, storage_options=opts) == [refused + ": Connection refused"]
    assert cli(["stats", url, f"--storage-option=endpoint_url={endpoint}"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"packshard stats: {refused}: Connection refused"]


def test_missing_objects(dataset, tmp_path: Path, capsys):
    url, opts, manifest, client, bucket = dataset
    client.delete_object(Bucket=bucket, Key=f"ds/{manifest['shards'][1]['path']}")
    with pytest.raises(FormatError, match=r"ds/shards/part-00001\.arrow: missing \(the manifest names it\)"):  # fmt: skip
        list(PackedShardStream(url, **ONE_RANK, storage_options=opts))
    with pytest.raises(FormatError, match=r"part-00001\.arrow: missing"):
        list(PackedShardStream(url, **ONE_RANK, storage_options=opts, cache_dir=tmp_path / "c"))
    assert any("part-00001.arrow: missing" in p for p in verify_dataset(url, storage_options=opts))
    key = f"ds/{manifest['shards'][2]['path']}"  # and one cut short: stats' listing sees both
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=data[:-10])
    assert cli(["stats", url, f"--storage-option=endpoint_url={opts['endpoint_url']}"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [
        f"packshard stats: {url}/shards/part-00001.arrow: missing (the manifest names it)",
        f"packshard stats: {url}/shards/part-00002.arrow: {len(data) - 10:,} bytes, "
        f"the manifest says {len(data):,}",
    ]
    client.delete_object(Bucket=bucket, Key="ds/manifest.json")
    with pytest.raises(DatasetNotFoundError, match=r"holds shards but no manifest.json"):
        ShardDataset.open(url, storage_options=opts)
    with pytest.raises(DatasetNotFoundError, match=r"does not exist"):
        ShardDataset.open(f"s3://{bucket}/elsewhere", storage_options=opts)


@pytest.mark.parametrize("seed", range(8))
def test_damaged_shard_read_by_ranges(dataset, seed):
    """Byte flips and cuts of a shard read by range requests: the original rows or a
    FormatError (the local fuzz test covers the memory-mapped path)."""
    url, opts, manifest, client, bucket = dataset
    original = [mb["input_ids"] for mb in PackedShardStream(url, **ONE_RANK, storage_options=opts)]
    rng = np.random.default_rng(seed)
    key = f"ds/{manifest['shards'][int(rng.integers(len(manifest['shards'])))]['path']}"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    if seed % 2:
        data = data[: int(rng.integers(len(data)))]
    else:
        data[int(rng.integers(len(data)))] ^= int(rng.integers(1, 256))
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    try:
        got = [mb["input_ids"] for mb in PackedShardStream(url, **ONE_RANK, storage_options=opts)]
    except FormatError:
        return
    assert len(got) == len(original) and all(
        (a == b).all() for a, b in zip(got, original, strict=True)
    )
