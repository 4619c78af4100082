"""PackedShardStream on local datasets: what a rank receives, fillers, bad configurations,
corruption, the shard cache and the prefetch thread."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from packshard.packers import DatasetNotFoundError, FormatError, ShardDataset, StorageError
from packshard.trainer_shim import PackedShardStream
from packshard.trainer_shim.microbatch import build_microbatch
from packshard.trainer_shim.reading import RowReader
from packshard.trainer_shim.stream import LOCAL_WINDOW_ROWS, REMOTE_WINDOW_ROWS
from packshard.trainer_shim.synthetic import write_synthetic_dataset


def live_threads(prefix: str) -> int:
    """Threads alive whose name starts with `prefix` ("packshard-prefetch", "packshard-read")."""
    return sum(t.name.startswith(prefix) and t.is_alive() for t in threading.enumerate())


def wait_for_threads(prefix: str, at_most: int, what: str) -> None:
    """Wait up to 5 s for the `prefix` threads to be down to `at_most`; fail with `what`."""
    deadline = time.monotonic() + 5
    while live_threads(prefix) > at_most:
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def collect(stream: PackedShardStream) -> list[dict]:
    return list(stream)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_rank_gets_its_rows_with_correct_contents(small_dataset: Path):
    ds = ShardDataset.open(str(small_dataset))
    streams = [
        PackedShardStream(str(small_dataset), dp_rank=r, dp_size=2, rows_per_step=6, seed=3)
        for r in range(2)
    ]
    lengths = [len(s) for s in streams]
    per_rank = [collect(s) for s in streams]
    assert len(per_rank[0]) == len(per_rank[1]) == lengths[0] == lengths[1] == 24
    assert len(streams[0]) == 0
    rows = [mb["row"] for mbs in per_rank for mb in mbs if mb["row"] >= 0]
    assert sorted(rows) == list(range(ds.num_rows))  # every row once over the DP group
    for mbs in per_rank:
        for i, mb in enumerate(mbs):
            assert (mb["step"], mb["micro_step"], mb["num_micro_steps"]) == (i // 3, i % 3, 3)
            if mb["row"] < 0:
                continue
            row = ds.read_row(mb["row"])
            want = build_microbatch(
                row["input_ids"], row["loss_mask"], row["doc_lens"], row=mb["row"]
            )
            for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "ks", "ke"):
                assert np.array_equal(mb[k].numpy(), want[k]), k
            assert mb["ks_host"] is mb["ks"] and mb["ke_host"] is mb["ke"]  # no device: one copy
            assert mb["input_ids"].dtype == torch.int64 and mb["cu_seqlens"].dtype == torch.int32
            assert mb["num_tokens"] == row["num_tokens"]


def test_short_last_step_is_completed_with_fillers(small_dataset: Path):
    n = ShardDataset.open(str(small_dataset)).num_rows  # 48 rows; 5 per step per rank x 2 ranks
    mbs = [
        collect(PackedShardStream(str(small_dataset), dp_rank=r, dp_size=2, rows_per_step=10))
        for r in range(2)
    ]
    assert len(mbs[0]) == len(mbs[1]) == 5 * -(-n // 10)
    fillers = [mb for m in mbs for mb in m if mb["row"] == -1]
    assert len(fillers) == 10 * -(-n // 10) - n
    for f in fillers:
        assert f["num_tokens"] == f["num_loss_tokens"] == 0 and (f["labels"] == -100).all()
        assert f["step"] == -(-n // 10) - 1


def test_read_paths_agree(small_dataset: Path, tmp_path: Path):
    """Read in the iterating thread (one read thread), on the prefetch thread (four read
    threads), through a cache with a tight limit: the same micro-batches."""
    kw = dict(
        dp_rank=1,
        dp_size=2,
        cp_rank=1,
        cp_size=2,
        rows_per_step=4,
        seed=9,
        cp_layout="zigzag",
        epochs=2,
    )
    base = collect(PackedShardStream(str(small_dataset), read_threads=1, prefetch=1, **kw))
    threaded = collect(
        PackedShardStream(
            str(small_dataset), read_threads=4, prefetch=16, prefetch_thread=True, **kw
        )
    )
    biggest = max(s.bytes for s in ShardDataset.open(str(small_dataset)).shards)
    cached_stream = PackedShardStream(
        str(small_dataset), cache_dir=tmp_path / "c", cache_limit_bytes=2 * biggest, **kw
    )
    cached = collect(cached_stream)
    assert len(base) == len(threaded) == len(cached) > 0
    assert all(same(a, b) and same(a, c) for a, b, c in zip(base, threaded, cached, strict=True))
    assert cached_stream.cache is not None
    assert cached_stream.cache.evictions > 0 and cached_stream.cache.used_bytes <= 2 * biggest


@pytest.fixture
def copy_of(small_dataset: Path, tmp_path: Path):
    def make() -> Path:
        out = tmp_path / "copy"
        shutil.copytree(small_dataset, out)
        return out

    return make


def corrupt_shard(root: Path) -> None:
    """Flip one bit of a token id of shard 0's row 5 (inside the data, not the metadata)."""
    ids = ShardDataset.open(str(root)).read_row(5)["input_ids"]
    shard = root / json.loads((root / "manifest.json").read_text())["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    at = bytes(data).find(np.asarray(ids, dtype=np.int32)[:8].tobytes())
    assert at > 0
    data[at + 9] ^= 0x01
    shard.write_bytes(bytes(data))


def test_corrupted_shard_is_detected_by_row_checksums(copy_of):
    root = copy_of()
    corrupt_shard(root)
    stream = PackedShardStream(str(root), dp_rank=0, dp_size=1, rows_per_step=48, shuffle=False)
    with pytest.raises(
        FormatError, match=r"part-00000\.arrow: row \d+ does not match its checksum"
    ):
        collect(stream)


def drop_row_checksums(root: Path) -> None:
    """index.arrow without `row_checksum` (the manifest's index entry updated to match)."""
    import pyarrow as pa
    import xxhash

    table = pa.ipc.open_file(pa.memory_map(str(root / "index.arrow"))).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(
        sink, table.schema.remove(table.schema.get_field_index("row_checksum"))
    ) as w:
        w.write_table(table.drop_columns(["row_checksum"]))
    data = sink.getvalue().to_pybytes()
    (root / "index.arrow").write_bytes(data)
    m = json.loads((root / "manifest.json").read_text())
    m["index"].update(bytes=len(data), checksum=f"xxh3_128:{xxhash.xxh3_128(data).hexdigest()}")
    (root / "manifest.json").write_text(json.dumps(m))


def test_an_index_without_row_checksums_is_said_to_leave_rows_unchecked(
    copy_of, small_dataset: Path, tmp_path: Path, caplog
):
    root = copy_of()
    drop_row_checksums(root)
    with caplog.at_level("WARNING", logger="packshard.trainer_shim.stream"):
        PackedShardStream(str(root), dp_rank=0, dp_size=1, rows_per_step=4).close()
    assert "index.arrow has no row_checksum column" in caplog.text
    assert f"run `packshard verify {root}` once, or give a cache_dir" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="packshard.trainer_shim.stream"):
        PackedShardStream(  # whole shards checked against the manifest as they are copied
            str(root), dp_rank=0, dp_size=1, rows_per_step=4, cache_dir=tmp_path / "c"
        ).close()
        PackedShardStream(str(root), dp_rank=0, dp_size=1, rows_per_step=4, verify=False).close()
        PackedShardStream(str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4).close()
    assert "row_checksum" not in caplog.text


@pytest.mark.parametrize("part", [None, 4096])
def test_corrupted_shard_is_refused_by_the_cache(copy_of, tmp_path: Path, monkeypatch, part):
    if part is not None:  # many parts: the download pipelines them (cache.PART)
        monkeypatch.setattr("packshard.trainer_shim.cache.PART", part)
    root = copy_of()
    corrupt_shard(root)
    stream = PackedShardStream(
        str(root), dp_rank=0, dp_size=1, rows_per_step=4, cache_dir=tmp_path / "cache"
    )
    with pytest.raises(
        FormatError, match=r"part-00000\.arrow: downloaded \d+ bytes with checksum .*corrupted"
    ):
        collect(stream)
    assert not list((tmp_path / "cache").rglob("part-00000.arrow*"))  # nothing kept


def test_cache_downloads_in_many_parts_exactly(small_dataset: Path, tmp_path: Path, monkeypatch):
    """A shard downloaded in parts far smaller than itself, several in flight, is the source
    file byte for byte, and the cached stream yields the uncached one's micro-batches."""
    monkeypatch.setattr("packshard.trainer_shim.cache.PART", 4096)
    args = {"dp_rank": 0, "dp_size": 1, "rows_per_step": 4, "seed": 3}
    plain = collect(PackedShardStream(str(small_dataset), **args))
    cached = collect(PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", **args))
    assert len(plain) == len(cached)
    for a, b in zip(plain, cached, strict=True):
        assert a["row"] == b["row"] and torch.equal(a["input_ids"], b["input_ids"])
    copies = sorted((tmp_path / "c").rglob("part-*.arrow"))
    assert copies and all(
        c.read_bytes() == (small_dataset / "shards" / c.name).read_bytes() for c in copies
    )


def test_a_failed_cache_write_is_raised_and_nothing_kept(
    small_dataset: Path, tmp_path: Path, monkeypatch
):
    """The cache's writer thread failing (a full disk) fails the read with that error, named
    as the cache's (the cache, the shard, the way out), after the writes in flight are done,
    and leaves no partial file under the cache."""
    import packshard.trainer_shim.cache as cache_module

    monkeypatch.setattr(cache_module, "PART", 4096)
    real_open = open
    calls = {"writes": 0}

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            calls["writes"] += 1
            if calls["writes"] == 3:
                raise OSError(28, "No space left on device")
            return self.f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def failing_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if mode == "wb" and str(path).endswith(".tmp") else f

    monkeypatch.setattr(cache_module, "open", failing_open, raising=False)
    stream = PackedShardStream(
        str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, shuffle=False,
        read_threads=1, cache_dir=tmp_path / "c",
    )  # fmt: skip
    with pytest.raises(
        StorageError,
        match=r"shard cache .*/c/.*: cannot write shards/part-00000\.arrow \(OSError: \[Errno 28\] "
        r"No space left on device\); free space there, lower cache_limit_bytes or give another",
    ):
        collect(stream)
    assert calls["writes"] >= 3
    assert (small_dataset / "shards" / "part-00000.arrow").stat().st_size > 3 * 4096
    assert not list((tmp_path / "c").rglob("*.tmp"))  # no partial file
    assert not list((tmp_path / "c").rglob("part-00000.arrow"))  # the failed shard is not kept


@pytest.mark.parametrize("prefetch_thread", [False, True])
def test_errors_arrive_after_the_good_micro_batches(copy_of, prefetch_thread: bool):
    root = copy_of()
    (root / "shards" / "part-00002.arrow").unlink()
    stream = PackedShardStream(
        str(root), dp_rank=0, dp_size=1, rows_per_step=2, shuffle=False, balance="count",
        prefetch=2, prefetch_thread=prefetch_thread,
    )  # fmt: skip
    got = []
    with pytest.raises((FileNotFoundError, FormatError)):
        for mb in stream:
            got.append(mb["row"])
    assert got == list(range(32))  # shards 0 and 1 (16 rows each) were delivered in order


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"cp_size": 8, "cp_rank": 0},
            r"padded to a multiple of 4, but cp_size=8 .* needs a multiple of 8; re-pack with `--pad-multiple 8`",
        ),
        ({"cp_size": 4, "cp_rank": 0, "cp_layout": "zigzag"}, r"re-pack with `--pad-multiple 8`"),
        (  # seq_len 512 is no multiple of 3: the advice says so
            {"cp_size": 3, "cp_rank": 0},
            r"re-pack with `--pad-multiple 3` and a --seq-len that is a multiple of it \(seq_len 512 is not; e.g. --seq-len 510\)",
        ),
        ({"seq_len": 1024}, r"packed with seq_len=512, the stream expects seq_len=1024"),
        (
            {"rows_per_step": 3},
            r"rows_per_step=3 is invalid: must be a positive multiple of dp_size=2",
        ),
        ({"dp_rank": 2}, r"dp_rank=2 is invalid: must be in \[0, dp_size=2\)"),
        ({"cp_layout": "ring"}, r"cp_layout='ring' is invalid"),
        ({"balance": "tokens"}, r"balance='tokens' is invalid"),
        ({"prefetch": 0}, r"prefetch=0 is invalid"),
    ],
)
def test_bad_configs_raise_at_construction(small_dataset: Path, kwargs, match):
    args = {"dp_rank": 0, "dp_size": 2, "rows_per_step": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        PackedShardStream(str(small_dataset), **args)


def test_not_a_dataset(tmp_path: Path):
    with pytest.raises(DatasetNotFoundError, match=r"is an empty directory: no packshard dataset"):
        PackedShardStream(str(tmp_path), dp_rank=0, dp_size=1, rows_per_step=1)


def test_cache_limit_below_a_shard(small_dataset: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="smaller than the largest shard"):
        PackedShardStream(
            str(small_dataset),
            dp_rank=0,
            dp_size=1,
            rows_per_step=1,
            cache_dir=tmp_path,
            cache_limit_bytes=10,
        )


def test_indivisible_row_in_index_is_refused(tmp_path: Path):
    # a manifest claiming pad_multiple 2 over rows padded to 1 is caught against index.arrow
    out = tmp_path / "odd"
    write_synthetic_dataset(str(out), lengths=[5, 7, 9], seq_len=16, pad_multiple=1)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["config"]["pad_multiple"] = 2
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        FormatError,
        match=r"odd/index.arrow: row \d+ has padded_len not a multiple of pad_multiple 2",
    ):
        PackedShardStream(str(out), dp_rank=0, dp_size=1, cp_size=2, cp_rank=0, rows_per_step=1)


def test_endless_stream_and_break(small_dataset: Path):
    stream = PackedShardStream(
        str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, epochs=None
    )
    with pytest.raises(TypeError):
        len(stream)
    it = iter(stream)
    mbs = [next(it) for _ in range(61)]
    assert mbs[-1]["epoch"] == 1  # 48 rows per epoch
    assert (
        stream.state_dict()["position"]["step"] == 15
        and stream.state_dict()["position"]["micro_step"] == 1
    )


def test_read_rows_arrays_matches_read_rows(small_dataset: Path):
    """The reader's numpy fast path (added for the stream) returns what read_rows returns."""
    ds = ShardDataset.open(str(small_dataset))
    rows = [7, 0, 15, 7, 3]
    table = ds.read_rows(1, rows, ["input_ids", "loss_mask", "doc_lens"])
    arrays = ds.read_rows_arrays(1, rows)
    for name in ("input_ids", "loss_mask", "doc_lens"):
        assert [a.tolist() for a in arrays[name]] == table.column(name).to_pylist()
    with pytest.raises(IndexError, match=r"row 16 is outside \[0, 16\)"):
        ds.read_rows_arrays(1, [16])


def test_window_sizes(small_dataset: Path, tmp_path: Path, monkeypatch):
    """64 rows a window from a local dataset by default, 8 through a shard cache (each window
    waits for the shards it touches) until it holds every shard, then 64; an explicit prefetch
    is taken as given; none takes more than an epoch of the rank's micro-batches (48 here at
    dp_size 1, 24 at 2)."""
    kw = dict(dp_rank=0, dp_size=1, rows_per_step=2, epochs=2)
    assert PackedShardStream(str(small_dataset), **kw).window_rows == 48 < LOCAL_WINDOW_ROWS == 64
    assert PackedShardStream(str(small_dataset), prefetch=3, **kw).window_rows == 3
    wide = dict(kw, dp_size=2, prefetch=30)
    assert PackedShardStream(str(small_dataset), **wide).window_rows == 24
    sizes: list[int] = []
    read = RowReader.read

    def counted(self: RowReader, rows: list[int]) -> dict:
        sizes.append(len(rows))
        return read(self, rows)

    monkeypatch.setattr(RowReader, "read", counted)
    cached = PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", **kw)
    assert cached.window_rows == REMOTE_WINDOW_ROWS == 8
    got = collect(cached)
    assert sizes[0] == 8 and 48 in sizes and sum(sizes) == len(got)
    assert sizes.index(48) <= len(cached.dataset.shards)  # one download a window at least
    sizes.clear()
    collect(PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", prefetch=8, **kw))
    assert set(sizes[:-1]) == {8}


def test_whole_batches_kept_scale_with_read_ahead(small_dataset: Path):
    """The bytes of remote batches kept between windows follow read_ahead_bytes (4 windows)."""
    args = {"dp_rank": 0, "dp_size": 1, "rows_per_step": 1}
    assert PackedShardStream(str(small_dataset), **args).dataset.whole_batch_bytes == 256 << 20
    small = PackedShardStream(str(small_dataset), read_ahead_bytes=1 << 20, **args)
    assert small.dataset.whole_batch_bytes == 4 << 20
    assert (
        PackedShardStream(str(small_dataset), read_ahead_bytes=0, **args).dataset.whole_batch_bytes
        == 0
    )


# ---- arguments a user can get wrong -----------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"rows_per_step": "4"}, r"rows_per_step='4' is invalid: must be an int"),
        ({"dp_size": 2.0}, r"dp_size=2.0 is invalid: must be an int"),
        ({"seed": 1.5}, r"seed=1.5 is invalid: must be an int"),
        ({"seed": None}, r"seed=None is invalid: must be an int"),
        ({"epochs": 1.5}, r"epochs=1.5 is invalid: must be an int or None"),
        ({"shuffle": "no"}, r"shuffle='no' is invalid: must be True or False"),
        ({"dp_rank": True}, r"dp_rank=True is invalid: must be an int"),
        ({"stall_timeout_s": 0}, r"stall_timeout_s=0 is invalid: must be a number of seconds > 0"),
        ({"stall_timeout_s": "30"}, r"stall_timeout_s='30' is invalid"),
        ({"stall_timeout_s": float("inf")}, r"stall_timeout_s=inf is invalid"),
        ({"stall_timeout_s": True}, r"stall_timeout_s=True is invalid"),
        ({"stall_timeout_s": 10**400}, r"stall_timeout_s=1000\d+ is invalid"),
        (
            {"prefetch_thread": "yes"},
            r"prefetch_thread='yes' is invalid: must be True, False or None",
        ),
        (
            {"prefetch_thread": False, "stall_timeout_s": 5},
            r"stall_timeout_s=5\.0 is invalid: needs the prefetch thread",
        ),
    ],
)
def test_arguments_of_the_wrong_type_are_named(small_dataset: Path, kw: dict, match: str):
    args = {"dp_rank": 0, "dp_size": 1, "rows_per_step": 4, **kw}
    with pytest.raises(ValueError, match=match):
        PackedShardStream(str(small_dataset), **args)


def test_numpy_ints_and_paths_are_accepted_empty_urls_are_not(small_dataset: Path):
    s = PackedShardStream(small_dataset, dp_rank=np.int64(0), dp_size=1, rows_per_step=np.int32(4))
    assert next(iter(s))["step"] == 0
    json.dumps(s.state_dict())  # a checkpoint's state stays JSON
    s.close()
    with pytest.raises(ValueError, match="the dataset URL is empty"):
        PackedShardStream("", dp_rank=0, dp_size=1, rows_per_step=4)
    with pytest.raises(TypeError, match=r"must be a str or os.PathLike.*got NoneType"):
        PackedShardStream(None, dp_rank=0, dp_size=1, rows_per_step=4)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_a_cuda_device_without_cuda_is_refused_at_construction(small_dataset: Path):
    with pytest.raises(ValueError, match="device='cuda', but torch sees no CUDA device"):
        PackedShardStream(str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, device="cuda")


def test_a_cache_dir_that_is_a_file_is_named(small_dataset: Path, tmp_path: Path):
    f = tmp_path / "cache"
    f.write_text("")
    with pytest.raises(ValueError, match=f"cache_dir='{f}' cannot hold the shard cache"):
        PackedShardStream(str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, cache_dir=f)


def test_zigzag_without_cp_streams_rows_of_any_length(tmp_path: Path):
    """A config that keeps cp_layout='zigzag' with CP off splits nothing: odd row lengths
    (a dataset packed with --pad-multiple 1) stream as with 'contiguous'."""
    from packshard.trainer_shim.synthetic import write_synthetic_dataset

    lengths = np.random.default_rng(3).integers(8, 300, 60)
    write_synthetic_dataset(tmp_path / "odd", lengths=lengths, seq_len=512, pad_multiple=1)
    kw = dict(dp_rank=0, dp_size=1, rows_per_step=2)
    zig = collect(PackedShardStream(str(tmp_path / "odd"), cp_layout="zigzag", **kw))
    flat = collect(PackedShardStream(str(tmp_path / "odd"), cp_layout="contiguous", **kw))
    assert any(mb["input_ids"].numel() % 2 for mb in zig)
    assert len(zig) == len(flat) and all(same(a, b) for a, b in zip(zig, flat, strict=True))


def test_an_empty_or_read_only_cache_dir_is_named(small_dataset: Path, tmp_path: Path, monkeypatch):
    """ "" (an unset setting) would put the cache in the working directory; a read-only
    filesystem raised a raw OSError (EROFS is no PermissionError)."""
    import errno

    kw = dict(dp_rank=0, dp_size=1, rows_per_step=4)
    with pytest.raises(ValueError, match=r"cache_dir='': give a directory \(None: no shard"):
        PackedShardStream(str(small_dataset), cache_dir="", **kw)

    def read_only(self: Path, *a: Any, **k: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ValueError, match=r"cannot hold the shard cache: OSError: Read-only"):
        PackedShardStream(str(small_dataset), cache_dir=tmp_path / "ro", **kw)


def test_a_window_larger_than_an_epoch_still_yields_an_endless_stream(small_dataset: Path):
    """The prefetch thread reads a window once it is full: one of more rows than an epoch of
    an endless stream (prefetch, or read_ahead_bytes over short remote rows) never filled."""
    s = PackedShardStream(
        str(small_dataset), dp_rank=0, dp_size=2, rows_per_step=4, epochs=None,
        prefetch=10**9, stall_timeout_s=20,
    )  # fmt: skip
    assert s.window_rows == s.steps_per_epoch * s.num_micro_steps
    it = iter(s)
    assert next(it)["row"] >= 0
    s.close()


def test_an_iterator_dropped_before_its_first_item_stops_its_thread(small_dataset: Path):
    import gc

    before = live_threads("packshard-prefetch")
    # windows of 4 rows: the thread blocks on its full queue (2 windows) until told to stop
    s = PackedShardStream(
        str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, prefetch=4, prefetch_thread=True
    )
    it = iter(s)
    time.sleep(0.3)
    assert live_threads("packshard-prefetch") == before + 1
    del it, s
    gc.collect()
    wait_for_threads("packshard-prefetch", before, "the dropped iterator's thread still runs")
    assert live_threads("packshard-prefetch") == before


def test_a_local_dataset_is_read_by_the_iterating_thread(small_dataset: Path, tmp_path: Path):
    """No prefetch thread for a local dataset by default (its rows are memory-mapped views); a
    cache_dir or a stall_timeout_s brings the thread, as prefetch_thread=True does."""
    before = live_threads("packshard-prefetch")
    kw = dict(dp_rank=0, dp_size=1, rows_per_step=4, prefetch=4)
    with PackedShardStream(str(small_dataset), **kw) as s:
        assert s.prefetch_thread is False
        it = iter(s)
        first = next(it)
        assert live_threads("packshard-prefetch") == before and s._thread is None
        rest = list(it)
    with PackedShardStream(str(small_dataset), prefetch_thread=True, **kw) as t:
        assert t.prefetch_thread is True
        threaded = list(t)
        assert len(threaded) == 1 + len(rest) > 1  # map() alone would stop at the shorter one
        assert all(map(same, [first, *rest], threaded))
    assert PackedShardStream(str(small_dataset), stall_timeout_s=30, **kw).prefetch_thread
    assert PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", **kw).prefetch_thread


def test_a_stream_read_inline_resumes_and_stops_like_a_threaded_one(small_dataset: Path):
    """state_dict mid-epoch, load_state_dict into a new stream, close() and a new iter() in the
    iterating thread: the same rows as with the prefetch thread."""
    kw = dict(dp_rank=0, dp_size=1, rows_per_step=4, prefetch=4, seed=3, epochs=2)

    def run(prefetch_thread: bool) -> tuple[list[int], list[int], list[int]]:
        s = PackedShardStream(str(small_dataset), prefetch_thread=prefetch_thread, **kw)
        it = iter(s)
        head = [next(it)["row"] for _ in range(7)]
        state = s.state_dict()
        again = iter(s)  # a new iteration stops the old one
        with pytest.raises(RuntimeError, match="this iteration was stopped"):
            next(it)
        after_new_iter = [next(again)["row"] for _ in range(4)]  # a whole window of 4
        s.close()
        with pytest.raises(RuntimeError, match="this iteration was stopped"):
            next(again)
        assert not s.dataset._files, "a read after close() opened the shards again"
        resumed = PackedShardStream(str(small_dataset), prefetch_thread=prefetch_thread, **kw)
        resumed.load_state_dict(state)
        return head, after_new_iter, [mb["row"] for mb in resumed]

    inline, threaded = run(False), run(True)
    assert inline == threaded
    head, after_new_iter, tail = inline
    assert after_new_iter == tail[:4]  # the new iteration went on from the position of row 7
    whole = [mb["row"] for mb in PackedShardStream(str(small_dataset), **kw)]
    assert head + tail == whole


@pytest.mark.parametrize("prefetch_thread", [True, False])
def test_close_leaves_no_shard_open_behind_a_read_in_flight(
    small_dataset: Path, monkeypatch: pytest.MonkeyPatch, prefetch_thread: bool
):
    """close() from another thread during a read (the prefetch thread's, or the iterating
    thread's own): the read, once done, would open its shards again (file descriptors and
    memory maps held until the stream is collected)."""

    from packshard.trainer_shim import stream as stream_mod

    reads: list[int] = []
    second = threading.Event()
    real = stream_mod.RowReader.read

    def slow_read(self, rows):
        reads.append(len(rows))
        if len(reads) == 2:
            second.set()
            time.sleep(0.3)  # close() arrives meanwhile
        return real(self, rows)

    monkeypatch.setattr(stream_mod.RowReader, "read", slow_read)
    s = PackedShardStream(
        str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=2, prefetch=2,
        prefetch_thread=prefetch_thread,
    )  # fmt: skip
    it = iter(s)
    next(it)
    errors: list[BaseException] = []
    if not prefetch_thread:  # the iterating thread reads the second window itself

        def consume(iterator) -> None:
            try:
                next(iterator)
                next(iterator)
            except RuntimeError as e:
                errors.append(e)

        consumer = threading.Thread(target=consume, args=(it,))
        consumer.start()
    assert second.wait(5)
    s.close()
    if not prefetch_thread:
        consumer.join(5)
        assert [str(e) for e in errors] == [stream_mod._SUPERSEDED]
    wait_for_threads("packshard-prefetch", 0, "a prefetch thread outlived close()")
    assert not s.dataset._files, f"shards {sorted(s.dataset._files)} open after close()"
    del it


def test_close_from_the_reading_thread_itself_does_not_wait_for_itself(
    small_dataset: Path, monkeypatch: pytest.MonkeyPatch
):
    """A signal handler (preemption) that calls close() while the iterating thread reads: close
    returns at once, the read ends as stopped, and no shard stays open."""
    from packshard.trainer_shim import stream as stream_mod

    real = stream_mod.RowReader.read
    s = PackedShardStream(str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=2, prefetch=2)
    took: list[float] = []

    def read_then_handler(self, rows):
        out = real(self, rows)
        if not took:  # the handler runs on this thread, in the middle of the read
            t0 = time.monotonic()
            s.close()
            took.append(time.monotonic() - t0)
        return out

    monkeypatch.setattr(stream_mod.RowReader, "read", read_then_handler)
    with pytest.raises(RuntimeError, match="this iteration was stopped"):
        next(iter(s))
    assert took and took[0] < 1.0, f"close() waited {took} s for its own thread"
    assert not s.dataset._files


def test_a_failed_window_waits_for_its_other_shard_reads(
    small_dataset: Path, monkeypatch: pytest.MonkeyPatch
):
    """One shard of a window fails at once while another is still being read: the error goes
    on only once that read is done, so it cannot open its shard after the caller closed the
    dataset."""
    ds = ShardDataset.open(str(small_dataset))
    reader = RowReader(ds, threads=3)
    real = RowReader._read_shard
    finished: list[int] = []

    def read_shard(self, shard, members):
        if shard == 0:
            raise FormatError("shard 0 is bad")
        time.sleep(0.3)
        out = real(self, shard, members)
        finished.append(shard)
        return out

    monkeypatch.setattr(RowReader, "_read_shard", read_shard)
    starts = ds.shard_row_starts
    rows = [int(starts[0]), int(starts[1]), int(starts[2])]  # one row of each of three shards
    with pytest.raises(FormatError, match="shard 0 is bad"):
        reader.read(rows)
    assert sorted(finished) == [1, 2]
    reader.close()
    ds.close()


def test_an_iterator_started_after_a_newer_one_leaves_the_newer_reader_alone(
    small_dataset: Path,
):
    """torch's DataLoader calls iter() when it makes its iterator and next() later: an older
    iterator's first next() after a newer one's must not take over the stream's read pool."""
    before = live_threads("packshard-read")
    s = PackedShardStream(
        str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, prefetch=48, read_threads=3
    )
    old, cur = iter(s), iter(s)
    next(cur)
    with pytest.raises(RuntimeError, match="this iteration was stopped"):
        next(old)
    s.close()
    wait_for_threads("packshard-read", before, "the current iteration's read pool outlived close()")
    del old, cur


def test_close_ends_the_read_pool_of_an_iterator_still_held(small_dataset: Path):
    """The iterating thread's reads fan shards out to a pool: close() ends its threads, as the
    prefetch thread's end with it, even while the trainer still holds the iterator."""
    before = live_threads("packshard-read")
    s = PackedShardStream(
        str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, prefetch=48, read_threads=3
    )  # a window of 48 shuffled rows spans several shards: read on the pool
    it = iter(s)
    next(it)
    assert live_threads("packshard-read") > before
    s.close()
    wait_for_threads("packshard-read", before, "the read pool's threads outlived close()")
    del it


def test_iterating_a_finished_stream_warns(small_dataset: Path, caplog):
    s = PackedShardStream(str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4)
    assert len(list(s)) > 0
    with caplog.at_level("WARNING", logger="packshard.trainer_shim.stream"):
        assert list(s) == []
    assert "its 1 epoch(s) are done; this iteration yields nothing" in caplog.text


def test_ranks_sharing_a_cache_dir_with_limits_heal_each_others_evictions(
    small_dataset: Path, tmp_path: Path
):
    """Each rank keeps its own bound over one cache_dir (cache.py), so one evicts shards the
    other counts as cached: the other's read fails, and it downloads the shard again."""
    biggest = max(s.bytes for s in ShardDataset.open(str(small_dataset)).shards)
    kw = dict(dp_size=2, rows_per_step=4, epochs=3)
    expected = [collect(PackedShardStream(str(small_dataset), dp_rank=r, **kw)) for r in range(2)]
    got: dict[int, Any] = {}

    def rank(r: int) -> None:
        stream = PackedShardStream(
            str(small_dataset), dp_rank=r, cache_dir=tmp_path / "c",
            cache_limit_bytes=2 * biggest, read_threads=1, **kw,
        )  # fmt: skip
        try:
            got[r] = collect(stream)
        except Exception as e:  # the test reports it
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in range(2):
        assert not isinstance(got[r], Exception), got[r]
        assert len(got[r]) == len(expected[r]) > 0
        assert all(same(a, b) for a, b in zip(got[r], expected[r], strict=True))


def test_a_download_evicted_by_another_rank_at_once_is_still_read(
    small_dataset: Path, tmp_path: Path, monkeypatch
):
    """Another process sharing the cache_dir may delete a shard the moment this one renames
    its download into place (its own bound counts that name as its copy): the read that follows
    must still get the rows, not fail with "missing"."""
    import packshard.trainer_shim.cache as cache_module

    kw = dict(dp_rank=0, dp_size=1, rows_per_step=8, seed=3)
    expected = collect(PackedShardStream(str(small_dataset), **kw))
    real_replace = os.replace
    evicted = []

    def replace_then_evicted(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if str(dst).endswith(".arrow") and "shards" in str(dst):
            os.unlink(dst)  # the other rank's _make_room, right after the rename
            evicted.append(dst)

    monkeypatch.setattr(cache_module.os, "replace", replace_then_evicted)
    stream = PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", read_threads=1, **kw)
    got = collect(stream)
    assert evicted and len(got) == len(expected) > 0
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))


def test_a_cached_shard_evicted_while_a_rank_opens_the_cache_is_left_out(
    small_dataset: Path, tmp_path: Path, monkeypatch
):
    """A rank that opens a shared cache_dir while another evicts: a file that goes right after
    the rank looked at it failed the stream's constructor with FileNotFoundError (it looked
    twice); adopted, its first read finds it gone and downloads it again."""
    kw = dict(dp_rank=0, dp_size=1, rows_per_step=8)
    expected = collect(PackedShardStream(str(small_dataset), **kw))
    collect(PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", **kw))  # warm
    real_stat, gone = Path.stat, []

    def evicted_after_first_look(self: Path, *a: Any, **k: Any) -> Any:
        found = real_stat(self, *a, **k)
        if self.name == "part-00001.arrow" and not gone:
            gone.append(self)
            os.unlink(self)  # the other rank's eviction, right after this look
        return found

    monkeypatch.setattr(Path, "stat", evicted_after_first_look)
    stream = PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", **kw)
    monkeypatch.setattr(Path, "stat", real_stat)
    assert gone and stream.cache is not None
    got = collect(stream)
    assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected, strict=True))


def test_iterating_in_a_dataloader_worker_is_refused(small_dataset: Path):
    """Each worker process would read every row (the rows twice with two workers) and the
    training process's stream state would never move: refused, naming num_workers=0."""
    from torch.utils.data import DataLoader, IterableDataset

    stream = PackedShardStream(str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4)

    class Wrapped(IterableDataset):
        def __iter__(self) -> Any:
            return iter(stream)

    with pytest.raises(RuntimeError, match=r"DataLoader worker process.*num_workers=0"):
        list(DataLoader(Wrapped(), batch_size=None, num_workers=1))
    expected = len(stream)  # micro-batches left (all: the worker's copy read none of ours)
    assert sum(1 for _ in DataLoader(Wrapped(), batch_size=None, num_workers=0)) == expected > 0


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_cached_copies_are_fetched_again(small_dataset: Path, tmp_path: Path, caplog):
    """A cached shard or index.arrow damaged on disk after it was verified (same size) is
    replaced by a verified copy, instead of failing every run with advice to re-pack."""
    kw = dict(dp_rank=0, dp_size=1, rows_per_step=48, shuffle=False)
    expected = collect(PackedShardStream(str(small_dataset), **kw))
    first = PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", **kw)
    collect(first)
    assert first.cache is not None
    (root,) = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
    manifest = json.loads((small_dataset / "manifest.json").read_text())
    shard = root / manifest["shards"][0]["path"]
    ids = ShardDataset.open(str(small_dataset)).read_row(5)["input_ids"]
    _flip_byte(shard, shard.read_bytes().find(np.asarray(ids, np.int32)[:8].tobytes()) + 9)
    _flip_byte(root / "index.arrow", (root / "index.arrow").stat().st_size // 2)
    with caplog.at_level("WARNING", logger="packshard.trainer_shim.cache"):
        again = PackedShardStream(str(small_dataset), cache_dir=tmp_path / "c", **kw)
        got = collect(again)
    assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected, strict=True))
    assert "index.arrow: checksum" in caplog.text and "copying index.arrow again" in caplog.text
    assert "part-00000.arrow could not be read (" in caplog.text
    assert again.cache is not None and again.cache.downloads == 1  # that shard alone
    assert shard.read_bytes() == (small_dataset / manifest["shards"][0]["path"]).read_bytes()


def test_a_stream_stalled_past_stall_timeout_s_raises_naming_the_shard(
    small_dataset: Path, monkeypatch
):
    """Rows read before the stall are delivered; then, once stall_timeout_s passes with no row
    and no shard's read completing, a StorageError names the shards being read (a stalled
    store otherwise keeps its client library retrying for many minutes). Without the timeout
    the same slow read just arrives."""
    read = RowReader.read
    calls = []

    def stalls_on_the_second_window(self, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            time.sleep(5.0)
        return read(self, rows)

    monkeypatch.setattr(RowReader, "read", stalls_on_the_second_window)
    args = dict(dp_rank=0, dp_size=1, rows_per_step=4, prefetch=4)
    s = PackedShardStream(str(small_dataset), stall_timeout_s=1, **args)
    it = iter(s)
    first = [next(it) for _ in range(4)]  # the first window
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        next(it)
    took = time.monotonic() - t0  # the timeout, then up to 1 s joining the blocked thread
    s.close()
    assert re.search(
        r"no rows for 1\.\d s and no read progress for 1\.\d s \(stall_timeout_s=1\) while "
        r"reading 4 rows of shards/part-\d+\.arrow",
        str(err.value),
    ), str(err.value)
    assert 1.0 <= took < 4.0 and all(mb["row"] >= 0 for mb in first)
    calls.clear()
    slow = PackedShardStream(str(small_dataset), **args)  # no timeout: waits for the read
    assert len(collect(slow)) == len(collect(PackedShardStream(str(small_dataset), **args)))


def test_the_stall_clock_restarts_with_each_shard_read(small_dataset: Path, monkeypatch):
    """A window over several shards, each read taking 0.6 s one at a time (read_threads=1):
    the window takes longer than stall_timeout_s=1, but no shard's read does, so nothing
    raises: the timeout is about a read that stops progressing, not a slow window."""
    read, read_shard = RowReader.read, RowReader._read_shard
    shards_a_window: list[int] = []

    def counted(self, rows):
        shards_a_window.append(0)
        return read(self, rows)

    def slow_shard(self, shard, members):
        shards_a_window[-1] += 1
        time.sleep(0.6)
        return read_shard(self, shard, members)

    monkeypatch.setattr(RowReader, "read", counted)
    monkeypatch.setattr(RowReader, "_read_shard", slow_shard)
    args = dict(dp_rank=0, dp_size=1, rows_per_step=4, prefetch=16, read_threads=1)
    s = PackedShardStream(str(small_dataset), stall_timeout_s=1, **args)
    got = collect(s)
    assert max(shards_a_window) >= 2  # some window took 1.2 s or more: longer than the timeout
    monkeypatch.setattr(RowReader, "read", read)
    monkeypatch.setattr(RowReader, "_read_shard", read_shard)
    assert len(got) == len(collect(PackedShardStream(str(small_dataset), **args)))


@pytest.mark.parametrize(
    ("prefetch_thread", "why"),
    [
        (True, "a store that accepts connections but does not answer"),
        (False, "while the iterating thread reads 4 rows of shards/part-00000.arrow (slow"),
    ],
)
def test_a_stream_waiting_long_for_rows_says_so(
    small_dataset: Path, monkeypatch, caplog, prefetch_thread: bool, why: str
):
    monkeypatch.setattr("packshard.trainer_shim.stream.STALL_WARN_S", 1.0)
    read = RowReader.read

    def slow(self, rows):
        time.sleep(2.6)
        return read(self, rows)

    monkeypatch.setattr(RowReader, "read", slow)
    with caplog.at_level("WARNING", logger="packshard.trainer_shim.stream"):
        s = PackedShardStream(
            str(small_dataset), dp_rank=0, dp_size=1, rows_per_step=4, prefetch=4,
            shuffle=False, prefetch_thread=prefetch_thread,
        )  # fmt: skip
        next(iter(s))
        s.close()
    assert "no rows for 1 s" in caplog.text and "no rows for 2 s" in caplog.text
    assert why in caplog.text


def test_a_damaged_row_read_without_verify_is_a_format_error_naming_the_file(copy_of):
    """verify=False skips the row checksums; a row whose documents overflow it still fails as
    the dataset's problem, naming the shard and the row."""
    root = copy_of()
    ds = ShardDataset.open(str(root))
    row = ds.read_row(5)
    shard = root / json.loads((root / "manifest.json").read_text())["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    lens = np.asarray(row["doc_lens"], dtype=np.int32).tobytes()
    at = bytes(data).find(lens)
    assert at > 0 and bytes(data).count(lens) == 1
    data[at + 2] ^= 0x40  # the first document's length grows by 2^22 tokens
    shard.write_bytes(bytes(data))
    stream = PackedShardStream(
        str(root), dp_rank=0, dp_size=1, rows_per_step=48, shuffle=False, verify=False
    )
    with pytest.raises(
        FormatError, match=r"part-00000\.arrow: row 5 \(global row 5\): documents hold"
    ):
        collect(stream)
