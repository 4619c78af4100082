"""`packshard stats` and `packshard verify` on a dataset built with the foundation writer."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from packshard.packers import DatasetWriter, pack_table
from packshard.pipeline.cli import main

CONFIG = {
    "seq_len": 1024,
    "cp": 8,
    "pad_multiple": 8,
    "pad_token_id": 0,
    "overlong": "truncate",
    "tokenizer": {"name": "t", "fingerprint": "x"},
}


def _write(url: str, ids: list[np.ndarray], config: dict, totals: dict, **writer_kw):
    """Pack `ids` with the foundation packer and commit them at `url`: (batch, manifest)."""
    batch, _ = pack_table(
        pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))}),
        seq_len=config["seq_len"],
        pad_multiple=config["pad_multiple"],
        pad_token_id=0,
    )
    w = DatasetWriter(url, config, **writer_kw)
    w.write(batch)
    return batch, w.close(totals)


@pytest.fixture
def dataset(tmp_path):
    rng = np.random.default_rng(3)
    ids = [rng.integers(1, 500, int(k)).astype(np.int32) for k in rng.integers(1, 700, 500)]
    url = str(tmp_path / "ds")
    totals = {"samples_in": 503, "samples_kept": 500, "dropped": {"no_loss_tokens": 3}}
    batch, manifest = _write(url, ids, CONFIG, totals, max_rows=40)
    return url, batch, manifest


def test_stats_json_reads_manifest_and_index(dataset, capsys):
    url, batch, _manifest = dataset
    assert main(["stats", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    num_tokens = sum(batch.column("num_tokens").to_pylist())
    padded = sum(len(x) for x in batch.column("input_ids").to_pylist())
    assert st["rows"] == batch.num_rows
    assert st["num_tokens"] == num_tokens and st["padded_tokens"] == padded
    # rounded once, to the digits the text prints (percentages to 3 and 2 decimals)
    assert st["padding_fraction"] == round((padded - num_tokens) / padded, 5)
    assert st["pad_to_seq_len_fraction"] == round(1 - num_tokens / (batch.num_rows * 1024), 4)
    assert st["samples_in"] == 503 and st["dropped"] == {"no_loss_tokens": 3}
    assert st["documents"] == 500
    assert sum(st["histogram"]["counts"]) == batch.num_rows


def test_stats_into_a_closed_pipe_ends_quietly(dataset):
    """`packshard stats URL | head`: the reader leaves early; no traceback."""
    url, _batch, _manifest = dataset
    code = "import sys; from packshard.pipeline.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.Popen(
        [sys.executable, "-c", code, "stats", url, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()  # before it writes: every write meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def test_stats_text_prints_the_json_values(dataset, capsys):
    """One rounding: every number of the text is the JSON's value, in the same digits."""
    url, _, _ = dataset
    assert main(["stats", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert main(["stats", url]) == 0
    text = capsys.readouterr().out

    def same(value: float | int) -> str:
        return (
            f"{value:,}"
            if not isinstance(value, float) or not value.is_integer()
            else f"{int(value):,}"
        )

    rt, dr = st["row_tokens"], st["docs_per_row"]
    assert f"median {same(rt['median'])}  max {rt['max']:,}" in text
    assert f"median {same(dr['median'])} max {dr['max']}" in text
    assert f"mean {dr['mean']:.2f}" in text and round(dr["mean"], 2) == dr["mean"]
    assert f"padding      {100 * st['padding_fraction']:.3f}%" in text
    assert float(f"{100 * st['padding_fraction']:.3f}") / 100 == pytest.approx(
        st["padding_fraction"], abs=1e-12
    )
    assert f"would waste {100 * st['pad_to_seq_len_fraction']:.2f}%" in text


def test_median_of_an_even_number_of_rows_keeps_its_half(tmp_path, capsys):
    """A median of integers that ends in .5 is printed as such in both forms (the text used
    to round it to the integer the JSON did not hold)."""
    ids = [np.arange(1, n + 1, dtype=np.int32) for n in (10, 11)]
    url = str(tmp_path / "even")
    config = {**CONFIG, "seq_len": 16, "cp": 1, "pad_multiple": 1}
    _write(url, ids, config, {"samples_in": 2, "samples_kept": 2, "dropped": {}})
    assert main(["stats", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["row_tokens"]["median"] == 10.5
    assert main(["stats", url]) == 0
    assert "median 10.5  max 11" in capsys.readouterr().out


def test_stats_text_and_plot(dataset, tmp_path, capsys):
    url, _, _ = dataset
    png = tmp_path / "p.png"
    assert main(["stats", url, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "padding every row to seq_len would waste" in out and "row-length histogram" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_store_that_cannot_list_is_asked_per_shard(dataset, tmp_path, monkeypatch):
    """An HTTP server without index pages, a key that may read but not list: no listing, so
    each shard's size is asked for; nothing is called missing that is there."""
    from packshard.packers import ShardDataset

    url, _, manifest = dataset
    ds = ShardDataset.open(url)

    def no_listing(path, detail=True):
        raise PermissionError(f"ListObjects denied: {path}")

    monkeypatch.setattr(ds.fs, "ls", no_listing)
    assert ds.shard_file_problems() == []
    (tmp_path / "ds" / manifest["shards"][1]["path"]).unlink()
    assert ds.shard_file_problems() == [
        f"{url}/shards/part-00001.arrow: missing (the manifest names it)"
    ]


def test_stats_refuses_a_plot_file_type_it_cannot_write(dataset, tmp_path, capsys):
    url, _, _ = dataset
    assert main(["stats", url, "--plot", str(tmp_path / "p.txt")]) == 2
    out, err = capsys.readouterr()
    assert not out and "--plot" in err and "give a file ending in one of " in err
    assert ".png" in err and ".tiff" in err  # whatever matplotlib writes
    assert main(["stats", url, "--plot", str(tmp_path / "p.tiff")]) == 0


def test_stats_plot_without_matplotlib_fails_before_any_work(
    dataset, tmp_path, monkeypatch, capsys
):
    url, _, _ = dataset
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as when it is not installed
    assert main(["stats", url, "--plot", str(tmp_path / "p.png")]) == 1
    out, err = capsys.readouterr()
    assert not out and "pip install 'packshard[plot]'" in err


def test_stats_does_not_read_shards(dataset, tmp_path, capsys):
    url, _, _ = dataset
    for p in (tmp_path / "ds" / "shards").iterdir():  # garbage of the manifest's sizes
        p.write_bytes(bytes(p.stat().st_size))
    assert main(["stats", url]) == 0
    assert "padding every row to seq_len" in capsys.readouterr().out


def test_stats_names_missing_and_truncated_shards_and_fails(dataset, tmp_path, capsys):
    url, _, manifest = dataset
    shards = tmp_path / "ds" / "shards"
    (shards / "part-00001.arrow").unlink()
    last = shards / manifest["shards"][-1]["path"].rpartition("/")[2]
    last.write_bytes(last.read_bytes()[:-100])
    assert main(["stats", url]) == 1
    out, err = capsys.readouterr()
    assert "padding every row to seq_len" in out  # the manifest's figures are still printed
    assert f"{url}/shards/part-00001.arrow: missing (the manifest names it)" in err
    size = manifest["shards"][-1]["bytes"]
    assert f"{last.name}: {size - 100:,} bytes, the manifest says {size:,}" in err
    assert f"2 of {len(manifest['shards'])} shards damaged" in err
    assert main(["stats", url, "--json"]) == 1  # JSON to stdout, the problems to stderr
    assert json.loads(capsys.readouterr().out)["rows"] > 0


def test_verify_ok(dataset, capsys):
    url, _, _ = dataset
    assert main(["verify", url, "--quiet"]) == 0
    assert "verify: OK" in capsys.readouterr().out


def test_verify_flipped_byte(dataset, tmp_path, capsys):
    url, _, manifest = dataset
    p = tmp_path / "ds" / manifest["shards"][1]["path"]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))
    assert main(["verify", url, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "part-00001.arrow" in err and "checksum" in err


def test_verify_missing_manifest(dataset, tmp_path, capsys):
    url, _, _ = dataset
    (tmp_path / "ds" / "manifest.json").unlink()
    assert main(["verify", url, "--quiet"]) == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_verify_dotdot_path(dataset, tmp_path, capsys):
    url, _, _ = dataset
    mp = tmp_path / "ds" / "manifest.json"
    m = json.loads(mp.read_text())
    m["shards"][0]["path"] = "shards/../../outside.arrow"
    mp.write_text(json.dumps(m))
    assert main(["verify", url, "--quiet"]) == 1
    assert "'..'" in capsys.readouterr().err


def test_verify_wrong_samples_kept(dataset, tmp_path, capsys):
    url, _, _ = dataset
    mp = tmp_path / "ds" / "manifest.json"
    m = json.loads(mp.read_text())
    m["totals"]["samples_kept"] = 499
    mp.write_text(json.dumps(m))
    assert main(["verify", url, "--quiet"]) == 1
    assert "samples_kept is 499" in capsys.readouterr().err


def test_verify_prints_no_credentials(capsys):
    from packshard.packers.writer import url_to_fs
    from packshard.trainer_shim.synthetic import write_synthetic_dataset

    url = "memory://alice:SECRET@bucket/verify_creds"
    write_synthetic_dataset(url, lengths=np.full(20, 30), seq_len=64, pad_multiple=4)
    fs, root = url_to_fs(url)
    m = json.loads(fs.cat_file(f"{root}/manifest.json"))
    m["totals"]["samples_kept"] -= 1
    m["totals"]["dropped"] = {"malformed_json": 1}
    fs.pipe_file(f"{root}/manifest.json", json.dumps(m).encode())
    assert main(["verify", "--quiet", url]) == 1
    err = capsys.readouterr().err
    assert "samples_kept is 19" in err and "SECRET" not in err and "alice" not in err


def test_a_manifest_counter_of_the_wrong_type_fails_every_reader(dataset, tmp_path, capsys):
    url, _, _ = dataset
    mp = tmp_path / "ds" / "manifest.json"
    m = json.loads(mp.read_text())
    m["totals"]["truncated_samples"] = "3"
    mp.write_text(json.dumps(m))
    for command in (["verify", "--quiet"], ["stats"], ["stats", "--json"]):
        assert main([*command, url]) == 1
        assert "truncated_samples must be an int >= 0, got '3'" in capsys.readouterr().err


def test_an_http_dataset_url_with_a_query_is_refused_in_one_line(capsys):
    """The query would have to go with each file of the dataset, which nothing sends: refused
    naming what to do, without the signature (it read '.../ds//manifest.json: not valid JSON',
    the server's directory listing)."""
    for command in (["stats"], ["verify", "--quiet"]):
        assert main([*command, "https://u:PW@host.example/ds/?sig=SECRET"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"packshard {command[0]}: https://host.example/ds/: a dataset URL")
        assert "query string" in err and "SECRET" not in err and "PW" not in err
        assert len(err.splitlines()) == 1


def test_an_unknown_protocol_is_one_line(capsys):
    assert main(["stats", "nosuch://u:SECRET@bucket/ds"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "packshard stats: nosuch://bucket/ds: cannot open its filesystem (Protocol not known: nosuch)"
    )


@pytest.mark.parametrize("overlong", ["truncate", "split"])
def test_verify_a_sample_in_two_documents(tmp_path, capsys, overlong):
    """Every sample written twice (consistent checksums and totals): a sample in two documents
    is an error, except under overlong=split, whose pieces share their sample's id."""
    rng = np.random.default_rng(5)
    ids = [rng.integers(1, 500, int(k)).astype(np.int32) for k in rng.integers(1, 700, 60)]
    batch, _ = pack_table(
        pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))}),
        seq_len=1024, pad_multiple=8, pad_token_id=0,
    )  # fmt: skip
    url = str(tmp_path / "ds")
    w = DatasetWriter(url, {**CONFIG, "overlong": overlong}, max_rows=40)
    w.write(batch)
    w.write(batch)
    w.close({"samples_in": 60, "samples_kept": 60, "dropped": {}})
    rc = main(["verify", url, "--quiet"])
    err = capsys.readouterr().err
    if overlong == "split":
        assert rc == 0, err
    else:
        assert rc == 1
        assert "60 sample ids appear in more than one document (e.g. [0, 1, 2, 3, 4])" in err


def test_verify_row_invariant_breach_names_shard_and_row(tmp_path, capsys):
    """A shard rewritten with a bad row (consistent checksums) is still caught by the row rules."""
    from packshard.packers import SHARD_SCHEMA

    row = {
        "input_ids": [5, 6, 7, 9],
        "loss_mask": [True, True, True, True],
        "doc_lens": [3],
        "sample_ids": [0],
        "num_tokens": 3,
        "num_loss_tokens": 4,
    }
    url = str(tmp_path / "bad")
    w = DatasetWriter(url, {**CONFIG, "cp": 4, "pad_multiple": 4, "pad_token_id": 0})
    w.write(pa.RecordBatch.from_pylist([row], schema=SHARD_SCHEMA))
    w.close({"samples_in": 1, "samples_kept": 1, "dropped": {}})
    assert main(["verify", url, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "part-00000.arrow: row 0: padding holds a token other than pad_token_id 0" in err


def test_console_script_entry_point(dataset):
    url, _, _ = dataset
    out = subprocess.run(
        [sys.executable, "-m", "packshard.pipeline.cli", "verify", url, "--quiet"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("tty", [True, False])
def test_verify_draws_its_bar_only_on_a_terminal(dataset, monkeypatch, capsys, tty):
    url, _, _ = dataset
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert main(["verify", url]) == 0
    assert ("verify: 100%" in capsys.readouterr().err) is tty


def test_stats_reports_what_the_overlong_policy_did(tmp_path, capsys):
    ids = [np.arange(1, 9, dtype=np.int32)]
    totals = {"samples_in": 1, "samples_kept": 1, "dropped": {}}
    url = str(tmp_path / "t")
    _write(url, ids, CONFIG, {**totals, "truncated_samples": 1, "truncated_tokens": 1200})
    assert main(["stats", url, "--json"]) == 0
    o = json.loads(capsys.readouterr().out)["overlong"]
    assert (o["policy"], o["truncated_samples"], o["truncated_tokens"]) == ("truncate", 1, 1200)
    assert main(["stats", url]) == 0
    assert "overlong     truncate: 1 samples cut, 1,200 tokens lost" in capsys.readouterr().out
    url = str(tmp_path / "s")
    split = {"split_samples": 1, "extra_pieces": 2, "lossless_pieces": 1, "lossless_piece_tokens": 1024}  # fmt: skip
    _write(url, ids, {**CONFIG, "overlong": "split"}, {**totals, **split})
    assert main(["stats", url]) == 0
    out = capsys.readouterr().out
    assert (
        "split: 1 samples into 2 extra pieces; 1 pieces (1,024 tokens) carry no loss token" in out
    )


def test_usage_errors_quote_no_credentials(capsys):
    """argparse quotes what it could not parse: a URL's user info and signature are removed."""
    with pytest.raises(SystemExit) as stats_exit:
        main(["stats", "s3://b/ds", "gs://alice:SECRET@bucket/x?sig=SECRET"])
    with pytest.raises(SystemExit) as pack_exit:  # the pack job's own parser
        from packshard.pipeline.config import build_parser

        build_parser().parse_args(["--output", "o", "gs://alice:SECRET@bucket/x?sig=SECRET"])
    err = capsys.readouterr().err
    assert stats_exit.value.code == pack_exit.value.code == 2
    assert "SECRET" not in err and err.count("unrecognized arguments: gs://bucket/x") == 2


def test_a_ctrl_c_while_the_cli_starts_is_one_line(monkeypatch, capsys):
    """The console script imports the CLI module before calling main: the module imports only
    the standard library, so a Ctrl-C meets main's handler, not a traceback."""
    code = "import sys, packshard.pipeline.cli; print(sorted({'numpy', 'pyarrow', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

    class Interrupted(type(sys)):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "packshard.pipeline.pack", Interrupted("pack"))
    assert main(["pack", "--demo", "--output", "x"]) == 130
    assert capsys.readouterr().err == "packshard pack: interrupted before anything started\n"


def test_a_ctrl_c_after_the_commit_says_the_dataset_is_whole(monkeypatch, tmp_path, capsys):
    from packshard.pipeline import pack
    from packshard.pipeline.config import config_from_args

    cfg = config_from_args(["--demo", "--output", str(tmp_path / "out")])

    def interrupted(cfg, committed):  # Ray's shutdown or the summary, after the commit
        committed.append(True)
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "_run", interrupted)
    assert pack.run(cfg) == 130
    assert "holds the whole dataset (it was committed before)" in capsys.readouterr().err

    def early(cfg, committed):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "_run", early)
    with pytest.raises(KeyboardInterrupt):  # main prints "whatever was written is kept"
        pack.run(cfg)


@pytest.mark.parametrize("argv", [["--version"], ["pack", "--version"]])
def test_version(argv: list[str], capsys) -> None:
    """One version, packshard.__version__, which the installed metadata reads too."""
    import importlib.metadata

    import packshard

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"packshard {packshard.__version__}"
    assert importlib.metadata.version("packshard") == packshard.__version__
