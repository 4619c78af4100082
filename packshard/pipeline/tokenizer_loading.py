"""Loading the tokenizer once on the driver, and shipping it to the workers.

The driver loads the user's tokenizer with `AutoTokenizer` (hub name or local path;
``trust_remote_code`` only when asked) and turns it into a `TokenizerPayload`: the complete
Rust tokenizer definition (`tokenizer.json` text: vocabulary, merges, normalizer, added
tokens, post-processor), the chat template, the special tokens and ids. Workers rebuild the
Rust tokenizer from it (`tokenizers.Tokenizer.from_str`, ~0.7 s for Qwen's 151K vocabulary)
instead of importing transformers' AutoTokenizer stack (~5 s per worker process: it pulls in
torch) and reloading the files, and they need neither the files nor hub access, so a tokenizer
that exists only on the submitting machine works on any cluster. Its `fingerprint` (sha256 of
the definition, the chat template and the special tokens) goes into the manifest.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

DEMO_TOKENIZER = "packshard:demo"


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or cannot do what the job needs."""


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """AutoTokenizer by hub name or local path (or the built-in demo tokenizer), once per process."""
    if name == DEMO_TOKENIZER:
        from packshard.pipeline.demo import demo_tokenizer

        return demo_tokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            name, trust_remote_code=trust_remote_code, revision=revision
        )
    except (OSError, ValueError, KeyError) as e:
        raise TokenizerError(
            f"cannot load tokenizer {name!r}: {e}\n(give a local directory with tokenizer files, or a "
            "Hugging Face hub name on a machine that can reach the hub or has it cached; "
            "--trust-remote-code for tokenizers that ship code)"
        ) from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise TokenizerError(
            f"tokenizer {name!r} is not a fast (Rust) tokenizer; packshard needs one"
        )
    return tok


def pad_token_id_of(tok: Any) -> int:
    """The tokenizer's pad id, else its EOS id; TokenizerError when it has neither."""
    for tid in (tok.pad_token_id, tok.eos_token_id):
        if tid is not None:
            return int(tid)
    raise TokenizerError("the tokenizer has no pad or EOS token; pass --pad-token-id")


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
        definition = tok.backend_tokenizer.to_str()
        template = tok.chat_template
        specials = set(tok.all_special_tokens) | {
            t.content for t in tok.added_tokens_decoder.values() if t.special
        }
        h = hashlib.sha256(definition.encode())
        h.update(
            b"\0"
            + (
                template if isinstance(template, str) else json.dumps(template, sort_keys=True)
            ).encode()
        )
        h.update(b"\0" + json.dumps(tok.special_tokens_map, sort_keys=True, default=str).encode())
        return cls(
            name=name,
            fingerprint=f"sha256:{h.hexdigest()}",
            tokenizer_json=definition,
            chat_template=template,
            special_tokens_map=dict(tok.special_tokens_map),
            special_tokens=tuple(sorted(specials)),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            vocab_size=len(tok),
        )

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
