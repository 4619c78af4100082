"""The pack job end to end on a real local Ray (one per module, 2 CPUs), run in-process through
`pipeline.pack.main`: real data, worker counts, shuffle, reruns, every bad input, S3 output."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from packshard.packers import ShardDataset
from packshard.pipeline.pack import main, start_local_ray
from packshard.pipeline.verify import verify_dataset
from tests.integration._http import serving

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


def run(*args: str) -> int:
    return main([*args, "--no-progress"])


def manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_text())


def fingerprint(out: Path) -> list[str]:
    m = manifest(out)
    return [s["checksum"] for s in m["shards"]] + [m["index"]["checksum"]]


def documents(
    url: str, storage_options: dict | None = None
) -> dict[int, tuple[list[int], list[bool]]]:
    """sample id -> (tokens, loss mask) of every document in the dataset (each id once)."""
    docs: dict[int, tuple[list[int], list[bool]]] = {}
    with ShardDataset.open(url, storage_options=storage_options) as ds:
        for s in range(len(ds.shards)):
            for batch in ds.iter_shard(s):
                for row in batch.to_pylist():
                    pos = 0
                    for sid, n in zip(row["sample_ids"], row["doc_lens"], strict=True):
                        assert sid not in docs, f"sample {sid} appears twice"
                        docs[sid] = (
                            row["input_ids"][pos : pos + n],
                            row["loss_mask"][pos : pos + n],
                        )
                        pos += n
    return docs


# ---- real data ------------------------------------------------------------------------------

REAL_INPUTS = [
    "gsm8k/test.jsonl",
    "chat/glaive_toolcall_en_demo.messages.jsonl",
    "chat/oasst_en_100_threads.messages.jsonl",
    "long_context/gutenberg/long_docs.jsonl",
    "long_context/agent_trajectories/swe_agent_trajectories.messages.jsonl",
]


def _real_args(shared: Path, out: Path, *extra: str) -> list[str]:
    args = []
    for rel in REAL_INPUTS:
        args += ["--input", str(shared / rel)]
    return [
        *args,
        "--output",
        str(out),
        "--tokenizer",
        str(shared / "tokenizers/qwen2.5-instruct"),
        "--columns",
        "prompt=question,completion=answer",
        "--seq-len",
        "32768",
        "--cp",
        "8",
        "--window",
        "4",
        "--shard-tokens",
        "250000",
        *extra,
    ]


@pytest.mark.shared
@pytest.mark.slow
def test_real_data_every_sample_once_with_its_exact_tokens_and_worker_count_changes_nothing(
    ray_local, shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from transformers import AutoTokenizer

    import packshard.pipeline.pack as pack

    monkeypatch.setenv("PACKSHARD_CACHE_DIR", str(tmp_path / "cache"))  # the first run loads
    out2, out1 = tmp_path / "w2", tmp_path / "w1"
    assert run(*_real_args(shared_data, out2, "--num-workers", "2")) == 0
    assert verify_dataset(str(out2)) == []
    m = manifest(out2)
    assert len(m["shards"]) >= 4
    assert m["config"]["tokenizer"]["fingerprint"].startswith("sha256:")
    # recorded by the directory's name, never the path as typed
    assert {k: v for k, v in m["config"]["tokenizer"].items() if k != "fingerprint"} == {
        "name": "qwen2.5-instruct",
        "source": "directory",
    }
    records = []
    for rel in REAL_INPUTS:
        with open(shared_data / rel) as f:
            records += [json.loads(line) for line in f]
    t = m["totals"]
    assert t["samples_in"] == len(records) == t["samples_kept"] and t["dropped"] == {}
    assert t["truncated_samples"] == 7  # every Gutenberg part is longer than 32768 tokens
    tok = AutoTokenizer.from_pretrained(str(shared_data / "tokenizers/qwen2.5-instruct"))
    docs = documents(str(out2))
    assert sorted(docs) == list(range(len(records)))
    for sid, rec in enumerate(records):
        if "question" in rec:
            chat = [
                {"role": "user", "content": rec["question"]},
                {"role": "assistant", "content": rec["answer"]},
            ]
            expect = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
        elif "messages" in rec:
            expect = tok.apply_chat_template(
                rec["messages"], tools=rec.get("tools"), tokenize=True, return_dict=False
            )
        else:
            expect = tok(rec["text"])["input_ids"] + [tok.eos_token_id]
        ids, mask = docs[sid]
        assert ids == list(expect)[:32768], sid
        assert 0 < sum(mask) <= len(mask)
        if "text" in rec:
            assert all(mask)
    # the same job on one worker writes the same bytes, with the tokenizer from the driver's
    # cache (loading it again would fail)
    monkeypatch.setattr(pack, "load_located", lambda *a: pytest.fail("tokenizer not cached"))
    assert run(*_real_args(shared_data, out1, "--num-workers", "1")) == 0
    assert fingerprint(out1) == fingerprint(out2)


# ---- built-in data: shuffle, reruns --------------------------------------------------------

DEMO = "demo://?num_math=400&num_trajectories=6"


def _demo_args(out: Path, *extra: str) -> list[str]:
    return [
        "--input",
        DEMO,
        "--tokenizer",
        "packshard:demo",
        "--output",
        str(out),
        "--seq-len",
        "16384",
        "--cp",
        "8",
        "--window",
        "2",
        "--shard-tokens",
        "40000",
        *extra,
    ]


def test_shuffle_is_seeded_worker_independent_and_keeps_every_sample(ray_local, tmp_path: Path):
    plain, a, b, c = (tmp_path / n for n in ("plain", "a", "b", "c"))
    assert run(*_demo_args(plain)) == 0
    assert run(*_demo_args(a, "--shuffle", "--seed", "7", "--num-workers", "1")) == 0
    assert run(*_demo_args(b, "--shuffle", "--seed", "7", "--num-workers", "2")) == 0
    assert run(*_demo_args(c, "--shuffle", "--seed", "8")) == 0
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    assert fingerprint(a) != fingerprint(plain)
    da, dp = documents(str(a)), documents(str(plain))
    assert da == dp  # same samples, same tokens, only their rows differ
    assert manifest(a)["config"]["seed"] == 7 and manifest(plain)["config"]["seed"] is None
    for out in (plain, a, c):
        assert verify_dataset(str(out)) == []


def test_rerun_is_a_no_op_other_config_is_refused_overwrite_replaces(
    ray_local, tmp_path: Path, capsys
):
    out = tmp_path / "out"
    assert run(*_demo_args(out)) == 0
    before = fingerprint(out)
    assert not (out / "_packshard").exists()  # job state is removed once committed
    capsys.readouterr()
    assert run(*_demo_args(out)) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert run(*_demo_args(out, "--overlong", "split")) == 1
    err = capsys.readouterr().err
    assert "different config" in err and "overlong" in err and "--overwrite" in err
    assert fingerprint(out) == before
    assert run(*_demo_args(out, "--seq-len", "8192", "--overwrite")) == 0
    assert manifest(out)["config"]["seq_len"] == 8192 and verify_dataset(str(out)) == []


def test_a_rerun_after_an_input_changed_names_the_file_and_the_change(
    ray_local, tmp_path: Path, capsys
):
    inp, out = tmp_path / "chats.jsonl", tmp_path / "out"
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    inp.write_text(json.dumps(chat) + "\n")
    args = ["--input", str(inp), "--output", str(out), "--tokenizer", "packshard:demo",
            "--seq-len", "1024", "--cp", "8", "--no-progress"]  # fmt: skip
    assert run(*args) == 0
    size = inp.stat().st_size
    with inp.open("a") as f:
        f.write(json.dumps(chat) + "\n")
    capsys.readouterr()
    assert run(*args) == 1
    err = capsys.readouterr().err
    assert f"input {inp}: changed since: {size} bytes then, {2 * size} now" in err, err
    assert "--overwrite" in err and '"bytes"' not in err


def test_overlong_split_and_drop_are_counted(ray_local, tmp_path: Path):
    split, drop = tmp_path / "split", tmp_path / "drop"
    args = [
        "--input",
        "demo://?num_math=50&num_trajectories=3",
        "--tokenizer",
        "packshard:demo",
        "--seq-len",
        "4096",
        "--cp",
        "8",
    ]
    assert run(*args, "--output", str(split), "--overlong", "split") == 0
    assert run(*args, "--output", str(drop), "--overlong", "drop") == 0
    ts, td = manifest(split)["totals"], manifest(drop)["totals"]
    assert ts["split_samples"] == 3 and ts["extra_pieces"] >= 3 and ts["samples_kept"] == 53
    assert (
        td["dropped"] == {"overlong": 3}
        and td["samples_kept"] == 50
        and td["dropped_tokens"] > 3 * 4096
    )
    assert verify_dataset(str(split)) == [] and verify_dataset(str(drop)) == []


# ---- bad input ---------------------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
BAD_LINES = {
    "malformed_json": b'{"messages": [1, }',
    "invalid_utf8": b'{"text": "caf\xe9"}',
    "missing_fields": b'{"question": "no mapping given"}',
    "empty_conversation": b'{"messages": []}',
    "unknown_role": b'{"messages": [{"role": "narrator", "content": "x"}]}',
    "no_loss_tokens": b'{"messages": [{"role": "user", "content": "only a question"}]}',
}


def _bad_file(tmp_path: Path, reason: str) -> Path:
    p = tmp_path / f"{reason}.jsonl"
    lines = [json.dumps(GOOD).encode()] * 3 + [BAD_LINES[reason]] + [json.dumps(GOOD).encode()] * 2
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


def _args(inp: Path | str, out: Path, *extra: str) -> list[str]:
    return [
        "--input",
        str(inp),
        "--output",
        str(out),
        "--tokenizer",
        "packshard:demo",
        "--seq-len",
        "1024",
        "--cp",
        "8",
        *extra,
    ]


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_a_bad_record_fails_the_job_naming_file_line_and_reason(
    ray_local, tmp_path: Path, capsys, reason: str
):
    path = _bad_file(tmp_path, reason)
    assert run(*_args(path, tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert f"{path}:line 4: {reason}" in err and "--skip-bad-records" in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_skip_bad_records_counts_every_reason_in_the_manifest(ray_local, tmp_path: Path):
    inputs = []
    for reason in sorted(BAD_LINES):
        inputs += ["--input", str(_bad_file(tmp_path, reason))]
    out = tmp_path / "out"
    assert run(*inputs, *_args(inputs[1], out, "--skip-bad-records")[2:]) == 0
    m = manifest(out)
    assert m["totals"]["dropped"] == dict.fromkeys(sorted(BAD_LINES), 1)
    assert m["totals"]["samples_in"] == 6 * len(BAD_LINES) and m["totals"][
        "samples_kept"
    ] == 5 * len(BAD_LINES)
    examples = {e[2]: e[1] for e in m["skipped_examples"]}
    assert examples["malformed_json"].endswith("malformed_json.jsonl:line 4")
    # sample ids count skipped records too: the bad line of the 2nd file is id 6 + 3
    kept = sorted(documents(str(out)))
    assert 3 not in kept and 9 not in kept and 10 in kept
    assert verify_dataset(str(out)) == []


def test_all_records_bad_is_an_error_even_when_skipping(ray_local, tmp_path: Path, capsys):
    p = tmp_path / "all_bad.jsonl"
    p.write_bytes(BAD_LINES["empty_conversation"] + b"\n")
    assert run(*_args(p, tmp_path / "out", "--skip-bad-records")) == 1
    err = capsys.readouterr().err
    # the reasons are in the message itself (it used to point at "the reasons above": none)
    assert "nothing to pack: all 1 samples were dropped: empty_conversation 1" in err
    assert f"{p}:line 1: empty_conversation: " in err


# Unusable inputs, tokenizers, outputs and flag values fail before Ray starts, so their tests
# run without Ray: tests/pipeline/test_preflight.py.


def test_formats_mix_in_one_job(ray_local, tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode() * 5))
    pq.write_table(
        pa.Table.from_pylist([{"prompt": f"q{i}", "completion": "a" * i} for i in range(1, 6)]),
        tmp_path / "b.parquet",
    )
    (tmp_path / "c.json").write_text(
        json.dumps([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}] * 5)
    )
    out = tmp_path / "out"
    assert run("--input", str(tmp_path / "*.*"), *_args(tmp_path / "a.jsonl.gz", out)[2:]) == 0
    docs = documents(str(out))
    assert sorted(docs) == list(range(15))
    assert docs[12] == ([5, 6, 7], [False, True, True])


# ---- S3 ------------------------------------------------------------------------------------------


@pytest.mark.s3
def test_s3_input_and_output_on_a_real_s3_server(ray_local, s3_server, s3_bucket, tmp_path: Path):
    import fsspec

    opts = s3_server["storage_options"]
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe(f"{s3_bucket}/raw/part-0.jsonl", (json.dumps(GOOD) + "\n").encode() * 40)
    fs.pipe(f"{s3_bucket}/raw/part-1.jsonl", b'{"text": "hello world"}\n' * 40)
    flags = [f"--storage-option={k}={v}" for k, v in opts.items()]
    url = f"s3://{s3_bucket}/packed/run1"
    args = [
        "--input",
        f"s3://{s3_bucket}/raw/*.jsonl",
        "--output",
        url,
        "--tokenizer",
        "packshard:demo",
        "--seq-len",
        "1024",
        "--cp",
        "8",
        "--shard-tokens",
        "600",
        "--window",
        "1",
        *flags,
    ]
    assert run(*args) == 0
    assert verify_dataset(url, storage_options=opts) == []
    m = json.loads(fs.cat(f"{s3_bucket}/packed/run1/manifest.json"))
    assert m["totals"]["samples_in"] == 80 and len(m["shards"]) >= 2
    assert not fs.exists(f"{s3_bucket}/packed/run1/_packshard")
    docs = documents(url, opts)
    from packshard.pipeline.tokenization import load_tokenizer

    eos = load_tokenizer("packshard:demo").eos_token_id
    assert sorted(docs) == list(range(80))
    assert docs[40] == ([*b"hello world", eos], [True] * 12)


# ---- secrets in input URLs -------------------------------------------------------------------


@pytest.fixture
def http_dir(tmp_path: Path):
    """(directory, host:port) of a local HTTP server over a directory (tests/integration/_http)."""
    root = tmp_path / "www"
    root.mkdir()
    with serving(root) as (host, _):
        yield root, host


def test_credentials_and_signatures_are_never_written_or_printed(
    ray_local, http_dir, tmp_path: Path, capsys, caplog
):
    """User info and query strings of input URLs appear in no message, log line, job state,
    manifest (config.inputs, skipped_examples), index or shard; a signed URL (its "?") reads as
    one file; a new signature for the same file resumes / finds the dataset complete."""
    from packshard.pipeline.cli import main as cli_main

    root, host = http_dir
    (root / "bad.jsonl").write_bytes(_bad_file(tmp_path, "malformed_json").read_bytes())
    (root / "good.jsonl").write_bytes((json.dumps(GOOD) + "\n").encode() * 4)

    def inputs(sig: str) -> list[str]:
        return [
            "--input", f"http://user:SECRET@{host}/bad.jsonl?sig=SECRET",
            "--input", f"http://{host}/good.jsonl?X-Amz-Signature={sig}&X-Amz-Expires=60",
        ]  # fmt: skip

    out = tmp_path / "out"
    rest = _args("x", out)[2:]

    def assert_clean() -> str:
        seen = capsys.readouterr()
        text = seen.out + seen.err + caplog.text
        assert "SECRET" not in text
        for p in out.rglob("*"):
            if p.is_file():
                assert b"SECRET" not in p.read_bytes(), p
        return text

    assert run(*inputs("SECRET"), *rest) == 1  # the bad record, no --skip-bad-records
    text = assert_clean()
    assert f"http://{host}/bad.jsonl:line 4: malformed_json" in text
    assert (out / "_packshard" / "plan.json").exists()

    assert run(*inputs("SECRET"), *rest, "--skip-bad-records") == 0  # replaces the shardless job
    text = assert_clean()
    assert f"http://{host}/bad.jsonl:line 4: malformed_json" in text  # the summary lists it
    m = manifest(out)
    assert [i["url"] for i in m["config"]["inputs"]] == [
        f"http://{host}/bad.jsonl",
        f"http://{host}/good.jsonl",
    ]
    assert m["totals"]["samples_in"] == 6 + 4 and m["totals"]["dropped"] == {"malformed_json": 1}
    assert m["skipped_examples"][0][1] == f"http://{host}/bad.jsonl:line 4"
    assert cli_main(["stats", str(out)]) == 0
    assert f"http://{host}/bad.jsonl:line 4: malformed_json" in assert_clean()

    assert run(*inputs("SECRET-RENEWED"), *rest, "--skip-bad-records") == 0
    assert "nothing to do" in assert_clean()
