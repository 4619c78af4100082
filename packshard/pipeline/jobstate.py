"""What a pack job keeps in its output to resume safely, and how a rerun decides what to do.

Besides the dataset (shards, index.arrow, manifest.json, written by packers), an unfinished
job keeps its own bookkeeping under ``OUT/_packshard/`` (readers ignore it; it is removed
once the dataset is committed):

    _packshard/plan.json               written before any shard: job version, the dataset config
                                       (the manifest's future `config`), the counted inputs
    _packshard/shards/part-NNNNN.json  one per shard, written after the shard is written and
                                       verified: its plan (positions, windows), manifest entry,
                                       and counters (samples in/kept, drops by reason, cuts)

Before any work (`check_output`) a non-empty OUT that holds neither a dataset nor an unfinished
job is refused, whatever the flags: packshard never mixes its files with others'. A probe file
is then written and deleted; any storage error (botocore's, gcsfs', aiohttp's) becomes one line,
``output URL is not writable (ErrorType: first line)``.

A rerun into the same output (`inspect_output`):

- a committed dataset (manifest.json) with the same config: nothing to do; another config:
  refused, naming the differing keys, unless ``--overwrite``;
- an unfinished job (plan.json) with the same config: resume. Its counted inputs are reused
  (no recount) and every shard with a marker is re-hashed against it; shards that verify are
  kept, the rest is redone. Another config (or inputs that changed since: size, mtime or ETag)
  is refused unless ``--overwrite``, except when the job wrote no shard: then nothing verified
  would be lost, so it is replaced (with a warning naming the differences). A job that failed
  on its first bad record or a missing column is rerun with the fix its error suggested
  (``--skip-bad-records``, ``--columns``) as is;
- shards but no plan (not ours, or a foreign layout): refused unless ``--overwrite``.

``--overwrite`` deletes only what a pack job writes (manifest first, so no reader sees a
half-replaced dataset), never other files under OUT. Nothing here is written with a
credential: URLs in messages, logs and the plan are redacted (`inputs.redact_url`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec

from packshard.packers.format import (
    INDEX_NAME,
    MANIFEST_NAME,
    SHARDS_DIR,
    fs_url,
    protocols,
    shard_name,
)
from packshard.packers.urls import BUCKET_SCHEMES
from packshard.packers.writer import write_json_atomic
from packshard.pipeline.inputs import redact_text, redact_url
from packshard.pipeline.storage import (
    describe,
    storage_errors_with,
    unreachable_endpoint,
)

log = logging.getLogger(__name__)

JOB_DIR = "_packshard"
PLAN_NAME = f"{JOB_DIR}/plan.json"
MARKERS_DIR = f"{JOB_DIR}/shards"
# 2: .json files are counted with the column mapping (readers._json_records)
# 3: plain prompt/completion pairs are tokenized joined (tokenization.SampleEncoder): an
#    unfinished job's shards from before hold other ids for them, so it is not resumed
JOB_STATE_VERSION = 3
PROBE_PREFIX = ".packshard-write-probe-"
OUR_NAMES = frozenset({MANIFEST_NAME, INDEX_NAME, SHARDS_DIR, JOB_DIR})
TMP_NAMES = frozenset({f"{MANIFEST_NAME}.tmp", f"{INDEX_NAME}.tmp"})


class OutputError(ValueError):
    """The output cannot be used as asked (not writable, or holds a different dataset); URLs in
    the message are redacted."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(message))


def marker_path(root: str, number: int) -> str:
    return f"{root}/{MARKERS_DIR}/{shard_name(number).split('/')[-1].replace('.arrow', '.json')}"


def _our_name(name: str) -> bool:
    """A top-level name a pack job writes under OUT (see the module docstring)."""
    return name in OUR_NAMES or name.startswith(PROBE_PREFIX) or name in TMP_NAMES


_SHARD_FILE = re.compile(r"part-\d{5,}\.arrow(\.tmp)?")  # a shard, or one being written


def _names_in(fs: fsspec.AbstractFileSystem, directory: str) -> set[str]:
    """The names listed in a directory, without its own (an object store's "dir/" marker
    object lists as the directory itself)."""
    own = directory.rstrip("/")
    return {
        p.rstrip("/").rsplit("/", 1)[-1]
        for p in fs.ls(directory, detail=False)
        if p.rstrip("/") != own
    }


def foreign_entries(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Names under OUT that no pack job writes (sorted), those inside OUT/shards/ included;
    empty when OUT does not exist."""
    if not fs.exists(root) or not fs.isdir(root):
        return []
    names = _names_in(fs, root)
    foreign = sorted(n for n in names if n and not _our_name(n))
    shards = f"{root}/{SHARDS_DIR}"
    if SHARDS_DIR in names and fs.isdir(shards):
        inside = _names_in(fs, shards)
        foreign += sorted(f"{SHARDS_DIR}/{n}" for n in inside if n and not _SHARD_FILE.fullmatch(n))
    elif SHARDS_DIR in names:
        foreign.append(SHARDS_DIR)  # a file of that name
    return foreign


def check_reachable(fs: fsspec.AbstractFileSystem, url: str) -> None:
    """OUT's object store endpoint, if it names one, accepts a connection (see
    `storage.unreachable_endpoint`): one error at once instead of after the client's retries."""
    why = unreachable_endpoint(fs)
    if why is not None:
        raise OutputError(f"output {url} is not writable ({why})")


def check_output(fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
    """Before any work: OUT is a file-free place for a dataset, and writable.

    An object store's endpoint is tried first (`check_reachable`). A non-empty OUT that holds
    neither a dataset nor an unfinished job is refused, whatever the flags (--overwrite deletes
    only what a pack job writes, so it would leave the user's files mixed with ours). Then a
    probe file is written and deleted.
    """
    check_reachable(fs, url)
    try:
        if fs.exists(root) and not fs.isdir(root):
            raise OutputError(f"output {url} is a file; give a directory (or a URL prefix)")
        if not fs.exists(f"{root}/{MANIFEST_NAME}") and not fs.exists(f"{root}/{PLAN_NAME}"):
            foreign = foreign_entries(fs, root)
            if foreign:
                shown = ", ".join(foreign[:5]) + (
                    f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
                )
                raise OutputError(
                    f"output {url} is not empty and holds no packshard dataset ({shown}): pack into a "
                    "new or empty directory (packshard never mixes its files with others, and "
                    "--overwrite deletes only what a pack job wrote)"
                )
    except storage_errors_with(*_REFUSALS) as e:
        if isinstance(e, OutputError):
            raise
        raise OutputError(f"output {url} is not writable ({_why(fs, e)})") from None
    check_writable(fs, root, url)


def _check_bucket(fs: fsspec.AbstractFileSystem, bucket: str, url: str) -> None:
    """OutputError when the store says the bucket does not exist (a 404). Any other answer
    (a role that may write objects but not read the bucket's metadata: a 403) is left to the
    probe write, which names it."""
    try:
        fs.info(bucket)
    except FileNotFoundError:
        raise OutputError(
            f"output {url}: the bucket {bucket!r} does not exist (packshard does not create "
            "buckets: create it, or check its name)"
        ) from None
    except Exception:  # see the docstring: the probe write reports it
        return


def check_writable(fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
    """Write and delete a probe file in OUT, before any work starts. An object store's bucket
    must exist: s3fs and gcsfs create a missing one on the first write, so a mistyped bucket
    would become a new one, with the store's defaults."""
    probe = f"{root}/{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        if BUCKET_SCHEMES & set(protocols(fs)):
            _check_bucket(fs, root.split("/", 1)[0], url)
        fs.makedirs(root, exist_ok=True)
        with fs.open(probe, "wb") as f:
            f.write(b"packshard write probe\n")
        fs.rm(probe)
    except storage_errors_with(*_REFUSALS) as e:
        if isinstance(e, OutputError):
            raise
        raise OutputError(f"output {url} is not writable ({_why(fs, e)})") from None


# what a filesystem raises for an output it cannot use, besides storage errors: a bad storage
# option (a ValueError, or a TypeError from the client's constructor: s3fs passes unknown
# options to aiobotocore's session), a filesystem that cannot write (fsspec's http)
_REFUSALS = (ValueError, TypeError, NotImplementedError)


def _why(fs: fsspec.AbstractFileSystem, e: BaseException) -> str:
    if isinstance(e, NotImplementedError):
        return f"fsspec's {protocols(fs)[0]}:// filesystem cannot write files"
    return describe(e)


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two configs (dotted keys)."""
    diffs: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs += config_diff(a, b, f"{name}.")
        elif name == "inputs" and isinstance(a, list) and isinstance(b, list) and a != b:
            diffs += _inputs_diff(a, b)
        elif a != b:
            sa, sb = json.dumps(a, default=str), json.dumps(b, default=str)
            diffs.append(f"{name}: {sa[:120]} (existing) vs {sb[:120]} (this run)")
    return diffs


def _inputs_diff(old: list[Any], new: list[Any]) -> list[str]:
    """What changed among the input files (`config.inputs`: url, bytes, version), per file."""
    if not all(isinstance(f, Mapping) and "url" in f for f in (*old, *new)):
        return [f"inputs: {json.dumps(old, default=str)[:120]} (existing) vs this run's"]
    before = {f["url"]: f for f in old}
    after = {f["url"]: f for f in new}
    diffs = [f"input {u}: not an input of this run" for u in before if u not in after]
    diffs += [f"input {u}: not an input of the existing one" for u in after if u not in before]
    for u in (u for u in after if u in before):
        a, b = before[u], after[u]
        if a.get("bytes") != b.get("bytes"):
            diffs.append(
                f"input {u}: changed since: {a.get('bytes')} bytes then, {b.get('bytes')} now"
            )
        elif a != b:
            changed = ", ".join(
                f"{k} {a.get(k)} then, {b.get(k)} now"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            )
            diffs.append(f"input {u}: changed since: {changed}")
    if not diffs and len(old) != len(new):  # a file listed more or fewer times
        diffs.append(f"inputs: the same files, {len(old)} listed then, {len(new)} now")
    elif not diffs:  # the same files, listed in another order (the row order depends on it)
        diffs.append("inputs: the same files in another order (it decides the rows' order)")
    return diffs


def _read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    with fs.open(path, "rb") as f:
        return json.loads(f.read())


@dataclass
class OutputState:
    """What `inspect_output` found."""

    status: Literal["fresh", "resume", "complete"]
    plan: dict[str, Any] | None = None
    markers: dict[int, dict[str, Any]] = field(default_factory=dict)


def _comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without the counted record numbers (known only after counting)."""
    out = dict(config)
    out["inputs"] = [
        {k: v for k, v in f.items() if k != "records"} for f in config.get("inputs", [])
    ]
    return out


def inspect_output(
    fs: fsspec.AbstractFileSystem,
    root: str,
    url: str,
    config: Mapping[str, Any],
    *,
    overwrite: bool,
) -> OutputState:
    """Decide fresh / resume / complete for this config, clearing the output under --overwrite."""
    manifest_path, plan_path = f"{root}/{MANIFEST_NAME}", f"{root}/{PLAN_NAME}"
    if fs.exists(manifest_path):
        try:
            existing = _read_json(fs, manifest_path).get("config", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            existing = {"<unreadable manifest>": True}
        diffs = config_diff(_comparable(existing), _comparable(config))
        if not diffs:
            return OutputState("complete")
        if not overwrite:
            raise OutputError(
                f"{url} already holds a packshard dataset made with a different config (or from "
                "inputs that changed since):\n  "
                + "\n  ".join(diffs[:20])
                + "\npass --overwrite to replace it, or choose another --output"
            )
        clear_output(fs, root)
        return OutputState("fresh")
    if fs.exists(plan_path):
        try:
            plan = _read_json(fs, plan_path)
        except (json.JSONDecodeError, UnicodeDecodeError):
            plan = {}
        diffs = []
        if plan.get("version") != JOB_STATE_VERSION:
            diffs.append(
                f"job state version: {plan.get('version')} (existing) vs {JOB_STATE_VERSION} (this run)"
            )
        diffs += config_diff(_comparable(plan.get("config", {})), _comparable(config))
        if not diffs:
            return OutputState("resume", plan=plan, markers=read_markers(fs, root))
        listed = "\n  ".join(diffs[:20])
        shards = count_markers(fs, root)
        if not shards:
            # it committed nothing (typically it failed on a bad record before its first shard):
            # nothing is lost by starting over, and the fix its error suggested just works
            log.warning(
                "replacing the unfinished pack job in %s: it wrote no shards, and its config differs:\n  %s",
                redact_url(url),
                listed,
            )
            clear_output(fs, root)
            return OutputState("fresh")
        if not overwrite:
            raise OutputError(
                f"{url} holds an unfinished pack job with {shards} verified shard(s) and a different "
                f"config (or inputs that changed since):\n  {listed}\nrerun with its original flags "
                "to resume it, or pass --overwrite to discard its shards and start over with this config"
            )
        clear_output(fs, root)
        return OutputState("fresh")
    if fs.exists(f"{root}/{SHARDS_DIR}") and fs.ls(f"{root}/{SHARDS_DIR}"):
        if not overwrite:
            raise OutputError(
                f"{url}/{SHARDS_DIR} holds files but no packshard job state: pass --overwrite to replace "
                "them, or choose another --output"
            )
        clear_output(fs, root)
    return OutputState("fresh")


def count_markers(fs: fsspec.AbstractFileSystem, root: str) -> int:
    """How many shard markers (verified shards) an unfinished job has written."""
    base = f"{root}/{MARKERS_DIR}"
    if not fs.exists(base):
        return 0
    return sum(1 for p in fs.ls(base, detail=False) if p.endswith(".json"))


def read_markers(fs: fsspec.AbstractFileSystem, root: str) -> dict[int, dict[str, Any]]:
    """Shard markers of an unfinished job, by shard number (unreadable ones are ignored: the
    shard is redone)."""
    base = f"{root}/{MARKERS_DIR}"
    if not fs.exists(base):
        return {}
    paths = sorted(p for p in fs.ls(base, detail=False) if p.endswith(".json"))
    if not paths:
        return {}
    markers: dict[int, dict[str, Any]] = {}
    for path, raw in fs.cat(paths).items():
        try:
            m = json.loads(raw)
            markers[int(m["plan"]["number"])] = m
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            log.warning("ignoring unreadable shard marker %s (its shard will be redone)", path)
    return markers


def write_plan(fs: fsspec.AbstractFileSystem, root: str, plan: Mapping[str, Any]) -> None:
    fs.makedirs(f"{root}/{MARKERS_DIR}", exist_ok=True)
    write_json_atomic(fs, f"{root}/{PLAN_NAME}", {"version": JOB_STATE_VERSION, **plan})


def clear_output(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Delete what a pack job writes: manifest first, then index, shards and job state."""
    for rel in (MANIFEST_NAME, INDEX_NAME):
        if fs.exists(f"{root}/{rel}"):
            fs.rm(f"{root}/{rel}")
    shards = f"{root}/{SHARDS_DIR}"
    if fs.exists(shards):
        for p in fs.find(shards):
            if p.rsplit("/", 1)[-1].startswith("part-"):
                fs.rm(p)
    remove_job_state(fs, root)
    log.info("cleared the previous dataset / job state under %s", redact_url(fs_url(fs, root)))


def remove_job_state(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """After the commit: the bookkeeping is no longer needed."""
    path = f"{root}/{JOB_DIR}"
    if fs.exists(path):
        fs.rm(path, recursive=True)
