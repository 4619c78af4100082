"""Chat templates: rendering exactly like `apply_chat_template`, and finding the loss spans of
templates that have no ``{% generation %}`` tags (all of Qwen2.5, Qwen3 and Phi-3, and most
templates on the Hub).

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
  loss role starts at the end of P_k when that is a prefix of F; otherwise where P_k's last
  turn ends in F, provided P_k differs from F only by text before that turn's content (Qwen3
  gives an assistant turn that ends P_k an empty ``<think>`` block) or by a trailer of special
  tokens F ends with (Phi-3 closes every render with ``<|endoftext|>``).
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

Trade-offs: 1 + 2 renders per trained turn (the last turn needs one), so O(turns x length)
characters rendered and no prefix ever tokenized; on GSM8K-shaped chats (2 messages) that is 2
renders, ~65 us, next to ~250 us of tokenization. Most chats need only F: `ChatMasker` finds
the turns by the assistant header the generation prompt writes, under conditions that make
that exact, and checks the first chats both ways. The method needs (a) a generation prompt that
is a prefix of the full render (true of every template we know; checked per turn), (b) a
special-token terminator (else the turn ends at the end of P_{k+1} when that is a prefix of F,
else the record fails loudly), and (c) content that does not itself contain the terminator
(rejected as ``special_token_in_content``). Templates that drop a role (Phi-3 has no ``tool``
role) or ignore ``tools`` are found by probing once and reported per record
(``role_not_in_template`` / ``tools_not_in_template`` / ``tool_calls_not_in_template``)
instead of losing text.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError

from packshard.pipeline.samples import BadRecord, Chat
from packshard.pipeline.tokenizer_loading import TokenizerError, TokenizerPayload

log = logging.getLogger(__name__)

_PROBE = "\u27e6packshard-probe-{}\u27e7"
ExactRender = Callable[[list[dict[str, Any]], Any, bool], str]
# What rendering a chat template raises: jinja's own errors (syntax, undefined, sandbox,
# `raise_exception`), and the Python errors of the operations a template runs on a record's
# data (`"a" + 1`, a missing key or index, a method of the wrong type, a division by zero).
# apply_chat_template adds ValueError (no template) and TokenizerError (a ValueError).
TEMPLATE_ERRORS: tuple[type[Exception], ...] = (
    TemplateError,
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> Any:
    """Compile a chat template in the Jinja environment transformers renders chat templates in
    (`transformers.utils.chat_template_utils._compile_jinja_template`, mirrored here): an
    immutable sandbox (templates from the Hub are untrusted code), trim_blocks and
    lstrip_blocks, loop controls, a ``tojson`` that keeps non-ASCII, ``raise_exception``,
    ``strftime_now``, and the guarded ``dict`` / ``namespace``. ``{% generation %}`` renders its
    body. Mirrored rather than imported because importing it pulls in all of transformers
    (2-6 s in each fresh worker process); `check_renderer` and the tests hold the two equal."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}  # noqa: RUF012 - jinja's Extension API

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's Namespace signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    return env.from_string(source)


class ChatRenderer:
    """Renders chats exactly as `apply_chat_template(tokenize=False)` does, ~2.5x faster.

    `apply_chat_template` normalises the messages on every call (drops None-valued keys, aliases
    reasoning fields, deep-copies everything into plain JSON types) and then renders the template
    in transformers' sandboxed Jinja environment. The masking method renders each chat several
    times, so here the messages are prepared once per chat (the same two steps; records decoded
    from JSON or Arrow are plain types already) and the template, compiled in the same
    environment (`compile_chat_template`), is rendered directly. Where the tokenizer itself is at
    hand (`exact`), the first `CANARY` full renders are compared with `apply_chat_template`, and a
    difference switches to it for good (with a warning); the driver checks probe chats both ways
    before a job starts (`check_renderer`), so workers, which only have the payload, render the
    same text.
    """

    CANARY = 16

    def __init__(
        self,
        payload: TokenizerPayload,
        template_kwargs: Mapping[str, Any],
        exact: ExactRender | None = None,
    ) -> None:
        self._compile = compile_chat_template
        self.payload = payload
        self.kwargs = {**(payload.special_tokens_map or {}), **template_kwargs}
        self.exact = exact
        self.checked = 0
        self._compiled: dict[bool, Any] = {}

    @staticmethod
    def prepare(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What apply_chat_template does to the messages before rendering them."""
        out = []
        for m in messages:
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next(
                (
                    m[k]
                    for k in ("reasoning_content", "thinking", "reasoning")
                    if m.get(k) is not None
                ),
                None,
            )
            if reasoning is not None:  # the record's own keys first: errors name its key
                m = {**m, "reasoning_content": reasoning}
                m.setdefault("thinking", reasoning)  # a record's own thinking stays its own
            out.append(m)
        return out

    def render(self, prepared: list[dict[str, Any]], tools: Any, gen: bool) -> str:
        if self.exact is not None and self.checked > self.CANARY:  # the fast path failed a canary
            return self.exact(prepared, tools, gen)
        has_tools = tools is not None
        if has_tools not in self._compiled:
            self._compiled[has_tools] = self._compile(self.payload.chat_template_for(tools))
        return self._compiled[has_tools].render(
            messages=prepared, tools=tools, documents=None, add_generation_prompt=gen, **self.kwargs
        )

    def check(self, messages: list[dict[str, Any]], tools: Any, rendered: str) -> str:
        """While canaries remain (and the tokenizer is at hand), compare with apply_chat_template."""
        if self.exact is None or self.checked >= self.CANARY:
            return rendered
        self.checked += 1
        exact = self.exact(messages, tools, False)
        if exact != rendered:
            log.warning(
                "rendering the chat template directly differs from apply_chat_template; using apply_chat_template from now on"
            )
            self.checked = self.CANARY + 1
        return exact


def hf_exact_render(tok: Any, template_kwargs: Mapping[str, Any]) -> ExactRender:
    """`apply_chat_template(tokenize=False)` of a loaded tokenizer, as an ExactRender."""

    def render(messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=gen, tokenize=False, **template_kwargs
        )

    return render


PROBE_CHATS: tuple[tuple[list[dict[str, Any]], Any], ...] = (
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi\n\nthere"},
            {"role": "assistant", "content": "  Hello", "reasoning_content": None},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "21 degrees."},
        ],
        [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    ),
)


def check_renderer(renderer: ChatRenderer, exact: ExactRender) -> None:
    """Refuse to run when the fast render path differs from apply_chat_template on probe chats."""
    for messages, tools in PROBE_CHATS:
        for n in range(1, len(messages) + 1):
            for gen in (False, True):
                try:
                    want = exact(messages[:n], tools, gen)
                except TEMPLATE_ERRORS as e:  # a template may refuse a probe (Phi-3 and tools)
                    log.debug("the template refuses a %d-message probe (gen=%s): %s", n, gen, e)
                    continue
                got = renderer.render(ChatRenderer.prepare(messages[:n]), tools, gen)
                if got != want:
                    raise TokenizerError(
                        "packshard's chat template rendering differs from this tokenizer's apply_chat_template "
                        f"(transformers version?) on a probe chat of {n} messages; refusing to tokenize"
                    )


@dataclass(frozen=True)
class TemplateProfile:
    """What probing a chat template found (once per tokenizer): the turn terminator, the roles
    and tools it renders, and the assistant header (the text the generation prompt appends,
    ``<|im_start|>assistant\n`` for Qwen) with the special tokens in it and the terminator
    (`guard`: a chat whose strings contain one of them is masked by prefix renders)."""

    terminator: str | None
    roles: frozenset[str]
    renders_tools: bool
    header: str | None = None
    guard: tuple[str, ...] = ()


def probe_template(renderer: ChatRenderer, special_tokens: Sequence[str]) -> TemplateProfile:
    """Find the assistant turn terminator, the roles the template renders, and whether it
    renders `tools`, from a few probe chats."""
    p = [_PROBE.format(i) for i in range(4)]

    def rendered(messages: list[dict[str, Any]], needle: str, tools: Any = None) -> str | None:
        try:
            text = renderer.render(ChatRenderer.prepare(messages), tools, False)
        except TEMPLATE_ERRORS as e:  # a template may raise on a role it does not know
            log.debug("probe render failed: %s", e)
            return None
        return text if needle in text else None

    text = rendered(
        [{"role": "user", "content": p[0]}, {"role": "assistant", "content": p[1]}], p[1]
    )
    if text is None:
        raise TokenizerError("the chat template does not render a user/assistant chat")
    trailer = text[text.index(p[1]) + len(p[1]) :]
    hits = [(trailer.find(s), s) for s in special_tokens if s and s in trailer]
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
    schema = {
        "type": "function",
        "function": {
            "name": p[3],
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    renders_tools = rendered([{"role": "user", "content": p[0]}], p[3], tools=[schema]) is not None
    header, guard = _assistant_header(renderer, special_tokens, p[0], terminator)
    return TemplateProfile(terminator, frozenset(roles), renders_tools, header, guard)


def _assistant_header(
    renderer: ChatRenderer, special_tokens: Sequence[str], probe: str, terminator: str | None
) -> tuple[str | None, tuple[str, ...]]:
    """(the text the generation prompt appends to a chat, the special tokens in it and the
    terminator), or (None, ()) when there is no such header: no terminator, a generation prompt
    that is not an append, or one without a special token."""
    if terminator is None:
        return None, ()
    chat = ChatRenderer.prepare([{"role": "user", "content": probe}])
    try:
        base, head = renderer.render(chat, None, False), renderer.render(chat, None, True)
    except TEMPLATE_ERRORS as e:
        log.debug("probe render failed: %s", e)
        return None, ()
    if not head.startswith(base) or len(head) == len(base):
        return None, ()
    header = head[len(base) :]
    in_header = {s for s in special_tokens if s and s in header}
    if not in_header:
        return None, ()
    return header, tuple(sorted(in_header | {terminator}))


class ChatMasker:
    """The loss spans of chats under one template (see the module docstring).

    One-render path: when the loss is on assistant turns only, no string of the chat contains
    a special token of the assistant header or the terminator (`TemplateProfile.guard`), and
    the full render holds the header exactly once per assistant message, the i-th header
    starts the i-th assistant turn, which ends at the first terminator after it and before the
    next header, and must hold the message's text content. Then the turns are found in F
    itself: 1 render per chat instead of 1 + 2 per trained turn (the benchmark's 9.2K chats:
    ~2.3 renders a chat, ~0.3 s of a worker's ~5.5 s). Anything else takes the prefix renders.
    The first `CANARY` one-render chats of each masker are also masked by prefix renders; spans
    that differ turn the one-render path off for good (with a warning). A chat the prefix
    renders refuse keeps its one-render spans.
    """

    CANARY = 16

    def __init__(
        self, renderer: ChatRenderer, profile: TemplateProfile, loss_roles: frozenset[str]
    ) -> None:
        self.renderer = renderer
        self.profile = profile
        self.loss_roles = loss_roles
        self.one_render = profile.header is not None and loss_roles == frozenset({"assistant"})
        self.checked = 0
        if self.one_render:
            self.one_render = self._paths_agree_on_a_probe()

    def _paths_agree_on_a_probe(self) -> bool:
        """Whether prefix renders locate a plain two-turn chat's assistant turns where the
        header does: a template they refuse (one whose text depends on later messages) takes
        the prefix renders for every chat, which then refuse its chats alike, whatever their
        order. Decided per template, so every worker decides the same."""
        p = [_PROBE.format(i) for i in range(4)]
        roles = ("user", "assistant", "user", "assistant")
        msgs = ChatRenderer.prepare(
            [{"role": r, "content": c} for r, c in zip(roles, p, strict=True)]
        )
        try:
            full = self.render(msgs)
            fast = self._one_render_spans(full, msgs, None, 0)
            # no header spans for this chat (Qwen3 without thinking: only the last turn
            # has the prompt's empty block): no evidence either way
            return fast is None or fast == self._prefix_spans(full, msgs, None, 0)
        except BadRecord:
            return False

    def render(self, messages: list[dict[str, Any]], tools: Any = None, gen: bool = False) -> str:
        """Render prepared messages; a template error makes the record bad."""
        try:
            return self.renderer.render(messages, tools, gen)
        except TEMPLATE_ERRORS as e:
            raise BadRecord(
                "template_error", f"the chat template failed: {type(e).__name__}: {e}"
            ) from None

    def _check_tool_calls_render(self, msgs: list[dict[str, Any]], tools: Any, full: str) -> None:
        """A chat whose assistant tool calls the template drops (Phi-3 renders an assistant's
        content only) would train a tool-call turn as its content alone: the chat rendered
        without its calls must differ from `full`. One more render, for chats with calls only
        (a template renders every call or none; a per-template probe misjudges templates that
        need a call id, string arguments or the tools to choose a tool-use template)."""
        calls = [i for i, m in enumerate(msgs) if m.get("tool_calls")]
        if not calls:
            return
        without = [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
        try:
            dropped = self.renderer.render(without, tools, False) == full
        except TEMPLATE_ERRORS:
            dropped = False  # the template needs the calls: it renders them
        if dropped:
            raise BadRecord(
                "tool_calls_not_in_template",
                f"messages[{calls[0]}] has tool_calls, which this chat template does not render "
                "(the turn would train on its content alone)",
            )

    def loss_spans(self, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
        """(F, [(start, end) character spans that carry loss])."""
        original, tools, prof = chat.messages, chat.tools, self.profile
        for i, m in enumerate(original):
            if m["role"] not in prof.roles:
                raise BadRecord(
                    "role_not_in_template",
                    f"messages[{i}] has role {m['role']!r}, which this chat template does not render (it renders {sorted(prof.roles)})",
                )
        if tools and not prof.renders_tools:
            raise BadRecord(
                "tools_not_in_template",
                "the record has tools, which this chat template does not render",
            )
        msgs = ChatRenderer.prepare(original)
        full = self.render(msgs, tools)
        self._check_tool_calls_render(msgs, tools, full)
        try:
            full = self.renderer.check(original, tools, full)
        except TEMPLATE_ERRORS as e:
            raise BadRecord(
                "template_error", f"the chat template failed: {type(e).__name__}: {e}"
            ) from None
        fast = (
            self._one_render_spans(full, msgs, tools, chat.loss_from) if self.one_render else None
        )
        if fast is None:
            return full, self._prefix_spans(full, msgs, tools, chat.loss_from)
        if self.checked < self.CANARY:
            self.checked += 1
            try:
                slow = self._prefix_spans(full, msgs, tools, chat.loss_from)
            except BadRecord:
                # Prefix renders refuse chats the full render has no doubt about (Qwen3: two
                # assistant turns in a row, or reasoning a later user turn drops): not a sign
                # against the header spans, and a refusal here would make the chat's fate
                # depend on how many chats its worker had seen.
                slow = fast
            if slow != fast:
                log.warning(
                    "locating assistant turns by their header differs from prefix renders on a chat; "
                    "using prefix renders from now on"
                )
                self.one_render = False
                return full, self._prefix_spans(full, msgs, tools, chat.loss_from)
        return full, fast

    def _one_render_spans(
        self, full: str, msgs: list[dict[str, Any]], tools: Any, loss_from: int
    ) -> list[tuple[int, int]] | None:
        """The loss spans found in F alone (see the class docstring), or None."""
        header, term, guard = self.profile.header, self.profile.terminator, self.profile.guard
        assert header is not None and term is not None
        if _where_mentioned([msgs, tools], guard) is not None:
            return None
        assistant = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        if full.count(header) != len(assistant) or (assistant and assistant[0] == 0):
            return None
        heads, pos = [], 0
        for _ in assistant:
            pos = full.index(header, pos)
            heads.append(pos)
            pos += len(header)
        heads.append(len(full))
        spans: list[tuple[int, int]] = []
        for i, k in enumerate(assistant):
            if k < loss_from:
                continue
            start = heads[i] + len(header)
            end = full.find(term, start, heads[i + 1])
            if end < 0:
                return None
            end += len(term)
            content = msgs[k].get("content")
            if isinstance(content, str) and content and full.find(content, start, end) < 0:
                return None
            spans.append((start, end))
        return spans

    def _prefix_spans(
        self, full: str, msgs: list[dict[str, Any]], tools: Any, loss_from: int
    ) -> list[tuple[int, int]]:
        """The loss spans found by prefix renders (see the module docstring)."""
        prof = self.profile
        spans: list[tuple[int, int]] = []
        for k in range(loss_from, len(msgs)):
            role = msgs[k]["role"]
            if role not in self.loss_roles:
                continue
            # anywhere in the message (content, a tool call's arguments, reasoning): the turn
            # would end at it, and the rest of it would train nothing
            where = _where_mentioned(msgs[k], (prof.terminator,)) if prof.terminator else None
            if where is not None:
                raise BadRecord(
                    "special_token_in_content",
                    f"messages[{k}].{where} contains the turn terminator {prof.terminator!r} as text",
                )
            start = self._turn_start(full, msgs, tools, k, role == "assistant")
            upto = full if k == len(msgs) - 1 else self.render(msgs[: k + 1], tools)
            spans.append((start, self._turn_end(full, upto, start, prof.terminator, k)))
        return spans

    def _turn_start(
        self, full: str, msgs: list[dict[str, Any]], tools: Any, k: int, assistant: bool
    ) -> int:
        if k == 0:
            return self._first_turn_start(full, msgs, tools, assistant)
        head = self.render(msgs[:k], tools, gen=assistant)
        if full.startswith(head):
            return len(head)
        if assistant:
            # The generation prompt may write text that earlier turns do not have in the full
            # chat (Qwen3 with enable_thinking=false: an empty <think> block): the turn starts
            # where the prompt and the chat part, provided the earlier messages are intact.
            # The two may share more than the header: a turn starting "<tool_call>" or "<b>"
            # shares the "<" of the prompt's "<think>". The turn starts at the last line end or
            # special token of the shared part, never inside a word of the text.
            prior = self.render(msgs[:k], tools)
            common = _common_prefix_len(head, full)
            if full.startswith(prior) and common >= len(prior):
                start = _last_boundary(head, len(prior), common, self.profile.guard)
                if start > len(prior):
                    _check_not_inside_block(head, full, len(prior), start, k)
                    return start
        else:
            # the earlier messages alone render their last turn differently (Qwen3), or end
            # with a trailer the full chat writes only at its end (Phi-3's <|endoftext|>)
            after = _start_after_changed_turn(head, full, self.profile.terminator)
            if after is None:
                after = _start_before_trailer(head, full, self.renderer.payload.special_tokens)
            if after is not None:
                return after
        raise BadRecord(
            "template_not_prefix_stable",
            f"the chat template renders messages[:{k}] differently from the start of the full chat, so the loss of messages[{k}] cannot be located",
        )

    def _first_turn_start(
        self, full: str, msgs: list[dict[str, Any]], tools: Any, assistant: bool
    ) -> int:
        """Where messages[0]'s turn starts: after what the template writes before any message
        (Qwen2.5's default system prompt), found as the text the same message renders again
        as a second turn; an assistant's after its header, as for later turns. A template
        that does not render the message so (one that refuses a role twice in a row, ends
        every render with a trailer as Phi-3 does, or adds tools to the first turn) writes
        nothing before it that this can see: the turn starts at 0 (an assistant's after its
        header)."""
        one = self.render(msgs[:1], tools)
        try:
            two = self.render([msgs[0], msgs[0]], tools)
        except BadRecord:
            two = ""
        turn = two[len(one) :] if two.startswith(one) else ""
        start = len(one) - len(turn)
        if not turn or not one.endswith(turn) or not full.startswith(one[:start]):
            if tools is not None and self.profile.renders_tools:
                # the tools block comes first, and how far it reaches cannot be told (two tool
                # messages render as one turn): the loss would fall on the tools block
                raise BadRecord(
                    "template_not_prefix_stable",
                    "the template writes its tools block before messages[0], and where "
                    "messages[0]'s turn starts after it cannot be told",
                )
            start = 0
        if not assistant:
            return start
        cut = self._assistant_header_len(full, start, msgs[0])
        if self.profile.header is not None and cut:  # as later turns are checked
            _check_not_inside_block(full[:start] + self.profile.header, full, start, start + cut, 0)
        return start + cut

    def _assistant_header_len(self, full: str, start: int, message: dict[str, Any]) -> int:
        """Length of the assistant header at full[start:]: the generation prompt's part the
        turn shares (cut at a line end or special token), or, for a template whose prompt is
        no append (Phi-3), what the message rendered with two other contents shares; 0 when
        neither says."""
        header = self.profile.header
        if header is not None:
            shared = _common_prefix_len(header, full[start:])
            return _last_boundary(header, 0, shared, self.profile.guard)
        try:
            a, b = (
                self.render(ChatRenderer.prepare([{**message, "content": p}]))
                for p in (_PROBE.format("a"), _PROBE.format("b"))
            )
        except BadRecord:
            return 0
        cut = _last_boundary(a, 0, _common_prefix_len(a, b), self.profile.guard)
        return cut if full[start : start + cut] == a[:cut] else 0

    @staticmethod
    def _turn_end(full: str, upto: str, start: int, term: str | None, k: int) -> int:
        stable = full.startswith(upto)
        if term is None:
            if not stable:
                raise BadRecord(
                    "template_not_prefix_stable",
                    f"the template has no special-token turn terminator and renders messages[:{k + 1}] differently from the start of the full chat",
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
                f"the chat template renders messages[{k}] differently inside the full chat than at the end of a prefix, beyond text inserted before its content",
            )
        return end


def _where_mentioned(value: Any, needles: Sequence[str]) -> str | None:
    """Where a string inside `value` (dicts, their keys included: a tool call's argument names
    render too; lists; strings) contains one of `needles`: its field path relative to `value`
    ("content", "tool_calls[0].function.arguments.cmd", "" for `value` itself), else None.
    The path is built only on the way back from a find."""
    if isinstance(value, str):
        return "" if any(n in value for n in needles) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and any(n in k for n in needles):
                return f"{k!r} (a key)"
            sub = _where_mentioned(v, needles)
            if sub is not None:
                return f"{k}{'' if not sub or sub[0] == '[' else '.'}{sub}"
        return None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            sub = _where_mentioned(v, needles)
            if sub is not None:
                return f"[{i}]{'' if not sub or sub[0] == '[' else '.'}{sub}"
    return None


_OPEN_TAG = re.compile(r"<([A-Za-z_][\w-]*)>")


def _check_not_inside_block(head: str, full: str, turn: int, common: int, k: int) -> None:
    """Refuse a turn that parts from the generation prompt inside a tagged block the prompt
    writes (Qwen3 with enable_thinking=false writes ``<think>\n\n</think>\n\n``; a message
    whose content holds its own ``<think>...`` shares the block's opening): the loss would start
    mid-block, on text that follows a prompt the model is never given."""
    matched, rest = head[turn:common], head[common:]
    for tag in _OPEN_TAG.findall(matched):
        if f"</{tag}>" in rest and f"</{tag}>" not in matched:
            raise BadRecord(
                "content_inside_generation_prompt",
                f"messages[{k}] renders inside the <{tag}> block the generation prompt writes "
                f"({head[turn:]!r} with these template kwargs): the turn does not follow the prompt "
                "the model gets (reasoning content with thinking disabled?)",
            )


def _start_before_trailer(head: str, full: str, special_tokens: Sequence[str]) -> int | None:
    """Where the turn after `head` starts in `full`, when `head` is the full chat's start plus
    a trailer made of special tokens that the full chat ends with (Phi-3 closes every render
    without a generation prompt with ``<|endoftext|>``), else None."""
    # back to a line end or special token: "<|endoftext|>" and "<|user|>" share their "<|"
    common = _last_boundary(head, 0, _common_prefix_len(head, full), special_tokens)
    rest = head[common:]
    if not rest or not full.endswith(rest) or common + len(rest) >= len(full):
        return None
    for token in sorted((t for t in special_tokens if t), key=len, reverse=True):
        rest = rest.replace(token, "")
    return common if not rest.strip() else None


def _start_after_changed_turn(head: str, full: str, term: str | None) -> int | None:
    """Where the turn after `head` starts in `full`, when `head` (the earlier messages alone)
    renders its last turn with text the full chat does not have before that turn's content
    (Qwen3 gives the last assistant turn an empty ``<think>`` block, which an assistant turn
    followed by a user or tool message does not have in the full chat), else None. Required:
    the two part inside head's last turn (no terminator of head after it but its own), that
    turn in `full` is the one in `head` with only text before its content removed, and what
    follows its terminator in `head` (a line end) follows it in `full` too."""
    if not term:
        return None
    common = _common_prefix_len(head, full)
    hpos, fpos = head.find(term, common), full.find(term, common)
    if hpos < 0 or fpos < 0 or head.find(term, hpos + len(term)) >= 0:
        return None
    tail = head[hpos:]
    if full[fpos : fpos + len(tail)] != tail or not head[common:hpos].endswith(full[common:fpos]):
        return None
    return fpos + len(tail)


def _last_boundary(text: str, lo: int, hi: int, tokens: Sequence[str]) -> int:
    """The last place in text[lo:hi] just after a newline or one of `tokens` (lo if none)."""
    best = text.rfind("\n", lo, hi) + 1
    for t in tokens:
        at = text.rfind(t, lo, hi) if t else -1
        if at >= 0:
            best = max(best, at + len(t))
    return max(best, lo)


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
