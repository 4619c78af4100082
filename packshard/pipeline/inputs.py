"""Inputs: turning `--input` specs into an ordered list of input files.

An input spec is a local path, a glob, a directory, or any fsspec URL (``s3://``, ``gs://``,
``hf://datasets/...``), a Hugging Face ``save_to_disk`` directory (``--split`` picks a split of a
DatasetDict), a bare hub dataset name (``org/name``, listed through ``hf://`` where the hub is
reachable), or ``demo://`` (the built-in generated dataset, made inside the tasks that read it,
so nothing travels from the driver). Specs keep their order; globs expand sorted; directories
list their supported files recursively, sorted. Formats, by extension: ``.jsonl``/``.ndjson``
(also ``.gz``, ``.zst``), ``.json`` (an array of records, an object without sample fields
holding one list of record objects, one record, or JSON lines), ``.parquet``,
``.arrow``/``.feather``/``.ipc`` (Arrow IPC file or stream format, detected from the magic
bytes), ``.txt`` (one ``{"text": line}`` per line).

Each file is recorded with its size and version (ETag, or mtime) so that a resumed job can tell
whether its inputs changed since it started (`pipeline.jobstate`).

Secrets: an input URL may carry credentials (``http://user:pw@host/x.jsonl``) or a signature
(``https://host/x.jsonl?X-Amz-Signature=...``). `InputFile.url` keeps them to read the file;
everything written or printed uses `redact_url` / `InputFile.display` (no user info, no query),
and `InputError` redacts its message itself. An http(s) URL's query is never a glob: a signed
URL reads as one file, and only ``*`` or ``[`` before its ``?`` make a glob (whose matches are
each read with the query).
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import fsspec

from packshard.packers import url_to_fs
from packshard.packers.format import fs_url, protocols
from packshard.packers.urls import (
    DEMO_SCHEME,
    UrlError,
    redact_text,
    redact_url,
    refuse_credentials,
)
from packshard.pipeline.storage import storage_errors, storage_errors_with, unreachable_endpoint

_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".txt": "txt",
}
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
IGNORED_SHOWN = 5  # ignored files a warning names

log = logging.getLogger(__name__)


class InputError(ValueError):
    """An input cannot be listed or read (names the input and the fix; URLs in the message
    are redacted, so it can be printed and logged as is)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(message))


@dataclass(frozen=True)
class InputFile:
    """One input file, as resolved and counted. `url` keeps its protocol (plain path if local)."""

    url: str  # as resolved, credentials included: never written or printed (see `display`)
    format: str
    compression: str | None = None
    size: int = 0
    version: str = ""
    records: int = -1
    # (byte offset, line number) of record k * STRIDE; a .json array's: (offset, k * STRIDE)
    checkpoints: tuple[tuple[int, int], ...] = ()
    layout: str = ""  # a .json file's with checkpoints: "array" or "lines" (readers.py)

    @property
    def display(self) -> str:
        """The URL without user info or query string: what messages, logs and files show."""
        return redact_url(self.url)

    def identity(self) -> dict[str, Any]:
        """What the manifest's ``config.inputs`` records of this file (no credentials)."""
        return {"url": self.display, "bytes": self.size, "version": self.version}

    def to_json(self) -> dict[str, Any]:
        """For the job's plan: the redacted URL (a resume matches it with the listed file)."""
        d = asdict(self)
        d["url"] = self.display
        d["checkpoints"] = [list(c) for c in self.checkpoints]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> InputFile:
        return cls(**{**d, "checkpoints": tuple(tuple(c) for c in d.get("checkpoints", ()))})

    def with_counts_of(self, counted: InputFile) -> InputFile:
        """This file with everything counting found in `counted` (`readers.count_records`):
        its records, seek points and a .json file's layout, which the reads rely on."""
        return replace(
            self, records=counted.records, checkpoints=counted.checkpoints, layout=counted.layout
        )


def _without_query(path: str) -> str:
    """An http(s) URL's path without its query (a signed URL's signature): where "?" is no glob."""
    if path.lower().startswith(("http://", "https://")):
        return path.split("#", 1)[0].split("?", 1)[0]
    return path


def _format_of(path: str) -> tuple[str, str | None] | None:
    name = posixpath.basename(_without_query(path)).lower()
    compression = None
    for ext, comp in _COMPRESSIONS.items():
        if name.endswith(ext):
            name, compression = name[: -len(ext)], comp
            break
    for ext, fmt in _EXTENSIONS.items():
        if name.endswith(ext):
            if compression and fmt in ("parquet", "arrow"):
                return None
            return fmt, compression
    return None


def _version(info: Mapping[str, Any]) -> str:
    for key in (
        "ETag",
        "etag",
        "md5Hash",
        "mtime",
        "LastModified",
        "Last-Modified",
        "last_modified",
        "created",
    ):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


def resolve_inputs(
    specs: Sequence[str], *, storage_options: Mapping[str, Any] | None = None, split: str = "train"
) -> list[InputFile]:
    """Every input file, in the order given (each glob / directory expanded sorted)."""
    return [
        f
        for found in resolve_specs(specs, storage_options=storage_options, split=split)
        for f in found
    ]


def resolve_specs(
    specs: Sequence[str], *, storage_options: Mapping[str, Any] | None = None, split: str = "train"
) -> list[list[InputFile]]:
    """The files of each spec, in the order given; InputError for a spec that matches none."""
    if not specs:
        raise InputError("no inputs given (pass --input, or --demo)")
    resolved = []
    for spec in specs:
        found = _resolve_one(spec, storage_options, split)
        if not found:
            raise InputError(f"input {spec!r} matches no readable files")
        resolved.append(found)
    return resolved


def _is_glob(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Glob characters the user wrote; an http(s) URL's query ("?sig=...") is not a glob."""
    if {"http", "https"} & set(protocols(fs)):
        return any(c in _without_query(path) for c in "*[")
    return any(c in path for c in "*?[")


def _resolve_one(
    spec: str, storage_options: Mapping[str, Any] | None, split: str
) -> list[InputFile]:
    if spec.startswith(DEMO_SCHEME):
        return [InputFile(url=spec, format="demo", records=demo_size(spec))]
    try:
        refuse_credentials(spec)
    except UrlError as e:
        raise InputError(f"input {e}") from None
    try:
        fs, path = url_to_fs(spec, storage_options)
    except (ImportError, ValueError) as e:
        raise InputError(f"input {spec!r}: cannot open its filesystem ({e})") from None
    why = unreachable_endpoint(fs)
    if why is not None:
        raise InputError(f"input {spec!r}: {why}")
    try:
        if _is_glob(fs, path):
            # an http(s) glob's query (a token) is no part of the pattern: each match gets it
            pattern = _without_query(path)
            query = path[len(pattern) :]
            paths = sorted(p + query for p in fs.glob(pattern) if fs.isfile(p + query))
            _split_does_not_apply(spec, split, "a glob reads what it matches")
            return _read_and_warn(fs, spec, paths, {p: p for p in paths}, skip_hidden=False)
        if fs.isdir(path):
            if _without_query(path) != path:  # the links listed would carry no query
                raise InputError(
                    f"input {spec!r}: a directory listing with a query string (a signed URL?): "
                    "the files it lists are read without the query; give the files' URLs, "
                    "each with its query, or a glob (dir/*.jsonl?query), which passes it on"
                )
            return _directory(fs, path, spec, split)
        if fs.isfile(path):
            _split_does_not_apply(spec, split, "a file")
            return [_file(fs, path, spec, strict=True)]
        _raise_unless_missing(fs, path)
    except PermissionError as e:
        raise InputError(f"input {spec!r}: permission denied ({e})") from None
    except storage_errors() as e:
        raise InputError(f"input {spec!r}: cannot be listed ({type(e).__name__}: {e})") from None
    except TypeError as e:  # a client given options it does not take (aiohttp: endpoint_url)
        if not storage_options:
            raise
        scheme = spec.partition("://")[0] if "://" in spec else "file"
        raise InputError(
            f"input {spec!r}: the --storage-option flags ({', '.join(sorted(storage_options))}) "
            f"go to every input and the output, and the {scheme}:// client does not take them "
            f"({e}); give the object store's settings through its environment variables "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL) instead"
        ) from None
    if _looks_like_hub_name(spec):
        return _hub_dataset(spec, storage_options, split)
    raise InputError(f"input {spec!r} does not exist")


def _raise_unless_missing(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """fsspec's `isdir` / `isfile` read any OSError as False, and some clients' errors are
    OSErrors (gcsfs' 403 a PermissionError, aiohttp's connection errors): an input is called
    missing only when `info` raises FileNotFoundError too; its other errors propagate."""
    with contextlib.suppress(FileNotFoundError):
        fs.info(path)


def _file(fs: fsspec.AbstractFileSystem, path: str, spec: str, strict: bool = False) -> InputFile:
    fmt = _format_of(path)
    if fmt is None:
        if strict:
            raise InputError(
                f"input {spec!r}: unsupported file type; packshard reads .jsonl/.ndjson (+.gz/.zst), .json, "
                ".parquet, .arrow/.feather/.ipc, .txt and Hugging Face save_to_disk directories"
            )
        raise AssertionError(path)
    info = fs.info(path)
    if fmt[0] == "arrow":
        with fs.open(path, "rb") as f:
            magic = f.read(6)
        if magic[:4] == b"FEA1":  # read as a stream it fails with "Expected to read N bytes"
            raise InputError(
                f"{fs_url(fs, path)} (input {spec!r}) is a Feather V1 file, which Arrow "
                "deprecates and packshard does not read; rewrite it as an Arrow IPC file: "
                "pyarrow.feather.write_feather(pyarrow.feather.read_table(OLD), NEW)"
            )
        fmt = ("arrow" if magic == b"ARROW1" else "arrow_stream", None)
    return InputFile(
        url=fs_url(fs, path),
        format=fmt[0],
        compression=fmt[1],
        size=int(info.get("size") or 0),
        version=_version(info),
    )


def _saved_json(fs: fsspec.AbstractFileSystem, path: str, spec: str) -> dict[str, Any]:
    """A Hugging Face save_to_disk JSON file (dataset_dict.json, state.json): an object."""
    name = posixpath.basename(path)
    try:
        with fs.open(path, "r") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"input {spec!r}: its {name} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise InputError(f"input {spec!r}: its {name} holds a {type(doc).__name__}, not an object")
    return doc


def _directory(
    fs: fsspec.AbstractFileSystem, path: str, spec: str, split: str, *, hub: bool = False
) -> list[InputFile]:
    """A directory's data files. With `hub` (a hub dataset), as the hub reads a repository:
    files that name no split are left out once any does, and files of no type packshard reads
    (README.md, LICENSE) go unmentioned."""
    saved_dict = fs.isfile(f"{path}/dataset_dict.json")
    if saved_dict:
        splits = _saved_json(fs, f"{path}/dataset_dict.json", spec).get("splits", [])
        if not isinstance(splits, list):
            raise InputError(f"input {spec!r}: dataset_dict.json's splits is not a list")
        if split not in splits:  # the hub's synonyms (val, dev, eval, ...) name a split it has
            same = SPLIT_WORDS.get(split.lower(), split)
            split = next((x for x in splits if SPLIT_WORDS.get(str(x).lower(), x) == same), split)
        if split not in splits:
            raise InputError(
                f"input {spec!r} is a DatasetDict without split {split!r} (it has {splits}); "
                "pass --split with one of them"
            )
        path = f"{path}/{split}"
        if len(splits) > 1:
            others = ", ".join(str(x) for x in splits if x != split)
            log.warning(
                "input %s: a DatasetDict: read its split %s, not %s (--split picks)",
                redact_url(spec), split, others,
            )  # fmt: skip
    if fs.isfile(f"{path}/state.json"):  # a Hugging Face save_to_disk dataset: its arrow files
        if not saved_dict:
            _split_does_not_apply(spec, split, "a saved Dataset, not a DatasetDict")
        files = _saved_json(fs, f"{path}/state.json", spec).get("_data_files", [])
        if not isinstance(files, list) or not all(
            isinstance(d, dict) and isinstance(d.get("filename"), str) for d in files
        ):
            raise InputError(
                f'input {spec!r}: state.json\'s _data_files is not a list of {{"filename": ...}}'
            )
        names = [d["filename"] for d in files]
        if not names:
            raise InputError(f"input {spec!r}: state.json lists no data files")
        return [_file(fs, f"{path}/{n}", spec, strict=True) for n in names]
    found = sorted(p for p in fs.find(path) if not hub or _format_of(p))
    shown = {p: posixpath.relpath(p, path) for p in found}
    _refuse_saved_datasets_inside(spec, [shown[p] for p in found if not _hidden(shown[p])])
    readable = [p for p in found if _format_of(p) and not _hidden(shown[p])]
    splits = {p: split_in_name(shown[p]) for p in readable}
    present = sorted({s for s in splits.values() if s is not None})
    # a split layout only when every data file names its split (the hub's layout): a file of
    # other data whose name happens to hold a split word is no reason to drop the others
    if not present or (None in splits.values() and not hub):
        _split_does_not_apply(spec, split, "its file names do not all name a split")
        return _read_and_warn(fs, spec, found, shown, skip_hidden=True)
    wanted = SPLIT_WORDS.get(split.lower(), split)
    if wanted not in present:
        raise InputError(
            f"input {spec!r} holds the splits {present} (by its file names), not {split!r}; "
            "pass --split"
        )
    other = {p: f"split {s}" if s else "names no split" for p, s in splits.items() if s != wanted}
    return _read_and_warn(fs, spec, found, shown, skip_hidden=True, left_out=other)


_SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes beside its data


def _refuse_saved_datasets_inside(spec: str, rels: Sequence[str]) -> None:
    """A directory holding `save_to_disk` datasets below its top: read as plain files, their
    metadata JSON would be records and a DatasetDict's splits all read. Name them instead."""
    dirs = {posixpath.dirname(r) for r in rels if posixpath.basename(r) in _SAVED_MARKERS}
    tops = sorted(d for d in dirs if not any(d.startswith(f"{o}/") for o in dirs))
    if tops:
        listed = ", ".join(f"{d}/" for d in tops[:IGNORED_SHOWN])
        more = f" and {len(tops) - IGNORED_SHOWN} more" if len(tops) > IGNORED_SHOWN else ""
        raise InputError(
            f"input {spec!r} holds Hugging Face save_to_disk datasets ({listed}{more}); "
            "pass each as its own --input (a DatasetDict's folder reads the split --split names)"
        )


# Split names in data file names, as the Hugging Face hub lays them out
# (data/train-00000-of-00002.parquet, test/part-0.jsonl, validation.jsonl, ...)
SPLIT_WORDS = {
    "train": "train", "training": "train",
    "validation": "validation", "valid": "validation", "val": "validation", "dev": "validation",
    "test": "test", "testing": "test", "eval": "test", "evaluation": "test",
}  # fmt: skip


def _split_does_not_apply(spec: str, split: str, why: str) -> None:
    if split != "train":  # the default: only a --split given on purpose is worth a word
        log.warning(
            "input %s: --split %s does not apply (%s): read whole", redact_url(spec), split, why
        )


def split_in_name(rel: str) -> str | None:
    """The split a data file's path (relative to its directory) names, the hub's way: a
    directory named for a split (``train/part-00000-of-00002.jsonl``), a hub shard name in
    ``data/``, whatever its split is called (``data/train_sft-00000-of-00003-5f4c8e2a.parquet``:
    ``train_sft``), or a file name that is a split, alone or with a shard number and hash
    (``test.jsonl``, ``train-00000-of-00002.parquet``, ``val_3.jsonl``); else None
    (``unit_test_writing.jsonl``, ``part-00000-of-00004.jsonl`` name none)."""
    *dirs, name = rel.lower().split("/")
    for word in dirs:
        if word in SPLIT_WORDS:
            return SPLIT_WORDS[word]
    stem = name.split(".", 1)[0]
    hub = _HUB_SHARD.fullmatch(stem)
    # any name is a split only where the hub puts split shards, data/ (part-00000-of-00004
    # elsewhere is a writer's shard name, not a split)
    if hub and (hub["split"] in SPLIT_WORDS or dirs == ["data"]):
        return SPLIT_WORDS.get(hub["split"], hub["split"])
    return SPLIT_WORDS.get(_SHARD_SUFFIX.sub("", stem))


_SHARD_SUFFIX = re.compile(r"([-_]\d+)*(-of-\d+)?$")
# the hub's shard names: SPLIT-00000-of-00003, then a content hash in older uploads
_HUB_SHARD = re.compile(r"(?P<split>\w+?)-\d+-of-\d+(?:-[0-9a-f]+)?")


def _hidden(rel: str) -> bool:
    """Whether a path inside a directory is hidden: a name on it starts with "." or "_" (the
    file's, or a directory's: .ipynb_checkpoints/, Spark's _temporary/), as pyarrow's dataset
    discovery has it."""
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def _read_and_warn(
    fs: fsspec.AbstractFileSystem,
    spec: str,
    paths: list[str],
    shown: Mapping[str, str],
    *,
    skip_hidden: bool,
    left_out: Mapping[str, str] | None = None,
) -> list[InputFile]:
    """The `paths` of a directory or glob that the job reads, in order. The others (a type it
    cannot read, such as .csv or .bz2; in a directory, hidden ones, `_hidden`; files of another
    split, `left_out`) are named in one warning, by their `shown` names: nothing is
    left out unsaid."""
    read, ignored = [], []
    for p in paths:
        if skip_hidden and _hidden(shown[p]):
            ignored.append(f"{shown[p]} (hidden)")
        elif not _format_of(p):
            ignored.append(f"{shown[p]} (not a type packshard reads)")
        elif left_out and p in left_out:
            ignored.append(f"{shown[p]} ({left_out[p]})")
        else:
            read.append(_file(fs, p, spec))
    if ignored:
        more = len(ignored) - IGNORED_SHOWN
        types = any(i.endswith("(not a type packshard reads)") for i in ignored)
        log.warning(
            "input %s: ignored %d of its %d files: %s%s%s",
            redact_url(spec), len(ignored), len(paths), ", ".join(ignored[:IGNORED_SHOWN]),
            f" and {more} more" if more > 0 else "",
            " (packshard reads .jsonl/.ndjson (+.gz/.zst), .json, .parquet, .arrow/.feather/.ipc "
            "and .txt)" if types else "",
        )  # fmt: skip
    return read


def _looks_like_hub_name(spec: str) -> bool:
    """`org/name` with no scheme, no leading ./ or /, and no file extension."""
    return (
        "://" not in spec
        and spec.count("/") == 1
        and not spec.startswith((".", "/"))
        and "." not in spec.rsplit("/", 1)[1]
    )


def _hub_dataset(
    name: str, storage_options: Mapping[str, Any] | None, split: str
) -> list[InputFile]:
    """A bare hub name `org/name`: its data files for `split` through the hf:// filesystem."""
    url = f"hf://datasets/{name}"
    try:
        fs, path = url_to_fs(url, storage_options)
        return _directory(fs, path, url, split, hub=True)
    except InputError:
        raise
    except storage_errors_with(ImportError, ValueError) as e:
        raise InputError(
            f"input {name!r} is not a local path, and the Hugging Face hub dataset of that name cannot "
            f"be listed ({type(e).__name__}: {e}); check the name and network access"
        ) from None


# ---- demo ------------------------------------------------------------------------------


def demo_params(url: str) -> dict[str, int]:
    from urllib.parse import parse_qsl, urlsplit

    try:
        params = {k: int(v) for k, v in parse_qsl(urlsplit(url).query)}
    except ValueError:
        raise InputError(
            f"{url}: demo parameters are integers (seed, num_math, num_trajectories)"
        ) from None
    unknown = set(params) - {"seed", "num_math", "num_trajectories"}
    if unknown:
        raise InputError(f"{url}: unknown demo parameters {sorted(unknown)}")
    return params


def demo_size(url: str) -> int:
    """Records of ``demo://[?seed=N&num_math=N&num_trajectories=N]`` (none generated)."""
    from packshard.pipeline.demo import DEMO_NUM_MATH, DEMO_NUM_TRAJECTORIES

    params = demo_params(url)
    return params.get("num_math", DEMO_NUM_MATH) + params.get(
        "num_trajectories", DEMO_NUM_TRAJECTORIES
    )
