"""Token ids and loss masks, checked against the tokenizers' own output.

Ids: equal to `apply_chat_template(tokenize=True)` token for token. Masks: an independent
oracle. For each real template (Qwen2.5, Qwen3, Phi-3) the test holds a rewrite with
``{% generation %}`` tags around what an assistant turn trains on; the rewrite must render the
very same text as the original (checked per chat), and Hugging Face's own
`return_assistant_tokens_mask` machinery then gives the reference character spans, which ours
must equal exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from packshard.pipeline.chat_template import ChatRenderer
from packshard.pipeline.samples import (
    BadRecord,
    Chat,
    PlainPromptCompletion,
    Text,
    Tokens,
    to_sample,
)
from packshard.pipeline.tokenization import (
    SampleEncoder,
    TokenizerError,
    load_tokenizer,
    pad_token_id_of,
    tokenizer_fingerprint,
)

# ---- generation-tagged rewrites of the real templates ------------------------------------


def _swap(template: str, old: str, new: str, count: int = 1) -> str:
    assert template.count(old) == count, (old, template.count(old))
    return template.replace(old, new)


QWEN25_LOOP = """{%- for message in messages %}
    {%- if message.role == "assistant" and not message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
    {%- elif (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}{% generation %}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
    {%- elif message.role == "tool" %}"""


def tagged_template(name: str, original: str) -> str:
    if name == "qwen2.5-instruct":
        start = original.index("{%- for message in messages %}")
        end = original.index('{%- elif message.role == "tool" %}') + len(
            '{%- elif message.role == "tool" %}'
        )
        return original[:start] + QWEN25_LOOP + original[end:]
    if name == "qwen3":
        t = _swap(
            original,
            "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content",
            "{{- '<think>\\n' + reasoning_content",
        )
        t = _swap(
            t, "{{- '<|im_start|>' + message.role + '\\n' + content }}", "{{- content }}", count=2
        )
        t = _swap(
            t,
            "{%- if loop.index0 > ns.last_query_index %}",
            "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{%- if loop.index0 > ns.last_query_index %}",
        )
        return _swap(
            t,
            "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
            "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}",
        )
    if name == "phi-3-mini-instruct":
        return _swap(
            original,
            "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
            "{{'<|assistant|>\n'}}{% generation %}{{message['content'] + '<|end|>'}}{% endgeneration %}{{'\n'}}",
        )
    raise KeyError(name)


def reference(tok: Any, tagged: str, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{k: v for k, v in m.items() if v is not None} for m in chat.messages]
    rendered, indices = render_jinja_template(
        conversations=[messages],
        tools=chat.tools,
        chat_template=tagged,
        return_assistant_tokens_mask=True,
        add_generation_prompt=False,
        **tok.special_tokens_map,
    )
    return rendered[0], [tuple(s) for s in indices[0]]


def _records(shared: Path) -> dict[str, list[dict]]:
    def jsonl(rel: str, limit: int | None = None) -> list[dict]:
        with open(shared / rel) as f:
            rows = [json.loads(line) for line in f]
        return rows[:limit]

    gsm = [
        {"prompt": r["question"], "completion": r["answer"]} for r in jsonl("gsm8k/test.jsonl", 40)
    ]
    return {
        "oasst": jsonl("chat/oasst_en_100_threads.messages.jsonl", 100),
        "glaive_tools": jsonl("chat/glaive_toolcall_en_demo.messages.jsonl", 200),
        "alpaca": jsonl("chat/alpaca_en_demo.messages.jsonl", 40),
        "swe_trajectories": jsonl(
            "long_context/agent_trajectories/swe_agent_trajectories.messages.jsonl"
        ),
        "gsm8k": gsm,
    }


def _starts_in(enc_offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    starts = np.asarray([o[0] for o in enc_offsets])
    mask = np.zeros(starts.size, np.bool_)
    for s, e in spans:
        mask |= (starts >= s) & (starts < e)
    return mask


@pytest.mark.shared
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3", "phi-3-mini-instruct"])
def test_masks_and_ids_match_the_tokenizers_own_output(shared_data: Path, name: str):
    tok = load_tokenizer(str(shared_data / "tokenizers" / name))
    tagged = tagged_template(name, tok.chat_template)
    enc = SampleEncoder(tok)
    checked: dict[str, int] = {}
    for dataset, records in _records(shared_data).items():
        samples = [to_sample(r) for r in records]
        out = enc.encode(samples)
        for rec, sample, got in zip(records, samples, out, strict=True):
            assert isinstance(sample, Chat)
            has_tool = any(m["role"] == "tool" for m in sample.messages)
            if name == "phi-3-mini-instruct" and (has_tool or sample.tools):
                # Phi-3's template has no tool role and ignores tools: reported, never dropped silently
                assert isinstance(got, BadRecord) and got.reason in (
                    "role_not_in_template",
                    "tools_not_in_template",
                )
                continue
            assert not isinstance(got, BadRecord), (dataset, got)
            ids = tok.apply_chat_template(
                sample.messages, tools=sample.tools, tokenize=True, return_dict=False
            )
            assert got.ids.tolist() == list(ids), (dataset, rec.get("id"))
            text, spans = enc.loss_spans(sample)
            ref_text, ref_spans = reference(tok, tagged, sample)
            assert ref_text == text, "the tagged rewrite must render exactly like the original"
            if sample.loss_from:  # prompt/completion: only the completion's assistant turns
                ref_spans = ref_spans[-1:]
            assert spans == ref_spans, (dataset, rec.get("id"))
            offsets = tok.backend_tokenizer.encode(text, add_special_tokens=False).offsets
            assert np.array_equal(got.mask, _starts_in(offsets, ref_spans))
            checked[dataset] = checked.get(dataset, 0) + 1
    assert checked["oasst"] == 100 and checked["alpaca"] == 40 and checked["gsm8k"] == 40
    if name != "phi-3-mini-instruct":
        assert checked["glaive_tools"] == 200 and checked["swe_trajectories"] == 22
    else:
        assert checked.get("glaive_tools", 0) > 30  # the ones without tools


@pytest.mark.shared
def test_qwen3_think_block_of_the_last_turn_is_trained_and_earlier_turns_have_none(
    shared_data: Path,
):
    tok = load_tokenizer(str(shared_data / "tokenizers" / "qwen3"))
    enc = SampleEncoder(tok)
    chat = Chat(
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    )
    text, spans = enc.loss_spans(chat)
    assert [text[s:e] for s, e in spans] == ["b<|im_end|>", "<think>\n\n</think>\n\nd<|im_end|>"]
    no_think = SampleEncoder(tok, template_kwargs={"enable_thinking": False})
    text, spans = no_think.loss_spans(chat)  # the empty think block is then part of the prompt
    assert [text[s:e] for s, e in spans] == ["b<|im_end|>", "d<|im_end|>"]
    # reasoning in the content with thinking disabled: the turn would part from the prompt
    # inside its <think> block (the loss starting mid-block); refused
    reasoning = Chat(
        [chat.messages[0], {"role": "assistant", "content": "<think>\nx\n</think>\n\nd"}]
    )
    (got,) = no_think.encode([reasoning])
    assert isinstance(got, BadRecord) and got.reason == "content_inside_generation_prompt"
    text, spans = enc.loss_spans(reasoning)  # thinking on: the whole block is the turn's
    assert [text[s:e] for s, e in spans] == ["<think>\nx\n</think>\n\nd<|im_end|>"]
    # an earlier turn whose text starts like the prompt's "<think>" ("<tool_call>", "<b>")
    # starts at its own first character, not one past the "<" the two share
    for first in ("<b>Yes</b>", "<tool_call>\n{}\n</tool_call>", "<think"):
        tagged = Chat(
            [chat.messages[0], {"role": "assistant", "content": first}, *chat.messages[2:]]
        )
        text, spans = no_think.loss_spans(tagged)
        assert [text[s:e] for s, e in spans] == [f"{first}<|im_end|>", "d<|im_end|>"]
        (got,) = no_think.encode([tagged])
        assert tok.decode(got.ids[got.mask]).startswith(first)


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3"])
def test_a_trained_first_message_starts_after_the_templates_preamble(shared_data: Path, name: str):
    """Qwen2.5 writes a default system prompt before the first message: a trained
    messages[0] (a chat opening with the assistant, or --loss-roles user) is its own turn,
    not that prompt, and an assistant's header is not trained."""
    tok = load_tokenizer(str(shared_data / "tokenizers" / name))
    opening = Chat(
        [
            {"role": "assistant", "content": "GREETING"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
    )
    text, spans = SampleEncoder(tok).loss_spans(opening)
    assert text[spans[0][0] : spans[0][1]] == "GREETING<|im_end|>"
    question = Chat(
        [{"role": "user", "content": "QUESTION"}, {"role": "assistant", "content": "a"}]
    )
    text, spans = SampleEncoder(tok, loss_roles=("user",)).loss_spans(question)
    assert [text[s:e] for s, e in spans] == ["<|im_start|>user\nQUESTION<|im_end|>"]


def test_a_trained_first_message_under_templates_that_write_no_preamble(shared_data: Path):
    """Phi-3 ends every render with a trailer (no generation prompt appended) and a
    Gemma-style template refuses a role twice in a row: neither can render the message again
    as a second turn, and neither writes anything before it; the turn starts at 0, an
    assistant's after its own header."""
    import copy

    phi3 = load_tokenizer(str(shared_data / "tokenizers" / "phi-3-mini-instruct"))
    opening = Chat(
        [
            {"role": "assistant", "content": "GREETING"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
    )
    text, spans = SampleEncoder(phi3).loss_spans(opening)
    assert [text[s:e] for s, e in spans] == ["GREETING<|end|>", "a<|end|>"]
    question = Chat(
        [{"role": "user", "content": "QUESTION"}, {"role": "assistant", "content": "a"}]
    )
    text, spans = SampleEncoder(phi3, loss_roles=("user",)).loss_spans(question)
    assert [text[s:e] for s, e in spans] == ["<|user|>\nQUESTION<|end|>"]
    alternating = copy.copy(load_tokenizer(str(shared_data / "tokenizers" / "qwen2.5-instruct")))
    alternating.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    text, spans = SampleEncoder(alternating, loss_roles=("user", "assistant")).loss_spans(question)
    assert [text[s:e] for s, e in spans] == ["<|im_start|>user\nQUESTION<|im_end|>", "a<|im_end|>"]


def test_a_chats_mask_does_not_depend_on_the_chats_its_worker_saw_before(shared_data: Path):
    """The first chats of a worker are checked against prefix renders too (the canary); one
    that prefix renders refuse but the full render locates (Qwen3: two assistant turns in a
    row) is kept alike by a fresh worker and by one past its canary."""
    tok = load_tokenizer(str(shared_data / "tokenizers" / "qwen3"))
    chat = Chat(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": "b"},
        ]
    )
    fresh = SampleEncoder(tok)
    (first,) = fresh.encode([chat])
    seasoned = SampleEncoder(tok)
    plain = Chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    seasoned.encode([plain] * 20)
    (later,) = seasoned.encode([chat])
    assert not isinstance(first, BadRecord) and not isinstance(later, BadRecord)
    assert np.array_equal(first.ids, later.ids) and np.array_equal(first.mask, later.mask)
    assert tok.decode(first.ids[first.mask]) == "a<|im_end|><think>\n\n</think>\n\nb<|im_end|>"


# ---- the built-in tokenizer (no shared data needed) ---------------------------------------


@pytest.fixture(scope="module")
def demo() -> SampleEncoder:
    return SampleEncoder(load_tokenizer("packshard:demo"))


def _decode_masked(enc: SampleEncoder, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(enc.tok.decode(cur))
            cur = []
    return runs + ([enc.tok.decode(cur)] if cur else [])


def test_chat_loss_covers_assistant_turns_and_their_terminator(demo: SampleEncoder):
    chat = to_sample(
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "tool", "content": "out"},
                {"role": "assistant", "content": "a2"},
            ]
        }
    )
    (got,) = demo.encode([chat])
    assert _decode_masked(demo, got.ids, got.mask) == ["a1<|im_end|>", "a2<|im_end|>"]
    roles = SampleEncoder(demo.tok, loss_roles=("assistant", "tool"))
    (got,) = roles.encode([chat])
    assert _decode_masked(roles, got.ids, got.mask) == [
        "a1<|im_end|>",
        "<|im_start|>tool\nout<|im_end|>",
        "a2<|im_end|>",
    ]


def test_a_text_with_a_lone_surrogate_is_one_bad_record(demo: SampleEncoder):
    """JSON allows "\\ud83d" (a cut emoji escape); UTF-8 cannot hold it and the Rust encoder
    refused the whole batch it was in. That sample alone is invalid_utf8, of every kind."""
    chat = lambda text: Chat(  # noqa: E731
        [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    )
    cut = "truncated emoji \ud83d"
    out = demo.encode(
        [chat("fine"), chat(cut), Text(cut), Text("fine"), PlainPromptCompletion(cut, "x")]
    )
    assert [type(o).__name__ for o in out] == [
        "Encoded", "BadRecord", "BadRecord", "Encoded", "BadRecord"
    ]  # fmt: skip
    for bad in (out[1], out[2], out[4]):
        assert isinstance(bad, BadRecord) and bad.reason == "invalid_utf8"
        assert "holds a lone surrogate '\\ud83d' (a cut" in bad.detail
    assert out[3].ids.tolist() == [*demo.encode([Text("fine")])[0].ids.tolist()]


def test_text_plain_prompt_completion_and_pretokenized(demo: SampleEncoder):
    eos = demo.tok.eos_token_id
    text, plain, toks = demo.encode(
        [Text("abc"), PlainPromptCompletion("ab", "cd"), Tokens([5, 6, 7], [False, True, True])]
    )
    assert text.ids.tolist() == [*b"abc", eos] and text.mask.all()
    assert plain.ids.tolist() == [*b"abcd", eos] and plain.mask.tolist() == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert toks.ids.tolist() == [5, 6, 7] and toks.mask.tolist() == [False, True, True]


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        (Tokens([1, 10**7]), "token_out_of_range"),
        (Tokens([1, 2], [False, False]), "no_loss_tokens"),
        (Chat([{"role": "user", "content": "only a question"}]), "no_loss_tokens"),
        (
            Chat(
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a<|im_end|>b"}]
            ),
            "special_token_in_content",
        ),
    ],
)
def test_unusable_samples_are_reported(demo: SampleEncoder, sample, reason):
    (got,) = demo.encode([sample])
    assert isinstance(got, BadRecord) and got.reason == reason


def test_a_terminator_anywhere_in_a_trained_message_is_reported(shared_data: Path):
    """In a tool call's arguments or the reasoning as in the content: the turn would end at
    it, and the rest of the turn, its real terminator too, would train nothing."""
    enc = SampleEncoder(load_tokenizer(str(shared_data / "tokenizers" / "qwen2.5-instruct")))
    call = {
        "type": "function",
        "function": {"name": "run", "arguments": {"cmd": "echo '<|im_end|>'"}},
    }
    chat = Chat(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ]
    )
    (got,) = enc.encode([chat])
    assert isinstance(got, BadRecord) and got.reason == "special_token_in_content"
    assert got.detail == (
        "messages[1].tool_calls[0].function.arguments.cmd contains the turn terminator "
        "'<|im_end|>' as text"
    )
    call["function"]["arguments"] = {"a<|im_end|>": 1}  # an argument's name renders too
    (got,) = enc.encode([chat])
    assert isinstance(got, BadRecord) and got.reason == "special_token_in_content"
    assert got.detail.startswith(
        "messages[1].tool_calls[0].function.arguments.'a<|im_end|>' (a key)"
    )
    from packshard.pipeline.chat_template import ChatRenderer

    own = {"role": "assistant", "content": "a", "thinking": "T", "reasoning_content": "R"}
    assert ChatRenderer.prepare([own])[0]["thinking"] == "T"  # a record's own, as it wrote it
    # the reasoning is named by the record's own key, not by the aliases rendering adds
    for key in ("reasoning_content", "reasoning", "thinking"):
        chat = Chat(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", key: "<|im_end|>"},
            ]
        )
        (got,) = enc.encode([chat])
        assert isinstance(got, BadRecord) and got.detail.startswith(f"messages[1].{key} contains")


def test_templates_that_are_not_prefix_stable_fail_loudly():
    import copy

    tok = load_tokenizer("packshard:demo")
    odd = copy.copy(tok)  # a copy: the cached tokenizer stays untouched
    # the first line counts the messages, so a prefix renders a different first line
    odd.chat_template = "{{ messages|length }}\n" + tok.chat_template
    enc = SampleEncoder(odd)
    (got,) = enc.encode(
        [Chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])]
    )
    assert isinstance(got, BadRecord) and got.reason == "template_not_prefix_stable"


def test_templates_that_drop_a_role_or_tools_are_reported():
    import copy

    tok = load_tokenizer("packshard:demo")
    no_tool = copy.copy(tok)
    no_tool.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    enc = SampleEncoder(no_tool)
    assert "tool" not in enc.profile.roles and not enc.profile.renders_tools
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    call = {"type": "function", "function": {"name": "get_w", "arguments": {"c": "x"}}}
    a, b, c = enc.encode(
        [
            Chat([*chat, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "c"}]),
            Chat(chat, tools=[{"name": "f"}]),
            Chat([chat[0], {"role": "assistant", "content": "", "tool_calls": [call]}, *chat]),
        ]
    )
    assert a.reason == "role_not_in_template" and b.reason == "tools_not_in_template"
    assert c.reason == "tool_calls_not_in_template" and "messages[1] has tool_calls" in c.detail
    # a template that renders the calls makes the same chat a sample
    with_calls = copy.copy(tok)
    with_calls.chat_template = no_tool.chat_template.replace(
        "{{ m['content'] }}",
        "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}{{ c['function']['name'] }}{% endfor %}",
    )
    enc = SampleEncoder(with_calls)
    (got,) = enc.encode(
        [Chat([chat[0], {"role": "assistant", "content": "", "tool_calls": [call]}])]
    )
    assert not isinstance(got, BadRecord)
    # ... and so does one that needs what a probe would lack: a call id (Mistral v0.3 raises
    # without a 9-character one), string arguments (DeepSeek joins them with +)
    strict = copy.copy(tok)
    strict.chat_template = no_tool.chat_template.replace(
        "{{ m['content'] }}",
        "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}{% if c['id'] | length != 9 %}"
        "{{ raise_exception('id') }}{% endif %}{{ c['function']['name'] + c['function']['arguments'] }}"
        "{% endfor %}",
    )
    real = {"id": "abcdefghi", "type": "function", "function": {"name": "get_w", "arguments": '{"c": 1}'}}  # fmt: skip
    (got,) = SampleEncoder(strict).encode(
        [Chat([chat[0], {"role": "assistant", "content": "", "tool_calls": [real]}])]
    )
    assert not isinstance(got, BadRecord), got


def test_tokenizer_loading_fingerprint_and_pad():
    tok = load_tokenizer("packshard:demo")
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(
        load_tokenizer.__wrapped__("packshard:demo")
    )
    assert tokenizer_fingerprint(tok).startswith("sha256:")
    assert pad_token_id_of(tok) == tok.pad_token_id
    stand_in = SimpleNamespace(pad_token_id=None, eos_token_id=7)  # no pad token: EOS pads
    assert pad_token_id_of(stand_in) == 7
    stand_in.eos_token_id = None
    with pytest.raises(TokenizerError, match="no pad or EOS token; pass --pad-token-id"):
        pad_token_id_of(stand_in)
    with pytest.raises(
        TokenizerError, match="tokenizer directory '/nonexistent/tok' does not exist"
    ):
        load_tokenizer("/nonexistent/tok")


@pytest.mark.shared
@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3", "phi-3-mini-instruct"])
def test_workers_encode_from_the_payload_exactly_like_the_driver(shared_data: Path, name: str):
    """Workers rebuild the tokenizer from the driver's payload (no files, no transformers
    AutoTokenizer): same ids, masks and bad-record verdicts on every kind of sample."""
    from packshard.pipeline.tokenizer_loading import TokenizerPayload

    tok = load_tokenizer(str(shared_data / "tokenizers" / name))
    driver = SampleEncoder(tok)
    worker = SampleEncoder(TokenizerPayload.from_tokenizer(tok, name))
    assert worker.payload.fingerprint == driver.payload.fingerprint == tokenizer_fingerprint(tok)
    assert worker.profile == driver.profile
    records = [r for recs in _records(shared_data).values() for r in recs[:40]]
    with open(shared_data / "long_context/gutenberg/long_docs.jsonl") as f:
        records += [{"text": json.loads(line)["text"]} for line in f][:2]
    samples = [to_sample(r) for r in records] + [
        PlainPromptCompletion("Question: 2+2?", " 4"),
        Tokens([1, 2, 3]),
    ]
    for a, b in zip(driver.encode(samples), worker.encode(samples), strict=True):
        if isinstance(a, BadRecord):
            assert isinstance(b, BadRecord) and a.reason == b.reason
        else:
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)


@pytest.mark.shared
@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3"])
def test_one_render_spans_equal_prefix_render_spans_on_every_chat(shared_data: Path, name: str):
    """The one-render path (turns found by their header in the full render) gives the spans of
    the prefix renders on every real chat it takes, and takes most of them."""
    tok = load_tokenizer(str(shared_data / "tokenizers" / name))
    masker = SampleEncoder(tok).masker
    assert masker is not None and masker.one_render and masker.profile.header
    fast = 0
    samples = [to_sample(r) for recs in _records(shared_data).values() for r in recs]
    for sample in samples:
        try:
            text, spans = masker.loss_spans(sample)
        except BadRecord:
            continue  # Phi-3 and tools: reported either way
        msgs = ChatRenderer.prepare(sample.messages)
        one = masker._one_render_spans(text, msgs, sample.tools, sample.loss_from)
        if one is not None:
            fast += 1
            assert one == masker._prefix_spans(text, msgs, sample.tools, sample.loss_from)
            assert spans == one
    assert masker.one_render, "no chat may disagree"
    assert fast >= 0.9 * len(samples), (fast, len(samples))


@pytest.mark.shared
def test_phi3_generation_prompt_is_no_append_so_its_chats_take_prefix_renders(shared_data: Path):
    """Phi-3 ends a chat with <|endoftext|>, which its generation prompt replaces: no header."""
    tok = load_tokenizer(str(shared_data / "tokenizers" / "phi-3-mini-instruct"))
    masker = SampleEncoder(tok).masker
    assert masker is not None and masker.profile.header is None and not masker.one_render


def test_one_render_path_steps_aside_for_header_text_and_stray_headers(demo: SampleEncoder):
    """A chat whose text holds the header's special tokens, or whose full render holds another
    number of headers than assistant messages, is masked by prefix renders."""
    masker = demo.masker
    assert masker is not None and masker.profile.header
    header = masker.profile.header
    tricky = Chat(
        [
            {"role": "user", "content": f"quote: {header}fake answer"},
            {"role": "assistant", "content": "real answer"},
        ]
    )
    text, spans = masker.loss_spans(tricky)
    msgs = ChatRenderer.prepare(tricky.messages)
    assert masker._one_render_spans(text, msgs, None, 0) is None
    assert [text[s:e] for s, e in spans] == ["real answer" + masker.profile.terminator]
    import copy

    tok = load_tokenizer("packshard:demo")
    stray = copy.copy(tok)  # a system line that repeats the header: counts differ
    stray.chat_template = "{{ '" + header.replace("\n", "\\n") + "' }}" + tok.chat_template
    enc = SampleEncoder(stray)
    chat = Chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    text, _ = enc.masker.loss_spans(chat)
    assert enc.masker._one_render_spans(text, ChatRenderer.prepare(chat.messages), None, 0) is None


@pytest.mark.shared
@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3", "phi-3-mini-instruct"])
def test_text_and_plain_samples_take_the_tokenizers_own_ids(shared_data: Path, name: str):
    """Texts are encoded without offsets (`encode_batch_fast` where tokenizers has it), plain
    prompt/completion pairs joined into one text: the ids are those of the tokenizer called on
    the text (a completion encoded alone would start with a SentencePiece space of its own:
    Phi-3's 'A:' + '4' read 'A: 4'), the loss on the tokens that start in the completion."""
    tok = load_tokenizer(str(shared_data / "tokenizers" / name))
    enc = SampleEncoder(tok)
    with open(shared_data / "long_context/gutenberg/long_docs.jsonl") as f:
        book = json.loads(f.readline())["text"]
    texts = [book[:200_000], "  leading spaces\n\n\ttabs", "Ünïcödé — ½ 日本語 🙂", "a" * 3000, ""]
    texts += [tok.eos_token + " after an eos", f"{tok.bos_token or ''}x"]
    pairs = [(t, c) for t in texts for c in (" 4", "4")] + [("The word is: un", "believable")]
    pairs += [("Sentiment: ", "positive"), ("A: ", "Paris"), ("Hel", "lo")]  # merged at the seam
    out = enc.encode([Text(t) for t in texts] + [PlainPromptCompletion(p, c) for p, c in pairs])
    for text, got in zip(texts, out[: len(texts)], strict=True):
        want = tok(text)["input_ids"]
        want = want if want and want[-1] == tok.eos_token_id else [*want, tok.eos_token_id]
        assert got.ids.tolist() == want and got.mask.all()
    for (prompt, completion), got in zip(pairs, out[len(texts) :], strict=True):
        whole = tok(prompt + completion, return_offsets_mapping=True)
        in_completion = [
            b > len(prompt) and b > a for a, b in whole["offset_mapping"]
        ]  # a token holding some of the completion (special tokens have no characters)
        assert got.ids.tolist() == [*whole["input_ids"], tok.eos_token_id], (prompt, completion)
        assert got.mask.tolist() == [*in_completion, True], (prompt, completion)
        trained = tok.decode(got.ids[got.mask][:-1]).strip()
        assert trained.endswith(completion.strip()) and len(trained) <= len(completion) + 3


@pytest.mark.shared
@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3", "phi-3-mini-instruct"])
def test_user_and_tool_loss_roles_after_an_assistant_turn(shared_data: Path, name: str):
    """--loss-roles user / tool: Qwen3 renders an assistant turn that ends the earlier messages
    with an empty <think> block it does not have inside the full chat, and Phi-3 closes every
    render with <|endoftext|>; both made every user or tool turn after the first
    template_not_prefix_stable. Each turn's span is its own (header, content, terminator), the
    ids the template's."""
    tok = load_tokenizer(str(shared_data / "tokenizers" / name))
    m = lambda role, content: {"role": role, "content": content}  # noqa: E731

    def spans(roles: tuple[str, ...], messages: list[dict]) -> list[str]:
        (got,) = SampleEncoder(tok, loss_roles=roles).encode([Chat(messages)])
        assert not isinstance(got, BadRecord), got
        text = tok.apply_chat_template(messages, tokenize=False)
        assert got.ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], got.mask.astype(int), [0]])))
        return [
            tok.decode(got.ids[a:b]).replace("\n", "")
            for a, b in zip(edges[::2], edges[1::2], strict=True)
        ]

    chat = [m("user", "q1"), m("assistant", "a1"), m("user", "q2"), m("assistant", "a2")]
    got = "".join(spans(("user",), chat))
    assert "q1" in got and "q2" in got and "a1" not in got and "a2" not in got
    assert got.count("q2") == 1 and got.endswith(text_end(name))
    with_system = [m("system", "Be brief."), m("user", "hi"), m("assistant", "hello")]
    got = "".join(spans(("assistant", "user"), with_system))
    assert "hi" in got and "hello" in got and "Be brief." not in got
    if name != "phi-3-mini-instruct":  # Phi-3's template has no tool role
        call = {"name": "f", "arguments": {"x": 1}}
        tools = [m("user", "q"), {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": call}]},
                 m("tool", "42"), m("assistant", "done")]  # fmt: skip
        got = spans(("tool",), tools)
        assert len(got) == 1 and "42" in got[0] and "done" not in got[0] and "q" not in got[0]


def text_end(name: str) -> str:
    """The end-of-turn token of each template (what a user or tool span ends with)."""
    return "<|end|>" if name.startswith("phi") else "<|im_end|>"


@pytest.mark.shared
def test_a_pairs_eos_added_by_the_tokenizer_is_trained(shared_data: Path):
    """A tokenizer whose post-processor appends EOS (add_eos_token configs): the pair's text
    already ends in it, so none is appended, and that EOS is the stop target all the same."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    base = load_tokenizer(str(shared_data / "tokenizers" / "qwen2.5-instruct"))
    rust = Tokenizer.from_str(base.backend_tokenizer.to_str())
    eos, eos_id = base.eos_token, base.eos_token_id
    rust.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=eos)
    enc = SampleEncoder(tok)
    assert not enc.has_chat_template
    (got,) = enc.encode([PlainPromptCompletion("Q: ", "A")])
    assert not isinstance(got, BadRecord)
    assert got.ids.tolist() == tok("Q: A")["input_ids"] and got.ids.tolist().count(eos_id) == 1
    assert got.mask[-1] and got.mask.sum() == 2  # " A" and EOS
    # a ByteLevel post-processor that trims offsets leaves whitespace tokens no width (code
    # indentation): those inside the completion are trained all the same
    rust.post_processor = processors.ByteLevel(trim_offsets=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=eos)
    code = "    if x:\n        return 1\n    return 2"
    (got,) = SampleEncoder(tok).encode([PlainPromptCompletion("def f():\n", code)])
    assert not isinstance(got, BadRecord)
    prompt_len = len(tok("def f():\n")["input_ids"])
    assert got.ids.tolist()[:-1] == tok("def f():\n" + code)["input_ids"]
    assert not got.mask[:prompt_len].any() and got.mask[prompt_len:].all()


@pytest.mark.shared
def test_first_turns_that_cannot_be_located_are_refused(shared_data: Path):
    """messages[0] as a tool response after Qwen's tools block (two tool messages render as
    one turn, so the double render finds no turn): its loss fell on the tools block. Qwen3 with
    thinking off and a first assistant message holding its own <think> block: the loss began
    inside the block (later turns were refused as content_inside_generation_prompt)."""
    path = str(shared_data / "tokenizers" / "qwen3")
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
              "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    first_tool = Chat(
        [{"role": "tool", "content": "RESULT"}, {"role": "assistant", "content": "ok"}], tools
    )
    (got,) = SampleEncoder(load_tokenizer(path), loss_roles=("tool", "assistant")).encode(
        [first_tool]
    )
    assert isinstance(got, BadRecord) and got.reason == "template_not_prefix_stable"
    think = {"role": "assistant", "content": "<think>\nz\n</think>\n\nw", "reasoning_content": ""}
    off = SampleEncoder(load_tokenizer(path), template_kwargs={"enable_thinking": False})
    chat = [think, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    (got,) = off.encode([Chat(chat)])
    assert isinstance(got, BadRecord) and got.reason == "content_inside_generation_prompt"
    (fine,) = off.encode([Chat([{"role": "assistant", "content": "w"}, *chat[1:]])])
    assert not isinstance(fine, BadRecord)
