"""Reading s3:// datasets through pyarrow's S3 client (packers.s3_reading): which options it
takes and when s3fs stays, the fsspec semantics of its reads, and a forked child's reads."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from packshard.packers import ShardDataset
from packshard.packers.s3_reading import ArrowS3FileSystem, arrow_s3_options, reading_fs

ENV = ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
       "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy",
       "PACKSHARD_S3_CLIENT", "AWS_CA_BUNDLE")  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_storage_options_translate_or_say_why_not(clean_env: pytest.MonkeyPatch):
    kw, endpoint = arrow_s3_options(
        {"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s", "token": "t"}
    )
    assert endpoint == "http://127.0.0.1:9000"
    assert kw == {"endpoint_override": "127.0.0.1:9000", "scheme": "http", "access_key": "k",
                  "secret_key": "s", "session_token": "t"}  # fmt: skip
    kw, _ = arrow_s3_options(
        {"client_kwargs": {"endpoint_url": "https://minio.lan/", "region_name": "eu-west-1"},
         "anon": True}
    )  # fmt: skip
    assert kw == {"endpoint_override": "minio.lan", "scheme": "https", "region": "eu-west-1",
                  "anonymous": True}  # fmt: skip
    assert "profile, requester_pays" in arrow_s3_options({"profile": "p", "requester_pays": True})
    assert "client_kwargs.verify" in arrow_s3_options({"client_kwargs": {"verify": False}})
    assert "anon='false'" in arrow_s3_options({"endpoint_url": "http://h:1", "anon": "false"})
    aws = {"endpoint_url": "https://s3.eu-west-1.amazonaws.com"}  # signed for us-east-1 else
    assert "AWS endpoint without a region" in arrow_s3_options(aws)
    assert arrow_s3_options({**aws, "region": "eu-west-1"})[0]["region"] == "eu-west-1"
    clean_env.setenv("AWS_CA_BUNDLE", "/etc/ssl/corp.pem")
    assert arrow_s3_options(aws | {"region": "x"})[0]["tls_ca_file_path"] == "/etc/ssl/corp.pem"
    clean_env.delenv("AWS_CA_BUNDLE")
    # AWS itself: s3fs follows a bucket to its region, pyarrow's client needs it said
    assert "neither an endpoint nor a region" in arrow_s3_options({})
    clean_env.setenv("AWS_REGION", "eu-west-1")
    assert arrow_s3_options({}) == ({"region": "eu-west-1"}, None)
    clean_env.setenv("AWS_ENDPOINT_URL", "http://10.0.0.5:9000")
    assert arrow_s3_options({})[0]["endpoint_override"] == "10.0.0.5:9000"
    # a proxy botocore would use, pyarrow's client would not
    clean_env.setenv("HTTP_PROXY", "http://proxy.lan:3128")
    assert "proxy" in arrow_s3_options({})
    clean_env.setenv("NO_PROXY", "10.0.0.5")
    assert isinstance(arrow_s3_options({}), tuple)


def test_the_client_choice(clean_env: pytest.MonkeyPatch):
    opts = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    found = reading_fs("s3://bucket/data", opts)
    assert found is not None and isinstance(found[0], ArrowS3FileSystem)
    assert found[1] == "bucket/data" and found[0].endpoint_url == opts["endpoint_url"]
    assert reading_fs("gs://bucket/data", {}) is None
    assert reading_fs("/local/data", None) is None
    assert reading_fs("s3://bucket/data", {"profile": "p"}) is None  # s3fs reads it
    clean_env.setenv("PACKSHARD_S3_CLIENT", "s3fs")
    assert reading_fs("s3://bucket/data", opts) is None
    clean_env.setenv("PACKSHARD_S3_CLIENT", "arrow")
    with pytest.raises(ValueError, match=r"PACKSHARD_S3_CLIENT=arrow: storage options .*profile"):
        reading_fs("s3://bucket/data", {"profile": "p"})
    clean_env.setenv("PACKSHARD_S3_CLIENT", "boto")
    with pytest.raises(ValueError, match="use auto, arrow or s3fs"):
        reading_fs("s3://bucket/data", opts)


@pytest.mark.s3
def test_reads_have_fsspecs_meaning(s3_server, s3_bucket):
    import boto3

    body = bytes(range(256)) * 40
    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1")
    client.put_object(Bucket=s3_bucket, Key="a/obj", Body=body)
    client.put_object(Bucket=s3_bucket, Key="a/other", Body=b"xyz")
    found = reading_fs(f"s3://{s3_bucket}/a", s3_server["storage_options"])
    assert found is not None
    fs, root = found
    path = f"{root}/obj"
    assert fs.cat_file(path) == body and fs.size(path) == len(body)
    assert fs.cat_file(path, 10, 20) == body[10:20]
    assert fs.cat_file(path, -5) == body[-5:] and fs.cat_file(path, 9000, 99999) == body[9000:]
    got = fs.cat_ranges([path, f"{root}/other", path, f"{root}/missing"], [0, 1, 100, 0],
                        [4, 3, 90, 1])  # fmt: skip
    assert got[:3] == [body[:4], b"yz", b""]
    assert isinstance(got[3], FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        fs.cat_ranges([f"{root}/missing"], [0], [1], on_error="raise")
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/obj", f"{root}/other"]


def _child_read(fs: ArrowS3FileSystem, path: str, out: multiprocessing.Queue) -> None:
    out.put((os.getpid(), fs.cat_file(path, 0, 8), fs.cat_ranges([path, path], [1, 2], [3, 4])))


@pytest.mark.s3
@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_a_forked_child_reads_with_a_client_of_its_own(s3_server, s3_bucket):
    """The AWS SDK's threads do not survive a fork: a child that inherits an open filesystem
    (a trainer forking data workers after opening the dataset) builds its own client."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1")
    client.put_object(Bucket=s3_bucket, Key="obj", Body=b"0123456789")
    found = reading_fs(f"s3://{s3_bucket}", s3_server["storage_options"])
    assert found is not None
    fs, root = found
    assert fs.cat_ranges([f"{root}/obj"] * 2, [0, 5], [2, 7]) == [b"01", b"56"]  # pool, client
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_read, args=(fs, f"{root}/obj", out))
    child.start()
    pid, head, ranges = out.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and pid != os.getpid()
    assert (head, ranges) == (b"01234567", [b"12", b"23"])


@pytest.mark.s3
def test_a_dataset_opens_with_the_client_chosen(s3_server, s3_bucket, monkeypatch):
    import s3fs

    from packshard.trainer_shim.synthetic import write_synthetic_dataset

    url = f"s3://{s3_bucket}/ds"
    write_synthetic_dataset(url, lengths=[30, 40, 50], seq_len=64, pad_multiple=4,
                            storage_options=s3_server["storage_options"])  # fmt: skip
    for choice, kind in (("auto", ArrowS3FileSystem), ("s3fs", s3fs.S3FileSystem)):
        monkeypatch.setenv("PACKSHARD_S3_CLIENT", choice)
        with ShardDataset.open(url, storage_options=s3_server["storage_options"]) as ds:
            assert isinstance(ds.fs, kind)
            assert ds.read_rows(0, [0]).num_rows == 1
