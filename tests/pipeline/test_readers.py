"""Input listing, counting and range reads for every supported format."""

from __future__ import annotations

import gzip
import json
import posixpath
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from packshard.pipeline import readers
from packshard.pipeline.inputs import InputError, resolve_inputs
from packshard.pipeline.readers import count_records, read_records
from packshard.pipeline.samples import BadRecord, source_fields

RECORDS = [{"text": f"doc {i}", "n": i} for i in range(23)]


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _all(path: str, **kw) -> list:
    (f,) = resolve_inputs([path], **kw)
    f = count_records(f)
    return list(read_records(f, 0, f.records))


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "a.jsonl").write_bytes(_jsonl(RECORDS))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(RECORDS)))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(RECORDS)))
    (tmp_path / "d.json").write_text(json.dumps(RECORDS))
    (tmp_path / "e.json").write_text(json.dumps({"version": 1, "data": RECORDS}))
    (tmp_path / "f.json").write_bytes(_jsonl(RECORDS))  # JSON lines with a .json name
    table = pa.Table.from_pylist(RECORDS)
    pq.write_table(table, tmp_path / "g.parquet", row_group_size=5)
    with pa.ipc.new_file(str(tmp_path / "h.arrow"), table.schema) as w:
        for b in table.to_batches(max_chunksize=4):
            w.write_batch(b)
    with pa.ipc.new_stream(str(tmp_path / "i.arrow"), table.schema) as w:
        for b in table.to_batches(max_chunksize=6):
            w.write_batch(b)
    (tmp_path / "j.txt").write_text("".join(f"{r['text']}\n" for r in RECORDS))
    return tmp_path


@pytest.mark.parametrize(
    "name",
    [
        "a.jsonl",
        "b.jsonl.gz",
        "c.jsonl.zst",
        "d.json",
        "e.json",
        "f.json",
        "g.parquet",
        "h.arrow",
        "i.arrow",
        "j.txt",
    ],
)
def test_every_format_reads_every_record_in_order(files: Path, name: str):
    got = _all(str(files / name))
    assert [rec["text"] for _, rec in got] == [r["text"] for r in RECORDS]
    unit = (
        "line"
        if name.endswith((".jsonl", ".gz", ".zst", ".txt")) or name == "f.json"  # JSON lines
        else ("row" if name.endswith((".parquet", ".arrow")) else "record")
    )
    assert got[4][0] == f"{files / name}:{unit} 5"


@pytest.mark.parametrize(
    "name", ["a.jsonl", "b.jsonl.gz", "g.parquet", "h.arrow", "i.arrow", "d.json"]
)
def test_any_range_reads_the_same_records(files: Path, name: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(readers, "STRIDE", 4)  # seek checkpoints every 4 records
    (f,) = resolve_inputs([str(files / name)])
    f = count_records(f)
    assert f.records == len(RECORDS)
    for start, stop in [(0, 1), (3, 9), (8, 8), (13, 23), (22, 23)]:
        got = [rec["n"] for _, rec in read_records(f, start, stop)]
        assert got == list(range(start, stop)), (start, stop)


@pytest.mark.parametrize("name", ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.json", "j.txt"])
def test_counting_and_reading_close_every_file_they_open(
    files: Path, name: str, monkeypatch: pytest.MonkeyPatch
):
    """The raw file under a decompressor is closed with it (GzipFile alone leaves it open:
    a file descriptor, or a remote file's connection, held until garbage collection)."""
    opened: list = []
    real = readers._open

    def spy(*args, **kwargs):
        fh = real(*args, **kwargs)
        opened.append((fh, getattr(fh, "fileobj", None) or getattr(fh, "raw", None)))
        return fh

    monkeypatch.setattr(readers, "_open", spy)
    (f,) = resolve_inputs([str(files / name)])
    f = count_records(f)
    assert len(list(read_records(f, 0, f.records))) == len(RECORDS)
    assert opened
    for fh, inner in opened:
        assert fh.closed
        assert inner is None or inner.closed, f"{name}: {inner!r} left open"


def test_zstd_frames_are_all_read_and_a_cut_frame_is_an_error(tmp_path: Path):
    """A .zst of several frames (pzstd, concatenated files) is read whole; one that ends inside
    a frame is an unreadable input, never the records before the cut alone."""
    c = zstandard.ZstdCompressor()
    half = len(RECORDS) // 2
    frames = c.compress(_jsonl(RECORDS[:half])) + c.compress(_jsonl(RECORDS[half:]))
    (tmp_path / "whole.jsonl.zst").write_bytes(frames)
    assert [r["text"] for _, r in _all(str(tmp_path / "whole.jsonl.zst"))] == [
        r["text"] for r in RECORDS
    ]
    for cut in (len(frames) - 6, len(frames) // 2 + 3, 9):
        (tmp_path / f"cut{cut}.jsonl.zst").write_bytes(frames[:cut])
        (f,) = resolve_inputs([str(tmp_path / f"cut{cut}.jsonl.zst")])
        with pytest.raises(
            InputError, match=r"cut\d+\.jsonl\.zst: unreadable .*ends inside a frame"
        ):
            count_records(f)


def test_globs_expand_sorted_and_directories_recurse(files: Path):
    found = resolve_inputs([str(files / "*.jsonl*")])
    assert [Path(f.url).name for f in found] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    (files / "sub").mkdir()
    (files / "sub" / "z.jsonl").write_bytes(_jsonl(RECORDS[:2]))
    (files / "notes.md").write_text("ignored")
    names = [Path(f.url).name for f in resolve_inputs([str(files)])]
    assert (
        names == sorted(names, key=lambda n: str(next(files.rglob(n))))
        and "z.jsonl" in names
        and "notes.md" not in names
    )
    # order of inputs is kept
    assert [
        Path(f.url).name for f in resolve_inputs([str(files / "j.txt"), str(files / "a.jsonl")])
    ] == ["j.txt", "a.jsonl"]


def test_blank_lines_are_not_records_but_line_numbers_stay_true(tmp_path: Path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n')
    got = _all(str(p))
    assert [(loc.rsplit(":", 1)[1], rec["text"]) for loc, rec in got] == [
        ("line 1", "a"),
        ("line 4", "b"),
    ]


def test_undecodable_lines_become_bad_records_with_their_line(tmp_path: Path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": \xff\xfe}\n{"text": "b",}\n')
    got = _all(str(p))
    assert (
        isinstance(got[1][1], BadRecord)
        and got[1][1].reason == "invalid_utf8"
        and got[1][0].endswith(":line 2")
    )
    assert (
        isinstance(got[2][1], BadRecord)
        and got[2][1].reason == "malformed_json"
        and got[2][0].endswith(":line 3")
    )


def test_a_byte_order_mark_is_not_data(tmp_path: Path):
    """A UTF-8 BOM before a file's first record (as some editors write) is skipped, as
    utf-8-sig, pandas and Hugging Face datasets skip it; it is not a malformed record."""
    recs = [{"text": "a"}, {"text": "b"}]
    body = "\n".join(json.dumps(r) for r in recs).encode()
    for name, data in [("bom.jsonl", body), ("bom.json", json.dumps(recs).encode())]:
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + data)
        (f,) = [count_records(x) for x in resolve_inputs([str(tmp_path / name)])]
        assert [r for _, r in read_records(f, 0, f.records)] == recs, name


def test_json_errors_read_as_one_sentence(tmp_path: Path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": 1,}\n{"text": "unterminated')
    (f,) = [count_records(x) for x in resolve_inputs([str(p)])]
    got = [r for _, r in read_records(f, 0, f.records)]
    assert [b.reason for b in got] == ["malformed_json", "malformed_json"]
    assert got[0].detail.endswith(" at column 12")  # the message's wording varies by Python
    assert got[1].detail == "Unterminated string starting at column 10"  # not "at at column"


def test_a_json_file_holding_one_chat_is_one_record(tmp_path: Path):
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    assert [(loc.rsplit(":", 1)[1], r) for loc, r in _all(str(tmp_path / "chat.json"))] == [
        ("record 1", chat)
    ]
    # an object holding one list of records under another name is a container of them
    (tmp_path / "data.json").write_text(json.dumps({"data": [chat, chat]}))
    assert [r for _, r in _all(str(tmp_path / "data.json"))] == [chat, chat]
    # ... and a stray non-object among them is that record's error, the others are records
    (tmp_path / "stray.json").write_text(json.dumps({"version": 1, "data": [chat, 5, chat]}))
    got = _all(str(tmp_path / "stray.json"))
    assert [r for _, r in got[::2]] == [chat, chat]
    assert got[1][1] == 5 and got[1][0].endswith("stray.json:record 2")  # not_an_object later
    # a sample with one list of objects beside its fields is a sample, not a container
    cited = {"prompt": "Q?", "completion": "A.", "citations": [{"url": "u1"}, {"url": "u2"}]}
    (tmp_path / "cited.json").write_text(json.dumps(cited))
    assert [r for _, r in _all(str(tmp_path / "cited.json"))] == [cited]
    (tmp_path / "no_images.json").write_text(json.dumps({"text": "hi", "images": []}))
    assert [r for _, r in _all(str(tmp_path / "no_images.json"))] == [{"text": "hi", "images": []}]
    # under --columns messages=conversations, "conversations" is the sample field
    (tmp_path / "sharegpt.json").write_text(json.dumps({"conversations": chat["messages"]}))
    fields = source_fields({"messages": "conversations"})
    (f,) = resolve_inputs([str(tmp_path / "sharegpt.json")])
    f = count_records(f, sample_fields=fields)
    assert f.records == 1
    assert [r for _, r in read_records(f, 0, 1, sample_fields=fields)] == [
        {"conversations": chat["messages"]}
    ]


@pytest.mark.parametrize("first", ['{"text": "a"}', "{not json"])
def test_json_lines_in_a_json_file_are_read_line_by_line(tmp_path: Path, first: str):
    """A line that does not parse is one malformed record at its own line, as in .jsonl; a
    line separator that JSON allows inside strings (U+2028) splits nothing."""
    p = tmp_path / "lines.json"
    p.write_text(
        f'{first}\n\n{{"text": "b\u2028c"}}\n{{"text": broken}}\n{{"text": "d"}}\n{{"text": "e"}}\n',
        encoding="utf-8",
    )
    got = _all(str(p))
    assert [loc.rsplit(":", 1)[1] for loc, _ in got] == [f"line {n}" for n in (1, 3, 4, 5, 6)]
    bad = [isinstance(r, BadRecord) and r.reason == "malformed_json" for _, r in got]
    assert bad == [first.startswith("{not"), False, True, False, False]
    assert got[1][1] == {"text": "b\u2028c"}
    # two lines, the second cut short; and files joined with a byte-order mark on each
    p.write_text('{"text": "a"}\n{"text": "b\n', encoding="utf-8")
    got = _all(str(p))
    assert [r == {"text": "a"} for _, r in got] == [True, False]
    assert isinstance(got[1][1], BadRecord)
    p.write_text('\ufeff{"text": "a"}\n\ufeff{"text": "b"}\n', encoding="utf-8")
    assert [r for _, r in _all(str(p))] == [{"text": "a"}, {"text": "b"}]


@pytest.fixture
def no_listing_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the check of size and modification time at open (`_check_unchanged`; a store
    whose open files carry no details cannot make it): the reads' own checks behind it."""
    monkeypatch.setattr(readers, "_check_unchanged", lambda *a, **k: None)


def test_a_json_file_that_changed_after_counting_is_named(tmp_path: Path, no_listing_check: None):
    p = tmp_path / "grows.json"
    p.write_text(json.dumps(RECORDS[:2]))
    (f,) = resolve_inputs([str(p)])
    f = count_records(f)
    p.write_text(json.dumps(RECORDS[:3]))
    with pytest.raises(InputError, match=f"{p}: changed since it was counted"):
        list(read_records(f, 0, 2))
    p.write_text(json.dumps({"data": RECORDS[:3]}))  # an object holding the records: no seek
    f = count_records(resolve_inputs([str(p)])[0])
    p.write_text(json.dumps({"data": RECORDS[:2]}))
    with pytest.raises(InputError, match="holds 2 records now, 3 when counted"):
        list(read_records(f, 0, 2))


def test_a_broken_json_document_is_not_taken_for_json_lines(tmp_path: Path):
    p = tmp_path / "array.json"  # an array missing its commas: one error, where it is
    for n in (2, 3):
        p.write_text("[\n" + "".join(f'{{"text": "{i}"}}\n' for i in range(n)) + "]\n")
        with pytest.raises(InputError, match="not valid JSON at line 3"):
            _all(str(p))
    p = tmp_path / "pretty.json"  # pretty-printed objects one after another: no JSON lines
    p.write_text('{\n  "text": "a"\n}\n{\n  "text": "b"\n}\n')
    with pytest.raises(InputError, match="not valid JSON at line 4"):
        _all(str(p))


def test_an_http_glob_with_a_query_matches_and_passes_the_query_on(tmp_path: Path):
    from tests.integration._http import serving

    (tmp_path / "data").mkdir()
    for name in ("a", "b"):
        (tmp_path / "data" / f"{name}.jsonl").write_bytes(_jsonl(RECORDS[:2]))
    paths: list[str] = []
    with serving(tmp_path, paths) as (host, _):
        files = resolve_inputs([f"http://{host}/data/*.jsonl?token=SECRET"])
        assert [f.display for f in files] == [f"http://{host}/data/{n}.jsonl" for n in "ab"]
        paths.clear()
        assert [r for f in files for _, r in read_records(count_records(f), 0, 2)] == RECORDS[
            :2
        ] * 2
    assert paths and all(p.endswith("?token=SECRET") for p in paths)


def test_an_http_directory_listing_with_a_query_is_refused_naming_the_glob(tmp_path: Path):
    """fsspec lists an http directory's links as '<dir>/?sig=.../a.jsonl': every file was
    'ignored (not a type packshard reads)', then 'matches no readable files'."""
    from tests.integration._http import serving

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_bytes(_jsonl(RECORDS[:2]))
    with serving(tmp_path) as (host, _):
        with pytest.raises(InputError, match=r"a directory listing with a query string") as e:
            resolve_inputs([f"http://{host}/data/?sig=SECRET"])
        assert "dir/*.jsonl?query" in str(e.value) and "SECRET" not in str(e.value)
        (f,) = resolve_inputs([f"http://{host}/data/*.jsonl?sig=SECRET"])  # the way out
        assert f.display == f"http://{host}/data/a.jsonl"


def test_an_http_input_that_refuses_mid_job_says_what_the_server_answered(tmp_path: Path):
    """fsspec reports any failed HTTP lookup as FileNotFoundError: a signature that expired
    after the listing (403) or a server error is no input that "disappeared"."""
    from tests.integration._http import serving

    (tmp_path / "a.jsonl").write_bytes(_jsonl(RECORDS[:2]))
    refuse: dict[str, int] = {}
    with serving(tmp_path, refuse=refuse) as (host, _):
        (f,) = resolve_inputs([f"http://{host}/a.jsonl?sig=SECRET"])
        f = count_records(f)
        for status, said in ((403, "403"), (503, "503")):
            refuse["status"] = status
            with pytest.raises(InputError) as e:
                list(read_records(f, 0, 2))
            assert f"http://{host}/a.jsonl: cannot be read now (" in str(e.value)
            assert said in str(e.value) and "SECRET" not in str(e.value)
            assert "disappeared" not in str(e.value)
        refuse["status"] = 404
        with pytest.raises(InputError, match="the input disappeared"):
            list(read_records(f, 0, 2))
        # the lookup succeeds and the read fails: aiohttp's error (which quotes the signed
        # URL and does not pickle) becomes one InputError without the signature
        refuse.clear()
        (listed,) = resolve_inputs([f"http://{host}/a.jsonl?sig=SECRET"])
        refuse.update(status=503, get_only=1)
        for read, said in (
            (lambda: list(read_records(f, 0, 2)), "read failed"),
            (lambda: count_records(listed), "unreadable jsonl input"),
        ):
            with pytest.raises(InputError) as e:
                read()
            assert f"http://{host}/a.jsonl: {said} (ClientResponseError: 503" in str(e.value)
            assert "SECRET" not in str(e.value)
            assert e.value.__cause__ is None and e.value.__suppress_context__


def test_hf_save_to_disk_directories(tmp_path: Path):
    import datasets

    ds = datasets.Dataset.from_list(RECORDS)
    ds.save_to_disk(str(tmp_path / "ds"))
    assert [r["n"] for _, r in _all(str(tmp_path / "ds"))] == list(range(23))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert len(_all(str(tmp_path / "dd"), split="test")) == 3
    with pytest.raises(InputError, match="without split 'validation'"):
        resolve_inputs([str(tmp_path / "dd")], split="validation")


def test_struct_columns_read_back_without_the_other_records_keys(tmp_path: Path):
    """Arrow gives a column one struct type, the union of its records' keys: a tool call read
    back from parquet must not gain the other calls' arguments as nulls (the template would
    render them, and the model learn arguments nobody wrote)."""

    def chat(name: str, args: dict) -> dict:
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        return {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "ok"},
                {"role": "assistant", "content": "done"},
            ],
            "tools": [
                {"name": name, "parameters": {"properties": {k: {"type": "string"} for k in args}}}
            ],
        }

    records = [chat("get_weather", {"city": "Paris"}), chat("search", {"query": "q", "n": 3})]
    table = pa.Table.from_pylist(records)
    assert table.column("messages").to_pylist()[0][1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris", "query": None, "n": None,
    }  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    for name in ("t.parquet", "t.arrow"):
        assert [r for _, r in _all(str(tmp_path / name))] == records, name


def test_a_folder_of_saved_datasets_is_refused_naming_them(tmp_path: Path):
    """Read as plain files, their dataset_info.json / state.json would be records and a
    DatasetDict's test split training data."""
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_list([{"text": f"t{i}"} for i in range(3)])
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "all" / "dd"))
    one.save_to_disk(str(tmp_path / "all" / "plain"))
    with pytest.raises(InputError, match=r"save_to_disk datasets \(dd/, plain/\); pass each"):
        resolve_inputs([str(tmp_path / "all")])
    assert len(_all(str(tmp_path / "all" / "dd"))) == 3  # each on its own reads as before
    # a hidden folder's (.checkpoints/, _temporary/) is skipped like the rest of it
    hidden = tmp_path / "hidden"
    (hidden / ".checkpoints" / "x").mkdir(parents=True)
    (hidden / ".checkpoints" / "x" / "state.json").write_text("{}")
    (hidden / "data.jsonl").write_text('{"text": "a"}\n')
    assert len(_all(str(hidden))) == 1


def test_saved_datasets_say_which_split_they_read(tmp_path: Path, caplog):
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_list([{"text": f"t{i}"} for i in range(3)])
    datasets.DatasetDict({"train": one, "test": one.select([0])}).save_to_disk(str(tmp_path / "dd"))
    one.save_to_disk(str(tmp_path / "plain"))
    with caplog.at_level("WARNING", logger="packshard.pipeline.inputs"):
        assert len(_all(str(tmp_path / "dd"))) == 3
        assert "a DatasetDict: read its split train, not test (--split picks)" in caplog.text
        assert len(_all(str(tmp_path / "dd"), split="eval")) == 1  # the hub's synonym of test
        dev = datasets.DatasetDict({"train": one, "dev": one.select([0, 1])})
        dev.save_to_disk(str(tmp_path / "dv"))
        assert len(_all(str(tmp_path / "dv"), split="validation")) == 2  # and of its name
        caplog.clear()
        assert len(_all(str(tmp_path / "plain"), split="test")) == 3
        assert "--split test does not apply (a saved Dataset, not a DatasetDict)" in caplog.text


def test_feather_v1_is_refused_naming_it(tmp_path: Path):
    """Feather V1 (magic FEA1) is no Arrow IPC stream: it is named, with the way to convert it,
    rather than failing as an unreadable stream after Ray starts."""
    import warnings

    import pyarrow.feather as feather

    with warnings.catch_warnings():  # pyarrow >= 25 warns that it writes a deprecated format
        warnings.simplefilter("ignore", DeprecationWarning)
        feather.write_feather(pa.table({"text": ["a b"]}), tmp_path / "v1.feather", version=1)
    with pytest.raises(InputError, match=r"is a Feather V1 file.*write_feather"):
        resolve_inputs([str(tmp_path / "v1.feather")])
    feather.write_feather(pa.table({"text": ["a b"]}), tmp_path / "v0.feather")
    with pytest.raises(InputError, match=r"v1\.feather \(input '.*'\) is a Feather V1 file"):
        resolve_inputs([str(tmp_path)])  # a folder's file is named, not the folder
    feather.write_feather(pa.table({"text": ["a b"]}), tmp_path / "v2.feather")
    (f,) = resolve_inputs([str(tmp_path / "v2.feather")])
    assert count_records(f).records == 1


def test_arrows_json_extension_type_is_decoded(tmp_path: Path):
    """🤗 datasets 5 stores values of mixed shape (tool schemas' properties, messages) as
    Arrow's ``arrow.json`` extension type; pyarrow hands them out as JSON text."""
    records = [
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "tools": [{"name": "f", "parameters": {"properties": {"x": {"type": "string"}}}}],
        },
        {
            "messages": [{"role": "user", "content": "r", "name": "u"}],
            "tools": [{"name": "g", "parameters": {"properties": {"y": {"enum": [1, 2]}}}}],
        },
    ]

    def json_array(values: list) -> pa.Array:
        return pa.ExtensionArray.from_storage(pa.json_(), pa.array([json.dumps(v) for v in values]))

    messages = pa.ListArray.from_arrays(
        pa.array([0, 2, 3], pa.int32()), json_array([m for r in records for m in r["messages"]])
    )
    params = pa.StructArray.from_arrays(
        [json_array([r["tools"][0]["parameters"]["properties"] for r in records])], ["properties"]
    )
    tools = pa.ListArray.from_arrays(
        pa.array([0, 1, 2], pa.int32()),
        pa.StructArray.from_arrays([pa.array(["f", "g"]), params], ["name", "parameters"]),
    )
    table = pa.table({"messages": messages, "tools": tools})
    assert "arrow.json" in str(table.schema)
    pq.write_table(table, tmp_path / "t.parquet")
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    for name in ("t.parquet", "t.arrow"):
        assert [r for _, r in _all(str(tmp_path / name))] == records, name


def test_a_directory_with_split_names_reads_one_split(tmp_path: Path, caplog):
    """The hub's layout (data/train-00000-of-00002.parquet, ...): --split picks the files."""
    d = tmp_path / "hub" / "data"
    d.mkdir(parents=True)
    for name, n in [("train-00000-of-00002", 6), ("train-00001-of-00002", 4), ("test-00000-of-00001", 3)]:  # fmt: skip
        pq.write_table(pa.table({"n": list(range(n))}), d / f"{name}.parquet")
    (d.parent / "README.md").write_text("configs: ...")
    hub = str(tmp_path / "hub")

    def records(spec: str, **kw) -> int:
        return sum(count_records(f).records for f in resolve_inputs([spec], **kw))

    with caplog.at_level("WARNING", logger="packshard.pipeline.inputs"):
        assert records(hub) == 10
    assert "data/test-00000-of-00001.parquet (split test)" in caplog.text
    assert records(hub, split="test") == 3
    with pytest.raises(
        InputError, match=r"holds the splits \['test', 'train'\] .*not 'validation'"
    ):
        resolve_inputs([hub], split="validation")
    assert records(hub, split="eval") == 3  # the hub's synonyms: eval, testing -> test
    # directories of other data whose names hold a split word are read whole
    for names in (["web", "unit_test_writing"], ["train_part1", "extra_math"], ["train", "notes"]):
        other = tmp_path / "-".join(names)
        other.mkdir()
        for name in names:
            (other / f"{name}.jsonl").write_text('{"text": "x"}\n')
        assert records(str(other)) == 2, names
    # a file, or a directory without split names, is read whole; an explicit --split says so
    caplog.clear()
    with caplog.at_level("WARNING", logger="packshard.pipeline.inputs"):
        assert len(_all(str(d / "test-00000-of-00001.parquet"), split="validation")) == 3
    assert "--split validation does not apply (a file): read whole" in caplog.text


def test_hub_shard_names_name_their_split_whatever_it_is(tmp_path: Path, caplog, monkeypatch):
    """Older uploads add a content hash (train-00000-of-00001-5f4c8e2a.parquet); a split may
    have any name (ultrachat's train_sft, test_sft): none of it is read as another split."""
    import fsspec

    from packshard.pipeline import inputs

    d = tmp_path / "hub" / "data"
    d.mkdir(parents=True)
    for name, n in [("train-00000-of-00001-5f4c8e2a1b3d9f70", 4), ("test-00000-of-00001-0a9d2e1c", 2)]:  # fmt: skip
        pq.write_table(pa.table({"n": list(range(n))}), d / f"{name}.parquet")
    (d.parent / "README.md").write_text("# x")

    def records(spec: str, **kw) -> int:
        return sum(count_records(f).records for f in resolve_inputs([spec], **kw))

    with caplog.at_level("WARNING", logger="packshard.pipeline.inputs"):
        assert records(str(tmp_path / "hub")) == 4
    assert "test-00000-of-00001-0a9d2e1c.parquet (split test)" in caplog.text
    assert records(str(tmp_path / "hub"), split="test") == 2
    sft = tmp_path / "sft" / "data"
    sft.mkdir(parents=True)
    for name, n in [("train_sft-00000-of-00002-aa01", 3), ("train_sft-00001-of-00002-bb02", 2), ("test_sft-00000-of-00001-cc03", 1), ("train_gen-00000-of-00001-dd04", 7)]:  # fmt: skip
        pq.write_table(pa.table({"n": list(range(n))}), sft / f"{name}.parquet")
    assert records(str(tmp_path / "sft"), split="train_sft") == 5
    with pytest.raises(InputError, match=r"\['test_sft', 'train_gen', 'train_sft'\].*not 'train'"):
        resolve_inputs([str(tmp_path / "sft")])
    # a hub name lists the same way (its filesystem stood in for by the local copy)
    real = inputs.url_to_fs
    monkeypatch.setattr(inputs, "url_to_fs", lambda url, so=None: (fsspec.filesystem("file"), str(tmp_path / "sft")) if url.startswith("hf://") else real(url, so))  # fmt: skip
    assert [
        posixpath.basename(f.url) for f in resolve_inputs(["org/ultra"], split="train_sft")
    ] == [
        "train_sft-00000-of-00002-aa01.parquet",
        "train_sft-00001-of-00002-bb02.parquet",
    ]


def test_writer_shard_names_are_no_split(tmp_path: Path, caplog, monkeypatch):
    """part-00000-of-00004 (Spark's, a writer's) names no split: a flat folder of them is read
    whole, and in train/ and test/ folders the folder names the split."""
    import fsspec

    from packshard.pipeline import inputs

    def names(spec: str, **kw) -> list[str]:
        return [posixpath.relpath(f.url, spec) for f in resolve_inputs([spec], **kw)]

    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(2):
        (flat / f"part-0000{i}-of-00002.jsonl").write_text('{"text": "x"}\n')
    assert len(names(str(flat))) == 2
    split = tmp_path / "split"
    for s in ("train", "test"):
        (split / s).mkdir(parents=True)
        for i in range(2):
            (split / s / f"part-0000{i}-of-00002.jsonl").write_text('{"text": "x"}\n')
    assert names(str(split)) == ["train/part-00000-of-00002.jsonl", "train/part-00001-of-00002.jsonl"]  # fmt: skip
    # a hub repository: files naming no split are left out once some do, as the hub reads it;
    # its README goes unmentioned
    hub = tmp_path / "hub"
    hub.mkdir()
    for n in ("train", "test", "few_shot_examples"):
        (hub / f"{n}.jsonl").write_text('{"text": "x"}\n')
    (hub / "README.md").write_text("# card")
    real = inputs.url_to_fs
    monkeypatch.setattr(inputs, "url_to_fs", lambda url, so=None: (fsspec.filesystem("file"), str(hub)) if url.startswith("hf://") else real(url, so))  # fmt: skip
    with caplog.at_level("WARNING", logger="packshard.pipeline.inputs"):
        got = [posixpath.basename(f.url) for f in resolve_inputs(["org/name"])]
    assert got == ["train.jsonl"]
    assert "few_shot_examples.jsonl (names no split)" in caplog.text and "README" not in caplog.text


def test_demo_input_is_generated_where_it_is_read():
    (f,) = resolve_inputs(["demo://?num_math=5&num_trajectories=1"])
    assert f.format == "demo" and f.records == 6
    recs = [r for _, r in read_records(f, 2, 4)]
    assert all("messages" in r for r in recs)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("/nonexistent/file.jsonl", "does not exist"),
        ("data/missing.jsonl", "does not exist"),
        ("/nonexistent/*.jsonl", "matches no readable files"),
        ("README.md", "unsupported file type"),
    ],
)
def test_unusable_inputs_are_named(spec: str, match: str):
    with pytest.raises(InputError, match=match):
        resolve_inputs([spec])


def test_corrupt_and_unreadable_files_are_named(tmp_path: Path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet")
    (f,) = resolve_inputs([str(bad)])
    with pytest.raises(InputError, match=r"bad\.parquet: unreadable parquet"):
        count_records(f)
    (tmp_path / "bad.json").write_text("[1, 2,")
    (f,) = resolve_inputs([str(tmp_path / "bad.json")])
    with pytest.raises(InputError, match="not valid JSON at line 1"):
        count_records(f)
    (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"not a zstd frame" * 4)
    (f,) = resolve_inputs([str(tmp_path / "bad.jsonl.zst")])
    with pytest.raises(
        InputError,
        match=r"bad\.jsonl\.zst: unreadable jsonl input \(OSError: ZSTD decompress failed",
    ):
        count_records(f)
    (tmp_path / "bad.jsonl.gz").write_bytes(
        gzip.compress(b'{"text": "x"}\n' * 50)[:-30] + b"x" * 30
    )
    (f,) = resolve_inputs([str(tmp_path / "bad.jsonl.gz")])
    with pytest.raises(InputError, match=r"bad\.jsonl\.gz: unreadable jsonl input"):
        count_records(f)
    for name, text, match in [
        ("dataset_dict.json", '{"splits": ["train",', "its dataset_dict.json is not valid JSON"),
        ("state.json", '{"_data_files": [{"name": "x.arrow"}]}', "_data_files is not a list"),
        ("state.json", "[]", "its state.json holds a list, not an object"),
    ]:
        saved = tmp_path / f"saved_{len(name)}_{len(text)}"
        saved.mkdir()
        (saved / name).write_text(text)
        with pytest.raises(InputError, match=match):
            resolve_inputs([str(saved)])
    locked = tmp_path / "locked.jsonl"
    locked.write_text('{"text": "x"}\n')
    (f,) = resolve_inputs([str(locked)])
    locked.unlink()
    with pytest.raises(InputError, match="disappeared"):
        count_records(f)


def test_a_file_that_shrinks_after_counting_is_reported(tmp_path: Path, no_listing_check: None):
    p = tmp_path / "x.jsonl"
    p.write_bytes(_jsonl(RECORDS))
    (f,) = resolve_inputs([str(p)])
    f = count_records(f)
    p.write_bytes(_jsonl(RECORDS[:3]))
    with pytest.raises(InputError, match="the file changed"):
        list(read_records(f, 0, f.records))


@pytest.mark.parametrize("edit", ["grown", "shifted", "arrow"])
def test_a_file_whose_size_changed_since_it_was_listed_is_refused_at_open(
    tmp_path: Path, edit: str
):
    """Counts and seek points hold only for the bytes a file had when the job listed it: a
    change of size is refused when a block opens it, naming the file, so records shifted by an
    edit are never read as others (a block's own checks cannot see a shift by whole records).
    The same bytes under another modification time read: a task on another node opens that
    node's copy of a local path (Ray's working_dir unpacks without keeping mtimes)."""
    import os

    def write_arrow(texts: list[str]) -> None:
        with pa.ipc.new_file(p, pa.schema([("text", pa.string())])) as w:
            w.write_table(pa.table({"text": texts}))

    if edit == "arrow":
        p = tmp_path / "t.arrow"
        write_arrow(["a", "b", "c"])
    elif edit == "shifted":
        p = tmp_path / "a.json"
        p.write_text(json.dumps([{"a": i} for i in range(1, 6)]).replace(" ", ""))
    else:
        p = tmp_path / "x.jsonl"
        p.write_bytes(_jsonl(RECORDS))
    (f,) = resolve_inputs([str(p)])
    f = count_records(f)
    listed = p.read_bytes()
    before = p.stat()
    p.write_bytes(listed)  # a copy: the same bytes, a later modification time
    os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert len(list(read_records(f, 0, f.records))) == f.records
    if edit == "grown":
        p.write_bytes(listed + _jsonl(RECORDS[:1]))
    elif edit == "shifted":  # one record more in front: records 3-4 would hold 2-3
        p.write_text('[{"a":0},' + listed.decode()[1:])
    else:
        write_arrow(["a", "b", "c", "d"])
    now = f"{p.stat().st_size:,} now"
    with pytest.raises(
        InputError,
        match=f"{p}: changed since the job listed it \\({before.st_size:,} bytes then, {now}",
    ):
        list(read_records(f, 2, 3))


def test_a_bare_hub_name_goes_to_the_hub_and_fails_clearly_offline(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="hub dataset"):
        resolve_inputs(["packshard-test-org/no-such-dataset"])


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_a_table_without_sample_columns_keeps_its_columns_for_the_error(
    tmp_path: Path, suffix: str
):
    """Projected to packshard's fields, such a table's records were empty: `the record has []`.
    They keep their own columns, so the bad record names them."""
    from packshard.pipeline.samples import source_fields, to_sample

    table = pa.table({"question": ["q"], "answer": ["a"]})
    path = tmp_path / f"qa.{suffix}"
    if suffix == "parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(path, table.schema) as w:
            w.write_table(table)
    [f] = [count_records(f) for f in resolve_inputs([str(path)])]
    [(location, record)] = list(read_records(f, 0, 1, fields=source_fields({})))
    assert location == f"{path}:row 1" and record == {"question": "q", "answer": "a"}
    with pytest.raises(BadRecord, match=r"the record has \['answer', 'question'\]"):
        to_sample(record)


def test_locations_and_errors_carry_no_credentials(tmp_path: Path):
    from packshard.pipeline.inputs import InputFile

    f = InputFile("http://user:SECRET@127.0.0.1:1/x.jsonl?sig=SECRET", "jsonl", records=1)
    assert f.display == "http://127.0.0.1:1/x.jsonl" and "SECRET" not in json.dumps(f.to_json())
    with pytest.raises(InputError) as e:
        list(read_records(f, 0, 1))
    assert "SECRET" not in str(e.value) and "http://127.0.0.1:1/x.jsonl" in str(e.value)


def _seek_point_files(tmp_path: Path) -> dict[str, list[dict]]:
    """A .json array (byte-order mark, non-ASCII text, U+2028 inside strings) and JSON lines
    in a .json file (blank lines), each of 2.5 x STRIDE records."""
    recs = [
        {"text": f"doc {i} " + "é" * (i % 7) + ("\u2028" if i % 11 == 0 else ""), "n": i}
        for i in range(readers.STRIDE * 5 // 2)
    ]
    body = ",\n ".join(json.dumps(r, ensure_ascii=False) for r in recs)
    (tmp_path / "array.json").write_bytes(b"\xef\xbb\xbf" + f"[\n {body}\n]\n".encode())
    (tmp_path / "lines.json").write_text(
        "".join(
            json.dumps(r, ensure_ascii=False) + "\n" + "\n" * (i % 5 == 0)
            for i, r in enumerate(recs)
        )
    )
    return {"array.json": recs, "lines.json": recs}


@pytest.mark.parametrize("name", ["array.json", "lines.json"])
def test_a_json_block_parses_only_its_own_bytes(tmp_path: Path, name: str, no_listing_check: None):
    recs = _seek_point_files(tmp_path)[name]
    (f,) = resolve_inputs([str(tmp_path / name)])
    f = count_records(f)
    assert (f.records, f.layout, len(f.checkpoints)) == (len(recs), name.removesuffix(".json"), 3)
    whole = list(read_records(replace(f, checkpoints=()), 0, f.records))  # parsed from the start
    assert [r for _, r in whole] == recs
    for a, b in [(0, 1), (0, 1024), (1023, 1025), (1024, 2048), (1500, 2560), (2559, 2560),
                 (700, 2100), (2048, 2048)]:  # fmt: skip
        assert list(read_records(f, a, b)) == whole[a:b], (a, b)
    # The seek is real: the first record's bytes, garbled after counting, stay unread by a
    # later block (a whole parse would now fail on them).
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    at = f.checkpoints[0][0]
    data[at : at + 4] = b"@@@@"
    path.write_bytes(bytes(data))
    assert list(read_records(f, 1100, 2000)) == whole[1100:2000]
    if name == "lines.json":  # a line that does not parse is a bad record
        assert getattr(next(read_records(f, 0, 5))[1], "reason", None) == "malformed_json"
    else:
        with pytest.raises(InputError, match="changed since it was counted"):
            list(read_records(f, 0, 5))


def test_a_json_array_that_changed_after_counting_is_refused(
    tmp_path: Path, no_listing_check: None
):
    recs = _seek_point_files(tmp_path)["array.json"]
    (f,) = resolve_inputs([str(tmp_path / "array.json")])
    f = count_records(f)
    (tmp_path / "array.json").write_text(json.dumps([*recs, {"text": "one more"}]))
    for a, b in [(2400, 2560), (0, 10)]:
        with pytest.raises(InputError, match="changed since it was counted"):
            list(read_records(f, a, b))


def test_a_compressed_json_array_has_no_seek_points(tmp_path: Path):
    recs = _seek_point_files(tmp_path)["array.json"]
    (tmp_path / "z.json.gz").write_bytes(gzip.compress((tmp_path / "array.json").read_bytes()))
    (f,) = resolve_inputs([str(tmp_path / "z.json.gz")])
    f = count_records(f)
    assert (f.records, f.checkpoints) == (len(recs), ())
    assert [r for _, r in read_records(f, 1030, 1040)] == recs[1030:1040]
