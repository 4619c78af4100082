"""Resume: exact (the next micro-batch is the one the uninterrupted run would give), elastic
(dp 4 -> 2 at a step boundary: no row skipped or repeated over the epoch), and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from packshard.trainer_shim import STATE_VERSION, PackedShardStream
from packshard.trainer_shim.synthetic import write_synthetic_dataset


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def stream(url: Path, **kw) -> PackedShardStream:
    args = {"dp_rank": 0, "dp_size": 2, "rows_per_step": 6, "seed": 4, "epochs": 2, **kw}
    return PackedShardStream(str(url), **args)


@pytest.mark.parametrize("stop_after", [0, 7, 8, 9, 23, 40])  # 3 micro-steps per step; 24 per epoch
def test_exact_resume(small_dataset: Path, stop_after: int):
    kw = {"dp_rank": 1, "cp_size": 2, "cp_rank": 1, "cp_layout": "zigzag"}
    full = list(stream(small_dataset, **kw))
    first = stream(small_dataset, **kw)
    it = iter(first)
    head = [next(it) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    assert len(json.dumps(state)) < 1024
    resumed = stream(small_dataset, **kw)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full) - stop_after
    tail = list(resumed)
    assert len(head) + len(tail) == len(full)
    assert all(same(a, b) for a, b in zip(head + tail, full, strict=True))


def test_state_contents(small_dataset: Path):
    s = stream(small_dataset, dp_rank=1)
    it = iter(s)
    for _ in range(4):
        next(it)
    st = s.state_dict()
    assert st["version"] == STATE_VERSION
    assert st["topology"] == {
        "dp_rank": 1,
        "dp_size": 2,
        "cp_rank": 0,
        "cp_size": 1,
        "cp_layout": "contiguous",
    }
    assert st["position"] == {"epoch": 0, "offset": 6, "step": 1, "micro_step": 1}
    assert st["dataset"]["fingerprint"].startswith("xxh3_128:")


def test_elastic_4_to_2_no_row_skipped_or_repeated(small_dataset: Path):
    """Four ranks run 3 steps and checkpoint; two ranks resume from rank 3's state."""
    n_rows = 48
    four = [
        stream(small_dataset, dp_rank=r, dp_size=4, rows_per_step=8, epochs=1) for r in range(4)
    ]
    seen: list[int] = []
    for s in four:
        it = iter(s)
        seen += [next(it)["row"] for _ in range(3 * 2)]  # 3 steps x 2 micro-steps
    states = [s.state_dict() for s in four]
    assert all(st["position"] == states[0]["position"] for st in states)
    two = [stream(small_dataset, dp_rank=r, dp_size=2, rows_per_step=8, epochs=1) for r in range(2)]
    for s in two:
        s.load_state_dict(states[3])
    rest = [list(s) for s in two]
    assert rest[0][0]["step"] == 3 and len(rest[0]) == len(rest[1]) == 3 * 4
    seen += [mb["row"] for mbs in rest for mb in mbs]
    real = sorted(r for r in seen if r >= 0)
    assert real == list(range(n_rows))


def test_elastic_change_of_rows_per_step(small_dataset: Path):
    a = stream(small_dataset, dp_size=1, rows_per_step=5, epochs=1)
    it = iter(a)
    rows = [next(it)["row"] for _ in range(10)]
    b = stream(small_dataset, dp_size=1, rows_per_step=7, epochs=1)
    b.load_state_dict(a.state_dict())
    rows += [mb["row"] for mb in b]
    assert sorted(r for r in rows if r >= 0) == list(range(48))


def test_mid_step_state_refuses_new_dp_size(small_dataset: Path):
    s = stream(small_dataset)
    it = iter(s)
    next(it)
    with pytest.raises(
        ValueError,
        match=r"middle of step 0 .* dp_size=2; resuming mid-step needs the same dp_size .*step boundaries",
    ):
        stream(small_dataset, dp_size=3).load_state_dict(s.state_dict())


def test_refuses_other_dataset_and_other_order(small_dataset: Path, tmp_path: Path):
    other = tmp_path / "other"
    write_synthetic_dataset(str(other), lengths=[30] * 100, seq_len=512, pad_multiple=4)
    state = stream(small_dataset).state_dict()
    with pytest.raises(ValueError, match="saved on another dataset"):
        stream(other).load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"seed=4 but the stream has seed=5; the row order would differ"
    ):
        stream(small_dataset, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match=r"shuffle=True but the stream has shuffle=False"):
        stream(small_dataset, shuffle=False).load_state_dict(state)
    # without shuffling the seed orders nothing: a state resumes under any seed, exactly
    plain = stream(small_dataset, shuffle=False)
    it = iter(plain)
    head = [next(it) for _ in range(5)]
    other_seed = stream(small_dataset, shuffle=False, seed=5)
    other_seed.load_state_dict(plain.state_dict())
    full = list(stream(small_dataset, shuffle=False))
    assert all(same(a, b) for a, b in zip(head + list(other_seed), full, strict=True))
    with pytest.raises(ValueError, match="version 99 is not known"):
        stream(small_dataset).load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="not a PackedShardStream state"):
        stream(small_dataset).load_state_dict({"step": 3})
    broken = json.loads(json.dumps(state))
    del broken["position"]["offset"]
    with pytest.raises(ValueError, match=r"position lacks \['offset'\]"):
        stream(small_dataset).load_state_dict(broken)


def test_load_state_supersedes_running_iteration(small_dataset: Path):
    s = stream(small_dataset)
    it = iter(s)
    next(it)
    s.load_state_dict(stream(small_dataset).state_dict())
    with pytest.raises(RuntimeError, match="this iteration was stopped"):
        next(it)
    assert next(iter(s))["step"] == 0


@pytest.mark.parametrize(
    "state, match",
    [
        (None, "must be a dict, got NoneType"),
        ('{"version": 1}', "must be a dict, got str"),
        ({"position": {"micro_step": -1}}, r"micro_step must be an int >= 0, got -1"),
        ({"position": {"offset": -4}}, r"offset must be an int >= 0, got -4"),
        ({"position": {"step": 1.0}}, r"step must be an int >= 0, got 1.0"),
    ],
)
def test_a_malformed_state_is_refused_when_loaded(small_dataset: Path, state, match):
    if isinstance(state, dict):
        good = stream(small_dataset).state_dict()
        state = {**good, "position": {**good["position"], **state["position"]}}
    with pytest.raises(ValueError, match=match):
        stream(small_dataset).load_state_dict(state)
