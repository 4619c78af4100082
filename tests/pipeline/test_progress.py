"""The pack job's progress line (total, percentage, ETA) and its end-of-job summary."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from packshard.pipeline import progress as progress_module
from packshard.pipeline.progress import JobProgress, format_summary
from packshard.pipeline.samples import REASONS


def test_progress_line_has_total_percentage_and_eta(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    p = JobProgress(0, enabled=False)
    p.total = 1000  # set once the scheduler knows what is left to tokenize
    p.tokenized(250, 50_000)
    now[0] = 110.0
    line = p.line()
    assert line.startswith("pack:  25.0% | samples 250/1,000 | 5.00k tok/s")
    assert "| shards 0 |" in line and "elapsed 0:00:10 | ETA 0:00:30" in line
    resumed = JobProgress(10, enabled=False, kept_shards=3)
    assert "| shards 3 (3 kept) |" in resumed.line()


def test_log_lines_come_after_10_s_then_every_30_s(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(progress_module.sys.stderr, "isatty", lambda: False, raising=False)
    p = JobProgress(10, enabled=True)
    with caplog.at_level(logging.INFO, logger="packshard.pipeline.pack"):
        for t in (5, 11, 20, 40, 42):
            now[0] = t
            p.tokenized(1, 10)
            p.refresh()
    assert [r.getMessage().split("|")[1].strip() for r in caplog.records] == [
        "samples 2/10",  # t=11
        "samples 5/10",  # t=42: 30 s after the first
    ]


def test_drop_reasons_name_counts_and_first_records():
    p = JobProgress(4, enabled=False)
    code = REASONS.index("malformed_json") + 1
    p.skipped(np.array([0, code, code, 0], np.int8), [(7, "a.jsonl:line 8", "malformed_json", "x")])
    p.skipped(
        np.array([REASONS.index("empty_text") + 1], np.int8),
        [(2, "a.jsonl:line 3", "empty_text", "y")],
    )
    text = p.drop_reasons("truncate")
    assert text.splitlines() == [
        "empty_text 1, malformed_json 2",
        "  a.jsonl:line 3: empty_text: y",
        "  a.jsonl:line 8: malformed_json: x",
    ]
    assert "longer than --seq-len" in JobProgress(1, enabled=False).drop_reasons("drop")


@pytest.mark.parametrize("dropped", [0, 7])
def test_summary_lists_skipped_records_with_file_and_line(dropped: int):
    examples = [
        [i, f"data.jsonl:line {i + 1}", "malformed_json", "Expecting value"] for i in range(dropped)
    ]
    manifest = {
        "config": {"overlong": "truncate", "pad_multiple": 8, "seq_len": 1024},
        "shards": [{"bytes": 2048}],
        "skipped_examples": examples,
        "totals": {
            "samples_in": 10, "samples_kept": 10 - dropped, "dropped": {"malformed_json": dropped} if dropped else {},
            "truncated_samples": 0, "truncated_tokens": 0, "rows": 2, "padding_fraction": 0.001,
            "num_tokens": 100, "loss_tokens": 50, "padded_tokens": 104,
        },
    }  # fmt: skip
    text = format_summary(
        manifest, url="out", seconds=2.0, tokenized_tokens=100, workers=2, kept_shards=0
    )
    if not dropped:
        assert "skipped" not in text
        return
    lines = text.splitlines()
    start = lines.index(
        "  skipped   the first 5 of 7 skipped records (manifest.json's skipped_examples lists up to 20):"
    )
    assert lines[start + 1 : start + 3] == [
        "    data.jsonl:line 1: malformed_json: Expecting value",
        "    data.jsonl:line 2: malformed_json: Expecting value",
    ]
    assert len(lines) == start + 6


def test_the_terminal_bar_gets_the_total(monkeypatch):
    """The bar is made before the total is known; it had total 0 (no percentage, no ETA)."""
    monkeypatch.setattr(progress_module.sys.stderr, "isatty", lambda: True, raising=False)
    p = JobProgress(0, enabled=True)
    try:
        p.total = 40
        assert p._bar is not None and p._bar.total == 40
    finally:
        p.close()
