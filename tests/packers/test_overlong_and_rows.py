"""Overlong policies, the padding rule, and row building (tokens land where they belong)."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packshard.packers import (
    apply_overlong,
    pack_table,
    padded_length,
    row_index_stats,
    row_problems,
)
from packshard.packers.arrays import column_numpy, numeric_array
from packshard.packers.rows import list_parts


@given(n=st.integers(0, 10_000), m=st.integers(1, 64))
def test_padded_length(n, m):
    p = padded_length(n, m)
    assert p % m == 0 and n <= p < n + m


def test_padded_length_rejects_bad_multiple():
    with pytest.raises(ValueError, match="multiple"):
        padded_length(3, 0)


lengths_st = st.lists(st.integers(0, 50), max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    lengths=lengths_st,
    cap=st.integers(1, 20),
    policy=st.sampled_from(["truncate", "split", "drop"]),
)
def test_overlong_accounting(lengths, cap, policy):
    r = apply_overlong(lengths, cap, policy)
    arr = np.asarray(lengths, dtype=np.int64)
    assert (r.length >= 1).all() and (r.length <= cap).all()
    assert (r.start >= 0).all() and (r.start + r.length <= arr[r.sample]).all()
    assert r.dropped.get("empty", 0) == int((arr == 0).sum())
    kept_tokens = int(r.length.sum())
    if policy == "split":
        assert kept_tokens == int(arr.sum()), "split loses no token"
        assert r.extra_pieces == int(np.maximum(-(-arr // cap) - 1, 0).sum())
        # pieces of a sample are consecutive and tile it
        for s in np.unique(r.sample):
            sel = r.sample == s
            assert np.array_equal(r.start[sel], np.arange(sel.sum()) * cap)
    elif policy == "truncate":
        assert kept_tokens + r.truncated_tokens == int(arr.sum())
        assert r.truncated_samples == int((arr > cap).sum())
        assert len(set(r.sample.tolist())) == r.num_pieces
    else:
        assert r.dropped.get("overlong", 0) == int((arr > cap).sum())
        assert kept_tokens + r.dropped_tokens == int(arr.sum())
    assert list(r.sample) == sorted(r.sample), "input order kept"


def _table(seqs, masks=None):
    cols = {"input_ids": pa.array(seqs, type=pa.list_(pa.int32()))}
    if masks is not None:
        cols["loss_mask"] = pa.array(masks, type=pa.list_(pa.bool_()))
    return pa.table(cols)


@settings(max_examples=100, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=40),
    mult=st.sampled_from([1, 2, 4, 8]),
    policy=st.sampled_from(["truncate", "split", "drop"]),
    algorithm=st.sampled_from(["bfd", "ffd", "greedy"]),
    seed=st.integers(0, 2**16),
)
def test_pack_table_rows_hold_exactly_the_samples(lens, mult, policy, algorithm, seed):
    rng = np.random.default_rng(seed)
    seq_len = 32
    seqs = [rng.integers(1, 1000, n).astype(np.int32) for n in lens]
    masks = [rng.random(n) < 0.5 for n in lens]
    batch, report = pack_table(
        _table(seqs, masks),
        seq_len=seq_len,
        pad_multiple=mult,
        pad_token_id=0,
        algorithm=algorithm,
        overlong=policy,
        sample_id_offset=100,
    )
    assert row_problems(batch, seq_len=seq_len, pad_multiple=mult, pad_token_id=0) == []
    # reassemble every sample's tokens from the rows and compare with its source
    pieces: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for row in batch.to_pylist():
        pos = 0
        for dl, sid in zip(row["doc_lens"], row["sample_ids"], strict=False):
            pieces.setdefault(sid - 100, []).append(
                (
                    np.array(row["input_ids"][pos : pos + dl]),
                    np.array(row["loss_mask"][pos : pos + dl]),
                )
            )
            pos += dl
        assert pos == row["num_tokens"]
        assert all(t == 0 for t in row["input_ids"][pos:]) and not any(row["loss_mask"][pos:])
    for s, n in enumerate(lens):
        got = pieces.get(s, [])
        if n == 0 or (policy == "drop" and n > seq_len):
            assert got == []
            continue
        # Under split, full pieces (seq_len tokens) fill rows of their own, which are ordered by
        # piece index; the one short tail piece may sit in an earlier row: put it last.
        got.sort(key=lambda p: len(p[0]) < seq_len)
        ids = np.concatenate([p[0] for p in got])
        mask = np.concatenate([p[1] for p in got])
        want = min(n, seq_len) if policy == "truncate" else n
        assert np.array_equal(ids, seqs[s][:want]) and np.array_equal(mask, masks[s][:want])
        if policy != "split":
            assert len(got) == 1
    assert report.num_tokens == sum(len(p[0]) for v in pieces.values() for p in v)


def test_row_index_stats():
    batch, _ = pack_table(
        _table([[1, 2, 3], [4, 5], [6]]),
        seq_len=8,
        pad_multiple=4,
        pad_token_id=9,
        algorithm="greedy",
    )
    st_ = row_index_stats(batch)
    assert st_["num_tokens"].tolist() == [6]
    assert st_["padded_len"].tolist() == [8]
    assert st_["num_docs"].tolist() == [3]
    assert st_["attn_cost"].tolist() == [9 + 4 + 1]
    assert batch.column("input_ids").to_pylist() == [[1, 2, 3, 4, 5, 6, 9, 9]]


def test_row_problems_catches_each_breach():
    good, _ = pack_table(_table([[1, 2, 3], [4, 5]]), seq_len=8, pad_multiple=4, pad_token_id=0)
    row = good.to_pylist()[0]

    def broken(**change):
        r = {**row, **change}
        return pa.RecordBatch.from_pylist([r], schema=good.schema)

    cases = {
        "not a multiple": broken(
            input_ids=row["input_ids"] + [0], loss_mask=row["loss_mask"] + [False]
        ),
        "exceeds seq_len": broken(
            input_ids=row["input_ids"] + [0] * 4, loss_mask=row["loss_mask"] + [False] * 4
        ),
        "doc_lens sum": broken(doc_lens=[3, 1]),
        "other than pad_token_id": broken(input_ids=[*row["input_ids"][:5], 7, 0, 0]),
        "loss_mask is true on padding": broken(
            loss_mask=[*row["loss_mask"][:5], True, False, False], num_loss_tokens=6
        ),
        "num_loss_tokens": broken(num_loss_tokens=2),
        "differ in length": broken(sample_ids=[0]),
    }
    assert row_problems(good, seq_len=8, pad_multiple=4, pad_token_id=0) == []
    for what, batch in cases.items():
        msgs = row_problems(batch, seq_len=8, pad_multiple=4, pad_token_id=0)
        assert any(what in m for m in msgs), (what, msgs)


def test_row_problems_on_a_zero_copy_slice():
    batch, _ = pack_table(
        _table([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]),
        seq_len=4,
        pad_multiple=2,
        pad_token_id=0,
        algorithm="greedy",
    )
    for start in range(batch.num_rows):
        for length in range(1, batch.num_rows - start + 1):
            assert (
                row_problems(batch.slice(start, length), seq_len=4, pad_multiple=2, pad_token_id=0)
                == []
            )


def test_pack_table_on_sliced_columns_with_different_offsets():
    """input_ids and loss_mask may come as slices whose offsets differ; rows must still match."""
    ids = pa.array([[9, 9], [1, 2, 3], [4, 5]], type=pa.list_(pa.int32())).slice(1)
    mask = pa.array([[True, False, True], [False, True]], type=pa.list_(pa.bool_()))
    batch, _ = pack_table(
        pa.table({"input_ids": ids, "loss_mask": mask}),
        seq_len=8,
        pad_multiple=4,
        pad_token_id=0,
        algorithm="greedy",
    )
    row = batch.to_pylist()[0]
    assert row["input_ids"] == [1, 2, 3, 4, 5, 0, 0, 0]
    assert row["loss_mask"] == [True, False, True, False, True, False, False, False]
    assert row["num_loss_tokens"] == 3


def test_pack_table_rejects_mismatched_mask():
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2], [3]], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([[True, True], [True, False]]),
        }
    )
    with pytest.raises(ValueError, match="row 1: loss_mask must have the length of input_ids"):
        pack_table(table, seq_len=8, pad_multiple=4, pad_token_id=0)


@settings(max_examples=100, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=60), mult=st.sampled_from([1, 3, 8, 16])
)
def test_rows_without_source_mask_have_loss_on_every_token(lens, mult):
    seqs = [np.full(n, 7, dtype=np.int32) for n in lens]
    batch, _ = pack_table(_table(seqs), seq_len=48, pad_multiple=mult, pad_token_id=0)
    assert row_problems(batch, seq_len=48, pad_multiple=mult, pad_token_id=0) == []
    for row in batch.to_pylist():
        n = row["num_tokens"]
        assert row["loss_mask"] == [True] * n + [False] * (len(row["input_ids"]) - n)
        assert row["num_loss_tokens"] == n


@pytest.mark.parametrize(("start", "length"), [(0, 4), (1, 3), (3, 1), (2, 0), (1, 1)])
def test_list_parts_of_a_slice_hold_only_its_own_values(start: int, length: int):
    lists = [[1, 2], [3], [], [4, 5, 6]]
    arr = pa.array(lists, pa.list_(pa.int32())).slice(start, length)
    offsets, values = list_parts(arr, np.int64)
    assert offsets[0] == 0 and values.dtype == np.int64
    assert [values[a:b].tolist() for a, b in itertools.pairwise(offsets)] == (
        lists[start : start + length]
    )
    assert values.size == sum(len(x) for x in lists[start : start + length])


@pytest.mark.parametrize(
    ("values", "arrow_type"),
    [
        (np.array([0, 7, 2**31 - 1], np.int64), pa.int32()),
        (np.array([-(2**40), 0, 2**40], np.int64), pa.int64()),
        (np.array([0, 2**63 + 5], np.uint64), pa.uint64()),
        (np.arange(20, dtype=np.int32)[::3], pa.int32()),  # strided: copied to contiguous
        (np.array([True, False, True, True, False, False, True, False, True]), pa.bool_()),
        (np.zeros(0), pa.int32()),
    ],
)
def test_numeric_array_equals_pa_array(values, arrow_type):
    got = numeric_array(values, arrow_type)
    assert got.type == arrow_type
    assert got.to_pylist() == pa.array(values.tolist(), type=arrow_type).to_pylist()


def test_numeric_array_refuses_values_that_do_not_fit():
    with pytest.raises(OverflowError, match="int32"):
        numeric_array(np.array([1, 2**31]), pa.int32())
    with pytest.raises(OverflowError, match="uint64"):
        numeric_array(np.array([-1]), pa.uint64())
    with pytest.raises(TypeError, match="round"):
        numeric_array(np.array([1.5]), pa.int32())
    with pytest.raises(ValueError, match="1-D"):
        numeric_array(np.zeros((2, 2), np.int32), pa.int32())


@settings(max_examples=100, deadline=None)
@given(
    bits=st.lists(st.booleans(), max_size=70),
    cut=st.tuples(st.integers(0, 70), st.integers(0, 70)),
    chunks=st.integers(1, 3),
)
def test_column_numpy_reads_sliced_and_chunked_columns(bits, cut, chunks):
    lo, hi = sorted(cut)
    lo, hi = min(lo, len(bits)), min(hi, len(bits))
    want = bits[lo:hi]
    for arrow_type in (pa.bool_(), pa.int64(), pa.uint8()):
        values = pa.array(bits, pa.bool_()).cast(arrow_type).slice(lo, hi - lo)
        got = column_numpy(values)
        assert got.tolist() == np.asarray(want, dtype=got.dtype).tolist()
        step = max(1, len(values) // chunks)
        pieces = [values.slice(i, step) for i in range(0, len(values), step)] or [values]
        assert column_numpy(pa.chunked_array(pieces, arrow_type)).tolist() == got.tolist()


def test_column_numpy_refuses_nulls_and_non_numeric_columns():
    with pytest.raises(ValueError, match="nulls"):
        column_numpy(pa.array([1, None, 3], pa.int32()))
    with pytest.raises(TypeError, match="fixed-width"):
        column_numpy(pa.array(["a"]))


def test_writing_a_shard_does_not_import_pandas(tmp_path):
    """pyarrow's `pa.array(ndarray)` imports pandas on its first call (~0.2 s of every pack
    worker's first shard); the row and index builders stay clear of it."""
    import subprocess
    import sys

    code = f"""
import sys
import numpy as np
import fsspec
from packshard.packers import pack_table
from packshard.packers.writer import build_index, write_shard
import pyarrow as pa
from packshard.packers.arrays import numeric_array
offsets = np.cumsum([0, 5, 9, 3, 12, 7])
ids = pa.ListArray.from_arrays(
    numeric_array(offsets, pa.int32()), numeric_array(np.arange(offsets[-1]), pa.int32())
)
table = pa.Table.from_arrays([ids], names=["input_ids"])
assert "pandas" not in sys.modules, "pandas before packing"
batch, _ = pack_table(table, seq_len=16, pad_multiple=4, pad_token_id=0)
record = write_shard(fsspec.filesystem("file"), {str(tmp_path)!r}, 0, iter([batch]), rows_per_batch=8)
build_index([record])
print("pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_pack_table_rejects_null_token_ids_and_mask_values():
    ids = pa.array([[1, 2], [3, None]], pa.list_(pa.int32()))
    with pytest.raises(ValueError, match="1 null token ids"):
        pack_table(pa.table({"input_ids": ids}), seq_len=8, pad_multiple=2, pad_token_id=0)
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2], [3, 4]], pa.list_(pa.int32())),
            "loss_mask": pa.array([[True, None], [True, False]], pa.list_(pa.bool_())),
        }
    )
    with pytest.raises(ValueError, match="loss_mask holds 1 null"):
        pack_table(table, seq_len=8, pad_multiple=2, pad_token_id=0)
