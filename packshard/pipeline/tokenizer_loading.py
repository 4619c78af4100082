"""Finding and loading the tokenizer once on the driver, and shipping it to the workers.

`locate_tokenizer` decides where ``--tokenizer`` comes from without importing transformers
(~5 s) or starting anything, so a wrong value fails in well under a second:

- ``packshard:demo``: the built-in tokenizer;
- an existing directory: used as is; a value that looks like a path (``./x``, ``../x``, ``/x``,
  ``~/x``, ``a/b/c``) but is not a directory fails as "directory ... does not exist" (naming
  the closest sibling), never as a malformed hub name;
- otherwise a hub name (``org/name``): with ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set it
  must be in the Hugging Face cache; else one request to the hub's API (5 s timeout, no retries)
  resolves ``--tokenizer-revision`` (default ``main``) to a commit. An unreachable hub falls back
  to the cache, and fails at once when the name is not cached: no 55 s of download retries.

The manifest records the tokenizer as ``{"name", "source", "revision"?, "fingerprint"}``: a hub
name with the commit it resolved to, or a directory's base name (never the path as typed, which
means nothing on another machine); the fingerprint identifies the tokenizer either way.

The driver loads the user's tokenizer with `AutoTokenizer` (``trust_remote_code`` only when
asked) and turns it into a `TokenizerPayload`: the complete Rust tokenizer definition
(`tokenizer.json` text: vocabulary, merges, normalizer, added tokens, post-processor), the chat
template, the special tokens and ids. Workers rebuild the Rust tokenizer from it
(`tokenizers.Tokenizer.from_str`, ~0.35 s for Qwen's 151K vocabulary) instead of importing
transformers' AutoTokenizer stack (~5 s per worker process: it pulls in torch) and reloading the
files, and they need neither the files nor hub access, so a tokenizer that exists only on the
submitting machine works on any cluster. Its `fingerprint` (sha256 of the definition, the chat
template and the special tokens) goes into the manifest. A payload the driver checked once is
kept on disk by `tokenizer_cache`, so the next job with the same tokenizer skips transformers.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import logging
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

log = logging.getLogger(__name__)

DEMO_TOKENIZER = "packshard:demo"
HUB_TIMEOUT_S = 5.0
# files any Hugging Face tokenizer directory holds at least one of
TOKENIZER_FILES = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt"}
)
# a hub repo id: `name` or `org/name`, letters, digits, "-", "_", "." (no "--", no "..")
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or cannot do what the job needs."""


@dataclass(frozen=True)
class TokenizerSource:
    """Where ``--tokenizer`` comes from, found by `locate_tokenizer` (nothing loaded yet)."""

    spec: str  # as given on the command line
    source: Literal["builtin", "directory", "hub"]
    path: str | None = None  # the directory, resolved
    revision: str | None = None  # hub: the commit (or the revision asked for, when unresolved)
    local_files_only: bool = False  # hub: load from the cache (offline, or the hub unreachable)

    def manifest_entry(self, fingerprint: str) -> dict[str, str]:
        """The manifest's ``config.tokenizer``: hub name + revision, or the directory's name."""
        if self.source == "directory":
            assert self.path is not None
            name = os.path.basename(self.path.rstrip(os.sep)) or self.path
            return {"name": name, "source": "directory", "fingerprint": fingerprint}
        entry = {"name": self.spec, "source": self.source, "fingerprint": fingerprint}
        if self.source == "hub" and self.revision:
            entry["revision"] = self.revision
        return entry


def _looks_like_path(name: str) -> bool:
    """A hub id has at most one "/" and never starts with ".", "/" or "~"."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or name.endswith("/")
        or "\\" in name
    )


def _missing_directory(name: str) -> TokenizerError:
    path = os.path.abspath(os.path.expanduser(name))
    parent, base = os.path.split(path.rstrip(os.sep))
    hint = ""
    if os.path.isdir(parent):
        close = difflib.get_close_matches(base, sorted(os.listdir(parent)), n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {os.path.join(os.path.dirname(name.rstrip('/')), close[0])!r}?"
    elif parent:
        hint = f" (nor does its parent {parent})"
    return TokenizerError(f"tokenizer directory {name!r} does not exist{hint}")


def _hub_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _cached_revision(name: str, revision: str | None) -> str | None:
    """The commit of `name`'s cached tokenizer files (None when they are not cached)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("tokenizer_config.json", "tokenizer.json"):
        found = try_to_load_from_cache(name, filename, revision=revision)
        if isinstance(found, str):
            parts = found.replace(os.sep, "/").split("/snapshots/", 1)
            return parts[1].split("/", 1)[0] if len(parts) == 2 else (revision or "main")
    return None


def _hub_commit(name: str, revision: str) -> str:
    """One request to the hub's API: the commit `revision` of `name` points to.

    Raises TokenizerError when the hub answers that there is no such repository or revision,
    and OSError (URLError, timeout) when the hub cannot be reached.
    """
    from huggingface_hub import constants, get_token

    url = f"{constants.ENDPOINT}/api/models/{name}/revision/{quote(revision, safe='')}"
    request = urllib.request.Request(url, headers={"User-Agent": "packshard"})
    token = get_token()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S) as response:
            info = json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            raise TokenizerError(
                f"tokenizer {name!r} (revision {revision}) is not on the Hugging Face hub "
                f"({constants.ENDPOINT} answered {e.code}): check the name and --tokenizer-revision; "
                "a gated or private repository needs HF_TOKEN; a local directory is written ./name"
            ) from None
        raise
    except json.JSONDecodeError as e:
        raise OSError(f"the hub's answer is not JSON ({e})") from None
    return str(info.get("sha") or revision)


def locate_tokenizer(name: str, revision: str | None = None) -> TokenizerSource:
    """Where `name` comes from (see the module docstring); TokenizerError when it cannot be used."""
    if name == DEMO_TOKENIZER:
        return TokenizerSource(name, "builtin")
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        files = set(os.listdir(path))
        if not files & TOKENIZER_FILES:
            raise TokenizerError(
                f"tokenizer directory {name!r} holds no tokenizer files (one of {sorted(TOKENIZER_FILES)})"
            )
        return TokenizerSource(name, "directory", path=os.path.abspath(path))
    if os.path.exists(path):
        raise TokenizerError(
            f"--tokenizer {name!r} is a file; give the directory that holds tokenizer.json"
        )
    if _looks_like_path(name) or not _HUB_ID.fullmatch(name):
        raise _missing_directory(name)
    if _hub_offline():
        cached = _cached_revision(name, revision)
        if cached is None:
            raise TokenizerError(
                f"tokenizer {name!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
                f"download it where the hub is reachable (hf download {name}), or give a local directory"
            )
        return TokenizerSource(name, "hub", revision=cached, local_files_only=True)
    try:
        commit = _hub_commit(name, revision or "main")
    except OSError as e:
        reason = getattr(e, "reason", e)
        cached = _cached_revision(name, revision)
        if cached is None:
            raise TokenizerError(
                f"tokenizer {name!r}: the Hugging Face hub cannot be reached ({reason}) and it is not "
                "in the local cache; give a local directory, or run where the hub is reachable"
            ) from None
        log.warning(
            "the Hugging Face hub cannot be reached (%s); using the cached tokenizer %s",
            reason,
            name,
        )
        return TokenizerSource(name, "hub", revision=cached, local_files_only=True)
    return TokenizerSource(name, "hub", revision=commit)


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """AutoTokenizer by hub name or local path (or the built-in demo tokenizer), once per process."""
    return load_located(locate_tokenizer(name, revision), trust_remote_code)


@functools.lru_cache(maxsize=4)
def load_located(source: TokenizerSource, trust_remote_code: bool = False) -> Any:
    """The tokenizer `locate_tokenizer` found, loaded (transformers' AutoTokenizer)."""
    if source.source == "builtin":
        from packshard.pipeline.demo import demo_tokenizer

        return demo_tokenizer()
    from transformers import AutoTokenizer

    where = source.path if source.source == "directory" else source.spec
    try:
        tok = AutoTokenizer.from_pretrained(
            where,
            trust_remote_code=trust_remote_code,
            revision=source.revision if source.source == "hub" else None,
            local_files_only=source.local_files_only,
        )
    except (OSError, ValueError, KeyError) as e:
        raise TokenizerError(
            f"cannot load tokenizer {source.spec!r}: {e}\n(--trust-remote-code for tokenizers that ship code)"
        ) from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise TokenizerError(
            f"tokenizer {source.spec!r} is not a fast (Rust) tokenizer; packshard needs one"
        )
    return tok


NO_PAD_TOKEN = "the tokenizer has no pad or EOS token; pass --pad-token-id"


def pad_or_eos(tok: Any) -> int | None:
    """The tokenizer's pad id, else its EOS id, else None."""
    return next((int(t) for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), None)


def pad_token_id_of(tok: Any) -> int:
    """The tokenizer's pad id, else its EOS id; TokenizerError when it has neither."""
    pad = pad_or_eos(tok)
    if pad is None:
        raise TokenizerError(NO_PAD_TOKEN)
    return pad


@dataclass(frozen=True)
class TokenizerPayload:
    """Everything workers need to tokenize and render like the driver's tokenizer."""

    name: str
    fingerprint: str
    tokenizer_json: str = ""
    chat_template: str | dict[str, str] | None = None
    special_tokens_map: dict[str, Any] | None = None
    special_tokens: tuple[str, ...] = ()
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    vocab_size: int = 0

    @classmethod
    def from_tokenizer(cls, tok: Any, name: str) -> TokenizerPayload:
        specials = set(tok.all_special_tokens) | {
            t.content for t in tok.added_tokens_decoder.values() if t.special
        }
        fields: dict[str, Any] = dict(
            name=name,
            tokenizer_json=tok.backend_tokenizer.to_str(),
            chat_template=tok.chat_template,
            special_tokens_map=dict(tok.special_tokens_map),
            special_tokens=tuple(sorted(specials)),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            vocab_size=len(tok),
        )
        return cls(fingerprint=cls(fingerprint="", **fields).computed_fingerprint(), **fields)

    def computed_fingerprint(self) -> str:
        """sha256 of the definition, the chat template and the special tokens map."""
        template = self.chat_template
        h = hashlib.sha256(self.tokenizer_json.encode())
        h.update(
            b"\0"
            + (
                template if isinstance(template, str) else json.dumps(template, sort_keys=True)
            ).encode()
        )
        h.update(b"\0" + json.dumps(self.special_tokens_map, sort_keys=True, default=str).encode())
        return f"sha256:{h.hexdigest()}"

    def chat_template_for(self, tools: Any) -> str:
        """The template `apply_chat_template` would pick (named templates: "tool_use" with tools)."""
        t = self.chat_template
        if isinstance(t, dict):
            if tools is not None and "tool_use" in t:
                return t["tool_use"]
            if "default" in t:
                return t["default"]
            raise TokenizerError(
                f"the tokenizer has several chat templates and no default: {sorted(t)}"
            )
        if not t:
            raise TokenizerError("the tokenizer has no chat template")
        return t


_RUST_TOKENIZERS: dict[str, Any] = {}


def rust_tokenizer(payload: TokenizerPayload) -> Any:
    """The Rust tokenizer rebuilt from a payload, once per process (keyed by fingerprint)."""
    if payload.fingerprint not in _RUST_TOKENIZERS:
        from tokenizers import Tokenizer

        _RUST_TOKENIZERS[payload.fingerprint] = Tokenizer.from_str(payload.tokenizer_json)
    return _RUST_TOKENIZERS[payload.fingerprint]


def tokenizer_fingerprint(tok: Any) -> str:
    """The fingerprint of a loaded tokenizer (see `TokenizerPayload`)."""
    return TokenizerPayload.from_tokenizer(tok, "").fingerprint
