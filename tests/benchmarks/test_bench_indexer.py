"""bench_indexer.py --final on CPU: the summaries, verdicts and RESULTS.md round trip (no GPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import benchmarks._results as results_module
from benchmarks.indexer_final import (
    FIXED_TOPK_NAME,
    LOGITS_CANDIDATES,
    TITLE,
    TOPK_CANDIDATES,
    append_final_results,
    e2e_combos,
    final_markdown,
    fixed_head_to_head,
    summarize,
    verdicts,
)
from packshard.kernels import FIXED_CONFIG, FIXED_LOGITS_CONFIG, FIXED_TOPK_CONFIG

FIXED = FIXED_LOGITS_CONFIG.label
PIPE = "n128/k64/w4/s3/pipe"


def _shape(h: int, s: int, ms: dict[str, float]) -> dict:
    best = min(ms, key=ms.get)
    flops = 2 * h * 128 * s * s / 2
    return {
        "name": f"H={h} S={s // 1024}K causal",
        "H": h,
        "S": s,
        "ms": ms,
        "best": best,
        "ratio": {c: v / ms[best] for c, v in ms.items()},
        "tflops": {c: flops / (v * 1e9) for c, v in ms.items()},
    }


SHAPES = [
    _shape(64, 4096, {FIXED: 0.20, PIPE: 0.205, "n256/k64/w8/s3": 0.21}),
    _shape(64, 65536, {FIXED: 39.5, PIPE: 33.0, "n256/k64/w8/s3": 37.4}),
]
E2E = [
    {"logits": FIXED, "topk": "fixed", "total_ms": 59.0, "logits_ms": 39.5, "select_ms": 16.3,
     "order_ms": 5.6, "fallback_rows": 0, "same_as_fixed": True},
    {"logits": PIPE, "topk": "warp", "overlap": "priority", "chunks": 6, "total_ms": 44.2, "logits_ms": 33.0, "select_ms": 6.0,
     "order_ms": 3.1, "fallback_rows": 0, "same_as_fixed": True},
]  # fmt: skip


def test_summary_and_verdicts_name_the_candidates_that_meet_each_target() -> None:
    summary = summarize(SHAPES, [FIXED, PIPE, "n256/k64/w8/s3"])
    by = {r["config"]: r for r in summary}
    assert by[FIXED]["worst"] == pytest.approx(39.5 / 33.0)
    assert by[FIXED]["over_1_05"] == ["H=64 S=64K causal"]
    assert by[PIPE]["worst"] == pytest.approx(1.025) and by[PIPE]["over_1_05"] == []
    assert by[PIPE]["min_tflops_h64_16k"] == pytest.approx(2 * 64 * 128 * 65536**2 / 2 / 33e9)
    lines = verdicts(summary, E2E)
    assert lines[0].endswith(f"met by {PIPE} in the sweep")
    assert lines[1].endswith(f"met by {PIPE}")  # 33 ms at 64K is ~1041 TFLOP/s
    assert "44.2 ms" in lines[2] and "overlap priority" in lines[2] and lines[2].endswith("met")
    # a run of small shapes only (`--shapes`) does not say target 2 failed
    small = verdicts(summarize(SHAPES[:1], [FIXED, PIPE]), [])
    assert small[1].endswith("not measured (no H = 64 shape from 16K in this run)")


def test_target_1_takes_the_head_to_head_retime_where_the_sweep_put_another_first() -> None:
    # 4K: the fixed config is the sweep's best (it counts 1.0); 64K: the sweep says 1.197 and,
    # without a retime, that ratio counts; with one, the retime of the two alone does
    shapes = [dict(r) for r in SHAPES]
    assert fixed_head_to_head(shapes) == (pytest.approx(39.5 / 33.0), "H=64 S=64K causal")
    summary = summarize(shapes, [FIXED, PIPE])
    for h2h, verdict in ((1.02, "met"), (1.07, "missed")):
        shapes[1]["head_to_head"] = {"best": PIPE, "rounds": 15, "ms": {}, "ratio": h2h}
        assert fixed_head_to_head(shapes) == (h2h, "H=64 S=64K causal")
        line = verdicts(summary, E2E, shapes)[0]
        assert f"met by {PIPE} in the sweep" in line
        assert line.endswith(f"worst {h2h:.3f} at H=64 S=64K causal, {verdict}")
    # another shape where the sweep put PIPE first, retimed at 1.08: now the worst
    shapes[1]["head_to_head"]["ratio"] = 1.02
    shapes.append(_shape(32, 4096, {FIXED: 0.21, PIPE: 0.20}))
    shapes[-1]["head_to_head"] = {"best": PIPE, "rounds": 15, "ms": {}, "ratio": 1.08}
    assert fixed_head_to_head(shapes) == (1.08, "H=32 S=4K causal")
    assert fixed_head_to_head([]) is None
    md = final_markdown(
        {"date": "d", "budget_s": 1.0, "elapsed_s": 1.0, "e2e": [], "shapes": shapes,
         "summary": summarize(shapes, [FIXED, PIPE])}
    )  # fmt: skip
    assert "| fixed / best, head to head |" in md and "| 1.080 (15 rounds) |" in md
    assert "worst 1.080 at H=32 S=4K causal, missed" in md


def test_markdown_and_append_results_round_trip(tmp_path: Path, monkeypatch) -> None:
    result = {
        "date": "2026-12-02 18:00 UTC", "budget_s": 130.0, "elapsed_s": 98.0,
        "skipped": ["H=32 S=16K packed x6"], "e2e": E2E, "prepare_ms": 0.9, "shapes": SHAPES,
        "summary": summarize(SHAPES, [c.label for c in LOGITS_CANDIDATES]), "equal_logits": True,
    }  # fmt: skip
    md = final_markdown(result)
    assert "| n128/k64/w4/s3/pipe | warp | priority | 6 | 44.20 |" in md
    assert f"| {FIXED} | fixed | none | - | 59.00 |" in md  # a row from before overlap
    assert "Skipped for time: H=32 S=16K packed x6." in md
    assert "masked serial kernel with the same head sum (4K packed, H=64): True" in md
    saved = tmp_path / "indexer_final.json"
    saved.write_text(
        json.dumps(
            {"markdown": md, "command": "python bench_indexer.py --final", "machine": "H200"}
        )
    )
    monkeypatch.setattr(results_module, "RESULTS_MD", tmp_path / "RESULTS.md")
    monkeypatch.setattr(results_module, "HISTORY_DIR", tmp_path / "history")
    assert append_final_results(saved) == md
    text = (tmp_path / "RESULTS.md").read_text()
    assert f"## {TITLE}" in text and "- machine: H200" in text and "--final" in text
    saved.write_text(json.dumps({"markdown": md}))
    with pytest.raises(ValueError, match="no 'command' key"):
        append_final_results(saved)


def test_e2e_combos_cover_every_candidate_once() -> None:
    combos = e2e_combos()
    assert len(set(combos)) == len(combos)
    assert {lc for lc, _, _ in combos} == set(LOGITS_CANDIDATES)
    assert {tn for _, tn, _ in combos} == set(TOPK_CANDIDATES)
    assert combos[0] == (FIXED_LOGITS_CONFIG, FIXED_TOPK_NAME, "none")
    assert TOPK_CANDIDATES[FIXED_TOPK_NAME] == FIXED_TOPK_CONFIG
    assert {ov for _, _, ov in combos} == {FIXED_CONFIG.overlap}
    # every top-k candidate runs with the fixed logits config
    assert {tn for lc, tn, _ in combos if lc == FIXED_LOGITS_CONFIG} == set(TOPK_CANDIDATES)


def test_plain_run_folder_appends_to_results(tmp_path: Path, monkeypatch) -> None:
    from benchmarks.bench_indexer import BENCH_TITLE, append_bench_results

    (tmp_path / "indexer_bench.md").write_text("### Fixed config n128/k64/w4/s3\n\n| H |\n")
    (tmp_path / "indexer_meta.json").write_text(
        json.dumps({"machine": "GPU NVIDIA H200", "command": "python bench_indexer.py --out x"})
    )
    monkeypatch.setattr(results_module, "RESULTS_MD", tmp_path / "RESULTS.md")
    monkeypatch.setattr(results_module, "HISTORY_DIR", tmp_path / "history")
    append_bench_results(tmp_path)
    text = (tmp_path / "RESULTS.md").read_text()
    assert f"## {BENCH_TITLE}" in text and "- machine: GPU NVIDIA H200" in text
    assert "### Fixed config n128/k64/w4/s3" in text
    (tmp_path / "indexer_meta.json").unlink()
    with pytest.raises(ValueError, match=r"indexer_meta\.json"):
        append_bench_results(tmp_path)


def test_autotuned_peer_tunes_each_distinct_kernel_of_the_sweep_once() -> None:
    # the fixed config tunes as its large launches' form, which is v10's config: one entry
    from benchmarks.indexer_peers import SWEEP_CONFIGS, AutotunedLogits

    peer = AutotunedLogits()
    for heads in (64, 32):
        tuned = [
            (c.kwargs, c.num_warps, c.num_stages, c.maxnreg) for c in peer._kernel(heads).configs
        ]
        want = set()
        for c in SWEEP_CONFIGS:
            if c.block_n >= heads:
                meta, opts = c.kernel_params(heads)
                want.add(
                    (
                        tuple(meta.items()),
                        opts["num_warps"],
                        opts["num_stages"],
                        opts.get("maxnreg"),
                    )
                )
        assert len(tuned) == len(want) < len(SWEEP_CONFIGS)
        assert {(tuple(kw.items()), w, st, r) for kw, w, st, r in tuned} == want


def test_event_ms_times_batches_of_back_to_back_calls(monkeypatch) -> None:
    # CUDA events stood in by a clock that each call moves by 2 ms (plus 0.5 ms of launch
    # latency a sample, which batching must spread over the calls): 2 calls a sample cover
    # 3 ms, and the median is per call.
    import benchmarks.bench_indexer as bench

    clock = [0.0]
    calls = []

    class _Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self) -> None:
            self.t = clock[0]
            clock[0] += 0.25  # half the launch latency before the first call, half after

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: _Event) -> float:
            return end.t - self.t

    def fn() -> None:
        calls.append(1)
        clock[0] += 2.0

    monkeypatch.setattr(bench.torch.cuda, "Event", _Event)
    assert bench.batch_size(fn, 3.0) == 2  # one call reads 2.25 ms
    calls.clear()
    assert bench.event_ms(fn, reps=3, warmup=1, min_sample_ms=3.0) == (0.25 + 2 * 2.0) / 2
    assert len(calls) == 1 + 1 + 3 * 2  # warmup, the batch size's call, 3 samples of 2


def test_time_interleaved_warms_each_sample_and_shuffles_the_order(monkeypatch) -> None:
    # events stood in by a clock each call moves by its runner's ms; every timed sample must
    # follow an untimed call of the same runner, and the order must change between rounds
    import benchmarks.bench_indexer as bench
    import benchmarks.indexer_final as final

    clock = [0.0]
    trace: list[str] = []

    class _Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self) -> None:
            self.t = clock[0]
            trace.append("|")

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: _Event) -> float:
            return end.t - self.t

    def runner(name: str, ms: float):
        def fn() -> None:
            trace.append(name)
            clock[0] += ms

        return fn

    monkeypatch.setattr(bench.torch.cuda, "Event", _Event)
    monkeypatch.setattr(final.torch.cuda, "Event", _Event)
    runners = {n: runner(n, ms) for n, ms in (("a", 1.0), ("b", 4.0), ("c", 2.0), ("d", 3.0))}
    ms = final.time_interleaved(runners, rounds=6, min_sample_ms=3.0, seed=1)
    assert ms == {"a": 1.0, "b": 4.0, "c": 2.0, "d": 3.0}
    i, orders = 4 * 4, []  # past each runner's warm call and batch-sizing sample (n, |, n, |)
    for _ in range(6):
        order = ""
        for _ in range(4):
            warm, start = trace[i], trace[i + 1]
            j = trace.index("|", i + 2)
            calls, i = trace[i + 2 : j], j + 1
            assert start == "|" and calls and set(calls) == {warm}  # warmed by its own call
            order += warm
        orders.append(order)
    assert i == len(trace)
    assert all(sorted(o) == list("abcd") for o in orders)
    assert len(set(orders)) > 1  # not the same neighbour every round


def test_launch_identity_merges_configs_that_launch_the_same_kernel() -> None:
    # at H = 32 the fixed config's pairing, cap and relu do not apply: it launches the plain
    # n128/k64/w4/s3 kernel with the same arguments; at H = 64 it pairs query blocks
    from dataclasses import replace

    import torch

    from benchmarks.bench_indexer import launch_identity
    from packshard.kernels.fp8_indexer import prepare_inputs
    from packshard.kernels.logits import LogitsConfig

    plain = LogitsConfig(block_n=128, block_k=64, num_warps=4, num_stages=3)
    s = 200
    ks = torch.tensor([0] * 120 + [120] * 80, dtype=torch.int32)
    ke = torch.arange(1, s + 1, dtype=torch.int32)
    ids = {}
    for h in (32, 64):
        g = torch.Generator().manual_seed(h)
        q = torch.randn(s, h, 128, generator=g).bfloat16()
        k = torch.randn(s, 128, generator=g).bfloat16()
        w = torch.randn(s, h, generator=g)
        p = prepare_inputs(q, k, w, ks, ke)
        configs = (FIXED_LOGITS_CONFIG, plain, replace(FIXED_LOGITS_CONFIG, group_min_scores=None))
        ids[h] = [launch_identity(p, c) for c in configs]
        assert all(i[0][0] == "triton" for i in ids[h])  # no warp-specialised launch on the CPU
    assert ids[32][0] == ids[32][1] == ids[32][2]
    # 200 rows x 256 keys is under the fixed config's 2^25 scores: its one-block form runs
    assert ids[64][0] == ids[64][1] != ids[64][2]


def test_markdown_names_configs_timed_once_with_the_fixed_config() -> None:
    shape = _shape(32, 4096, {FIXED: 0.09, "n128/k64/w4/s3": 0.09, PIPE: 0.1})
    shape["same_as"] = {"n128/k64/w4/s3": FIXED}
    result = {
        "date": "2026-12-04 14:00 UTC", "budget_s": 300.0, "elapsed_s": 120.0, "e2e": [],
        "shapes": [shape], "summary": summarize([shape], [FIXED]), "equal_logits": None,
    }  # fmt: skip
    md = final_markdown(result)
    assert "Timed once with the fixed config (the same kernels and arguments): " in md
    assert "H=32 S=4K causal: n128/k64/w4/s3." in md


def test_shapes_parse_and_bad_items_are_named() -> None:
    from benchmarks.bench_indexer import parse_shapes

    assert parse_shapes("64:4096:packed, 32:8192:causal") == ((64, 4096, True), (32, 8192, False))
    for bad in ("64:4096", "64:4k:causal", "64:4096:dense", "16:4096:causal", "32:2560:causal",
                "32:0:packed"):  # fmt: skip
        with pytest.raises(SystemExit, match=re.escape(f"{bad!r} is not H:S:causal|packed")):
            parse_shapes(f"32:2048:causal,{bad}")
