"""The pack job's driver loop (`pipeline.scheduler`) on a real local Ray (2 CPUs, one per module):
the error names the first bad record in input order whatever the worker count and the order in
which tokenize tasks finish, and the manifest records the nodes that ran the tasks."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from packshard.pipeline.pack import main, start_local_ray

pytestmark = [pytest.mark.ray]

GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
BAD = {"messages": []}  # empty_conversation
# file -> 1-based lines holding a bad record; the first in input order is a.jsonl line 7, and
# every block of 13+ records of a.jsonl holds one (so a later block in flight fails too)
BAD_AT = {"a.jsonl": (7, 20, 33, 46, 59), "b.jsonl": (5, 40), "c.jsonl": (12,)}
LINES = 60


@pytest.fixture(scope="module")
def ray_local():
    import ray

    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    for name, bad in BAD_AT.items():
        rows = [BAD if n in bad else GOOD for n in range(1, LINES + 1)]
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture
def last_finished_first(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`ray.wait` that hands the driver the most recently submitted of the ready tasks first
    (the adversarial order: later blocks seen before earlier ones); returns a list that counts
    the calls in which more than one task was ready (so the order was really reversed)."""
    import ray

    real_wait = ray.wait
    reversed_calls: list[int] = []

    def wait(refs: list[Any], *, num_returns: int = 1, timeout: float | None = None, **kw: Any):
        ready, _ = real_wait(refs, num_returns=len(refs), timeout=timeout, **kw)
        if len(ready) > 1:
            reversed_calls.append(len(ready))
        chosen = ready[-1:] if ready else []
        return chosen, [r for r in refs if r not in chosen]

    monkeypatch.setattr(ray, "wait", wait)
    return reversed_calls


def _args(inp: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--input", str(inp), "--output", str(out), "--tokenizer", "packshard:demo",
        "--seq-len", "1024", "--cp", "8", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_error_names_the_first_bad_record_in_input_order(
    ray_local, inputs: Path, tmp_path: Path, capsys, last_finished_first: list[int], workers: int
):
    out = tmp_path / "out"
    assert main(_args(inputs, out, "--num-workers", str(workers))) == 1
    err = capsys.readouterr().err
    assert f"{inputs / 'a.jsonl'}:line 7: empty_conversation" in err, err
    assert err.count("empty_conversation") == 1 and "--skip-bad-records" in err
    assert not (out / "manifest.json").exists()
    if workers > 1:  # blocks of 60 small records: several finished together, the later first
        assert last_finished_first


def test_a_bad_record_after_written_shards_names_overwrite_too():
    """Shards written before the bad record was read were packed without skipping: a rerun
    with --skip-bad-records is another config, refused without --overwrite, so the error says
    both (and only --skip-bad-records while nothing was written)."""
    from types import SimpleNamespace

    from packshard.pipeline.scheduler import Scheduler

    def failure(results: dict, skippable: bool = True) -> str:
        s = SimpleNamespace(error=(7, "a.jsonl:line 8: empty_conversation: x", skippable))
        s.results = results
        return str(Scheduler._failure(s))  # type: ignore[arg-type]

    assert failure({}).endswith(
        "(pass --skip-bad-records to skip such records and count them in the manifest)"
    )
    assert "this job has 2 verified shard(s) packed without it, so add --overwrite" in failure(
        {0: 1, 1: 1}
    )
    assert failure({0: 1}, skippable=False) == "a.jsonl:line 8: empty_conversation: x"


def test_the_first_bad_record_also_under_shuffle_and_when_it_is_the_last_block(
    ray_local, inputs: Path, tmp_path: Path, capsys, last_finished_first: list[int]
):
    for name in ("a.jsonl", "b.jsonl"):  # only c.jsonl (the last file) keeps a bad record
        (inputs / name).write_text(json.dumps(GOOD) + "\n")
    assert main(_args(inputs, tmp_path / "out", "--shuffle", "--num-workers", "2")) == 1
    assert f"{inputs / 'c.jsonl'}:line 12: empty_conversation" in capsys.readouterr().err
    assert last_finished_first  # the blocks' results reached the driver out of order


def test_skipping_counts_every_bad_record_and_the_manifest_names_the_nodes(
    ray_local, inputs: Path, tmp_path: Path
):
    import ray

    out = tmp_path / "out"
    assert main(_args(inputs, out, "--skip-bad-records", "--num-workers", "2")) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["dropped"] == {"empty_conversation": 8}
    assert [e[1].rsplit("/", 1)[1] for e in m["skipped_examples"]] == [
        f"{name}:line {line}" for name, lines in BAD_AT.items() for line in lines
    ]
    (node,) = m["job"]["nodes"]  # one local node ran everything
    assert node["node_id"] == ray.get_runtime_context().get_node_id()
    assert node["tasks"]["tokenize"] >= 3 and node["tasks"]["pack"] == len(m["shards"])


def test_truncation_that_leaves_no_loss_token_is_counted_not_fatal(
    ray_local, tmp_path: Path, capsys
):
    inp = tmp_path / "ids.jsonl"
    rows = [
        {"input_ids": list(range(1, 25)), "loss_mask": [0] * 16 + [1] * 8},  # loss past 16
        {"input_ids": list(range(1, 25)), "loss_mask": [0] * 15 + [1] * 9},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
    ]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = _args(inp, out, "--num-workers", "1")
    args[args.index("--seq-len") + 1] = "16"
    assert main(args) == 0
    m = json.loads((out / "manifest.json").read_text())
    t = m["totals"]
    assert t["dropped"] == {"no_loss_after_truncate": 1} and t["samples_kept"] == 2
    assert (t["truncated_samples"], t["truncated_tokens"], t["loss_tokens"]) == (1, 8, 3)
    assert t["dropped_tokens"] == 24  # the dropped sample's tokens are counted too
    assert [e[1].rsplit("/", 1)[1] for e in m["skipped_examples"]] == ["ids.jsonl:line 1"]
    assert (
        "1 more dropped (24 tokens), their loss tokens all past seq_len" in capsys.readouterr().out
    )
    # split keeps every token: the first 16 of sample 1 become a piece with no loss token
    split = tmp_path / "split"
    args[args.index(str(out))] = str(split)
    assert main([*args, "--overlong", "split"]) == 0
    t = json.loads((split / "manifest.json").read_text())["totals"]
    assert t["dropped"] == {} and (t["split_samples"], t["extra_pieces"]) == (2, 2)
    assert (t["lossless_pieces"], t["lossless_piece_tokens"]) == (1, 16)
    assert "1 pieces (16 tokens) carry no loss token" in capsys.readouterr().out


_TIMED_OUT = Exception("The current node timed out during startup. (a busy machine)")


@pytest.mark.parametrize(
    "failure",
    ["ctrl_c", "error", "timeout_then_ctrl_c", "ctrl_c_in_retry_shutdown"],
)
def test_a_failed_ray_start_stops_the_ray_processes_it_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failure: str
):
    """Ray cannot stop a node whose start failed before it held it (Ctrl-C inside `ray.init`, a
    start error, a start that timed out before the retry): its raylet's dashboard and
    runtime-env agents ran on for good. Here each attempt's node is a process named
    ``ray::...`` (as Ray's agents and workers name themselves) that starts one of its own (the
    raylet's agent); every attempt's pair must be gone, while a subprocess of the caller's,
    started during the same `ray.init` from a ``ray`` directory that is not Ray's package (Ray
    images run from ``/home/ray``), must live on."""
    import subprocess
    import sys
    import time

    import psutil  # after ray: Ray ships it
    import ray

    node_script = tmp_path / "node.py"
    node_script.write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.argv[1], '-c', 'import time; time.sleep(120)'])\n"
        "time.sleep(120)\n"
    )
    callers_script = tmp_path / "home" / "ray" / "app.py"
    callers_script.parent.mkdir(parents=True)
    callers_script.write_text("import time\ntime.sleep(120)\n")
    nodes: list[int] = []
    callers: list[subprocess.Popen] = []
    attempts: list[int] = []

    def start_node() -> None:
        child = subprocess.Popen(
            ["ray::FakeNode", str(node_script), sys.executable], executable=sys.executable
        )
        deadline = time.monotonic() + 30
        while not psutil.Process(child.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        nodes.extend([child.pid, *(p.pid for p in psutil.Process(child.pid).children())])

    def failing_init(**_: Any) -> None:
        attempts.append(1)
        if len(attempts) == 1:  # the caller's own subprocess, started meanwhile
            callers.append(subprocess.Popen([sys.executable, str(callers_script)]))
        start_node()
        if failure == "error":
            raise RuntimeError("the raylet died")
        if failure != "ctrl_c" and len(attempts) == 1:
            raise _TIMED_OUT
        raise KeyboardInterrupt

    shutdowns: list[int] = []

    def shutdown() -> None:  # the module's Ray, if up, stays
        shutdowns.append(1)
        if failure == "ctrl_c_in_retry_shutdown" and len(shutdowns) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    try:
        with pytest.raises(RuntimeError if failure == "error" else KeyboardInterrupt):
            start_local_ray(num_cpus=1)
        expected_attempts = 2 if failure == "timeout_then_ctrl_c" else 1
        assert len(attempts) == expected_attempts and len(nodes) == 2 * expected_attempts

        def gone(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        deadline = time.monotonic() + 10
        while not all(gone(p) for p in nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(p) for p in nodes)
        assert callers[0].poll() is None  # not Ray's: left alone
    finally:
        for c in callers:
            c.kill()
            c.wait()
        for pid in nodes:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


@pytest.mark.parametrize("case", ["one", "two", "one_then_timeout", "ignored"])
def test_a_ctrl_c_while_ray_starts_is_held_until_the_start_returns(
    monkeypatch: pytest.MonkeyPatch, case: str
):
    """Raised inside `ray.init`, a Ctrl-C can land after Ray made the driver's core worker and
    before Python holds it; the process then crashed with SIGSEGV at exit. One Ctrl-C is held
    until `ray.init` returns or fails (a start that timed out is not retried then), and the
    start is then stopped (`ray.shutdown` among it); a second one raises at once. A SIGINT the
    process ignores (a background job of a script) stays ignored."""
    import os
    import signal

    import ray

    # Python's own handler, as in a terminal (a background run of the suite ignores SIGINT)
    previous = signal.signal(
        signal.SIGINT, signal.SIG_IGN if case == "ignored" else signal.default_int_handler
    )
    finished: list[bool] = []
    shutdowns: list[int] = []

    def init(**_: Any) -> None:
        for _ in range(2 if case == "two" else 1 if not finished else 0):
            os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):  # the handler runs between these bytecodes
            pass
        finished.append(True)
        if case == "one_then_timeout" and len(finished) == 1:
            raise _TIMED_OUT

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    try:
        before = signal.getsignal(signal.SIGINT)
        if case == "ignored":
            start_local_ray(num_cpus=1)
            assert finished == [True] and shutdowns == []
        else:
            with pytest.raises(KeyboardInterrupt):
                start_local_ray(num_cpus=1)
            assert finished == ([] if case == "two" else [True])  # and no second start
            assert shutdowns == [1]
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_task_error_that_does_not_pickle_is_raised_redacted():
    """Ray prints a task's error that does not pickle whole, message unredacted (aiohttp's
    ClientResponseError quotes the signed URL it read)."""
    from packshard.pipeline.scheduler import picklable_errors

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no pickling")

    def fails(kind: str) -> None:
        if kind == "unpicklable":
            raise Unpicklable("503, url='http://h/x.jsonl?X-Amz-Signature=SECRET'\nmore")
        raise ValueError("a picklable error passes as it is")

    with pytest.raises(RuntimeError) as e:
        picklable_errors(fails)("unpicklable")
    assert str(e.value) == "Unpicklable: 503, url='http://h/x.jsonl'"
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(ValueError, match="passes as it is"):
        picklable_errors(fails)("picklable")
    assert picklable_errors(fails).__name__ == "fails"  # Ray's task name


@pytest.mark.parametrize("cancel_tasks", [True, False])
def test_a_stop_cancels_tasks_only_where_the_driver_stays_connected(
    monkeypatch: pytest.MonkeyPatch, cancel_tasks: bool
):
    """Ray 2.60's driver aborts when a cancel races with a task finishing (exit 1 and a stack
    trace on `ray job stop`). A driver that disconnects at the job's end (it joined or started
    Ray itself) ends its tasks so and cancels none; under a caller's Ray they are cancelled."""
    import ray

    from packshard.pipeline.scheduler import Interrupted, StopFlag

    cancelled: list[str] = []
    monkeypatch.setattr(ray, "wait", lambda refs, **_: ([], list(refs)))
    monkeypatch.setattr(ray, "cancel", lambda ref, **_: cancelled.append(ref))
    stop = StopFlag(cancel_tasks=cancel_tasks)
    stop.check(["a"])  # not set: nothing happens
    stop.set("SIGTERM")
    with pytest.raises(Interrupted, match="SIGTERM"):
        stop.check(["a", "b"])
    assert cancelled == (["a", "b"] if cancel_tasks else [])
