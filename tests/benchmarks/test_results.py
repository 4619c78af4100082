"""record_result: RESULTS.md keeps one section a benchmark (the latest run), the history keeps
every run, and other benchmarks' sections and the text above them stay as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks._results as results


@pytest.fixture
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    md, hist = tmp_path / "RESULTS.md", tmp_path / "history"
    monkeypatch.setattr(results, "RESULTS_MD", md)
    monkeypatch.setattr(results, "HISTORY_DIR", hist)
    return md, hist


def test_section_is_replaced_not_duplicated(paths: tuple[Path, Path]) -> None:
    md, hist = paths
    results.record_result("bench_a", "A: ours vs peer", "| x |\n|---|\n| 1.0 |", command="c1")
    results.record_result("bench_b", "B: other", "b body", data={"n": 3}, machine="m-b")
    b_section = results.split_sections(md.read_text())[1]["bench_b"]
    results.record_result("bench_a", "A: ours vs peer", "| x |\n|---|\n| 2.0 |", command="c2")

    text = md.read_text()
    head, sections = results.split_sections(text)
    assert list(sections) == ["bench_a", "bench_b"]  # replaced in place, order kept
    assert text.count("<!-- benchmark: bench_a -->") == 1
    assert "| 2.0 |" in sections["bench_a"] and "| 1.0 |" not in text
    assert "- command: `c2`" in sections["bench_a"] and "`c1`" not in text
    assert sections["bench_b"] == b_section  # the other benchmark's section, byte for byte
    assert head.startswith("# Benchmark results")

    runs = [json.loads(line) for line in (hist / "bench_a.jsonl").read_text().splitlines()]
    assert [r["command"] for r in runs] == ["c1", "c2"]  # every run, oldest first
    assert runs[0]["markdown"] == "| x |\n|---|\n| 1.0 |"
    assert set(runs[1]) == {
        "benchmark",
        "title",
        "date",
        "machine",
        "load",
        "command",
        "markdown",
        "data",
    }
    assert runs[1]["benchmark"] == "bench_a" and runs[1]["date"].endswith(" UTC")
    assert len(runs[1]["load"]) == 3 and all(x >= 0 for x in runs[1]["load"])
    assert runs[1]["machine"] == results.machine_description()
    assert results.read_history("bench_b") == [json.loads((hist / "bench_b.jsonl").read_text())]
    assert results.read_history("bench_b")[0]["data"] == {"n": 3}
    assert results.read_history("bench_b")[0]["machine"] == "m-b"


def test_section_shows_date_machine_load_and_command(paths: tuple[Path, Path]) -> None:
    md, _ = paths
    results.record_result("bench_a", "A title", "the body", command="python x.py --n 1")
    section = results.split_sections(md.read_text())[1]["bench_a"]
    lines = section.splitlines()
    assert lines[:2] == ["<!-- benchmark: bench_a -->", "## A title"]
    assert any(line.startswith("- date: ") and line.endswith(" UTC") for line in lines)
    assert f"- machine: {results.machine_description()}" in lines
    assert any(line.startswith("- load average (1/5/15 min): ") for line in lines)
    assert "- command: `python x.py --n 1`" in lines
    assert lines[-1] == "the body"


def test_text_above_the_sections_and_unmarked_files_are_kept(paths: tuple[Path, Path]) -> None:
    md, _ = paths
    md.write_text("# Benchmark results\n\nA note the lead wrote.\n")
    results.record_result("bench_a", "A", "body")
    head, sections = results.split_sections(md.read_text())
    assert "A note the lead wrote." in head and list(sections) == ["bench_a"]


def test_bad_ids_titles_and_data_touch_no_file(paths: tuple[Path, Path]) -> None:
    md, hist = paths
    with pytest.raises(ValueError, match="benchmark id"):
        results.record_result("Bench A", "A", "body")
    with pytest.raises(ValueError, match="spans lines"):
        results.record_result("bench_a", "A\nB", "body")
    with pytest.raises(TypeError):
        results.record_result("bench_a", "A", "body", data=[1, 2])  # type: ignore[arg-type]
    assert not md.exists() and not hist.exists()


def test_duplicate_markers_are_refused(paths: tuple[Path, Path]) -> None:
    md, _ = paths
    md.write_text("# R\n\n<!-- benchmark: a -->\n## A\n\n<!-- benchmark: a -->\n## A again\n")
    with pytest.raises(ValueError, match="two sections"):
        results.record_result("a", "A", "body")


def test_saved_gpu_run_keeps_its_stamp_and_data(paths: tuple[Path, Path], tmp_path: Path) -> None:
    md, _ = paths
    saved = tmp_path / "run.json"
    stamp = {"date": "2026-01-02 03:04 UTC", "machine": "H200 box", "load": [1.0, 2.0, 3.0]}
    saved.write_text(json.dumps({**stamp, "command": "python g.py", "markdown": "| t |", "ms": 4}))
    assert results.record_saved_result(saved, "bench_g", "G", "g.json") == "| t |"
    (run,) = results.read_history("bench_g")
    assert {k: run[k] for k in stamp} == stamp and run["data"] == {"ms": 4}
    assert "- load average (1/5/15 min): 1.00 / 2.00 / 3.00" in md.read_text()
    saved.write_text(json.dumps({"markdown": "x"}))
    with pytest.raises(ValueError, match=r"not the g\.json \(no 'command' key\)"):
        results.record_saved_result(saved, "bench_g", "G", "g.json")


def test_run_stamp_names_this_machine() -> None:
    stamp = results.run_stamp()
    assert stamp["machine"] == results.machine_description()
    assert len(stamp["load"]) == 3 and stamp["command"].startswith("python ")
