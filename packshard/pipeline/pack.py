"""The pack job: raw samples -> a committed packshard dataset, on Ray.

    packshard pack --input 'data/*.jsonl' --output s3://bucket/run/ \\
        --tokenizer Qwen/Qwen3-8B --seq-len 131072 --cp 8 --cp-layout zigzag
    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m packshard.pipeline.pack ...                                 # on a cluster
    packshard pack --demo --output demo_out                                   # built-in data, no files

Under `ray job submit` (``RAY_ADDRESS`` set) it joins that cluster; otherwise it starts a local
Ray of ``--num-cpus`` CPUs (never joining another local cluster by accident).

Steps: check this Python has the job's dependencies (`missing_environment`: find_spec only, so a
job submitted to a head that runs another Python stops in one line naming it); check the
output, the inputs and the tokenizer's source (`preflight`: no Ray, no transformers); load the
tokenizer once on the driver, check that packshard renders its chat template exactly like
`apply_chat_template`; compare the config with what the output holds (`jobstate`: fresh, resume,
or already complete; a different config is refused naming ``--overwrite``). Every user error
arrives before this point, within about a second for local files; only then does Ray start.
Then count the inputs, write the plan, tokenize and pack on Ray (`scheduler`; the tokenizer
travels to the workers through the object store), commit with `packers.finalize_dataset`
(index.arrow, then manifest.json last) and print the summary and the dataset's stats. Nothing
printed or logged holds a credential (`inputs.redact_text`). ``--demo`` packs
`packshard.pipeline.demo`'s generated mix through the ``demo://`` input (generated inside the
tasks that read it, so it works on any cluster) with the built-in tokenizer, at seq_len 32768
and cp 8 unless given.

Exit status: 0 done (or nothing to do), 1 the job failed (message names the record, file or
shard), 2 bad flags, 130/143 stopped by SIGINT/SIGTERM (rerun the same command to resume).
"""

# ruff: noqa: E402 (the environment is checked before the imports that need it)

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import posixpath
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packshard._extras import EXTRAS, MissingExtraError

RAY_START_ATTEMPTS = 3


def missing_environment() -> str | None:
    """What this Python lacks for the job, with the fix; None when it has everything.

    Under `ray job submit` the entrypoint's ``python`` is the first one on the Ray head's PATH
    when ``ray start`` ran, which need not be the environment packshard is installed in.
    Only `find_spec` is used: nothing is imported.
    """
    missing = [
        m
        for m in ("numpy", "pyarrow", "fsspec", *EXTRAS["pack"])
        if importlib.util.find_spec(m) is None
    ]
    if not missing:
        return None
    message = f"the pack job needs {', '.join(missing)}, which this Python ({sys.executable}) lacks"
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or os.environ.get("RAY_ADDRESS"):
        return message + (
            ". Under `ray job submit` the job's `python` is the first on the Ray head's PATH when "
            "`ray start` ran: start the head from the environment that has packshard[pack] (its "
            "venv activated, or deploy/Dockerfile's image), or submit with --runtime-env-json "
            '\'{"env_vars": {"PATH": "/path/to/venv/bin:${PATH}"}, "py_executable": '
            '"/path/to/venv/bin/python"}\' (the workers need it too; docs/OPERATIONS.md)'
        )
    return message + ": pip install 'packshard[pack]'"


if (_MISSING := missing_environment()) is not None:
    if __name__ == "__main__":  # `python -m packshard.pipeline.pack`: one line, no traceback
        print(f"packshard pack: error: {_MISSING}", file=sys.stderr)
        sys.exit(1)
    raise MissingExtraError(_MISSING, name="packshard.pipeline.pack")

from packshard.packers import FormatError, ShardDataset, finalize_dataset, rows_per_batch_for
from packshard.packers.urls import add_redacting_filter
from packshard.pipeline.config import PackConfig, config_from_args
from packshard.pipeline.inputs import InputError, InputFile, redact_text, redact_url
from packshard.pipeline.jobstate import (
    OutputError,
    OutputState,
    inspect_output,
    remove_job_state,
    write_plan,
)
from packshard.pipeline.preflight import has_chat_template, preflight
from packshard.pipeline.progress import JobProgress, format_summary
from packshard.pipeline.stats import dataset_stats, format_stats
from packshard.pipeline.tokenizer_loading import (
    NO_PAD_TOKEN,
    TokenizerError,
    TokenizerSource,
    load_located,
    pad_or_eos,
)

if TYPE_CHECKING:
    from packshard.pipeline.scheduler import InputCounter, StopFlag
    from packshard.pipeline.tokenization import SampleEncoder

log = logging.getLogger("packshard.pipeline.pack")

USER_ERRORS = (InputError, OutputError, TokenizerError, FormatError)


def _stats_text(url: str, storage_options: Any) -> str:
    with ShardDataset.open(url, storage_options=storage_options) as ds:
        return redact_text(format_stats(dataset_stats(ds)))


def start_ray(cfg: PackConfig) -> bool:
    """Connect to the job's cluster (RAY_ADDRESS) or start a local Ray; True if started here."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return True
    # Workers import `packshard` from a checkout too: the local Ray's processes inherit this
    # PYTHONPATH (and start_local_ray's Ray settings) when they start; the caller's environment
    # is given back afterwards (a process that packs in-process and starts other Pythons later
    # must not pass them our path).
    root = str(Path(__file__).resolve().parents[2])
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *LOCAL_RAY_ENV)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, saved["PYTHONPATH"]) if p)
    try:
        start_local_ray(cfg.num_cpus)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return True


LOCAL_RAY_ENV = {"RAY_agent_register_timeout_ms": "120000"}  # see start_local_ray


def start_local_ray(num_cpus: int | None) -> None:
    """A new local Ray (never an existing cluster found on this machine), robust to a busy box.

    Whatever stops the start (Ctrl-C, an error, a start that timed out before a retry) stops
    the Ray processes it started (`_stop_new_processes`): Ray cannot reach a node whose start
    failed before it held it, and its agents would run on for good."""
    import ray

    # The raylet waits for its Python agents' ports (15 s by default) and aborts if they are late,
    # which happens on a busy machine; give them two minutes (the user's setting wins).
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    before = _descendants()
    try:
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                with _ctrl_c_after_start():
                    ray.init(
                        address="local",
                        num_cpus=num_cpus,
                        include_dashboard=False,
                        logging_level=logging.WARNING,
                    )
                return
            except Exception as e:  # ray/_private/node.py raises exactly Exception for this case
                # Ray's driver gives the node 30 s to register; a loaded machine can miss that.
                # That is worth another try; anything else (another type or message) is raised.
                if (
                    type(e) is not Exception
                    or "timed out during startup" not in str(e)
                    or attempt == RAY_START_ATTEMPTS
                ):
                    raise
                log.warning(
                    "local Ray did not start in time (attempt %d of %d); retrying",
                    attempt,
                    RAY_START_ATTEMPTS,
                )
                _stop_new_processes(before)  # the late node's GCS, raylet and agents
    except BaseException:
        _stop_new_processes(before)
        raise


@contextlib.contextmanager
def _ctrl_c_after_start() -> Iterator[None]:
    """Hold a Ctrl-C that arrives while `ray.init` starts the local node until it returns or
    fails (then raise KeyboardInterrupt, and `start_local_ray` stops what it started, retrying
    nothing); a second Ctrl-C raises at once. Only Python's own SIGINT handler is replaced.

    Raised inside `ray.init`, the interrupt can land after Ray 2.60 made this process's core
    worker and before Python holds it: no `ray.shutdown` can stop it then, and the process
    crashed with SIGSEGV at exit (Ray's metrics thread outlives the worker it reads; 2 of 7
    Ctrl-Cs late in the start, seen with gdb). Holding it adds little: raised inside
    `ray.init`, a Ctrl-C surfaced only once its blocking calls returned (3-12 s after the key
    on a loaded machine)."""
    import threading

    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):  # a caller's own handler, or SIGINT ignored (`cmd &` in a script): theirs to keep
        yield
        return
    pressed: list[int] = []

    def hold(_signum: int, _frame: Any) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(1)
        os.write(  # not print: this may run inside a print of the main thread
            2, b"packshard pack: stopping once the local Ray has started (Ctrl-C again: now)\n"
        )

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    except Exception:
        if pressed:  # not the start's error (a timeout, which would be retried): the stop
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def _descendants() -> set[int]:
    """The pids of this process's descendants (Ray ships psutil: ray/thirdparty_files)."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _is_ray_process(p: Any) -> bool:
    """Whether `p` runs Ray: its GCS and raylet binaries and its Python agents are files of
    the ray package, and its workers and agents name themselves ``ray::...``. (A path that
    merely holds a ``ray`` directory, such as Ray images' ``/home/ray``, is not enough.)"""
    import psutil

    try:
        cmd = p.cmdline()
    except psutil.Error:
        return False
    roots = _ray_package_roots()
    return bool(cmd) and (cmd[0].startswith("ray::") or any(a.startswith(roots) for a in cmd))


@functools.cache
def _ray_package_roots() -> tuple[str, ...]:
    """The ray package's directory as imported and as resolved (a venv may link it)."""
    import ray

    package = os.path.dirname(os.path.abspath(ray.__file__))
    return tuple({package + os.sep, os.path.realpath(package) + os.sep})


def _stop_new_processes(before: set[int]) -> None:
    """Stop the Ray processes that became this process's descendants since `before`, and
    theirs (the node's GCS, raylet and the raylet's agents and workers), after Ray's own
    shutdown. They are listed first: the raylet's shutdown orphans its agents, which are then
    no descendants to find. Other new descendants (a caller's own subprocesses, when the job
    runs inside another program) are left alone."""
    import psutil
    import ray

    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    ray_pids = {p.pid for p in new if _is_ray_process(p)}

    def from_ray(p: Any) -> bool:
        try:
            return p.pid in ray_pids or any(a.pid in ray_pids for a in p.parents())
        except psutil.Error:
            return False

    procs = [p for p in new if from_ray(p)]
    try:
        with contextlib.suppress(Exception):
            ray.shutdown()
    finally:  # a Ctrl-C in Ray's shutdown still stops them
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=3)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()


@contextlib.contextmanager
def stop_on_signals(stop: Any) -> Iterator[None]:
    """SIGTERM (`ray job stop`) and SIGINT set the stop flag; the loops then cancel and exit."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, lambda signum, _frame: stop.set(signal.Signals(signum).name))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _digest(obj: Any) -> str:
    return (
        "sha256:"
        + hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    )


@dataclass
class DriverTokenizer:
    """The tokenizer as the driver holds it: the encoder (for its payload and template checks),
    the manifest's `tokenizer` entry, and the pad id."""

    encoder: SampleEncoder | None
    info: dict[str, str] | None
    pad_token_id: int
    cached: bool = False  # from `tokenizer_cache`, without loading it


def prepare_tokenizer(cfg: PackConfig, source: TokenizerSource | None) -> DriverTokenizer:
    """Load the tokenizer once, check that packshard renders its chat template exactly like
    `apply_chat_template`, and that the loss roles exist in it. A tokenizer checked before (same
    files, versions and template arguments) comes from `tokenizer_cache` without transformers."""
    if source is None:
        assert cfg.pad_token_id is not None  # PackConfig requires it without a tokenizer
        return DriverTokenizer(None, None, cfg.pad_token_id)
    from packshard.pipeline import tokenizer_cache
    from packshard.pipeline.tokenization import SampleEncoder

    key = tokenizer_cache.cache_key(source, cfg.trust_remote_code, cfg.template_kwargs)
    cached = tokenizer_cache.read(key, source.spec) if key else None
    if cached is not None:
        payload, tok_pad = cached
        encoder = SampleEncoder(
            payload, loss_roles=cfg.loss_roles, template_kwargs=cfg.template_kwargs
        )
    else:
        from packshard.pipeline.chat_template import check_renderer, hf_exact_render

        tok = load_located(source, cfg.trust_remote_code)
        encoder = SampleEncoder(tok, loss_roles=cfg.loss_roles, template_kwargs=cfg.template_kwargs)
        if encoder.renderer is not None:
            check_renderer(encoder.renderer, hf_exact_render(tok, cfg.template_kwargs))
        tok_pad = pad_or_eos(tok)
        # stored only when the files are still those keyed: an edit during the load is not
        # filed under the files before it
        if key and key == tokenizer_cache.cache_key(
            source, cfg.trust_remote_code, cfg.template_kwargs
        ):
            tokenizer_cache.write(key, encoder.payload, tok_pad)
    if encoder.profile is not None and not set(cfg.loss_roles) & encoder.profile.roles:
        raise TokenizerError(
            f"--loss-roles {','.join(cfg.loss_roles)}: the chat template renders none of them"
        )
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else tok_pad
    if pad_id is None:
        raise TokenizerError(NO_PAD_TOKEN)
    vocab = encoder.vocab_size
    if vocab and not 0 <= pad_id < vocab:  # as token ids of pre-tokenized samples are checked
        raise TokenizerError(
            f"--pad-token-id {pad_id} is outside the tokenizer's vocabulary [0, {vocab:,}): the "
            "rows' padding would be a token the model has no embedding for"
        )
    return DriverTokenizer(
        encoder, source.manifest_entry(encoder.payload.fingerprint), pad_id, cached is not None
    )


def _cluster_cpus() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _start_counting(cfg: PackConfig, files: list[InputFile]) -> InputCounter:
    """Count the inputs on Ray, after one `warm_up` task per worker the job will use."""
    from packshard.pipeline.samples import source_fields
    from packshard.pipeline.scheduler import InputCounter

    cpus = _cluster_cpus()
    return InputCounter(
        files,
        cfg.storage_options,
        2 * cpus,
        warm_workers=min(cfg.num_workers or cpus, cpus),
        sample_fields=source_fields(cfg.columns),
    )


def _cluster_is_up() -> bool:
    """True when this process is connected to Ray or is a job of a cluster (``RAY_ADDRESS``).
    Looking costs nothing: Ray is never imported here (a process that has not imported it
    cannot be connected)."""
    ray = sys.modules.get("ray")
    return bool(os.environ.get("RAY_ADDRESS")) or (ray is not None and ray.is_initialized())


def run(cfg: PackConfig) -> int:
    """Run the job for a validated config (raises the errors `main` reports); a Ctrl-C once
    the dataset is committed (Ray's shutdown, the summary) says the dataset is complete."""
    committed: list[bool] = []
    try:
        return _run(cfg, committed)
    except KeyboardInterrupt:
        if not committed:
            raise
        print(
            f"packshard pack: interrupted; {redact_url(cfg.output)} holds the whole dataset "
            "(it was committed before): `packshard stats` describes it",
            file=sys.stderr,
        )
        return 130


def _run(cfg: PackConfig, committed: list[bool]) -> int:
    """`run`, appending to `committed` once the output holds the whole dataset.

    Every check that needs no Ray runs first (`preflight`), so a user error never waits for
    Ray. On a running cluster (``ray job submit``, or a caller's ``ray.init``) the driver then
    connects and starts counting the inputs and warming the workers (their imports) while it
    loads and checks the tokenizer: at 2 workers on 2.8M tokens that hides ~0.5-1 s of the
    job's ~3 s. A local Ray starts only once the tokenizer and the output's state are checked
    too, and only for a job with work to do.
    """
    t0 = time.perf_counter()
    phase = _Phases()
    checked = preflight(cfg)
    phase(f"checked the output, {len(checked.files)} input file(s) and the tokenizer")
    fs, root, files = checked.fs, checked.root, checked.files
    started, counter = False, None
    try:
        if _cluster_is_up():
            started = start_ray(cfg)  # set before counting starts: a Ctrl-C there shuts it down
            counter = _start_counting(cfg, files)
            phase("joined the Ray cluster; counting the inputs and warming the workers")
        tokenizer = prepare_tokenizer(cfg, checked.tokenizer)
        phase("loaded the tokenizer" + (" from packshard's cache" if tokenizer.cached else ""))
        if (
            tokenizer.encoder is not None
            and not tokenizer.encoder.has_chat_template
            and has_chat_template(checked.tokenizer) is None
        ):  # a hub tokenizer's files said nothing before it loaded
            checked.refuse_chats(cfg)
        config = cfg.dataset_config(
            tokenizer=tokenizer.info,
            pad_token_id=tokenizer.pad_token_id,
            inputs=[f.identity() for f in files],
        )
        state = inspect_output(fs, root, cfg.output, config, overwrite=cfg.overwrite)
        if state.status == "complete":
            committed.append(True)
            print(
                f"packshard pack: {redact_url(cfg.output)} already holds this dataset (same inputs and config); nothing to do"
            )
            print(_stats_text(cfg.output, cfg.storage_options))
            return 0
        from packshard.pipeline.scheduler import StopFlag

        if counter is None:
            started = start_ray(cfg)
            phase("started a local Ray")
        stop = StopFlag(cancel_tasks=not started)  # a driver that disconnects ends its tasks
        with stop_on_signals(stop):
            if state.status == "resume":  # the plan holds the counts
                assert state.plan is not None
                files = resumed_files(files, state.plan)
                if counter is not None:
                    counter.cancel(tasks=not started)
                counter = None
            elif counter is None:
                counter = _start_counting(cfg, files)
            job = _pack(cfg, fs, root, files, counter, tokenizer, config, state, stop, phase, t0)
            committed.append(True)
    except BaseException:  # a failure or Ctrl-C before anything was written (Ray's start, ...)
        checked.discard_output()  # leaves no empty OUT it created (it keeps one with files)
        raise
    finally:
        if counter is not None:
            counter.cancel(tasks=not started)  # once counted a no-op; else stops the counts
        if started:
            import ray

            ray.shutdown()
    print(
        format_summary(
            job.manifest,
            url=redact_url(cfg.output),
            seconds=time.perf_counter() - t0,
            tokenized_tokens=job.tokens,
            workers=job.workers,
            kept_shards=job.kept,
        )
    )
    print()
    print(_stats_text(cfg.output, cfg.storage_options))
    return 0


def resumed_files(files: list[InputFile], plan: dict[str, Any]) -> list[InputFile]:
    """The listed files with the record counts, seek points and layouts of the unfinished job's
    plan.

    The plan holds redacted URLs (no credentials are written), so the files to read are the
    ones listed now; `inspect_output` has checked that they are the plan's (URL, size, version).
    """
    planned = [InputFile.from_json(d) for d in plan["inputs"]]
    if [redact_url(p.url) for p in planned] != [f.display for f in files]:
        raise OutputError(
            "the unfinished job's plan lists other input files than this run; rerun with --overwrite"
        )
    return [f.with_counts_of(p) for f, p in zip(files, planned, strict=True)]


@dataclass
class _Done:
    manifest: dict[str, Any]
    tokens: int
    workers: int
    kept: int


def _pack(
    cfg: PackConfig,
    fs: Any,
    root: str,
    files: list[InputFile],
    counter: InputCounter | None,
    tokenizer: DriverTokenizer,
    config: dict[str, Any],
    state: OutputState,
    stop: StopFlag,
    phase: _Phases,
    t0: float,
) -> _Done:
    """Count, plan, tokenize, pack, write and commit (Ray is up)."""
    import ray

    from packshard.pipeline.planning import sample_order
    from packshard.pipeline.scheduler import Scheduler, check_kept, merge_counters, plan_blocks
    from packshard.pipeline.tasks import WorkSpec

    workers = cfg.num_workers or _cluster_cpus()
    payload = tokenizer.encoder.payload if tokenizer.encoder is not None else None
    spec = WorkSpec(
        output=cfg.output, storage_options=dict(cfg.storage_options),
        tokenizer=ray.put(payload) if payload is not None else None,
        tokenizer_fingerprint=payload.fingerprint if payload is not None else None,
        kind=cfg.kind, columns=dict(cfg.columns), loss_roles=cfg.loss_roles,
        template_kwargs=dict(cfg.template_kwargs), skip_bad_records=cfg.skip_bad_records,
        seq_len=cfg.seq_len, pad_multiple=cfg.pad_multiple, pad_token_id=tokenizer.pad_token_id,
        algorithm=cfg.algorithm, overlong=cfg.overlong, carry_rows=cfg.carry_rows,
        rows_per_batch=rows_per_batch_for(cfg.seq_len), config_digest="",
    )  # fmt: skip
    if counter is not None:
        files = counter.result(stop)
    else:
        log.info(
            "resuming the unfinished job in %s (%d shard markers)",
            redact_url(cfg.output),
            len(state.markers),
        )
    num_samples = sum(f.records for f in files)
    phase(f"counted {len(files)} input files: {num_samples:,} records")
    if num_samples == 0:
        raise InputError(f"the inputs hold no records: {', '.join(cfg.inputs)}")
    config["inputs"] = [
        {**i, "records": f.records} for i, f in zip(config["inputs"], files, strict=True)
    ]
    spec = replace(spec, config_digest=_digest(config))
    if state.status == "fresh":
        write_plan(
            fs,
            root,
            {"config": config, "inputs": [f.to_json() for f in files], "num_samples": num_samples},
        )
    kept = check_kept(state.markers, spec, stop) if state.markers else {}
    progress = JobProgress(0, enabled=cfg.progress, kept_shards=len(kept))
    scheduler = Scheduler(
        spec=spec, files=files, blocks=plan_blocks(files, workers),
        order=sample_order(num_samples, shuffle=cfg.shuffle, seed=cfg.seed), kept=kept,
        window_tokens=cfg.window_tokens, shard_tokens=cfg.shard_tokens, workers=workers, stop=stop, progress=progress,
    )  # fmt: skip
    progress.total = scheduler.samples_to_tokenize
    try:
        results = scheduler.run()
    finally:
        progress.close()
    phase(f"tokenized {progress.samples:,} samples and wrote {len(results) - len(kept)} shards")
    ordered = [results[n] for n in sorted(results)]
    if [r.plan.number for r in ordered] != list(range(len(ordered))):
        raise AssertionError(f"shard numbers are not contiguous: {sorted(results)}")
    merged = merge_counters(ordered)
    if merged["totals"]["samples_in"] != num_samples:
        raise AssertionError(
            f"shards account for {merged['totals']['samples_in']} samples of {num_samples}"
        )
    records, nodes = [r.record for r in ordered], scheduler.node_summary()
    _check_shards_visible(fs, root, cfg.output, records, nodes)
    manifest = finalize_dataset(
        fs, root, config, records, merged["totals"],
        extra={"skipped_examples": merged["examples"], "job": {"workers": workers, "seconds": round(time.perf_counter() - t0, 3), "nodes": nodes}},
    )  # fmt: skip
    remove_job_state(fs, root)
    phase("committed index.arrow and manifest.json")
    return _Done(manifest, progress.tokens, workers, len(kept))


def _check_shards_visible(
    fs: Any, root: str, output: str, shards: list[Any], nodes: list[dict[str, Any]]
) -> None:
    """OutputError unless every shard the tasks wrote (and verified where they ran) is at OUT
    as this driver sees it, at its size: a local OUT that is not one filesystem for every node
    (a path on each node's own disk) gets shards scattered over the nodes. One listing of
    OUT/shards, and a lookup by name of each shard it misses; nothing is committed when it
    fails."""
    fs.invalidate_cache(f"{root}/shards")  # s3fs / gcsfs answer ls and info from a cache
    try:
        listed = fs.ls(f"{root}/shards", detail=True)
    except FileNotFoundError:
        listed = []
    sizes = {posixpath.basename(str(e["name"])): e.get("size") for e in listed}
    absent = [s for s in shards if sizes.get(posixpath.basename(s.path)) != s.bytes]
    # a listing may lag (an NFS client caches directory contents for up to a minute): ask for
    # each file the listing missed by name before calling it absent
    absent = [s.path for s in absent if _size_of(fs, f"{root}/{s.path}") != s.bytes]
    if not absent:
        return
    where = (
        f"the job's tasks ran on {len(nodes)} nodes; a local path is each node's own disk, "
        "unless every node mounts one filesystem there"
        if len(nodes) > 1
        else "another process may have removed them"
    )
    raise OutputError(
        f"{len(absent)} of the {len(shards)} shards the job wrote are not at {output} as this "
        f"driver sees it (first: {absent[0]}): {where}. Nothing was committed; give an object "
        "store URL (s3://, gs://, ...) or a path every node shares, and rerun"
    )


def _size_of(fs: Any, path: str) -> int | None:
    try:
        return fs.info(path).get("size")
    except FileNotFoundError:
        return None


class _Phases:
    """Logs how long each step of the job took."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        log.info("%s (%.1f s)", what, now - self.last)
        self.last = now


class _StderrHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (a test's capture, a redirected stream)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _setup_logging() -> None:
    """packshard's INFO lines on stderr, URLs redacted. Only when the program has configured
    no logging of its own (the CLI): a handler on the root logger would print the lines of
    libraries that have their own handler (huggingface_hub) a second time, and an embedding
    program's configuration wins. Other libraries' warnings reach stderr through logging's
    last-resort handler, which gets the same redaction, without their tracebacks (see
    `RedactingFilter`)."""
    logger = logging.getLogger("packshard")
    if logging.getLogger().handlers or any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    add_redacting_filter(handler)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if logging.lastResort is not None:
        add_redacting_filter(logging.lastResort, library_tracebacks=False)


def _scheduler_error(name: str) -> tuple[type[BaseException], ...]:
    """`scheduler.<name>` once the scheduler is imported (before that it cannot be raised)."""
    module = sys.modules.get("packshard.pipeline.scheduler")
    return (getattr(module, name),) if module is not None else ()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m packshard.pipeline.pack` and `packshard pack`; returns the exit status."""
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from_args(argv)
    except ValueError as e:
        print(f"packshard pack: error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    for warning in cfg.warnings():
        log.warning("%s", warning)
    try:
        return run(cfg)
    except _scheduler_error("Interrupted") as e:
        name = str(e) or "a signal"
        print(
            f"packshard pack: stopped by {name}; the shards written so far are kept. "
            "Run the same command again to finish the dataset.",
            file=sys.stderr,
        )
        return 130 if name == "SIGINT" else 143
    except _scheduler_error("JobError") + USER_ERRORS as e:
        print(f"packshard pack: error: {redact_text(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the job's own handler is installed, or after it
        print(INTERRUPTED, file=sys.stderr)
        return 130


INTERRUPTED = (
    "packshard pack: interrupted; whatever was written is kept. Run the same command again to "
    "finish the dataset."
)

if __name__ == "__main__":
    sys.exit(main())
