"""A pack job's S3 output and inputs checked before any work (moto's server, real HTTP): a
mistyped bucket is named, not created; credentials in an s3:// URL are refused redacted;
S3 console "folder" markers are no foreign files; storage options an http input's client does
not take are one line."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from packshard.pipeline.config import config_from_args
from packshard.pipeline.inputs import InputError
from packshard.pipeline.jobstate import OutputError
from packshard.pipeline.preflight import preflight
from tests.integration._http import serving

pytestmark = pytest.mark.s3

CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def _args(inp: str, out: str, opts: dict, *extra: str) -> list[str]:
    flags = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={v}")]
    return [
        "--input", inp, "--output", out, "--tokenizer", "packshard:demo",
        "--seq-len", "64", "--cp", "2", *flags, *extra,
    ]  # fmt: skip


def _buckets(s3_server) -> list[str]:
    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1")
    return sorted(b["Name"] for b in client.list_buckets()["Buckets"])


def test_a_missing_output_bucket_is_named_and_not_created(s3_server, s3_bucket, tmp_path: Path):
    (tmp_path / "in.jsonl").write_text(json.dumps(CHAT) + "\n")
    opts = s3_server["storage_options"]
    before = _buckets(s3_server)
    cfg = config_from_args(_args(str(tmp_path / "in.jsonl"), "s3://no-such-bucket-x1/run", opts))
    with pytest.raises(OutputError, match=r"the bucket 'no-such-bucket-x1' does not exist"):
        preflight(cfg)
    assert _buckets(s3_server) == before
    checked = preflight(
        config_from_args(_args(str(tmp_path / "in.jsonl"), f"s3://{s3_bucket}/run", opts))
    )
    assert checked.root == f"{s3_bucket}/run"


def test_credentials_in_an_s3_url_are_refused_redacted(s3_server, s3_bucket, tmp_path: Path):
    (tmp_path / "in.jsonl").write_text(json.dumps(CHAT) + "\n")
    opts = s3_server["storage_options"]
    secret_input = f"s3://AKIA:SE/CRET@{s3_bucket}/in.jsonl"
    with pytest.raises(InputError) as e:
        preflight(config_from_args(_args(secret_input, f"s3://{s3_bucket}/run", opts)))
    assert "SE/CRET" not in str(e.value) and "credentials in the URL are not read" in str(e.value)
    with pytest.raises(OutputError) as e:
        preflight(config_from_args(_args(str(tmp_path / "in.jsonl"), secret_input, opts)))
    assert "SE/CRET" not in str(e.value) and "credentials in the URL are not read" in str(e.value)


def test_folder_markers_in_the_output_are_no_foreign_files(s3_server, s3_bucket, tmp_path: Path):
    """The S3 console's "Create folder" (and sync tools) write empty "out/" and "out/shards/"
    objects, which list as the directories themselves."""
    (tmp_path / "in.jsonl").write_text(json.dumps(CHAT) + "\n")
    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1")
    for key in ("run/", "run/shards/"):
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"")
    opts = s3_server["storage_options"]
    preflight(config_from_args(_args(str(tmp_path / "in.jsonl"), f"s3://{s3_bucket}/run", opts)))


def test_storage_options_an_http_input_cannot_take_are_one_line(s3_server, tmp_path: Path):
    (tmp_path / "in.jsonl").write_text(json.dumps(CHAT) + "\n")
    with serving(tmp_path) as (host, _):
        cfg = config_from_args(
            _args(f"http://{host}/in.jsonl", str(tmp_path / "out"), s3_server["storage_options"])
        )
        with pytest.raises(
            InputError,
            match=r"the --storage-option flags \(endpoint_url, key, secret\) go to every input",
        ):
            preflight(cfg)


def test_a_storage_option_the_client_does_not_take_is_one_line(
    s3_server, s3_bucket, tmp_path: Path
):
    """s3fs passes unknown options to aiobotocore's session: a TypeError at the first request."""
    (tmp_path / "in.jsonl").write_text(json.dumps(CHAT) + "\n")
    opts = {**s3_server["storage_options"], "bogus": 1}
    cfg = config_from_args(_args(str(tmp_path / "in.jsonl"), f"s3://{s3_bucket}/run", opts))
    with pytest.raises(OutputError, match=r"is not writable \(TypeError: .*'bogus'"):
        preflight(cfg)
