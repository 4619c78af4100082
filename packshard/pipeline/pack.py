"""The pack job: raw samples -> a committed packshard dataset, on Ray.

    python -m packshard.pipeline.pack --input 'data/*.jsonl' --output s3://bucket/run/ \\
        --tokenizer Qwen/Qwen3-8B --seq-len 131072 --cp 8
    ray job submit --working-dir . -- python -m packshard.pipeline.pack ...   # on a cluster
    packshard pack ...                                                        # the console script
    packshard pack --demo --output demo_out                                   # built-in data, no files

Under `ray job submit` (``RAY_ADDRESS`` set) it connects to that cluster; otherwise it starts a
local Ray of ``--num-cpus`` CPUs (never joining another local cluster by accident).

Steps: check the output is writable; list the inputs; load the tokenizer once on the driver
(while the local Ray starts), check that packshard renders its chat template exactly like
`apply_chat_template`, and ship it to the workers through the object store
(`tokenizer_loading`: workers need neither the files nor the hub); compare the config with what
the output holds (`jobstate`: fresh, resume, or already complete; a different config is
refused unless ``--overwrite``); count the inputs; write the plan; tokenize and pack on Ray
(`scheduler`); commit with `packers.finalize_dataset` (index.arrow, then manifest.json last);
print the summary and the dataset's stats. ``--demo`` packs `packshard.pipeline.demo`'s generated mix through the ``demo://`` input
(generated inside the tasks that read it, so it works on any cluster) with the built-in
tokenizer, at seq_len 32768 and cp 8 unless given.

Exit status: 0 done (or nothing to do), 1 the job failed (message names the record, file or
shard), 2 bad flags, 130/143 stopped by SIGINT/SIGTERM (rerun the same command to resume).
"""

# ruff: noqa: E402 (the extra is checked before the imports that need it)

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packshard._extras import require_extra

require_extra("pack", "the pack job (packshard pack)")

from packshard.packers import (
    FormatError,
    ShardDataset,
    finalize_dataset,
    rows_per_batch_for,
    url_to_fs,
)
from packshard.packers.format import MANIFEST_NAME
from packshard.pipeline.chat_template import check_renderer, hf_exact_render
from packshard.pipeline.config import PackConfig, config_from_args
from packshard.pipeline.inputs import InputError, InputFile, resolve_inputs
from packshard.pipeline.jobstate import (
    OutputError,
    OutputState,
    check_writable,
    inspect_output,
    remove_job_state,
    write_plan,
)
from packshard.pipeline.planning import sample_order
from packshard.pipeline.progress import JobProgress, format_summary
from packshard.pipeline.scheduler import (
    InputCounter,
    Interrupted,
    JobError,
    Scheduler,
    StopFlag,
    check_kept,
    merge_counters,
    plan_blocks,
)
from packshard.pipeline.stats import dataset_stats, format_stats
from packshard.pipeline.tasks import WorkSpec
from packshard.pipeline.tokenization import (
    SampleEncoder,
    TokenizerError,
    load_tokenizer,
    pad_token_id_of,
)

log = logging.getLogger("packshard.pipeline.pack")

USER_ERRORS = (InputError, OutputError, TokenizerError, FormatError)
RAY_START_ATTEMPTS = 3


def _stats_text(url: str, storage_options: Any) -> str:
    with ShardDataset.open(url, storage_options=storage_options) as ds:
        return format_stats(dataset_stats(ds))


def start_ray(cfg: PackConfig) -> bool:
    """Connect to the job's cluster (RAY_ADDRESS) or start a local Ray; True if started here."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return True
    root = str(
        Path(__file__).resolve().parents[2]
    )  # workers import `packshard` from a checkout too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    start_local_ray(cfg.num_cpus)
    return True


def start_local_ray(num_cpus: int | None) -> None:
    """A new local Ray (never an existing cluster found on this machine), robust to a busy box."""
    import ray

    # The raylet waits for its Python agents' ports (15 s by default) and aborts if they are late,
    # which happens on a busy machine; give them two minutes (the user's setting wins).
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
            return
        except Exception as e:  # Ray raises a bare Exception when its node does not come up
            # Ray's driver gives the node 30 s to register; a loaded machine can miss that.
            # That is worth another try; anything else is not.
            if "timed out during startup" not in str(e) or attempt == RAY_START_ATTEMPTS:
                raise
            log.warning(
                "local Ray did not start in time (attempt %d of %d); retrying",
                attempt,
                RAY_START_ATTEMPTS,
            )
            ray.shutdown()


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


def prepare_tokenizer(cfg: PackConfig) -> DriverTokenizer:
    """Load the tokenizer once, check that packshard renders its chat template exactly like
    `apply_chat_template`, and that the loss roles exist in it."""
    if cfg.tokenizer is None:
        assert cfg.pad_token_id is not None  # PackConfig requires it without a tokenizer
        return DriverTokenizer(None, None, cfg.pad_token_id)
    tok = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code, cfg.tokenizer_revision)
    encoder = SampleEncoder(tok, loss_roles=cfg.loss_roles, template_kwargs=cfg.template_kwargs)
    if encoder.renderer is not None:
        check_renderer(encoder.renderer, hf_exact_render(tok, cfg.template_kwargs))
    if encoder.profile is not None and not set(cfg.loss_roles) & encoder.profile.roles:
        raise TokenizerError(
            f"--loss-roles {','.join(cfg.loss_roles)}: the chat template renders none of them"
        )
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else pad_token_id_of(tok)
    return DriverTokenizer(
        encoder, {"name": cfg.tokenizer, "fingerprint": encoder.payload.fingerprint}, pad_id
    )


def _cluster_cpus() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def run(cfg: PackConfig) -> int:
    """Run the job for a validated config (raises the errors `main` reports)."""
    import ray

    t0 = time.perf_counter()
    phase = _Phases()
    try:
        fs, root = url_to_fs(cfg.output, cfg.storage_options)
    except (ValueError, ImportError) as e:
        raise OutputError(f"output {cfg.output!r}: {e}") from None
    check_writable(fs, root, cfg.output)
    files = resolve_inputs(cfg.inputs, storage_options=cfg.storage_options, split=cfg.split)
    started, counter = False, None
    try:
        # Loading the tokenizer (~5 s with transformers' imports) overlaps Ray's start-up, unless
        # a committed dataset is there: then the job may have nothing to do and no Ray is needed.
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(prepare_tokenizer, cfg)
            if not fs.exists(f"{root}/{MANIFEST_NAME}"):
                started = start_ray(cfg)
                counter = InputCounter(files, cfg.storage_options, 2 * _cluster_cpus())  # meanwhile
            tokenizer = loading.result()
        phase("loaded the tokenizer and started Ray")
        identity = [{"url": f.url, "bytes": f.size, "version": f.version} for f in files]
        config = cfg.dataset_config(
            tokenizer=tokenizer.info, pad_token_id=tokenizer.pad_token_id, inputs=identity
        )
        state = inspect_output(fs, root, cfg.output, config, overwrite=cfg.overwrite)
        if state.status == "complete":
            print(
                f"packshard pack: {cfg.output} already holds this dataset (same inputs and config); nothing to do"
            )
            print(_stats_text(cfg.output, cfg.storage_options))
            return 0
        started = start_ray(cfg) or started
        stop = StopFlag()
        with stop_on_signals(stop):
            if state.status == "resume":  # the plan holds the counts
                if counter is not None:
                    counter.cancel()
                counter = None
            elif counter is None:
                counter = InputCounter(files, cfg.storage_options, 2 * _cluster_cpus())
            job = _pack(cfg, fs, root, counter, tokenizer, config, state, stop, phase, t0)
    finally:
        if counter is not None:
            counter.cancel()  # no-op once counted; stops counting when the job ends early
        if started:
            ray.shutdown()
    print(
        format_summary(
            job.manifest,
            url=cfg.output,
            seconds=time.perf_counter() - t0,
            tokenized_tokens=job.tokens,
            workers=job.workers,
            kept_shards=job.kept,
        )
    )
    print()
    print(_stats_text(cfg.output, cfg.storage_options))
    return 0


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
        assert state.status == "resume" and state.plan is not None
        files = [InputFile.from_json(d) for d in state.plan["inputs"]]
        log.info(
            "resuming the unfinished job in %s (%d shard markers)", cfg.output, len(state.markers)
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
    manifest = finalize_dataset(
        fs, root, config, [r.record for r in ordered], merged["totals"],
        extra={"skipped_examples": merged["examples"], "job": {"workers": workers, "seconds": round(time.perf_counter() - t0, 3), "nodes": scheduler.node_summary()}},
    )  # fmt: skip
    remove_job_state(fs, root)
    phase("committed index.arrow and manifest.json")
    return _Done(manifest, progress.tokens, workers, len(kept))


class _Phases:
    """Logs how long each step of the job took."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        log.info("%s (%.1f s)", what, now - self.last)
        self.last = now


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m packshard.pipeline.pack` and `packshard pack`; returns the exit status."""
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from_args(argv)
    except ValueError as e:
        print(f"packshard pack: error: {e}", file=sys.stderr)
        return 2
    try:
        return run(cfg)
    except Interrupted as e:
        name = str(e) or "a signal"
        print(
            f"packshard pack: stopped by {name}; the shards written so far are kept. "
            "Run the same command again to finish the dataset.",
            file=sys.stderr,
        )
        return 130 if name == "SIGINT" else 143
    except (JobError, *USER_ERRORS) as e:
        print(f"packshard pack: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
