"""A dataset URL with credentials (``http://user:SECRET@host/ds``): they reach the server, and
nothing that reads the dataset (ShardDataset, stats, verify, the shim) writes or prints them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from packshard.packers import DatasetNotFoundError, FormatError, ShardDataset, StorageError
from packshard.pipeline.stats import dataset_stats, format_stats, stats_json
from packshard.pipeline.verify import verify_dataset
from packshard.trainer_shim import PackedShardStream
from packshard.trainer_shim.synthetic import write_synthetic_dataset
from tests.integration._http import serving

SECRET = "S3CRET-pw"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """(URL with credentials of a dataset on a local HTTP server, Authorization headers seen)."""
    root = tmp_path_factory.mktemp("www")
    write_synthetic_dataset(
        str(root / "ds"), lengths=[100, 300, 50, 700, 20] * 4, seq_len=1024, pad_multiple=8
    )
    with serving(root) as (host, seen):
        yield f"http://reader:{SECRET}@{host}/ds", seen


def test_the_credentials_are_sent_but_never_shown(served, caplog, tmp_path) -> None:
    url, seen = served
    caplog.set_level(logging.INFO)
    ds = ShardDataset.open(url)
    assert any(h.startswith("Basic ") for h in seen), "the URL's credentials reach the server"
    assert SECRET not in ds.url and ds.url.startswith("http://127.0.0.1:")
    stats = dataset_stats(ds)
    assert ds.num_rows > 0
    shown = [stats_json(ds), format_stats(stats), *verify_dataset(url)]
    stream = PackedShardStream(url, dp_rank=0, dp_size=1, rows_per_step=2)
    shown.append(stream.url)
    from packshard.trainer_shim.hf import PackedShardDataset

    # the test server ignores Range requests (it sends whole files), so rows are read from
    # whole shards in a cache_dir; read in place, they fail saying so
    hf = PackedShardDataset(
        url, rows_per_rank=2, dp_rank=0, dp_size=1, epochs=1, cache_dir=tmp_path / "cache"
    )
    assert next(iter(hf))["row"] >= 0  # it reads with the credentials
    with pytest.raises(StorageError, match="ignores HTTP Range requests") as no_ranges:
        next(iter(stream))
    shown += [hf.url, str(no_ranges.value)]
    with pytest.raises(
        ValueError, match=r"seq_len=\d+, the stream expects seq_len=2048"
    ) as wrong_len:
        PackedShardStream(url, dp_rank=0, dp_size=1, rows_per_step=2, seq_len=2048)
    with pytest.raises(DatasetNotFoundError) as missing:
        ShardDataset.open(url + "-missing")
    shown += [str(wrong_len.value), str(missing.value), caplog.text]
    assert "127.0.0.1" in str(wrong_len.value) and "127.0.0.1" in str(missing.value)
    for text in shown:
        assert SECRET not in text


def test_a_server_error_on_a_shard_is_no_missing_shard(tmp_path) -> None:
    """fsspec's HTTP client raises FileNotFoundError for any failed lookup: a 500 (or an
    expired signature's 403) on a shard is a storage failure, a 404 a missing shard."""
    write_synthetic_dataset(
        str(tmp_path / "ds"), lengths=[100, 300] * 4, seq_len=1024, pad_multiple=8
    )
    refuse: dict[str, object] = {}
    with serving(tmp_path, refuse=refuse) as (host, _):
        url = f"http://reader:{SECRET}@{host}/ds"
        for status, error, said in (
            (500, StorageError, "the storage failed (ClientResponseError: 500"),
            (403, StorageError, "the storage failed (ClientResponseError: 403"),
            (404, FormatError, "missing (the manifest names it)"),
        ):
            stream = PackedShardStream(url, dp_rank=0, dp_size=1, rows_per_step=2)
            refuse.update(status=status, under="/ds/shards/")
            with pytest.raises(error) as e:
                next(iter(stream))
            refuse.clear()
            assert said in str(e.value) and SECRET not in str(e.value)
            assert f"http://{host}/ds/shards/part-00000.arrow" in str(e.value)
            assert isinstance(e.value, StorageError) == (status != 404)


def test_a_server_gone_after_opening_is_no_missing_shard(tmp_path) -> None:
    """fsspec's HTTP client raises FileNotFoundError chained to aiohttp's connection error."""
    write_synthetic_dataset(
        str(tmp_path / "ds"), lengths=[100, 300] * 4, seq_len=1024, pad_multiple=8
    )
    with serving(tmp_path) as (host, _):
        stream = PackedShardStream(f"http://{host}/ds", dp_rank=0, dp_size=1, rows_per_step=2)
    with pytest.raises(StorageError, match="the storage failed"):
        next(iter(stream))


def test_a_storage_option_the_client_refuses_at_its_first_request(served) -> None:
    """fsspec's http (and s3fs) take unknown options until the first request: a TypeError."""
    url, _ = served
    with pytest.raises(StorageError, match=r"cannot read manifest.json \(TypeError: .*bogus"):
        ShardDataset.open(url, storage_options={"bogus": 1})


def test_format_errors_redact_their_message() -> None:
    err = FormatError(f"https://u:{SECRET}@host/ds/part-00000.arrow?sig={SECRET}: bad footer")
    assert SECRET not in str(err) and "https://host/ds/part-00000.arrow: bad footer" in str(err)


def test_a_filesystem_that_connects_when_made_fails_as_a_storage_error() -> None:
    """fsspec's ftp filesystem connects in its constructor: a refused connection is no raw
    ConnectionRefusedError to the shim's users."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed
    with pytest.raises(StorageError, match=r"cannot open its filesystem \(ConnectionRefused"):
        ShardDataset.open(f"ftp://reader:{SECRET}@127.0.0.1:{port}/ds")
