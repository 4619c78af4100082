"""Reading s3:// datasets through pyarrow's S3 client (packers.s3_reading): which options it
takes and when s3fs stays, the fsspec semantics of its reads, and a forked child's reads."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from packshard.packers import ShardDataset, s3_reading
from packshard.packers.s3_reading import ArrowS3FileSystem, arrow_s3_options, reading_fs

ENV = ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
       "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy",
       "PACKSHARD_S3_CLIENT", "AWS_CA_BUNDLE", "AWS_PROFILE", "AWS_ROLE_ARN",
       "AWS_WEB_IDENTITY_TOKEN_FILE")  # fmt: skip
WAITS = {"connect_timeout": 60.0, "request_timeout": 60.0}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> pytest.MonkeyPatch:
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws_config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws_credentials"))
    return monkeypatch


def test_storage_options_translate_or_say_why_not(clean_env: pytest.MonkeyPatch, tmp_path):
    kw, endpoint = arrow_s3_options(
        {"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s", "token": "t"}
    )
    assert endpoint == "http://127.0.0.1:9000"
    assert kw == {"endpoint_override": "127.0.0.1:9000", "scheme": "http", "access_key": "k",
                  "secret_key": "s", "session_token": "t", **WAITS}  # fmt: skip
    # s3fs reads anonymously whatever the keys; user info stays out of the endpoint (errors
    # would show it)
    kw, _ = arrow_s3_options(
        {"client_kwargs": {"endpoint_url": "https://AKIA:pw@minio.lan/", "region_name": "eu-1"},
         "anon": True, "key": "k", "secret": "s"}
    )  # fmt: skip
    assert kw == {"endpoint_override": "minio.lan", "scheme": "https", "region": "eu-1",
                  "anonymous": True, **WAITS}  # fmt: skip
    assert "profile, requester_pays" in arrow_s3_options({"profile": "p", "requester_pays": True})
    assert "region" in arrow_s3_options({"region": "eu-west-1"})  # not an s3fs option
    assert "client_kwargs.verify" in arrow_s3_options({"client_kwargs": {"verify": False}})
    assert "anon='false'" in arrow_s3_options({"endpoint_url": "http://h:1", "anon": "false"})
    # AWS itself: s3fs follows a bucket to its region, pyarrow's client only goes where told;
    # the environment's region is the machine's, not the bucket's
    clean_env.setenv("AWS_REGION", "eu-west-1")
    clean_env.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert "AWS bucket without client_kwargs region_name" in arrow_s3_options({})
    aws = {"endpoint_url": "https://s3.eu-west-1.amazonaws.com"}
    assert "AWS bucket without" in arrow_s3_options(aws)
    told = {"client_kwargs": {"region_name": "us-east-2"}}
    assert arrow_s3_options(told) == ({"region": "us-east-2", **WAITS}, None)
    # a custom endpoint is signed for botocore's region: AWS_DEFAULT_REGION, not AWS_REGION
    clean_env.setenv("AWS_DEFAULT_REGION", "us-west-1")
    assert arrow_s3_options({"endpoint_url": "http://h:1"})[0]["region"] == "us-west-1"
    clean_env.setenv("AWS_ENDPOINT_URL", "http://10.0.0.5:9000")
    assert arrow_s3_options({})[0]["endpoint_override"] == "10.0.0.5:9000"
    clean_env.setenv("AWS_CA_BUNDLE", "/etc/ssl/corp.pem")
    assert arrow_s3_options({})[0]["tls_ca_file_path"] == "/etc/ssl/corp.pem"
    # a proxy botocore would use, pyarrow's client would not
    clean_env.setenv("HTTP_PROXY", "http://proxy.lan:3128")
    assert "proxy" in arrow_s3_options({})
    clean_env.setenv("NO_PROXY", "10.0.0.5")
    assert isinstance(arrow_s3_options({}), tuple)


@pytest.mark.parametrize(
    "setting",
    ["AWS_PROFILE=dev", "AWS_ROLE_ARN=arn:aws:iam::1:role/r", "config:endpoint_url = http://x:1",
     "config:role_arn=arn:aws:iam::1:role/r", "config:sso_start_url = https://sso",
     "credentials:credential_process = /bin/creds"],
)  # fmt: skip
def test_aws_settings_that_botocore_follows_keep_s3fs(
    clean_env: pytest.MonkeyPatch, tmp_path, setting: str
):
    where, _, value = setting.partition(":") if ":" in setting.split("=")[0] else ("", "", setting)
    if where:
        (tmp_path / f"aws_{where}").write_text(f"[default]\n{value}\n")
    else:
        name, _, v = value.partition("=")
        clean_env.setenv(name, v)
    env_endpoint = {"client_kwargs": {"endpoint_url": "http://h:1"}}
    assert "an AWS setting" in arrow_s3_options(env_endpoint)
    # credentials and endpoint both given: nothing of the configuration applies
    assert isinstance(arrow_s3_options({**env_endpoint, "key": "k", "secret": "s"}), tuple)
    assert isinstance(arrow_s3_options({**env_endpoint, "anon": True}), tuple)


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
def test_reads_have_fsspecs_meaning(s3_server, s3_bucket, monkeypatch):
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
    # an object dropped from the open ones stays readable by whoever still holds it
    monkeypatch.setattr(s3_reading, "OPEN_OBJECTS", 1)
    fs._files.clear()
    held = fs._input_file(path)
    fs.cat_file(f"{root}/other", 0, 1)  # drops `path` from the open objects
    assert held.read_at(4, 0) == body[:4]


def _child_read(
    fs: ArrowS3FileSystem, url: str, opts: dict, path: str, out: multiprocessing.Queue
) -> None:
    try:
        fs.cat_file(path, 0, 8)
        inherited = "read"
    except RuntimeError as e:
        inherited = str(e)
    found = reading_fs(url, opts)
    out.put((os.getpid(), inherited, found))


@pytest.mark.s3
@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_a_forked_child_reads_through_s3fs(s3_server, s3_bucket):
    """pyarrow's S3 client holds locks that a fork taken mid-request leaves held (the child's
    first request would hang): a child refuses the inherited filesystem with a clear error, and
    a dataset it opens itself reads through s3fs."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1")
    client.put_object(Bucket=s3_bucket, Key="obj", Body=b"0123456789")
    url, opts = f"s3://{s3_bucket}", s3_server["storage_options"]
    found = reading_fs(url, opts)
    assert found is not None
    fs, root = found
    assert fs.cat_ranges([f"{root}/obj"] * 2, [0, 5], [2, 7]) == [b"01", b"56"]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_read, args=(fs, url, opts, f"{root}/obj", out))
    child.start()
    pid, inherited, fresh = out.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and pid != os.getpid()
    assert "cannot be used across a fork" in inherited and fresh is None
    assert reading_fs(url, opts) is not None  # the parent keeps its client


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
