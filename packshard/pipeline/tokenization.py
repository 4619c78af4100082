"""Tokenization: samples of every kind -> token ids and loss masks, with a real Hugging Face
tokenizer.

- chats: rendered and masked by `pipeline.chat_template` (loss on the configured roles, located
  without ``{% generation %}`` tags), the rendered text tokenized once, as
  `apply_chat_template(tokenize=True)` does, so the ids are the tokenizer's own;
- text: tokenized with the tokenizer's special tokens (e.g. BOS) and EOS appended, every token
  a loss token;
- prompt + completion without a chat template: the two texts joined and tokenized once (the
  ids of the tokenizer on the whole text: a SentencePiece tokenizer encoding the completion
  alone would start it with a space of its own), loss on every token holding some of the
  completion (a token merging the prompt's last space with the completion's first word is
  the completion's), and on EOS;
- pre-tokenized ids: checked against the vocabulary size, kept as they are.

A token is a loss token when it *starts* inside a loss span: Phi-3's ``<|assistant|>`` token
swallows the whitespace after it (its ``rstrip``), and a BPE merge of the header's newline with a
content that starts with a newline makes one token straddle the span start; both belong to the
prompt. Character spans map to tokens with a few `char_to_token` look-ups per span (no offsets
list is built).

Texts are encoded by the Rust tokenizer in batches of `ENCODE_BATCH` (1024): on 7.5K GSM8K chats
that is ~25% faster than one batch of all of them. Encoders are built once per process (in Ray
workers: once per worker, from the driver's `TokenizerPayload`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packshard.pipeline.chat_template import (
    ChatMasker,
    ChatRenderer,
    TemplateProfile,
    hf_exact_render,
    probe_template,
)
from packshard.pipeline.samples import BadRecord, Chat, PlainPromptCompletion, Sample, Text, Tokens
from packshard.pipeline.tokenizer_loading import (
    DEMO_TOKENIZER,
    TokenizerError,
    TokenizerPayload,
    load_tokenizer,
    pad_token_id_of,
    rust_tokenizer,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)

ENCODE_BATCH = 1024

__all__ = [
    "DEMO_TOKENIZER",
    "ENCODE_BATCH",
    "Encoded",
    "SampleEncoder",
    "TokenizerError",
    "TokenizerPayload",
    "load_tokenizer",
    "pad_token_id_of",
    "tokenizer_fingerprint",
]


@dataclass(frozen=True)
class Encoded:
    """One tokenized sample."""

    ids: np.ndarray  # int32
    mask: np.ndarray  # bool


@dataclass
class _Pending:
    """A sample between preparation and batch encoding."""

    texts: list[str]  # one text (chat / text) or two (plain prompt, completion)
    spans: list[tuple[int, int]] = field(default_factory=list)
    kind: str = "chat"


class SampleEncoder:
    """Samples -> token ids and loss masks with one tokenizer.

    Built from a loaded Hugging Face tokenizer (the driver, tests: chat renders are then also
    checked against its `apply_chat_template`) or from a `TokenizerPayload` (workers).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        loss_roles: Sequence[str] = ("assistant",),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.template_kwargs = dict(template_kwargs or {})
        self._backend: Any = None  # a payload's Rust tokenizer is built on the first encode
        if isinstance(tokenizer, TokenizerPayload):
            payload, exact = tokenizer, None
            self.tok = None
        else:
            payload = TokenizerPayload.from_tokenizer(
                tokenizer, str(getattr(tokenizer, "name_or_path", ""))
            )
            exact, self._backend = (
                hf_exact_render(tokenizer, self.template_kwargs),
                tokenizer.backend_tokenizer,
            )
            self.tok = tokenizer
        self.payload = payload
        self.loss_roles = frozenset(loss_roles)
        self.has_chat_template = bool(payload.chat_template)
        self.renderer: ChatRenderer | None = None
        self.profile: TemplateProfile | None = None
        self.masker: ChatMasker | None = None
        if self.has_chat_template:
            self.renderer = ChatRenderer(payload, self.template_kwargs, exact)
            self.profile = probe_template(self.renderer, payload.special_tokens)
            self.masker = ChatMasker(self.renderer, self.profile, self.loss_roles)
        self.eos_id = payload.eos_token_id
        self.vocab_size = payload.vocab_size

    @property
    def backend(self) -> Any:
        """The Rust tokenizer (from a payload: rebuilt once per process, ~0.35 s for Qwen's
        151K vocabulary; a driver that only checks the template never needs it)."""
        if self._backend is None:
            self._backend = rust_tokenizer(self.payload)
        return self._backend

    def loss_spans(self, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered chat, its loss spans); see `pipeline.chat_template`."""
        if self.masker is None:
            raise BadRecord(
                "no_chat_template", "the tokenizer has no chat template; chats need one"
            )
        return self.masker.loss_spans(chat)

    # ---- all kinds ---------------------------------------------------------------------

    def _prepare(self, sample: Sample) -> _Pending:
        if isinstance(sample, Chat):
            text, spans = self.loss_spans(sample)
            if not spans:
                raise BadRecord(
                    "no_loss_tokens", f"no message with a loss role {sorted(self.loss_roles)}"
                )
            return _Pending([text], spans, "chat")
        if isinstance(sample, Text):
            return _Pending([sample.text], kind="text")
        if isinstance(sample, PlainPromptCompletion):
            start = len(sample.prompt)
            return _Pending(
                [sample.prompt + sample.completion],
                [(start, start + len(sample.completion))],
                kind="plain_pc",
            )
        raise TypeError(f"cannot prepare {type(sample).__name__}")

    def _check_ids(self, sample: Tokens) -> Encoded:
        ids = checked_ids(sample.input_ids, self.vocab_size, "the tokenizer's")
        mask = (
            np.ones(ids.size, np.bool_)
            if sample.loss_mask is None
            else np.asarray(sample.loss_mask, np.bool_)
        )
        return Encoded(ids, mask)

    def _encode_batch(
        self, texts: list[str], add_special_tokens: bool, *, offsets: bool = True
    ) -> list[Any]:
        """The Rust batch encoder, in batches of ENCODE_BATCH texts (measured ~25% faster than
        one huge batch on 7.5K GSM8K chats). Without `offsets` (texts whose every token is a
        loss token) it uses `encode_batch_fast` where the installed tokenizers has it: the same
        ids without character offsets, ~20% faster on Gutenberg books. A text the encoder
        refuses (a lone surrogate such as a cut emoji escape, "\ud83d", which JSON allows and
        UTF-8 cannot hold fails its whole batch) comes back as a BadRecord, found by encoding
        that batch's texts one at a time."""
        encode = self.backend.encode_batch
        if not offsets:
            encode = getattr(self.backend, "encode_batch_fast", encode)
        out: list[Any] = []
        for i in range(0, len(texts), ENCODE_BATCH):
            batch = texts[i : i + ENCODE_BATCH]
            try:
                out += encode(batch, add_special_tokens=add_special_tokens)
            except TypeError:
                for text in batch:
                    try:
                        out += encode([text], add_special_tokens=add_special_tokens)
                    except TypeError:
                        out.append(_unencodable(text))
        return out

    def _ending_in_eos(self, ids: list[int], mask: np.ndarray) -> Encoded:
        """A text's or pair's ids ending in EOS, a loss token: appended unless the tokenizer
        already ends the text with it (its post-processor adds one, or the text holds it)."""
        if self.eos_id is not None and ids and ids[-1] == self.eos_id:
            mask[-1] = True
        elif self.eos_id is not None:
            ids, mask = [*ids, self.eos_id], np.append(mask, True)
        return Encoded(np.asarray(ids, np.int32), mask)

    def encode(self, samples: Sequence[Sample | BadRecord]) -> list[Encoded | BadRecord]:
        """Encode a batch (one Rust batch call per kind); BadRecords pass through, new ones
        replace samples that fail."""
        out: list[Encoded | BadRecord | None] = [None] * len(samples)
        pending: dict[int, _Pending] = {}
        for i, s in enumerate(samples):
            if isinstance(s, BadRecord):
                out[i] = s
                continue
            try:
                if isinstance(s, Tokens):
                    out[i] = self._check_ids(s)
                else:
                    pending[i] = self._prepare(s)
            except BadRecord as e:
                out[i] = e
        chats = [(i, p) for i, p in pending.items() if p.kind == "chat"]
        pairs = [(i, p) for i, p in pending.items() if p.kind == "plain_pc"]
        texts = [(i, p) for i, p in pending.items() if p.kind == "text"]
        if chats:
            encs = self._encode_batch([p.texts[0] for _, p in chats], False)
            for (i, p), enc in zip(chats, encs, strict=True):
                out[i] = (
                    enc
                    if isinstance(enc, BadRecord)
                    else Encoded(np.asarray(enc.ids, np.int32), _span_mask(enc, p.spans))
                )
        if pairs:  # plain prompt + completion: loss on the completion's tokens and EOS
            encs = self._encode_batch([p.texts[0] for _, p in pairs], True)
            for (i, p), enc in zip(pairs, encs, strict=True):
                if isinstance(enc, BadRecord):
                    out[i] = enc
                    continue
                out[i] = self._ending_in_eos(list(enc.ids), _overlap_mask(enc, p.spans[0]))
        if texts:  # text: loss on every token, EOS appended
            encs = self._encode_batch([p.texts[0] for _, p in texts], True, offsets=False)
            for (i, _p), enc in zip(texts, encs, strict=True):
                if isinstance(enc, BadRecord):
                    out[i] = enc
                    continue
                out[i] = self._ending_in_eos(list(enc.ids), np.ones(len(enc.ids), np.bool_))
        result: list[Encoded | BadRecord] = []
        for r in out:
            assert r is not None
            if isinstance(r, Encoded) and not r.mask.any():
                r = BadRecord("no_loss_tokens", "the sample has no loss tokens")
            result.append(r)
        return result


def _unencodable(text: str) -> BadRecord:
    """The BadRecord of a text the Rust encoder refuses: UTF-8 cannot hold a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return BadRecord(
            "invalid_utf8",
            f"the record holds a lone surrogate {text[e.start]!r} (a cut \\uD8xx escape, as "
            "a truncated emoji leaves); UTF-8 cannot hold it",
        )
    return BadRecord("invalid_utf8", "the tokenizer cannot encode the text")


def checked_ids(values: Sequence[int], upper: int, whose: str) -> np.ndarray:
    """Pre-tokenized ids as int32, each in [0, upper) (`whose` range: "the tokenizer's"), or
    BadRecord token_out_of_range naming the first that is not (also one past int64)."""
    try:
        ids = np.asarray(values, dtype=np.int64)
    except OverflowError:
        i, v = next((i, v) for i, v in enumerate(values) if not -(2**63) <= v < 2**63)
        raise BadRecord(
            "token_out_of_range", f"input_ids[{i}] = {v} is outside {whose} [0, {upper})"
        ) from None
    bad = np.flatnonzero((ids < 0) | (ids >= upper))
    if bad.size:
        raise BadRecord(
            "token_out_of_range",
            f"input_ids[{int(bad[0])}] = {int(ids[bad[0]])} is outside {whose} [0, {upper})",
        )
    return ids.astype(np.int32)


def _span_mask(enc: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    """Loss mask over `enc`'s tokens: true for tokens that start inside a character span."""
    mask = np.zeros(len(enc), np.bool_)  # len(enc.ids) would build the ids list again
    for start, end in spans:
        first = _first_token_from(enc, start, end)
        last = _last_token_before(enc, start, end)
        if first is not None and last is not None and last >= first:
            mask[first : last + 1] = True
    return mask


def _overlap_mask(enc: Any, span: tuple[int, int]) -> np.ndarray:
    """Loss mask of a plain prompt + completion: every token holding some of the completion's
    characters. Unlike a chat turn (which a special token separates from what precedes it), a
    completion often merges with the prompt's end ('Answer: ' + 'Paris' is one token
    ' Paris'): that token is the completion's target, predicted from the prompt."""
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    a, b = offsets[:, 0], offsets[:, 1]
    start, end = span
    mask = (b > start) & (a < end) & (b > a)
    # a whitespace token a ByteLevel post-processor trims to no width (trim_offsets: code
    # indentation) sits where its whitespace ended; special tokens the tokenizer adds have none
    special = np.asarray(enc.special_tokens_mask, dtype=np.bool_)
    mask |= (a == b) & ~special & (a > start) & (a <= end)
    if mask.any():  # and every token between the completion's first and last
        hit = np.flatnonzero(mask)
        mask[hit[0] : hit[-1] + 1] = True
    return mask


def _first_token_from(enc: Any, start: int, end: int) -> int | None:
    """Index of the first token whose start offset is in [start, end)."""
    for c in range(start, end):
        t = enc.char_to_token(c)
        if t is None:
            continue
        return (
            t
            if enc.token_to_chars(t)[0] >= start
            else (t + 1 if t + 1 < len(enc) and enc.token_to_chars(t + 1)[0] < end else None)
        )
    return None


def _last_token_before(enc: Any, start: int, end: int) -> int | None:
    """Index of the last token whose start offset is in [start, end). Several tokens may
    start at one character (a SentencePiece '▁' and the token after it; the byte-fallback
    tokens of one character): char_to_token names the first of them, so later ones that still
    start before `end` are taken too."""
    for c in range(end - 1, start - 1, -1):
        t = enc.char_to_token(c)
        if t is None:
            continue
        if enc.token_to_chars(t)[0] < start:
            return None
        while t + 1 < len(enc):
            chars = enc.token_to_chars(t + 1)
            if chars is None or not start <= chars[0] < end:
                break
            t += 1
        return t
    return None
