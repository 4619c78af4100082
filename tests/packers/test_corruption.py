"""Known corruptions, each one clear packshard error naming the file (the fuzz test in
tests/integration/test_corruption_fuzz.py covers random ones), and what a URL without a dataset
is said to hold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from packshard.packers import (
    DatasetNotFoundError,
    DatasetWriter,
    FormatError,
    ShardDataset,
    pack_table,
)
from packshard.packers.ipc import footer_length, message_flatbuffer, parse_batch, read_footer
from packshard.packers.shard_file import batches_from_bytes

CONFIG = {"seq_len": 256, "cp": 2, "pad_multiple": 4, "pad_token_id": 0}


def _make(root: Path, *, rows_per_batch: int = 3) -> tuple[str, pa.RecordBatch]:
    rng = np.random.default_rng(3)
    ids = [rng.integers(1, 500, int(n)).astype(np.int32) for n in rng.integers(5, 200, 90)]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))})
    batch, _ = pack_table(table, seq_len=256, pad_multiple=4, pad_token_id=0)
    w = DatasetWriter(str(root), CONFIG, max_rows=10, rows_per_batch=rows_per_batch)
    w.write(batch)
    w.close({"samples_in": 90, "samples_kept": 90, "dropped": {}})
    return str(root), batch


def _edit(url: str, change) -> None:
    path = Path(url) / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


def _read_all(url: str) -> None:
    with ShardDataset.open(url) as ds:
        for s, entry in enumerate(ds.shards):
            ds.read_rows_arrays(s, np.arange(entry.rows))


def test_a_shard_file_of_another_size_is_refused_on_open(tmp_path):
    """Two shards swapped: with no row checksums to catch it (format v1 allows an index
    without them), only the size the manifest records tells a local reader."""
    url, _ = _make(tmp_path / "ds")
    a, b = (tmp_path / "ds" / "shards" / f"part-0000{i}.arrow" for i in (0, 1))
    assert a.stat().st_size != b.stat().st_size
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    with pytest.raises(FormatError, match=rf"part-00000\.arrow: {len(data_b)} bytes, the manifest says {len(data_a)}"):  # fmt: skip
        _read_all(url)


def test_verify_refuses_a_shard_with_compressed_bodies(tmp_path):
    """Arrow reads it locally, but a range reader cannot address its buffers: the remote stream
    would fail mid-training. Format v1 shards are uncompressed; verify says so up front."""
    import xxhash

    from packshard.pipeline.verify import verify_dataset

    url, _ = _make(tmp_path / "ds")
    path = tmp_path / "ds" / "shards" / "part-00001.arrow"
    table = pa.ipc.open_file(str(path)).read_all()
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema, options=options) as w:
        w.write_table(table)
    data = path.read_bytes()
    _edit(url, lambda m: m["shards"][1].update(bytes=len(data), checksum=f"xxh3_128:{xxhash.xxh3_128(data).hexdigest()}"))  # fmt: skip
    problems = verify_dataset(url)
    assert any("part-00001.arrow: record batch 0: the record batch body is compressed" in p for p in problems), problems  # fmt: skip


def test_rows_per_batch_disagreeing_with_the_shard(tmp_path):
    url, _ = _make(tmp_path / "ds")
    _edit(url, lambda m: m["shards"][1].update(rows_per_batch=4))  # 10 rows: 4 batches, not 3
    with pytest.raises(FormatError, match=r"part-00001\.arrow: holds 4 record batches, .*rows_per_batch=4 need 3"):  # fmt: skip
        _read_all(url)


@pytest.mark.parametrize("reader", ["local", "remote rows", "remote whole", "whole file"])
def test_rows_per_batch_with_the_same_batch_count(tmp_path, monkeypatch, reader):
    """A rows_per_batch that gives the shard's batch count but other batch lengths: each reader
    checks every batch's length before it locates a row in it."""
    url, _ = _make(tmp_path / "ds", rows_per_batch=4)  # shards of 10, 10, 10 and 6 rows
    m = json.loads((Path(url) / "manifest.json").read_text())
    (last,) = [i for i, e in enumerate(m["shards"]) if e["rows"] == 6]  # batches 4, 2
    _edit(url, lambda m: m["shards"][last].update(rows_per_batch=3))  # 3, 3: the same count
    want = rf"part-0000{last}\.arrow: record batch 0 holds 4 rows; .*put 3 there"
    monkeypatch.setattr(
        "packshard.packers.shard_file.DENSE", 2.0 if reader == "remote whole" else 0.0
    )
    ds = _remote(url) if reader.startswith("remote") else ShardDataset.open(url)
    entry = ds.shards[last]
    with pytest.raises(FormatError, match=want):
        if reader == "whole file":  # what `packshard verify` reads
            batches_from_bytes(ds.shard_bytes(last), entry, f"{url}/{entry.path}")
        else:
            ds.read_rows_arrays(last, np.arange(entry.rows))
    _edit(url, lambda m: m["shards"][last].pop("rows_per_batch"))  # not recorded: the batches'
    _read_all(url)  # own lengths locate the rows


def test_shifted_rows_counts(tmp_path):
    url, _ = _make(tmp_path / "ds")

    def shift(m: dict) -> None:
        m["shards"][0]["rows"] += 1
        m["shards"][1]["rows"] -= 1

    _edit(url, shift)
    with pytest.raises(
        FormatError, match=r"index\.arrow: row 10 points at shard 1 row 0, .* at shard 0 row 10"
    ):
        ShardDataset.open(url).index  # noqa: B018


def test_footer_byte_flip(tmp_path):
    url, _ = _make(tmp_path / "ds")
    path = Path(url) / "shards" / "part-00000.arrow"
    data = bytearray(path.read_bytes())
    n = footer_length(bytes(data[-10:]), len(data))
    data[len(data) - 10 - n + n // 2] ^= 0xFF  # inside the footer flatbuffer
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"part-00000\.arrow: (not a readable Arrow IPC file|record batch)"):  # fmt: skip
        _read_all(url)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda m: m["shards"][0].update(rows="10"),
            r"shards\[0\]: rows must be an int >= 0, got '10'",
        ),
        (lambda m: m["shards"][0].update(rows=True), r"rows must be an int"),
        (lambda m: m["config"].update(seq_len=-5), r"config: seq_len must be an int >= 1"),
        (lambda m: m["totals"].update(rows=1), r"totals: rows is 1, but the shards hold"),
        (lambda m: m["totals"].update(samples_kept=5), r"samples_kept is 5 .* do not add up"),
        (lambda m: m.update(histogram=None), r"histogram must be a JSON object"),
        (
            lambda m: m["histogram"]["counts"].__setitem__(0, 7),
            r"histogram: counts .* do not match",
        ),
        (lambda m: m["index"].update(rows=3), r"index: rows is 3"),
        (lambda m: m["shards"][1].update(path=m["shards"][0]["path"]), r"shards name a file twice"),
        (lambda m: m.update(shards={}), r"shards must be a list"),
        # numbers JSON allows but numpy cannot hold (OverflowError deep in a reader before)
        (lambda m: m["config"].update(seq_len=10**30), r"seq_len must be an int <= 2,147,483,647"),
        (lambda m: m["config"].update(pad_multiple=2**63), r"pad_multiple must be an int <= "),
        (
            lambda m: m["shards"][0].update(rows_per_batch=2**63),
            r"rows_per_batch must be an int <= ",
        ),
        # the filler rows' token: a negative or past-int32 id reached the trainer
        (lambda m: m["config"].update(pad_token_id=-5), r"pad_token_id must be an int >= 0"),
        (lambda m: m["config"].update(pad_token_id=2**31), r"pad_token_id must be an int <= "),
        (
            lambda m: m["histogram"]["edges"].__setitem__(1, 2**63),
            r"edges and counts must be ints in",
        ),
    ],
)
def test_manifest_values_are_checked(tmp_path, change, match):
    url, _ = _make(tmp_path / "ds")
    _edit(url, change)
    with pytest.raises(FormatError, match=match) as e:
        ShardDataset.open(url).index  # noqa: B018
    assert "manifest.json" in str(e.value) or "index.arrow" in str(e.value)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,  # past the parser's recursion limit
        '{"format": "packshard", "version": ' + "1" * 5000 + "}",  # past int()'s digit limit
    ],
)
def test_a_manifest_python_cannot_parse_is_a_format_error(tmp_path, text):
    url, _ = _make(tmp_path / "ds")
    (tmp_path / "ds" / "manifest.json").write_text(text)
    with pytest.raises(FormatError, match=r"manifest\.json: not valid JSON"):
        ShardDataset.open(url)


def test_a_config_breaking_the_shape_rules_fails_verify_but_still_reads(tmp_path):
    from packshard.pipeline.verify import verify_dataset

    url, _ = _make(tmp_path / "ds")
    _edit(url, lambda m: m["config"].update(cp=8))
    assert verify_dataset(url) == [
        f"{url}/manifest.json: config: pad_multiple 4 is not a multiple of cp 8"
    ]
    _read_all(url)  # a dataset written before the writer checked still reads


def test_the_writer_refuses_a_config_readers_would_refuse(tmp_path):
    for change, match in [
        ({"cp": 8}, "pad_multiple 4 is not a multiple of cp 8"),
        ({"seq_len": 250}, "seq_len 250 is not a multiple of pad_multiple 4"),
        ({"pad_token_id": None}, "pad_token_id must be an int"),
    ]:
        with pytest.raises(ValueError, match=match):
            DatasetWriter(str(tmp_path / "ds"), {**CONFIG, **change})
    assert not (tmp_path / "ds").exists()


def test_what_a_url_without_a_dataset_holds(tmp_path):
    def said(url: Path) -> str:
        with pytest.raises(DatasetNotFoundError) as e:
            ShardDataset.open(str(url))
        return str(e.value)

    assert "does not exist" in said(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    assert "is an empty directory" in said(tmp_path / "empty")
    (tmp_path / "job" / "_packshard").mkdir(parents=True)
    (tmp_path / "job" / "_packshard" / "plan.json").write_text("{}")
    assert "holds an unfinished pack job" in said(tmp_path / "job")
    url, _ = _make(tmp_path / "half")
    (Path(url) / "manifest.json").unlink()
    assert "holds shards but no manifest.json" in said(Path(url))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    assert "holds no packshard dataset" in said(tmp_path / "other")
    assert "is a file" in said(tmp_path / "other" / "notes.txt")


def test_ipc_layout_matches_pyarrow(tmp_path):
    """The footer and message parser finds the very buffers pyarrow decodes."""
    url, _ = _make(tmp_path / "ds")
    path = Path(url) / "shards" / "part-00000.arrow"
    data = path.read_bytes()
    n = footer_length(data[-10:], len(data))
    blocks = read_footer(data[len(data) - 10 - n : len(data) - 10], len(data))
    reader = pa.ipc.open_file(pa.BufferReader(data))
    assert len(blocks) == reader.num_record_batches == math.ceil(10 / 3)
    for b, block in enumerate(blocks):
        meta = message_flatbuffer(data[block.offset : block.body_offset], block.metadata_length)
        layout = parse_batch(meta, block.body_length)
        batch = reader.get_batch(b)
        assert layout.length == batch.num_rows
        ours = [data[block.body_offset + o : block.body_offset + o + k] for o, k in layout.buffers]
        theirs = [buf for col in batch.columns for buf in col.buffers()]
        assert len(ours) == len(theirs) == 20
        for mine, buf in zip(ours, theirs, strict=True):
            if buf is not None:
                assert mine[: buf.size] == buf.to_pybytes()[: len(mine)]


def _remote(url: str) -> ShardDataset:
    """The dataset read as a remote one (byte ranges through fsspec), here from local files."""
    ds = ShardDataset.open(url)
    ds.local = False
    return ds


@pytest.mark.parametrize("recorded", [True, False])
@pytest.mark.parametrize("dense", [0.0, 2.0])  # every batch read whole / by rows' ranges
def test_range_reader_matches_memory_map(tmp_path, monkeypatch, recorded, dense):
    monkeypatch.setattr("packshard.packers.shard_file.DENSE", dense)
    url, _ = _make(tmp_path / "ds")
    if not recorded:  # an older writer: the batches' own lengths locate rows
        _edit(url, lambda m: [s.pop("rows_per_batch") for s in m["shards"]])
    local, remote = ShardDataset.open(url), _remote(url)
    requests = []
    cat_ranges = type(remote.fs).cat_ranges
    monkeypatch.setattr(
        type(remote.fs), "cat_ranges", lambda fs, p, s, e, **kw: requests.append(len(p)) or cat_ranges(fs, p, s, e, **kw)
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for s, entry in enumerate(local.shards):
        rows = rng.permutation(entry.rows)[: max(1, entry.rows - 2)]
        a = local.read_rows_arrays(s, rows, ("input_ids", "loss_mask", "doc_lens", "sample_ids"))
        b = remote.read_rows_arrays(s, rows, ("input_ids", "loss_mask", "doc_lens", "sample_ids"))
        for col in a:
            assert all(np.array_equal(x, y) for x, y in zip(a[col], b[col], strict=True)), col
    # per shard: the file's head and tail, then the batches' metadata, then their small buffers
    # with the rows' tokens (or, dense, the whole batches at once); this small dataset's ranges
    # all merge (< 1 MiB apart)
    assert len(requests) <= 4 * len(local.shards) and max(requests) <= 2
