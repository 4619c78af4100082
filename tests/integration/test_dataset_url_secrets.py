"""A dataset URL with credentials (``http://user:SECRET@host/ds``): they reach the server, and
nothing that reads the dataset (ShardDataset, stats, verify, the shim) writes or prints them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from packshard.packers import DatasetNotFoundError, FormatError, ShardDataset
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


def test_the_credentials_are_sent_but_never_shown(served, caplog) -> None:
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


def test_format_errors_redact_their_message() -> None:
    err = FormatError(f"https://u:{SECRET}@host/ds/part-00000.arrow?sig={SECRET}: bad footer")
    assert SECRET not in str(err) and "https://host/ds/part-00000.arrow: bad footer" in str(err)
