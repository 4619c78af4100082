"""The pack job's task functions run in-process (no Ray): tokenize a block, pack + write +
verify a shard, check a kept shard."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from packshard.pipeline import tasks
from packshard.pipeline.inputs import resolve_inputs
from packshard.pipeline.jobstate import marker_path
from packshard.pipeline.planning import ShardPlan, contributions, plan_shards
from packshard.pipeline.readers import count_records
from packshard.pipeline.samples import REASONS
from packshard.pipeline.tasks import WorkSpec, check_shard, pack_shard, tokenize_block
from packshard.pipeline.tokenization import SampleEncoder, load_tokenizer


def _spec(out: Path, **kw) -> WorkSpec:
    payload = SampleEncoder(load_tokenizer("packshard:demo")).payload
    base = {
        "output": str(out), "storage_options": {}, "tokenizer": payload,
        "tokenizer_fingerprint": payload.fingerprint, "kind": "auto", "columns": {},
        "loss_roles": ("assistant",), "template_kwargs": {}, "skip_bad_records": True, "seq_len": 256,
        "pad_multiple": 8, "pad_token_id": payload.pad_token_id, "algorithm": "bfd",
        "overlong": "truncate", "carry_rows": 1, "rows_per_batch": 16, "config_digest": "sha256:test",
    }  # fmt: skip
    return WorkSpec(**{**base, **kw})


GOOD_CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def _records(n: int) -> list[dict]:
    recs = []
    for i in range(n):
        if i % 17 == 5:
            recs.append({"messages": []})  # bad: empty conversation
        elif i % 3 == 0:
            recs.append({"text": "x" * (20 + 7 * i % 300)})
        else:
            recs.append({"prompt": f"q{i}", "completion": "a" * (5 + i % 40)})
    return recs


@pytest.fixture
def data(tmp_path: Path):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _records(120)))
    (f,) = resolve_inputs([str(p)])
    return count_records(f)


def _blocks(spec, f, per):
    metas, datas = [], []
    for start in range(0, f.records, per):
        m, d = tokenize_block(spec, f, start, min(f.records, start + per), start)
        metas.append(m)
        datas.append(d)
    return metas, datas


def test_tokenize_block_reports_bad_records_with_location(tmp_path: Path, data):
    spec = _spec(tmp_path / "out")
    meta, block = tokenize_block(spec, data, 0, 40, 0)
    assert meta.status.tolist().count(0) == 37 and (meta.lengths[meta.status > 0] == 0).all()
    sid, location, reason, _ = meta.examples[0]
    assert (sid, reason) == (5, "empty_conversation") and location.endswith("in.jsonl:line 6")
    assert block.offsets[-1] == block.tokens.size == meta.tokens


def test_pack_shard_is_independent_of_block_boundaries_and_verifies(tmp_path: Path, data):
    shards = {}
    for per in (7, 50, 120):
        spec = _spec(tmp_path / f"out{per}")
        metas, datas = _blocks(spec, data, per)
        contrib = contributions(
            np.concatenate([m.lengths for m in metas]), spec.seq_len, spec.overlong
        )
        plans = plan_shards(
            contrib,
            first_number=0,
            first_position=0,
            window_tokens=4 * 256,
            shard_tokens=8 * 256,
            complete=True,
        )
        firsts = [d.first_id for d in datas]
        results = [pack_shard(spec, p, None, firsts, *datas) for p in plans]
        shards[per] = [r.record.checksum for r in results]
        assert sum(r.counters["samples_in"] for r in results) == 120
        assert sum(r.counters["dropped"].get("empty_conversation", 0) for r in results) == 7
        marker = json.loads(Path(marker_path(str(tmp_path / f"out{per}"), 0)).read_text())
        assert marker["record"]["checksum"] == results[0].record.checksum
    assert shards[7] == shards[50] == shards[120] and len(shards[7]) > 1


def test_shuffled_shard_gathers_from_many_blocks(tmp_path: Path, data):
    spec = _spec(tmp_path / "out")
    _, datas = _blocks(spec, data, 16)
    ids = np.random.default_rng(0).permutation(120)
    plan = ShardPlan(0, 0, 120, (60, 120))
    result = pack_shard(spec, plan, ids, [d.first_id for d in datas], *datas)
    table = pa.ipc.open_file(str(tmp_path / "out" / result.record.path)).read_all()
    seen = np.concatenate(table.column("sample_ids").to_pylist())
    assert sorted(seen.tolist()) == sorted(i for i in range(120) if i % 17 != 5)
    # every document holds exactly its sample's tokens
    by_id = {
        d.first_id + j: d.tokens[d.offsets[j] : d.offsets[j + 1]]
        for d in datas
        for j in range(d.status.size)
    }
    for row in table.to_pylist():
        pos = 0
        for sid, n in zip(row["sample_ids"], row["doc_lens"], strict=True):
            expect = by_id[sid][:n]
            assert row["input_ids"][pos : pos + n] == expect.tolist()
            pos += n


def test_check_shard_keeps_good_shards_and_rejects_touched_ones(tmp_path: Path, data):
    spec = _spec(tmp_path / "out")
    _, datas = _blocks(spec, data, 120)
    plan = ShardPlan(0, 0, 120, (120,))
    result = pack_shard(spec, plan, None, [0], *datas)
    marker = json.loads(Path(marker_path(str(tmp_path / "out"), 0)).read_text())
    kept = check_shard(spec, marker)
    assert not isinstance(kept, str) and kept.kept
    for name in result.record.index:
        assert np.array_equal(kept.record.index[name], result.record.index[name])
    assert (
        check_shard(replace(spec, config_digest="sha256:other"), marker)
        == "its marker belongs to another config"
    )
    shard = tmp_path / "out" / result.record.path
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert "checksum" in check_shard(spec, marker)
    shard.unlink()
    assert check_shard(spec, marker) == "the shard file is missing"


def test_no_tokenizer_accepts_pretokenized_only(tmp_path: Path):
    p = tmp_path / "ids.jsonl"
    p.write_text(
        '{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n{"text": "needs a tokenizer"}\n'
    )
    (f,) = resolve_inputs([str(p)])
    f = count_records(f)
    spec = _spec(tmp_path / "out", tokenizer=None, tokenizer_fingerprint=None, pad_token_id=0)
    meta, block = tokenize_block(spec, f, 0, 2, 0)
    assert block.tokens.tolist() == [1, 2, 3] and block.mask.tolist() == [False, True, True]
    assert meta.examples[0][2] == "no_tokenizer"


def test_no_tokenizer_refuses_ids_no_embedding_row_or_int32_holds(tmp_path: Path):
    """Without a tokenizer the ids go to int32 shards: one past int32 (or int64) is a bad
    record naming it, as a negative id is, never an OverflowError that fails the job."""
    p = tmp_path / "ids.jsonl"
    rows = [[1, 2, 3], [1, 2**31], [-1, 2], [7, 2**70]]
    p.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    (f,) = resolve_inputs([str(p)])
    f = count_records(f)
    spec = _spec(tmp_path / "out", tokenizer=None, tokenizer_fingerprint=None, pad_token_id=0)
    meta, block = tokenize_block(spec, f, 0, 4, 0)
    assert block.tokens.tolist() == [1, 2, 3]
    assert [(e[2], e[3]) for e in meta.examples] == [
        ("token_out_of_range", "input_ids[1] = 2147483648 is outside int32's [0, 2147483648)"),
        ("token_out_of_range", "input_ids[0] = -1 is outside int32's [0, 2147483648)"),
        ("token_out_of_range", f"input_ids[1] = {2**70} is outside int32's [0, 2147483648)"),
    ]


# ---- pre-tokenized tables: read column-wise when clean, per record otherwise ---------------

PRETOKENIZED = [
    {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
    {"input_ids": [8], "loss_mask": [1]},
    {"input_ids": list(range(10, 60)), "loss_mask": [i % 2 for i in range(50)]},
]
BAD_PRETOKENIZED = {  # record -> the reason the per-record path gives it
    "empty_input_ids": {"input_ids": [], "loss_mask": []},
    "loss_mask_length": {"input_ids": [1, 2], "loss_mask": [1]},
    "token_out_of_range": {"input_ids": [1, 10**6], "loss_mask": [1, 1]},
    "no_loss_tokens": {"input_ids": [1, 2], "loss_mask": [0, 0]},
    "bad_field_type": {"input_ids": [1, None], "loss_mask": [1, 1]},
    "missing_fields": {"input_ids": None, "loss_mask": [1]},
}


def _both_paths(tmp_path: Path, records: list[dict], spec: WorkSpec, **table_kw):
    """tokenize_block over the records as parquet and as JSON lines (always per record)."""
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records, **table_kw), tmp_path / "ids.parquet")
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = []
    for name in ("ids.parquet", "ids.jsonl"):
        (f,) = resolve_inputs([str(tmp_path / name)])
        f = count_records(f)
        out.append((f, tokenize_block(spec, f, 0, f.records, 100)))
    return out


@pytest.mark.parametrize("kind", ["input_ids", "auto"])
@pytest.mark.parametrize("with_mask", [True, False])
def test_clean_pretokenized_tables_are_read_as_arrays_with_the_same_result(
    tmp_path: Path, kind: str, with_mask: bool
):
    records = [r if with_mask else {"input_ids": r["input_ids"]} for r in PRETOKENIZED]
    schema = pa.schema(
        [("input_ids", pa.large_list(pa.int64()))]
        + ([("loss_mask", pa.list_(pa.int8()))] if with_mask else [])
    )
    spec = _spec(tmp_path / "out", kind=kind)
    (fp, (mp, bp)), (_, (mj, bj)) = _both_paths(tmp_path, records, spec, schema=schema)
    assert tasks.columnar_block(spec, fp, 0, fp.records, 1000) is not None
    for a, b in ((bp.offsets, bj.offsets), (bp.tokens, bj.tokens), (bp.mask, bj.mask)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert bp.tokens.dtype == np.int32 and bp.first_id == 100 and not bp.status.any()
    assert (mp.tokens, mp.loss_tokens, mp.lengths.tolist()) == (
        mj.tokens,
        mj.loss_tokens,
        [3, 1, 50],
    )


@pytest.mark.parametrize("reason", sorted(BAD_PRETOKENIZED))
def test_a_bad_pretokenized_record_takes_the_per_record_path_and_is_named(
    tmp_path: Path, reason: str
):
    records = [*PRETOKENIZED[:2], BAD_PRETOKENIZED[reason], PRETOKENIZED[2]]
    spec = _spec(tmp_path / "out", kind="input_ids")
    (fp, (mp, bp)), (_, (mj, bj)) = _both_paths(tmp_path, records, spec)
    assert tasks.columnar_block(spec, fp, 0, fp.records, 1000) is None
    assert mp.status.tolist() == mj.status.tolist() == [0, 0, REASONS.index(reason) + 1, 0]
    assert [e[2] for e in mp.examples] == [reason] and mp.examples[0][1].endswith(
        "ids.parquet:row 3"
    )
    assert np.array_equal(bp.tokens, bj.tokens) and np.array_equal(bp.mask, bj.mask)


def test_a_table_with_chats_in_auto_is_read_per_record(tmp_path: Path):
    records = [{**PRETOKENIZED[0], "messages": None}, {"input_ids": None, **GOOD_CHAT}]
    spec = _spec(tmp_path / "out")
    (fp, (mp, _)), _ = _both_paths(tmp_path, records, spec)
    assert tasks.columnar_block(spec, fp, 0, 2, 1000) is None
    assert not mp.status.any() and mp.lengths[0] == 3 and mp.lengths[1] > 3


# ---- --overlong truncate that leaves no loss token -----------------------------------------

TRUNCATED_AWAY = [
    {"input_ids": list(range(1, 13)), "loss_mask": [0] * 8 + [1] * 4},  # loss only past 8
    {"input_ids": list(range(1, 13)), "loss_mask": [0] * 7 + [1] * 5},  # keeps one loss token
    {"input_ids": [1, 2], "loss_mask": [0, 1]},
]


@pytest.mark.parametrize("skip", [True, False])
def test_truncate_drops_a_sample_it_would_leave_without_loss_tokens(
    tmp_path: Path, skip: bool, monkeypatch: pytest.MonkeyPatch
):
    spec = _spec(tmp_path / "out", kind="input_ids", seq_len=8, skip_bad_records=skip)
    real_read_records = tasks.read_records

    def per_record(f, *a, **kw):  # the parquet stays on the columnar path
        assert f.format != "parquet", "a clean table took the per-record path"
        return real_read_records(f, *a, **kw)

    monkeypatch.setattr(tasks, "read_records", per_record)
    code = REASONS.index("no_loss_after_truncate") + 1
    for f, (meta, block) in _both_paths(tmp_path, TRUNCATED_AWAY, spec):
        assert meta.status.tolist() == [code, 0, 0] and meta.lengths.tolist() == [0, 12, 2]
        (sid, location, reason, detail), *more = meta.examples
        assert not more and (sid, reason) == (100, "no_loss_after_truncate")
        assert location.endswith(
            f"{f.url.rsplit('/', 1)[1]}:{'row' if 'parquet' in f.url else 'line'} 1"
        )
        assert "first 8 of 12 tokens" in detail and "first loss token is at 8" in detail
        assert block.tokens.size == 14 and block.policy_tokens.tolist() == [12, 0, 0]
    # the scheduler fails a job on bad records only, never on what the policy dropped
    monkeypatch.setattr(tasks, "read_records", real_read_records)  # a bad record: per record
    (f, (meta, _)), _ = _both_paths(tmp_path, [*TRUNCATED_AWAY, {"input_ids": []}], spec)
    assert [e[2] for e in meta.examples] == ["empty_input_ids", "no_loss_after_truncate"]


@pytest.mark.parametrize("overlong", ["split", "drop"])
def test_other_overlong_policies_keep_their_own_accounting(tmp_path: Path, overlong: str):
    spec = _spec(tmp_path / "out", kind="input_ids", seq_len=8, overlong=overlong)
    for _, (meta, _) in _both_paths(tmp_path, TRUNCATED_AWAY, spec):
        assert not meta.status.any() and meta.lengths.tolist() == [12, 12, 2]
