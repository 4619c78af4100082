"""Every user error of the pack job fails before Ray starts: one line naming the input, column,
tokenizer or output and the fix, with neither Ray nor transformers imported (each case runs the
job's `main` in a fresh process and lists what it imported)."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from packshard.pipeline.config import config_from_args
from packshard.pipeline.inputs import InputError
from packshard.pipeline.preflight import preflight

HEAVY = ("ray", "transformers", "torch")
PROBE = (
    "import sys\n"
    "from packshard.pipeline.pack import main\n"
    "rc = main(sys.argv[1:])\n"
    f"print('IMPORTED', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    "sys.exit(rc)\n"
)
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "a",
    "AWS_SECRET_ACCESS_KEY": "b",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def pack(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit status, stderr) of the pack job run in a fresh process; asserts it imported neither
    Ray nor transformers (so neither started) and printed its error as one line."""
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *args, "--no-progress"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    assert r.stdout.strip().endswith("IMPORTED []"), (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    return r.returncode, errors[0]


@pytest.fixture
def good(tmp_path: Path) -> Path:
    p = tmp_path / "good.jsonl"
    p.write_text(json.dumps(CHAT) + "\n")
    return p


def args(
    inp: Path | str, out: Path | str, *extra: str, tokenizer: str = "packshard:demo"
) -> list[str]:
    return [
        "--input", str(inp), "--output", str(out), "--tokenizer", tokenizer,
        "--seq-len", "64", "--cp", "2", *extra,
    ]  # fmt: skip


def test_mistyped_tokenizer_directory(tmp_path: Path, good: Path):
    (tmp_path / "tokenizers" / "qwen2.5-instruct").mkdir(parents=True)
    (tmp_path / "tokenizers" / "qwen2.5-instruct" / "tokenizer.json").write_text("{}")
    typo = str(tmp_path / "tokenizers" / "qwen25-instruct")
    rc, err = pack(*args(good, tmp_path / "out", tokenizer=typo))
    assert rc == 1 and f"tokenizer directory '{typo}' does not exist; did you mean" in err
    assert "qwen2.5-instruct" in err and "Repo id" not in err
    assert not (tmp_path / "out").exists()  # the refused job leaves no empty output behind
    (tmp_path / "mine").mkdir()  # ... and a directory that was there stays
    assert pack(*args(good, tmp_path / "mine", tokenizer=typo))[0] == 1
    assert (tmp_path / "mine").is_dir()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_chats_with_a_tokenizer_without_a_chat_template(tmp_path: Path, good: Path, fmt: str):
    tok = tmp_path / "base-model"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")  # located only: preflight loads nothing
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    inp = good
    if fmt == "parquet":
        inp = tmp_path / "chats.parquet"
        pq.write_table(pa.Table.from_pylist([CHAT]), inp)
    rc, err = pack(*args(inp, tmp_path / "out", tokenizer=str(tok)))
    assert rc == 1 and f"the tokenizer '{tok}' has no chat template, and chats need one" in err
    assert (
        "line 1: the record is a chat" if fmt == "jsonl" else "holds chats (column 'messages')"
    ) in err
    # with one (as a chat_template.jinja file, transformers 5's layout) the check passes
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    from packshard.pipeline.preflight import has_chat_template
    from packshard.pipeline.tokenizer_loading import locate_tokenizer

    assert has_chat_template(locate_tokenizer(str(tok), None)) is True


def test_hub_name_offline_and_not_cached(tmp_path: Path, good: Path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    rc, err = pack(*args(good, tmp_path / "out", tokenizer="Qwen/Qwen3-8B"), env=env)
    assert rc == 1 and "not in the Hugging Face cache and HF_HUB_OFFLINE is set" in err


def test_hub_that_cannot_be_reached(tmp_path: Path, good: Path):
    env = {
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
    }
    rc, err = pack(*args(good, tmp_path / "out", tokenizer="Qwen/Qwen3-8B"), env=env)
    assert rc == 1 and "the Hugging Face hub cannot be reached" in err


@pytest.mark.parametrize(
    ("output", "extra", "match"),
    [
        ("http://127.0.0.1:{port}/out", (), "fsspec's http:// filesystem cannot write files"),
        ("ftp://127.0.0.1:{port}/out", (), "cannot open its filesystem (ConnectionRefusedError"),
        (
            "s3://bucket/out",
            ("--storage-option", "client_kwargs=notjson"),
            "client_kwargs=... must be a JSON object",
        ),
    ],
)
def test_outputs_a_filesystem_cannot_use_are_one_line(
    tmp_path: Path, good: Path, output: str, extra: tuple[str, ...], match: str
):
    """fsspec's http filesystem cannot write (NotImplementedError), ftp connects when it is
    made (ConnectionRefusedError), s3fs takes a string for a dict until its first request."""
    rc, err = pack(*args(good, output.format(port=_closed_port()), *extra))
    assert rc in (1, 2) and match in err


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", b"", "is empty (0 bytes)"),
        ("blank.jsonl", b"\n\n  \n", "holds no records"),
        ("bad.parquet", b"nope", "unreadable parquet input"),
        ("x.jsonl.gz", b"not gzip", "unreadable jsonl input"),
        ("notes.md", b"# hi", "unsupported file type"),
    ],
)
def test_unusable_inputs(tmp_path: Path, name: str, data: bytes | None, match: str):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    rc, err = pack(*args(path, tmp_path / "out"))
    assert rc == 1 and match in err and str(path) in err


@pytest.mark.parametrize(
    ("name", "compress", "found", "fix"),
    [
        ("chats.jsonl", gzip.compress, "gzip", "name it with .gz at the end (e.g. x.jsonl.gz)"),
        (
            "chats.json",
            lambda b: zstandard.ZstdCompressor().compress(b),
            "zstd",
            "(e.g. x.json.zst)",
        ),
        ("chats.jsonl", lambda b: b"\xfd7zXZ\x00" + b"\x00" * 20, "xz", "decompress it"),
        ("lines.txt", lambda b: b"BZh91AY&SY" + b"\x00" * 20, "bzip2", "decompress it"),
    ],
)
@pytest.mark.parametrize("skip", [False, True])
def test_compressed_data_in_a_plain_name(
    tmp_path: Path, name: str, compress, found: str, fix: str, skip: bool
):
    """Read as text, a compressed file is a few bad lines instead of its records (silently
    dropped under --skip-bad-records): refused before Ray, whatever --skip-bad-records says."""
    path = tmp_path / name
    path.write_bytes(compress((json.dumps(CHAT) + "\n").encode() * 50))
    extra = ("--skip-bad-records",) if skip else ()
    rc, err = pack(*args(path, tmp_path / "out", *extra))
    plain = name.rsplit(".", 1)[1]
    assert (
        rc == 1 and f"{path}: holds {found}-compressed data, but its name says plain {plain}" in err
    )
    assert fix in err


def test_output_inside_an_input_directory(tmp_path: Path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(json.dumps(CHAT) + "\n")
    for out in (tmp_path / "in" / "packed", tmp_path / "in"):  # below it, or the directory
        rc, err = pack(*args(tmp_path / "in", out))
        assert rc == 1 and f"output {out} lies inside input '{tmp_path / 'in'}'" in err
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["a.jsonl"]  # nothing created


def test_what_a_directory_or_glob_leaves_out_and_twice_listed_files_are_named(
    tmp_path: Path, caplog
):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    for name in (
        "a.jsonl",
        "B.JSONL",
        "sub/e.json",
        "c.jsonl.bz2",
        "d.csv",
        ".hidden.jsonl",
        "_x.jsonl",
    ):
        (d / name).write_text(json.dumps([CHAT] if name.endswith(".json") else CHAT) + "\n")
    caplog.set_level("WARNING")
    cfg = config_from_args(args(d, tmp_path / "out", "--input", str(d / "a.jsonl")))
    checked = preflight(cfg)
    assert [Path(f.url).name for f in checked.files] == ["B.JSONL", "a.jsonl", "e.json", "a.jsonl"]
    text = caplog.text
    assert f"input {d}: ignored 4 of its 7 files: " in text
    for name, why in [
        ("_x.jsonl", "hidden"),
        (".hidden.jsonl", "hidden"),
        ("c.jsonl.bz2", "not a type"),
        ("d.csv", "not a type"),
    ]:
        assert f"{name} ({why}" in text
    assert f"input file {d / 'a.jsonl'} is listed 2 times by --input" in text
    caplog.clear()
    # a glob reads what it names, hidden names too (its files only: not sub/)
    checked = preflight(config_from_args(args(str(d / "*"), tmp_path / "out")))
    assert [Path(f.url).name for f in checked.files] == [
        ".hidden.jsonl",
        "B.JSONL",
        "_x.jsonl",
        "a.jsonl",
    ]
    assert (
        f"input {d}/*: ignored 2 of its 6 files: {d}/c.jsonl.bz2 (not a type packshard reads), "
        f"{d}/d.csv (not a type packshard reads) (packshard reads" in caplog.text
    )


def test_files_inside_a_directorys_hidden_directories_are_left_out_and_named(
    tmp_path: Path, caplog
):
    """Notebook checkpoints and Spark's partial outputs are copies or leftovers: packing them
    would pack their records a second time."""
    d = tmp_path / "in"
    for name in ("a.jsonl", ".ipynb_checkpoints/a-checkpoint.jsonl", "_temporary/0/part-0.jsonl"):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(CHAT) + "\n")
    caplog.set_level("WARNING")
    checked = preflight(config_from_args(args(d, tmp_path / "out")))
    assert [Path(f.url).name for f in checked.files] == ["a.jsonl"]
    assert (
        f"input {d}: ignored 2 of its 3 files: .ipynb_checkpoints/a-checkpoint.jsonl (hidden), "
        "_temporary/0/part-0.jsonl (hidden)" in caplog.text
    )


def test_parquet_without_sample_columns_names_the_columns_it_has(tmp_path: Path):
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), path)
    for extra in ((), ("--skip-bad-records",)):  # skipping would drop every record: refused too
        rc, err = pack(*args(path, tmp_path / "out", *extra))
        assert rc == 1 and "its columns are ['answer', 'question']" in err and "--columns" in err
    rc, err = pack(*args(path, tmp_path / "out", "--columns", "prompt=question,completion=ans"))
    assert rc == 1 and "packshard reads one of [messages, question, ans, input_ids, text]" in err


def test_json_lines_without_sample_fields(tmp_path: Path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    rc, err = pack(*args(path, tmp_path / "out"))
    assert rc == 1 and f"{path}:line 1: missing_fields" in err
    assert "the record has ['answer', 'question']" in err and "--columns" in err


def test_first_record_without_fields_passes_the_check_when_skipping(tmp_path: Path, good: Path):
    """With --skip-bad-records a JSON-lines record is one record to skip, not a column error."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"question": "a"}) + "\n" + json.dumps(CHAT) + "\n")
    out = tmp_path / "out"
    cfg = config_from_args(args(path, out, "--skip-bad-records"))
    assert [f.display for f in preflight(cfg).files] == [str(path)]
    with pytest.raises(InputError, match="missing_fields"):
        preflight(config_from_args(args(path, out)))


def test_an_earlier_malformed_first_line_is_reported_before_a_later_files_error(
    tmp_path: Path, good: Path
):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("{not json\n" + json.dumps(CHAT) + "\n")
    (tmp_path / "in" / "b.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"a\.jsonl:line 1: malformed_json"):
        preflight(config_from_args(args(tmp_path / "in" / "*.jsonl", out)))
    # the first input's first line is the first record of all: reported before Ray starts
    with pytest.raises(InputError, match=r"a\.jsonl:line 1: malformed_json.*\n\(pass --skip-bad"):
        preflight(config_from_args(args(tmp_path / "in" / "a.jsonl", out)))
    preflight(config_from_args(args(tmp_path / "in" / "a.jsonl", out, "--skip-bad-records")))
    # a later file's malformed first line is the job's to report: an earlier record may be bad
    (tmp_path / "c.jsonl").write_text(json.dumps(CHAT) + "\n")
    cfg = [*args(tmp_path / "c.jsonl", out), "--input", str(tmp_path / "in" / "a.jsonl")]
    preflight(config_from_args(cfg))


def test_output_that_holds_other_files(tmp_path: Path, good: Path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):
        rc, err = pack(*args(good, out, *extra))
        assert rc == 1 and "is not empty and holds no packshard dataset (notes.txt)" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_ctrl_c_while_ray_starts_leaves_no_empty_output(
    tmp_path: Path, good: Path, monkeypatch, capsys
):
    """The checks create OUT; a job stopped before it wrote anything (Ctrl-C while the local
    Ray starts) removes it again, as a refused one does (stats would call it empty)."""
    import packshard.pipeline.pack as pack_module

    def interrupted(cfg: object) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(pack_module, "start_ray", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack_module.run(config_from_args([*args(good, tmp_path / "out"), "--no-progress"]))
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()  # an OUT the user made stays
    with pytest.raises(KeyboardInterrupt):
        pack_module.run(config_from_args([*args(good, tmp_path / "mine"), "--no-progress"]))
    assert (tmp_path / "mine").is_dir()


def test_relative_output_of_a_submitted_ray_job(tmp_path: Path, good: Path, monkeypatch):
    """Under `ray job submit` the entrypoint runs in Ray's copy of the working directory: a
    relative local OUT would land there (and each node's tasks in their own copy). Refused
    before anything is created; absolute paths, and relative ones outside a submitted job, pass."""
    monkeypatch.chdir(tmp_path)
    shipped = {"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}, "metadata": {}}
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(shipped)}
    for out in ("packed/run1", "./packed/run1", "file://packed/run1"):
        rc, err = pack(*args(good, out), env=job)
        assert rc == 1 and f"output {out} is a relative path, and this job was submitted" in err
        assert f"Ray's copy of the working directory ({tmp_path})" in err
    bare = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {}, "metadata": {}})}
    rc, err = pack(*args(good, "packed/run1"), env=bare)  # no --working-dir: no copy to name
    assert rc == 1 and f"the job's directory on the head node ({tmp_path}), not where" in err
    assert not (tmp_path / "packed").exists()
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", job["RAY_JOB_CONFIG_JSON_ENV_VAR"])
    preflight(config_from_args(args(good, tmp_path / "abs")))
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    preflight(config_from_args(args(good, "rel")))
    assert (tmp_path / "rel").is_dir() and (tmp_path / "abs").is_dir()


def test_shards_the_driver_cannot_see_are_not_committed(tmp_path: Path, monkeypatch):
    """A local OUT that each node of a cluster has on its own disk gets shards scattered over
    the nodes: the commit checks that every shard is at OUT, at its size, as the driver sees it."""
    from types import SimpleNamespace

    import fsspec

    from packshard.pipeline.jobstate import OutputError
    from packshard.pipeline.pack import _check_shards_visible

    fs = fsspec.filesystem("file")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "part-00000.arrow").write_bytes(b"x" * 10)
    (tmp_path / "shards" / "part-00002.arrow").write_bytes(b"x" * 9)  # another size
    shards = [SimpleNamespace(path=f"shards/part-0000{n}.arrow", bytes=10) for n in range(3)]
    two_nodes = [{"node_id": "a"}, {"node_id": "b"}]
    with pytest.raises(OutputError, match=r"2 of the 3 shards .* \(first: shards/part-00001"):
        _check_shards_visible(fs, str(tmp_path), "/out", shards, two_nodes)
    with pytest.raises(OutputError, match="tasks ran on 2 nodes; a local path is each node's"):
        _check_shards_visible(fs, str(tmp_path), "/out", shards, two_nodes)
    _check_shards_visible(fs, str(tmp_path), "/out", shards[:1], two_nodes)
    real_ls = fs.ls  # a listing that lags (NFS caches directory contents): asked by name

    def lagging(path: str, detail: bool = True) -> list:
        return [e for e in real_ls(path, detail=True) if "00000" not in e["name"]]

    monkeypatch.setattr(fs, "ls", lagging)
    dropped: list[str] = []  # s3fs and gcsfs answer ls and info from a cache: dropped first
    monkeypatch.setattr(fs, "invalidate_cache", dropped.append)
    _check_shards_visible(fs, str(tmp_path), "/out", shards[:1], two_nodes)
    assert dropped == [f"{tmp_path}/shards"]
    monkeypatch.undo()
    with pytest.raises(OutputError, match="another process may have removed them"):
        _check_shards_visible(fs, str(tmp_path / "none"), "/out", shards[:1], two_nodes[:1])


def test_output_that_cannot_be_written(tmp_path: Path, good: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, err = pack(*args(good, blocker / "out"))
    assert rc == 1 and f"output {blocker / 'out'} is not writable (" in err


@pytest.mark.s3
def test_output_on_an_unreachable_s3_endpoint_is_one_line(tmp_path: Path, good: Path):
    endpoint = f"endpoint_url=http://127.0.0.1:{_closed_port()}"
    rc, err = pack(*args(good, "s3://bucket/out", "--storage-option", endpoint), env=DUMMY_AWS)
    # refused at the TCP connect, before any S3 request (botocore and s3fs retry those for 5-10 s)
    assert (
        rc == 1
        and "output s3://bucket/out is not writable (cannot connect to its endpoint http://127.0.0.1:"
        in err
    )
    assert len(err.strip().splitlines()) == 1


@pytest.mark.s3
def test_input_on_an_unreachable_s3_endpoint_is_one_line(tmp_path: Path):
    endpoint = f"endpoint_url=http://user:SECRET@127.0.0.1:{_closed_port()}"
    rc, err = pack(
        *args("s3://bucket/data/*.jsonl", tmp_path / "out", "--storage-option", endpoint),
        env=DUMMY_AWS,
    )
    # refused at the TCP connect, before any S3 request; the endpoint's user info is not printed
    assert (
        rc == 1
        and "input 's3://bucket/data/*.jsonl': cannot connect to its endpoint http://" in err
    )
    assert "SECRET" not in err and len(err.strip().splitlines()) == 1


def test_the_endpoint_check_connects_directly_only_without_a_proxy(monkeypatch):
    """`unreachable_endpoint` reads s3fs's two ways of naming an endpoint, and stays silent
    where the client would go through a proxy (from the environment or botocore's config)."""
    from types import SimpleNamespace

    from packshard.pipeline.storage import unreachable_endpoint

    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    closed = f"http://127.0.0.1:{_closed_port()}"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        open_ = f"http://127.0.0.1:{listening.getsockname()[1]}"
        assert unreachable_endpoint(SimpleNamespace(endpoint_url=open_)) is None
        assert unreachable_endpoint(SimpleNamespace(client_kwargs={"endpoint_url": open_})) is None
    assert "cannot connect to its endpoint" in unreachable_endpoint(
        SimpleNamespace(client_kwargs={"endpoint_url": closed})
    )
    assert unreachable_endpoint(SimpleNamespace()) is None  # no endpoint named: nothing to try
    proxied = SimpleNamespace(endpoint_url=closed, config_kwargs={"proxies": {"http": closed}})
    assert unreachable_endpoint(proxied) is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert unreachable_endpoint(SimpleNamespace(endpoint_url=closed)) is None
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert unreachable_endpoint(SimpleNamespace(endpoint_url=closed)) is not None


def test_credentials_in_an_input_url_are_never_printed(tmp_path: Path):
    url = f"http://user:SECRET@127.0.0.1:{_closed_port()}/data/x.jsonl?sig=SECRET&X-Amz-Credential=SECRET"
    rc, err = pack(*args(url, tmp_path / "out"))
    assert rc == 1 and "SECRET" not in err
    assert "/data/x.jsonl" in err


def test_bad_flag_values_exit_2(tmp_path: Path, good: Path):
    rc, err = pack(*args(good, tmp_path / "out", "--seq-len", "1001"))
    assert rc == 2 and "is not a multiple of --pad-multiple 2" in err
    rc, err = pack(*args(good, tmp_path / "out", "--pad-multiple", "3", "--cp-layout", "zigzag"))
    assert rc == 2 and "--pad-multiple 3 does not suit --cp 2 --cp-layout zigzag" in err


def test_a_resume_reads_the_files_listed_now_with_the_plans_counts():
    """The plan holds redacted URLs; a resume reads the URLs given now (credentials and a
    renewed signature included) with the record counts and seek points of the plan."""
    from packshard.pipeline.inputs import InputFile
    from packshard.pipeline.jobstate import OutputError
    from packshard.pipeline.pack import resumed_files

    now = [InputFile("http://u:SECRET@h/a.jsonl?sig=NEW", "jsonl", size=10, version="e")]
    planned = InputFile(
        "http://u:SECRET@h/a.jsonl?sig=OLD",
        "jsonl",
        size=10,
        version="e",
        records=3,
        checkpoints=((0, 1),),
    )
    plan = {"inputs": [planned.to_json()]}
    assert plan["inputs"][0]["url"] == "http://h/a.jsonl"  # what the job state holds
    [f] = resumed_files(now, plan)
    assert f.url == now[0].url and f.records == 3 and f.checkpoints == ((0, 1),)
    with pytest.raises(OutputError, match="other input files"):
        resumed_files([InputFile("http://h/b.jsonl", "jsonl")], plan)


@pytest.mark.parametrize("layout", ["lines", "array"])
def test_a_resumed_json_file_reads_its_records_as_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
):
    """A .json file's seek points only make sense with its layout (JSON lines or one array):
    a resume takes both from the plan and reads the records a fresh job reads."""
    from packshard.pipeline import readers
    from packshard.pipeline.inputs import resolve_inputs
    from packshard.pipeline.pack import resumed_files

    monkeypatch.setattr(readers, "STRIDE", 2)  # seek points inside a small file
    records = [{"text": f"doc {i}"} for i in range(5)]
    path = tmp_path / "docs.json"
    if layout == "lines":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))
    [counted] = [readers.count_records(f) for f in resolve_inputs([str(path)])]
    assert counted.layout == layout and counted.checkpoints
    fresh = list(readers.read_records(counted, 1, 5))
    [resumed] = resumed_files(resolve_inputs([str(path)]), {"inputs": [counted.to_json()]})
    assert resumed.layout == layout and resumed.records == 5
    assert list(readers.read_records(resumed, 1, 5)) == fresh
    assert [r for _, r in fresh] == records[1:]


def test_every_file_of_a_glob_is_peeked(tmp_path: Path):
    """A file deep in a glob whose columns or first record do not fit fails before Ray starts,
    named; a glob of files without records is one error."""
    data = tmp_path / "parts"
    data.mkdir()
    for i in range(5):
        table = pa.table({"messages": [CHAT["messages"]]}) if i != 3 else pa.table({"q": ["a"]})
        pq.write_table(table, data / f"part-{i}.parquet")
    with pytest.raises(InputError, match=r"part-3\.parquet: .*its columns are \['q'\]"):
        preflight(config_from_args(args(data / "*.parquet", tmp_path / "out")))
    (data / "part-3.parquet").unlink()
    assert len(preflight(config_from_args(args(data / "*.parquet", tmp_path / "o2"))).files) == 4

    lines = tmp_path / "lines"
    lines.mkdir()
    (lines / "a.jsonl").write_text(json.dumps(CHAT) + "\n")
    (lines / "b.jsonl").write_text(json.dumps({"question": "a"}) + "\n")
    with pytest.raises(InputError, match=r"b\.jsonl:line 1: missing_fields"):
        preflight(config_from_args(args(lines / "*.jsonl", tmp_path / "o3")))
    cfg = config_from_args(args(lines / "*.jsonl", tmp_path / "o4", "--skip-bad-records"))
    assert len(preflight(cfg).files) == 2

    blank = tmp_path / "blank"
    blank.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (blank / name).write_text("\n \n")
    with pytest.raises(InputError, match=r"holds no records \(none of its 2 files\)"):
        preflight(config_from_args(args(blank / "*.jsonl", tmp_path / "o5")))


def test_ctrl_c_before_the_job_is_under_way_is_one_line_and_130(
    tmp_path: Path, good: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    from packshard.pipeline import pack as pack_module
    from packshard.pipeline.cli import main as cli

    def interrupted(cfg):
        raise KeyboardInterrupt  # Ctrl-C while the tokenizer loads or Ray starts

    monkeypatch.setattr(pack_module, "run", interrupted)
    assert cli(["pack", *args(good, tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip() == pack_module.INTERRUPTED


def test_chats_with_a_cached_hub_tokenizer_without_a_chat_template(tmp_path: Path, good: Path):
    """A hub tokenizer's chat template is known only once it loads: the job looks at the inputs
    again then, still before a local Ray starts."""
    pytest.importorskip("transformers")
    from packshard.pipeline.demo import demo_tokenizer

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--someone--base-model"
    snapshot = repo / "snapshots" / sha
    tok = demo_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(str(snapshot))
    assert not (snapshot / "chat_template.jinja").exists()
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # a model repo's
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *args(good, tmp_path / "out", tokenizer="someone/base-model"),
         "--no-progress"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )  # fmt: skip
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "'ray'" not in r.stdout.rsplit("IMPORTED", 1)[-1], r.stdout  # no Ray started
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert "line 1: the record is a chat" in errors[0], errors[0]
    assert "'someone/base-model' has no chat template" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()


def test_input_on_an_unreachable_gcs_endpoint_is_one_line(tmp_path: Path):
    """gcsfs retries a request that cannot connect for ~30 s and then reads it as "no such
    file"; its endpoint gets the TCP check that an S3 endpoint gets."""
    pytest.importorskip("gcsfs")
    rc, err = pack(
        *args(
            "gs://bucket/data/x.jsonl",
            tmp_path / "out",
            "--storage-option",
            f"endpoint_url=http://127.0.0.1:{_closed_port()}",
            "--storage-option",
            "token=anon",  # no credential lookup (it probes the GCE metadata server)
        )
    )
    assert rc == 1 and (
        "input 'gs://bucket/data/x.jsonl': cannot connect to its endpoint http://127.0.0.1:" in err
    )


def test_an_input_is_missing_only_when_info_says_so(monkeypatch: pytest.MonkeyPatch):
    """fsspec's isdir / isfile read any OSError (a 403 from gcsfs, a refused connection from
    aiohttp) as False: the input is called missing only when `info` raises FileNotFoundError."""
    from fsspec.implementations.memory import MemoryFileSystem

    from packshard.pipeline.inputs import resolve_specs

    with pytest.raises(InputError, match=r"'memory://nope/x.jsonl' does not exist"):
        resolve_specs(["memory://nope/x.jsonl"])

    def denied(self, path, **kwargs):
        raise PermissionError(403, "Forbidden")

    monkeypatch.setattr(MemoryFileSystem, "info", denied)
    monkeypatch.setattr(MemoryFileSystem, "isdir", lambda self, path: False)
    monkeypatch.setattr(MemoryFileSystem, "isfile", lambda self, path: False)
    with pytest.raises(InputError, match=r"'memory://nope/x.jsonl': permission denied"):
        resolve_specs(["memory://nope/x.jsonl"])

    def refused(self, path, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(MemoryFileSystem, "info", refused)
    with pytest.raises(InputError, match=r"cannot be listed \(ConnectionRefusedError: "):
        resolve_specs(["memory://nope/x.jsonl"])


def test_the_pack_cli_redacts_library_warnings_and_drops_their_tracebacks():
    """Libraries' warnings reach stderr through logging's last-resort handler (the pack CLI
    configures a handler for packshard's own logger only): the secret in one (gcsfs quotes
    ``alice:PW@bucket`` as a bucket name) is removed, and so is its traceback."""
    code = (
        "import logging\n"
        "from packshard.pipeline.pack import _setup_logging\n"
        "_setup_logging()\n"
        "try:\n"
        "    raise OSError('unreachable')\n"
        "except OSError:\n"
        "    logging.getLogger('gcsfs').error('bucket name alice:SECRET@bucket', exc_info=True)\n"
        "logging.getLogger('packshard.x').warning('own line')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["bucket name bucket", "WARNING packshard.x: own line"]
