"""Tokenization with a real Hugging Face tokenizer, and loss masks for chat templates that have
no ``{% generation %}`` tags (all of Qwen2.5, Qwen3 and Phi-3, and most templates on the Hub).

Masking method: generation-prompt prefix + turn terminator
-----------------------------------------------------------
For a chat m_0 .. m_{n-1} let F = render(all messages): exactly the text `apply_chat_template`
renders, and the text that is tokenized (once, like `apply_chat_template(tokenize=True)`), so
the token ids equal the tokenizer's own output by construction. For each message k that carries
loss (its role is in `loss_roles`, and k >= the completion start for prompt/completion data):

- start s_k. An assistant turn starts where generation would start: H_k = render(m_<k,
  add_generation_prompt=True) is a prefix of F, and s_k = len(H_k). When the generation prompt
  writes text the full chat does not have at that turn (Qwen3 with ``enable_thinking=false``
  puts an empty ``<think>`` block into the prompt, and only the last turn of the chat has one),
  the turn starts where H_k and F part, provided P_k = render(m_<k) is intact in F. Another
  loss role starts at the end of P_k (checked to be a prefix of F).
- end e_k: the end of the first *turn terminator* at or after s_k. The terminator is learned
  once per tokenizer from a probe chat: the first special token the template writes after an
  assistant's content (``<|im_end|>`` for Qwen, ``<|end|>`` for Phi-3, ``<|eot_id|>`` for
  Llama 3). The terminator is trained (the model must learn to stop); whatever the template
  writes after it (a newline, Phi-3's final ``<|endoftext|>``) is not.
- cross-check against P_{k+1} = render(m_<=k): when it is a prefix of F, the terminator must
  end inside it; when it is not (Qwen3 writes an empty ``<think>`` block into the *last*
  assistant turn only, so a prefix ending at turn k renders that turn differently from the full
  chat), the turn's text in F must be a suffix of the turn as P_{k+1} renders it, i.e. the
  template only inserted text before the content. Anything else raises
  ``BadRecord("template_not_prefix_stable")`` naming the message: a template this method cannot
  mask is reported, never masked wrongly.

A token is a loss token when it *starts* inside some [s_k, e_k): Phi-3's ``<|assistant|>`` token
swallows the whitespace after it (its ``rstrip``), and a BPE merge of the header's newline with
a content that starts with a newline makes one token straddle s_k; both belong to the prompt.

Trade-offs: rendering costs 1 + 2 renders per trained turn (the last turn needs one), so
O(turns x length) characters; on GSM8K-shaped chats (2 messages) that is 2 renders, ~0.3 ms, next
to ~1 ms of tokenization, and no prefix is ever tokenized. The method needs (a) a generation
prompt that is a prefix of the full render (true of every template we know; checked per turn),
(b) a special-token terminator (else the turn ends at the end of P_{k+1} when that is a prefix
of F, else the record fails loudly), and (c) message content that does not itself contain the
terminator (such a record is rejected as ``special_token_in_content``). Templates that drop a
role (Phi-3 has no ``tool`` role) or ignore ``tools`` are detected by probing once and reported
per record (``role_not_in_template`` / ``tools_not_in_template``) instead of losing text.

Tokenizers are loaded once per process (`load_tokenizer` is cached), which in Ray workers means
once per worker, never per task.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.samples import BadRecord, Chat, PlainPromptCompletion, Sample, Text, Tokens

log = logging.getLogger(__name__)

DEMO_TOKENIZER = "packshard:demo"
_PROBE = "\u27e6packshard-probe-{}\u27e7"


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or cannot do what the job needs."""


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """AutoTokenizer by hub name or local path (or the built-in demo tokenizer), once per process."""
    if name == DEMO_TOKENIZER:
        from pipeline.demo import demo_tokenizer

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


def tokenizer_fingerprint(tok: Any) -> str:
    """sha256 over the full tokenizer definition (vocabulary, merges, normalizer, added tokens)
    and the chat template: two tokenizers with the same fingerprint tokenize identically."""
    h = hashlib.sha256()
    h.update(tok.backend_tokenizer.to_str().encode())
    h.update(b"\0")
    h.update(
        (tok.chat_template or "").encode()
        if isinstance(tok.chat_template, str)
        else json.dumps(tok.chat_template, sort_keys=True).encode()
    )
    h.update(b"\0")
    h.update(json.dumps(tok.special_tokens_map, sort_keys=True, default=str).encode())
    return f"sha256:{h.hexdigest()}"


def pad_token_id_of(tok: Any) -> int:
    """The tokenizer's pad id, else its EOS id; TokenizerError when it has neither."""
    for tid in (tok.pad_token_id, tok.eos_token_id):
        if tid is not None:
            return int(tid)
    raise TokenizerError("the tokenizer has no pad or EOS token; pass --pad-token-id")


@dataclass(frozen=True)
class TemplateProfile:
    """What probing a chat template found (once per tokenizer)."""

    terminator: str | None
    roles: frozenset[str]
    renders_tools: bool


def _render(
    tok: Any, messages: list[dict[str, Any]], tools: Any, gen: bool, kwargs: Mapping[str, Any]
) -> str:
    return tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs
    )


def probe_template(tok: Any, template_kwargs: Mapping[str, Any]) -> TemplateProfile:
    """Find the assistant turn terminator, the roles the template renders, and whether it
    renders `tools`, from a few probe chats."""
    p = [_PROBE.format(i) for i in range(4)]
    specials = sorted(
        {s for s in tok.all_special_tokens}
        | {t.content for t in tok.added_tokens_decoder.values() if t.special},
        key=len,
        reverse=True,
    )

    def rendered(messages: list[dict[str, Any]], needle: str, tools: Any = None) -> str | None:
        try:
            text = _render(tok, messages, tools, False, template_kwargs)
        except Exception as e:
            log.debug("probe render failed: %s", e)
            return None
        return text if needle in text else None

    text = rendered(
        [{"role": "user", "content": p[0]}, {"role": "assistant", "content": p[1]}], p[1]
    )
    if text is None:
        raise TokenizerError("the chat template does not render a user/assistant chat")
    trailer = text[text.index(p[1]) + len(p[1]) :]
    hits = [(trailer.find(s), s) for s in specials if s and s in trailer]
    terminator = min(hits, key=lambda h: (h[0], -len(h[1])))[1] if hits else None
    roles = {"user", "assistant"}
    if rendered([{"role": "system", "content": p[2]}, {"role": "user", "content": p[0]}], p[2]):
        roles.add("system")
    tool_chat = [
        {"role": "user", "content": p[0]},
        {"role": "assistant", "content": p[1]},
        {"role": "tool", "content": p[2]},
        {"role": "assistant", "content": p[3]},
    ]
    if rendered(tool_chat, p[2]):
        roles.add("tool")
    tool_schema = {
        "type": "function",
        "function": {
            "name": p[3],
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    renders_tools = (
        rendered([{"role": "user", "content": p[0]}], p[3], tools=[tool_schema]) is not None
    )
    return TemplateProfile(terminator, frozenset(roles), renders_tools)


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
    first_text_index: int = 0


class SampleEncoder:
    """Samples -> token ids and loss masks with one tokenizer (see the module docstring)."""

    def __init__(
        self,
        tok: Any,
        *,
        loss_roles: Sequence[str] = ("assistant",),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tok = tok
        self.backend = tok.backend_tokenizer
        self.loss_roles = frozenset(loss_roles)
        self.template_kwargs = dict(template_kwargs or {})
        self.has_chat_template = bool(tok.chat_template)
        self.profile = probe_template(tok, self.template_kwargs) if self.has_chat_template else None
        self.eos_id = tok.eos_token_id
        self.vocab_size = len(tok)

    # ---- chats -------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: Any = None, gen: bool = False) -> str:
        try:
            return _render(self.tok, messages, tools, gen, self.template_kwargs)
        except Exception as e:
            raise BadRecord(
                "template_error", f"the chat template failed: {type(e).__name__}: {e}"
            ) from None

    def loss_spans(self, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
        """(F, [(start, end) character spans that carry loss])."""
        if self.profile is None:
            raise BadRecord(
                "no_chat_template", "the tokenizer has no chat template; chats need one"
            )
        msgs, tools, prof = chat.messages, chat.tools, self.profile
        for i, m in enumerate(msgs):
            if m["role"] not in prof.roles:
                raise BadRecord(
                    "role_not_in_template",
                    f"messages[{i}] has role {m['role']!r}, which this chat template does not render "
                    f"(it renders {sorted(prof.roles)})",
                )
        if tools and not prof.renders_tools:
            raise BadRecord(
                "tools_not_in_template",
                "the record has tools, which this chat template does not render",
            )
        full = self.render(msgs, tools)
        spans: list[tuple[int, int]] = []
        for k in range(chat.loss_from, len(msgs)):
            role = msgs[k]["role"]
            if role not in self.loss_roles:
                continue
            term = prof.terminator
            content = msgs[k].get("content")
            if term and isinstance(content, str) and term in content:
                raise BadRecord(
                    "special_token_in_content",
                    f"messages[{k}].content contains the turn terminator {term!r} as text",
                )
            start = self._turn_start(full, msgs, tools, k, role == "assistant")
            upto = full if k == len(msgs) - 1 else self.render(msgs[: k + 1], tools)
            spans.append((start, self._turn_end(full, upto, start, term, k)))
        return full, spans

    def _turn_start(
        self, full: str, msgs: list[dict[str, Any]], tools: Any, k: int, assistant: bool
    ) -> int:
        if k == 0:
            return 0
        head = self.render(msgs[:k], tools, gen=assistant)
        if full.startswith(head):
            return len(head)
        if assistant:
            # The generation prompt may write text that earlier turns do not have in the full
            # chat (Qwen3 with enable_thinking=false: an empty <think> block): the turn starts
            # where the prompt and the chat part, provided the earlier messages are intact.
            prior = self.render(msgs[:k], tools)
            common = _common_prefix_len(head, full)
            if full.startswith(prior) and common >= len(prior):
                return common
        raise BadRecord(
            "template_not_prefix_stable",
            f"the chat template renders messages[:{k}] differently from the start of the full chat, "
            f"so the loss of messages[{k}] cannot be located",
        )

    @staticmethod
    def _turn_end(full: str, upto: str, start: int, term: str | None, k: int) -> int:
        stable = full.startswith(upto)
        if term is None:
            if not stable:
                raise BadRecord(
                    "template_not_prefix_stable",
                    f"the template has no special-token turn terminator and renders messages[:{k + 1}] "
                    "differently from the start of the full chat",
                )
            return len(upto.rstrip())
        pos = full.find(term, start)
        if pos < 0:
            raise BadRecord(
                "template_not_prefix_stable",
                f"no {term!r} after messages[{k}] in the rendered chat",
            )
        end = pos + len(term)
        if stable:
            if end > len(upto):
                raise BadRecord(
                    "template_not_prefix_stable",
                    f"messages[{k}] renders without its {term!r}; the next one found belongs to a later turn",
                )
            return end
        # The prefix render differs from the full chat (Qwen3's last-turn <think> block): the
        # turn in `full` must be the turn in `upto` with only text before the content removed.
        upos = upto.find(term, start) if upto.startswith(full[:start]) else -1
        if upos < 0 or not upto[start : upos + len(term)].endswith(full[start:end]):
            raise BadRecord(
                "template_not_prefix_stable",
                f"the chat template renders messages[{k}] differently inside the full chat than at the "
                "end of a prefix, beyond text inserted before its content",
            )
        return end

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
            return _Pending([sample.prompt, sample.completion], kind="plain_pc")
        raise TypeError(f"cannot prepare {type(sample).__name__}")

    def _check_ids(self, sample: Tokens) -> Encoded:
        ids = np.asarray(sample.input_ids, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise BadRecord(
                "token_out_of_range",
                f"input_ids[{int(bad[0])}] = {int(ids[bad[0]])} is outside the tokenizer's [0, {self.vocab_size})",
            )
        mask = (
            np.ones(ids.size, np.bool_)
            if sample.loss_mask is None
            else np.asarray(sample.loss_mask, np.bool_)
        )
        return Encoded(ids.astype(np.int32), mask)

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
        plain = [(i, p) for i, p in pending.items() if p.kind == "chat"]
        special = [(i, p) for i, p in pending.items() if p.kind != "chat"]
        if plain:
            encs = self.backend.encode_batch(
                [p.texts[0] for _, p in plain], add_special_tokens=False
            )
            for (i, p), enc in zip(plain, encs, strict=True):
                out[i] = Encoded(np.asarray(enc.ids, np.int32), _span_mask(enc, p.spans))
        if special:
            firsts = self.backend.encode_batch(
                [p.texts[0] for _, p in special], add_special_tokens=True
            )
            seconds_idx = [(i, p) for i, p in special if len(p.texts) > 1]
            seconds = self.backend.encode_batch(
                [p.texts[1] for _, p in seconds_idx], add_special_tokens=False
            )
            second_of = {i: enc for (i, _), enc in zip(seconds_idx, seconds, strict=True)}
            eos = [] if self.eos_id is None else [self.eos_id]
            for (i, _p), enc in zip(special, firsts, strict=True):
                head = list(enc.ids)
                if i in second_of:  # plain prompt + completion: loss on the completion + EOS
                    tail = list(second_of[i].ids) + eos
                    ids = head + tail
                    mask = np.concatenate(
                        [np.zeros(len(head), np.bool_), np.ones(len(tail), np.bool_)]
                    )
                else:  # text: loss on every token, EOS appended
                    ids = head + eos if not head or head[-1] != self.eos_id else head
                    mask = np.ones(len(ids), np.bool_)
                out[i] = Encoded(np.asarray(ids, np.int32), mask)
        result: list[Encoded | BadRecord] = []
        for r in out:
            assert r is not None
            if isinstance(r, Encoded) and not r.mask.any():
                r = BadRecord("no_loss_tokens", "the sample has no loss tokens")
            result.append(r)
        return result


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-level slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _span_mask(enc: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    """Loss mask over `enc`'s tokens: true for tokens that start inside a character span."""
    mask = np.zeros(len(enc.ids), np.bool_)
    for start, end in spans:
        first = _first_token_from(enc, start, end)
        last = _last_token_before(enc, start, end)
        if first is not None and last is not None and last >= first:
            mask[first : last + 1] = True
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
            else (t + 1 if t + 1 < len(enc.ids) and enc.token_to_chars(t + 1)[0] < end else None)
        )
    return None


def _last_token_before(enc: Any, start: int, end: int) -> int | None:
    """Index of the last token whose start offset is in [start, end)."""
    for c in range(end - 1, start - 1, -1):
        t = enc.char_to_token(c)
        if t is None:
            continue
        return t if enc.token_to_chars(t)[0] >= start else None
    return None
