"""Flags -> PackConfig validation, and how a rerun treats what the output already holds."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from packshard.pipeline.config import config_from_args
from packshard.pipeline.jobstate import (
    OutputError,
    check_output,
    check_writable,
    clear_output,
    config_diff,
    inspect_output,
    marker_path,
    write_plan,
)

BASE = [
    "--input",
    "x.jsonl",
    "--output",
    "out",
    "--tokenizer",
    "t",
    "--seq-len",
    "4096",
    "--cp",
    "8",
]


def test_defaults_and_demo():
    cfg = config_from_args(BASE)
    assert cfg.pad_multiple == 8 and cfg.window_tokens == 128 * 4096 and cfg.overlong == "truncate"
    demo = config_from_args(["--demo", "--output", "o"])
    assert demo.inputs == ("demo://",) and demo.tokenizer == "packshard:demo"
    assert (demo.seq_len, demo.cp) == (32768, 8)
    assert (
        config_from_args(["--demo", "--output", "o", "--seq-len", "1024", "--cp", "2"]).seq_len
        == 1024
    )


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--pad-multiple", "48"], "--seq-len 4096 is not a multiple of --pad-multiple 48"),
        (["--cp", "0"], "--cp=0 is not valid"),
        (["--loss-roles", "wizard"], "--loss-roles"),
        (["--window", "0"], "--window=0"),
        # shards store lengths and ids as int32: refused here, not as a numpy error after Ray
        (
            ["--pad-token-id", "3000000000"],
            r"--pad-token-id=3000000000 is not valid: a token id in \[0, 2,147,483,647\]",
        ),
        (["--pad-token-id", "-1"], "--pad-token-id=-1 is not valid"),
        (["--seq-len", str(2**32)], r"--seq-len=4294967296 is not valid: at most 2,147,483,647"),
    ],
)
def test_bad_values_name_the_flag(extra, match):
    with pytest.raises(ValueError, match=match):
        config_from_args(BASE + extra)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        config_from_args(["--output", "o", "--seq-len", "8"])
    assert e.value.code == 2 and "--input" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_args(["--demo", "--output", "o", "--input", "x"])


def test_zigzag_pad_multiple_and_tokenizerless_pretokenized():
    cfg = config_from_args([*BASE, "--pad-multiple", "16"])
    assert cfg.pad_multiple == 16
    one = ["--input", "x", "--output", "o", "--tokenizer", "t", "--seq-len", "63", "--cp", "1"]
    # one CP rank splits nothing: zigzag at cp 1 takes any pad multiple (the stream agrees)
    assert (
        config_from_args([*one, "--cp-layout", "zigzag", "--pad-multiple", "1"]).pad_multiple == 1
    )
    with pytest.raises(ValueError, match="--pad-multiple 3 does not suit --cp 2"):
        config_from_args([*one[:-1], "2", "--seq-len", "66", "--pad-multiple", "3"])
    with pytest.raises(ValueError, match="--tokenizer"):
        config_from_args(["--input", "x", "--output", "o", "--seq-len", "64", "--cp", "8"])
    assert (
        config_from_args(
            ["--input", "x", "--output", "o", "--seq-len", "64", "--cp", "8", "--pad-token-id", "0"]
        ).tokenizer
        is None
    )


CONFIG = {
    "seq_len": 4096,
    "inputs": [{"url": "a", "bytes": 3, "version": "m=1", "records": 10}],
    "packing": {"window": 128},
}


def _fs(tmp_path: Path):
    return fsspec.filesystem("file"), str(tmp_path / "out")


def test_fresh_then_resume_then_complete(tmp_path: Path):
    fs, root = _fs(tmp_path)
    check_writable(fs, root, root)
    assert inspect_output(fs, root, root, CONFIG, overwrite=False).status == "fresh"
    write_plan(fs, root, {"config": CONFIG, "inputs": []})
    Path(marker_path(root, 0)).write_text(json.dumps({"plan": {"number": 0}}))
    Path(marker_path(root, 1)).write_text("{not json")
    state = inspect_output(fs, root, root, CONFIG, overwrite=False)
    assert state.status == "resume" and list(state.markers) == [
        0
    ]  # the unreadable marker is redone
    (Path(root) / "manifest.json").write_text(json.dumps({"config": CONFIG}))
    # records are compared only once counted: a config without them matches
    uncounted = {
        **CONFIG,
        "inputs": [{k: v for k, v in CONFIG["inputs"][0].items() if k != "records"}],
    }
    assert inspect_output(fs, root, root, uncounted, overwrite=False).status == "complete"


def test_different_config_is_refused_unless_overwrite(tmp_path: Path):
    fs, root = _fs(tmp_path)
    check_writable(fs, root, root)
    write_plan(fs, root, {"config": CONFIG, "inputs": []})
    Path(marker_path(root, 0)).write_text(json.dumps({"plan": {"number": 0}}))
    other = {**CONFIG, "seq_len": 8192}
    with pytest.raises(OutputError, match=r"seq_len: 4096 \(existing\) vs 8192 \(this run\)") as e:
        inspect_output(fs, root, root, other, overwrite=False)
    assert "1 verified shard(s)" in str(e.value) and "pass --overwrite" in str(e.value)
    changed = {**CONFIG, "inputs": [{**CONFIG["inputs"][0], "version": "m=2"}]}
    with pytest.raises(OutputError, match="inputs"):
        inspect_output(fs, root, root, changed, overwrite=False)
    (Path(root) / "keep.txt").write_text("not ours")
    assert inspect_output(fs, root, root, other, overwrite=True).status == "fresh"
    assert sorted(p.name for p in Path(root).iterdir()) == [
        "keep.txt"
    ]  # only our files were removed


def test_an_unfinished_job_that_wrote_no_shard_is_replaced(tmp_path: Path, caplog):
    """A job that failed before its first shard (a bad record, say) is replaced by the rerun
    with the fix its error suggested, without --overwrite: nothing verified is lost."""
    fs, root = _fs(tmp_path)
    write_plan(fs, root, {"config": CONFIG, "inputs": []})
    fixed = {**CONFIG, "samples": {"skip_bad_records": True}}
    assert inspect_output(fs, root, root, fixed, overwrite=False).status == "fresh"
    assert not (Path(root) / "_packshard").exists()
    assert "replacing the unfinished pack job" in caplog.text and "wrote no shards" in caplog.text


def test_a_directory_of_other_files_is_refused(tmp_path: Path):
    """Whatever the flags (check_output takes none: --overwrite never deletes others' files)."""
    fs, root = _fs(tmp_path)
    Path(root).mkdir(parents=True)
    (Path(root) / "notes.txt").write_text("mine")
    with pytest.raises(
        OutputError, match=r"is not empty and holds no packshard dataset \(notes.txt\)"
    ):
        check_output(fs, root, root)
    assert sorted(p.name for p in Path(root).iterdir()) == ["notes.txt"]  # no probe left behind
    (Path(root) / "notes.txt").unlink()
    check_output(fs, root, root)  # empty: fine
    write_plan(fs, root, {"config": CONFIG, "inputs": []})
    (Path(root) / "lengths.png").write_bytes(b"x")  # the user's file beside our own dataset
    check_output(fs, root, root)


def test_output_that_is_a_file_is_refused(tmp_path: Path):
    (tmp_path / "out.jsonl").write_text("{}")
    fs, _ = _fs(tmp_path)
    with pytest.raises(OutputError, match="is a file"):
        check_output(fs, str(tmp_path / "out.jsonl"), "out.jsonl")


def test_foreign_shards_are_refused(tmp_path: Path):
    fs, root = _fs(tmp_path)
    (Path(root) / "shards").mkdir(parents=True)
    (Path(root) / "shards" / "part-00000.arrow").write_bytes(b"x")
    with pytest.raises(OutputError, match="no packshard job state"):
        inspect_output(fs, root, root, CONFIG, overwrite=False)
    clear_output(fs, root)
    assert not list((Path(root) / "shards").iterdir())


def test_others_files_inside_shards_are_refused_whatever_the_flags(tmp_path: Path):
    """--overwrite deletes only shards (part-NNNNN.arrow): another file in OUT/shards/ would end
    up inside the dataset."""
    fs, root = _fs(tmp_path)
    (Path(root) / "shards").mkdir(parents=True)
    (Path(root) / "shards" / "part-00000.arrow").write_bytes(b"x")
    (Path(root) / "shards" / "part-00001.arrow.tmp").write_bytes(b"x")  # a write in flight
    check_output(fs, root, root)  # shards only: inspect_output asks for --overwrite
    (Path(root) / "shards" / "mydata.csv").write_text("precious")
    with pytest.raises(
        OutputError, match=r"is not empty and holds no packshard dataset \(shards/mydata.csv\)"
    ):
        check_output(fs, root, root)
    assert (Path(root) / "shards" / "mydata.csv").read_text() == "precious"


def test_unwritable_output_is_refused_before_any_work(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text(
        "x"
    )  # a file where the output directory's parent should be (fails even as root)
    with pytest.raises(OutputError, match="is not writable"):
        check_writable(fsspec.filesystem("file"), str(blocker / "out"), str(blocker / "out"))


def test_config_diff_names_nested_keys():
    assert config_diff({"a": {"b": 1}}, {"a": {"b": 2}}) == ["a.b: 1 (existing) vs 2 (this run)"]


def test_config_diff_names_each_changed_input_file():
    a = {"url": "s3://b/a.jsonl", "bytes": 100, "version": "ETag=1"}
    b = {"url": "s3://b/b.jsonl", "bytes": 50, "version": "ETag=2"}
    c = {"url": "s3://b/c.jsonl", "bytes": 7, "version": "ETag=3"}
    grown = {**a, "bytes": 120, "version": "ETag=9"}
    assert config_diff({"inputs": [a, b]}, {"inputs": [grown, c]}) == [
        "input s3://b/b.jsonl: not an input of this run",
        "input s3://b/c.jsonl: not an input of the existing one",
        "input s3://b/a.jsonl: changed since: 100 bytes then, 120 now",
    ]
    touched = {**a, "version": "mtime=2"}
    assert config_diff({"inputs": [a]}, {"inputs": [touched]}) == [
        "input s3://b/a.jsonl: changed since: version ETag=1 then, mtime=2 now"
    ]
    assert config_diff({"inputs": [a, b]}, {"inputs": [b, a]}) == [
        "inputs: the same files in another order (it decides the rows' order)"
    ]
    assert config_diff({"inputs": [a]}, {"inputs": [a]}) == []
    assert config_diff({"inputs": [a, b]}, {"inputs": [a, a, b]}) == [
        "inputs: the same files, 2 listed then, 3 now"
    ]


def test_shards_smaller_than_a_window_are_warned_about():
    base = ["--input", "x.jsonl", "--output", "o", "--tokenizer", "t", "--seq-len", "1024", "--cp", "8"]  # fmt: skip
    assert config_from_args(base).warnings() == []
    huge = [*base[:7], "524288", *base[8:]]  # the default shard size below one window of 512K
    assert config_from_args(huge).warnings() == []
    (w,) = config_from_args([*base, "--shard-tokens", "1000", "--window", "4"]).warnings()
    assert w.startswith("--shard-tokens 1,000 is below one packing window (--window 4 rows x")


def test_python_literals_in_key_values_read_as_json_ones():
    """`--template-kwarg enable_thinking=False` was the string 'False', which a chat template
    takes as true; `--storage-option anon=False` the same for a filesystem."""
    from packshard.pipeline.options import parse_key_values

    got = parse_key_values(["a=False", "b=True", "c=None", "d=false", "e=1", "f=Falsey", "g=x=y"])
    assert got == {"a": False, "b": True, "c": None, "d": False, "e": 1, "f": "Falsey", "g": "x=y"}
    cfg = config_from_args([*BASE, "--template-kwarg", "enable_thinking=False"])
    assert cfg.template_kwargs == {"enable_thinking": False}


def test_a_malformed_storage_option_is_not_echoed():
    """`--storage-option secret:VALUE` (a ":" for the "=") would print the secret."""
    from packshard.pipeline.options import parse_key_values

    for pair, said in (("secret:S3CRET", "without '='"), ("=S3CRET", "without a key")):
        with pytest.raises(ValueError) as e:
            parse_key_values([pair])
        assert said in str(e.value) and "S3CRET" not in str(e.value)
    with pytest.raises(ValueError, match="got 'enable_thinking'"):  # no secret: shown
        parse_key_values(["enable_thinking"], flag="--template-kwarg")
