"""The driver's tokenizer cache: a checked `TokenizerPayload`, kept on disk, so that a pack job
with a tokenizer it has seen before skips transformers altogether.

Every pack job's driver is a fresh process (`packshard pack`, or the driver of a ``ray job
submit``), and loading a tokenizer with `AutoTokenizer` there costs ~2.3 s before any work
starts: transformers imports torch, then Qwen2.5's vocab.json and merges.txt are converted to
a Rust tokenizer. What the driver keeps of it is small and deterministic: the payload the
workers rebuild the tokenizer from, the pad id, and the fact that packshard's chat rendering
matched `apply_chat_template` on the probe chats. That is what this module stores, one JSON file
per key under ``$PACKSHARD_CACHE_DIR/tokenizers/`` (default ``~/.cache/packshard``, or
``$XDG_CACHE_HOME/packshard``). A hit costs ~0.1 s and imports neither transformers nor torch.

The key covers everything the cached result depends on, so a hit is what a fresh load would
give:

- the tokenizer's files: for a directory, the name and bytes of every file in it and in its
  subdirectories (chat templates live in one), model weights and files over 256 MiB excepted
  (a directory with more than 1,000 files or 512 MiB of hashable ones is not cached);
  for a hub tokenizer, its name and the commit it resolved to (a commit's files never change;
  a revision that is not a commit is not cached), and, when it loads from the local Hugging
  Face cache only (offline, or the hub unreachable), the files of that commit's snapshot there
  too (a snapshot may hold some of the commit's files, and gain the others later);
- the versions of transformers, tokenizers, jinja2, huggingface_hub and of the converters
  (sentencepiece, protobuf, tiktoken; a conversion or a template feature may change with them),
  and the bytes of packshard's own rendering code;
- the chat template keyword arguments (the rendering check depends on them).

Tokenizers loaded with ``trust_remote_code`` (their code may do anything) and the built-in demo
tokenizer (built in-process) are never cached. A cached file must match the sha256 stored in
it (over everything a hit hands out: payload, fingerprint, pad id), else it counts as a miss
and is rewritten. A load whose files changed while it ran is not stored. The cache keeps the
`MAX_ENTRIES` most recently used files (~10 MB each for a 150K vocabulary). Reading or writing
it never fails a job: an unusable directory or entry only means no cache (logged at debug
level). Entries are readable by their owner only: the cache is per user (a directory shared by
several users gives each of them misses). ``PACKSHARD_TOKENIZER_CACHE=0`` turns it off; deleting
the directory is always safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packshard.pipeline.tokenizer_loading import TokenizerPayload, TokenizerSource

log = logging.getLogger(__name__)

FORMAT = 1
MAX_ENTRIES = 16
STALE_TMP_S = 3600  # a temporary file this old was left by a writer that died
MAX_FILE_BYTES = 256 << 20  # a file this large is no tokenizer file (a dataset, a checkpoint)
MAX_HASHED_FILES, MAX_HASHED_BYTES = 1000, 512 << 20  # beyond these: not cached
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")  # fmt: skip
# the libraries that load, convert (slow to fast: sentencepiece, protobuf, tiktoken) or render
VERSIONED = (
    "transformers", "tokenizers", "jinja2", "huggingface_hub", "sentencepiece", "protobuf",
    "tiktoken",
)  # fmt: skip
# the code whose behaviour a cached result stands for: rendering, masking probes, payloads
OWN_CODE = ("chat_template.py", "tokenization.py", "tokenizer_loading.py", "tokenizer_cache.py")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_OFF = frozenset({"0", "off", "false", "no"})


def cache_dir() -> Path | None:
    """Where cached tokenizers go; None when the cache is turned off."""
    if os.environ.get("PACKSHARD_TOKENIZER_CACHE", "").strip().lower() in _OFF:
        return None
    root = os.environ.get("PACKSHARD_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "packshard")
    return Path(root) / "tokenizers"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _walk(root: Path) -> list[Path] | None:
    """The files under `root`, sorted, through symlinked directories too (transformers reads a
    symlinked additional_chat_templates/), each real directory once; None as soon as there are
    more than MAX_HASHED_FILES (the walk stops there, wherever a link leads)."""
    found: list[Path] = []
    seen = set()
    for top, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs.clear()
            continue
        seen.add(real)
        found += [Path(top) / n for n in names if os.path.isfile(os.path.join(top, n))]
        if len(found) > MAX_HASHED_FILES:
            return None
    return sorted(found)


def _hash_directory(h: Any, root: Path) -> bool:
    """Hash the directory's files (weights excepted); False, hashing nothing, when it holds
    more than MAX_HASHED_FILES files or MAX_HASHED_BYTES of hashable ones (a tree that is no
    tokenizer's)."""
    paths = _walk(root)
    if paths is None:
        return False
    files = []
    for path in paths:
        name, size = path.relative_to(root).as_posix(), path.stat().st_size
        if not name.endswith(WEIGHT_SUFFIXES) and size <= MAX_FILE_BYTES:
            files.append((path, name, size))
    if sum(size for *_, size in files) > MAX_HASHED_BYTES:
        return False
    for path, name, size in files:
        h.update(f"\0file {name} {size}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return True


def cache_key(
    source: TokenizerSource, trust_remote_code: bool, template_kwargs: Mapping[str, Any]
) -> str | None:
    """The key of this tokenizer's cached payload; None when it must not be cached (or the key
    cannot be computed: a cache problem never fails a job)."""
    if trust_remote_code or source.source == "builtin":
        return None
    try:
        return _key(source, template_kwargs)
    except Exception as e:  # an install without sources, an unreadable file, a hub cache quirk
        log.debug(
            "tokenizer cache: no key for %s (%s: %s); not cached", source.spec, type(e).__name__, e
        )
        return None


def _snapshot(source: TokenizerSource) -> Path | None:
    """The local Hugging Face cache's folder of a hub tokenizer's commit, if it holds one."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("tokenizer_config.json", "tokenizer.json"):
        found = try_to_load_from_cache(source.spec, filename, revision=source.revision)
        if isinstance(found, str):
            return Path(found).parent
    return None


def _key(source: TokenizerSource, template_kwargs: Mapping[str, Any]) -> str | None:
    h = hashlib.sha256(f"packshard tokenizer cache {FORMAT}\0".encode())
    for dist in VERSIONED:
        h.update(f"{dist}={_version(dist)}\0".encode())
    here = Path(__file__).resolve().parent
    for name in OWN_CODE:
        h.update((here / name).read_bytes())
    # a keyword argument JSON cannot hold raises TypeError: no stable key (cache_key says so)
    h.update(json.dumps(dict(template_kwargs), sort_keys=True).encode())
    if source.source == "hub":
        if not source.revision or not _COMMIT.fullmatch(source.revision):
            return None
        h.update(f"\0hub {source.spec} {source.revision}".encode())
        if not source.local_files_only:
            return h.hexdigest()
        folder = _snapshot(source)  # what the local cache holds of the commit is what loads
        if folder is None:
            return None
    else:
        assert source.path is not None
        folder = Path(source.path)
    if not _hash_directory(h, folder):  # an unreadable file raises: cache_key logs it
        log.debug("tokenizer cache: %s holds too much to hash; not cached", folder)
        return None
    return h.hexdigest()


def read(key: str, name: str) -> tuple[TokenizerPayload, int | None] | None:
    """(payload, pad id) cached under `key`, or None (a miss: absent, unreadable or damaged)."""
    root = cache_dir()
    if root is None:
        return None
    path = root / f"{key}.json"
    try:
        entry = json.loads(path.read_text())
        if not isinstance(entry, dict):
            raise ValueError(f"the entry is a {type(entry).__name__}")
        if entry.get("format") != FORMAT or entry.get("sha256") != _entry_digest(entry):
            log.debug("tokenizer cache: %s is damaged or of another format", path)
            return None
        fields = dict(entry["payload"])
        fields["special_tokens"] = tuple(fields["special_tokens"])
        payload = TokenizerPayload(**{**fields, "name": name})
        pad = entry["pad_token_id"]
    except FileNotFoundError:
        return None
    except Exception as e:  # damaged in any way (RecursionError for a deeply nested one)
        log.debug("tokenizer cache: %s is unusable (%s); loading the tokenizer", path, e)
        return None
    with contextlib.suppress(OSError):  # a read-only cache still serves hits
        os.utime(path)  # most recently used
    return payload, pad


def write(key: str, payload: TokenizerPayload, pad_token_id: int | None) -> None:
    """Store a checked payload (atomically: readers see the old file or the new one)."""
    root = cache_dir()
    if root is None:
        return
    fields = {f: getattr(payload, f) for f in payload.__dataclass_fields__ if f != "name"}
    try:
        entry = {"format": FORMAT, "payload": fields, "pad_token_id": pad_token_id}
        text = json.dumps({**entry, "sha256": _entry_digest(entry)})
    except TypeError as e:  # a special token map JSON cannot hold
        log.debug("tokenizer cache: payload not JSON (%s); not cached", e)
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, root / f"{key}.json")
        except BaseException:
            os.unlink(tmp)
            raise
        _prune(root)
    except OSError as e:
        log.debug("tokenizer cache: cannot write under %s (%s)", root, e)


def _entry_digest(entry: dict[str, Any]) -> str:
    """sha256 of an entry's payload and pad id (every field a hit hands out)."""
    body = {"payload": entry.get("payload"), "pad_token_id": entry.get("pad_token_id")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _prune(root: Path) -> None:
    """Keep the MAX_ENTRIES most recently used entries; remove temporary files that a writer
    left behind (older than STALE_TMP_S: one being written is not touched)."""
    entries = []
    now = time.time()
    for p in root.glob("*.json"):
        try:
            mtime = p.stat().st_mtime
        except FileNotFoundError:
            continue  # pruned by another job meanwhile
        if not p.name.startswith(".tmp-"):
            entries.append((mtime, p))
        elif now - mtime > STALE_TMP_S:
            p.unlink(missing_ok=True)
    for _, p in sorted(entries, reverse=True)[MAX_ENTRIES:]:
        p.unlink(missing_ok=True)
