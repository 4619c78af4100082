"""Raw records -> typed samples: kind detection, column mapping, every rejection reason."""

from __future__ import annotations

import json

import pytest

from packshard.pipeline.samples import (
    REASONS,
    BadRecord,
    Chat,
    PlainPromptCompletion,
    Text,
    Tokens,
    parse_columns,
    to_sample,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_kinds_are_detected_in_order():
    assert isinstance(to_sample(CHAT), Chat)
    assert isinstance(to_sample({"text": "doc"}), Text)
    assert to_sample({"input_ids": [1, 2], "loss_mask": [0, 1]}) == Tokens([1, 2], [False, True])
    pc = to_sample({"prompt": "q", "completion": "a", "text": "ignored"})
    assert (
        isinstance(pc, Chat)
        and pc.loss_from == 1
        and pc.messages[1] == {"role": "assistant", "content": "a"}
    )
    assert to_sample(
        {"prompt": "q", "completion": "a"}, has_chat_template=False
    ) == PlainPromptCompletion("q", "a")


def test_prompt_completion_message_lists_train_only_the_completion():
    rec = {
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "completion": [{"role": "assistant", "content": "a"}],
    }
    s = to_sample(rec)
    assert isinstance(s, Chat) and s.loss_from == 2 and len(s.messages) == 3


def test_column_mapping_serves_a_mix_of_datasets():
    cols = parse_columns(["prompt=question,completion=answer", "text=body"])
    assert cols == {"prompt": "question", "completion": "answer", "text": "body"}
    s = to_sample({"question": "2+2?", "answer": "4"}, columns=cols)
    assert isinstance(s, Chat) and s.messages[0]["content"] == "2+2?"
    assert isinstance(to_sample(CHAT, columns=cols), Chat)  # a chat record still matches
    assert to_sample({"body": "doc"}, columns=cols) == Text("doc")


@pytest.mark.parametrize(
    ("record", "kind", "detail"),
    [
        ({"question": None, "answer": "4"}, "auto", "'question' is null"),
        ({"question": "2+2?", "answer": None}, "auto", "'answer' is null"),
        (
            {"question": "2+2?"},
            "prompt_completion",
            "no 'answer' field (the record has ['question']; map yours with --columns)",
        ),
        (
            {"question": None},
            "prompt_completion",
            "'question' is null; no 'answer' field (the record has ['question']; map yours with --columns)",
        ),
        (  # one side of the mapping wrong: named, not "no sample fields"
            {"question": "2+2?", "answer": "4"},
            "auto",
            "no 'nope' field (the record has ['answer', 'question']; map yours with --columns)",
        ),
        (
            {"conv": {"messages": []}},
            "auto",
            "no sample fields: expected one of [conv.messages, prompt, completion, input_ids, "
            "text], the record has ['conv']; map yours with --columns (e.g. --columns "
            "prompt=question,completion=answer) ('conv.messages' is a field inside column 'conv': "
            "packshard reads top-level columns only; flatten it first, e.g. datasets' "
            "Dataset.flatten())",
        ),
        ({"body": None}, "auto", "'body' is null"),
        ({"body": None}, "text", "'body' is null"),
        ({"messages": None}, "auto", "'messages' is null"),
        ({"messages": None, "body": "doc"}, "messages", "'messages' is null"),
        ({"input_ids": None}, "input_ids", "'input_ids' is null"),
    ],
)
def test_a_null_field_is_named_rather_than_blamed_on_the_column_mapping(record, kind, detail):
    cols = parse_columns(["prompt=question,completion=answer,text=body"])
    if "nope" in detail:
        cols["completion"] = "nope"
    if "conv" in record:
        cols = {"messages": "conv.messages"}
    with pytest.raises(BadRecord) as e:
        to_sample(record, kind=kind, columns=cols)
    assert (e.value.reason, e.value.detail) == ("missing_fields", detail)


def test_forced_kind_and_tools_as_json_string():
    s = to_sample({**CHAT, "tools": '[{"name": "f"}]'}, kind="messages")
    assert isinstance(s, Chat) and s.tools == [{"name": "f"}]
    with pytest.raises(BadRecord) as e:
        to_sample(CHAT, kind="text")
    assert e.value.reason == "missing_fields"


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], "not_an_object"),
        ({"foo": 1}, "missing_fields"),
        ({"messages": []}, "empty_conversation"),
        ({"messages": "hi"}, "bad_field_type"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "unknown_role"),
        ({"messages": [{"content": "x"}]}, "missing_fields"),
        ({"messages": [{"role": "user"}]}, "missing_fields"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
            "bad_field_type",
        ),
        ({**CHAT, "tools": "not json"}, "bad_field_type"),
        ({"text": ""}, "empty_text"),
        ({"text": 3}, "bad_field_type"),
        ({"input_ids": []}, "empty_input_ids"),
        ({"input_ids": [1, "2"]}, "bad_field_type"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "loss_mask_length"),
        ({"prompt": "q", "completion": 3}, "bad_field_type"),
    ],
)
def test_bad_records_name_their_reason(record, reason):
    with pytest.raises(BadRecord) as e:
        to_sample(record)
    assert e.value.reason == reason and e.value.reason in REASONS
    assert e.value.detail  # says what was wrong


def test_assistant_tool_call_without_content_is_fine():
    rec = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        ]
    }
    assert isinstance(to_sample(rec), Chat)


def test_bad_column_flags_are_refused():
    with pytest.raises(ValueError, match="not a field"):
        parse_columns(["question=prompt"])
    with pytest.raises(ValueError, match="CANONICAL=FIELD"):
        parse_columns(["prompt"])


def test_messages_stored_as_json_text_are_parsed():
    text = json.dumps(CHAT["messages"])
    assert to_sample({"messages": text}) == to_sample(CHAT)
    assert to_sample({"conv": text}, columns={"messages": "conv"}) == to_sample(CHAT)
    with pytest.raises(BadRecord, match="messages is a string but not a JSON list of messages"):
        to_sample({"messages": "[{"})


def test_a_column_mapped_twice_is_refused():
    assert parse_columns(["text=body", "text=body"]) == {"text": "body"}
    with pytest.raises(ValueError, match="--columns maps 'text' twice \\('body' and 'doc'\\)"):
        parse_columns(["text=body,text=doc"])


def test_sharegpt_conversations_read_as_messages():
    """ShareGPT's layout (OpenHermes, SlimOrca, ...): `conversations` of {"from", "value"}."""
    from packshard.pipeline.samples import column_problem, source_fields

    rec = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a", "weight": 1},
        ]
    }
    s = to_sample(rec)
    assert isinstance(s, Chat) and s.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "weight": 1},
    ]
    assert rec["conversations"][0] == {"from": "system", "value": "s"}  # the record untouched
    assert column_problem(["conversations", "id"]) is None  # a parquet schema of it
    assert "conversations" in source_fields({})  # parquet projection keeps the column
    # mapped explicitly, or with messages present, --columns and messages win
    assert to_sample(rec, columns={"messages": "conversations"}).messages == s.messages
    both = {**CHAT, "conversations": [{"from": "human", "value": "other"}]}
    assert to_sample(both).messages == CHAT["messages"]
    # a record of another kind that also carries conversations stays that kind
    for other, cols, kind in [
        ({"text": "hello"}, {}, Text),
        ({"body": "some text"}, {"text": "body"}, Text),
        ({"question": "q", "answer": "a"}, {"prompt": "question", "completion": "answer"}, Chat),
        ({"input_ids": [1, 2, 3]}, {}, Tokens),
    ]:
        got = to_sample({**other, "conversations": 3}, columns=cols)
        assert isinstance(got, kind) and "conversations" not in str(got), (other, got)
    bad = {
        "conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"}]
    }
    with pytest.raises(
        BadRecord, match=r"conversations\[1\] is a ShareGPT turn from 'function_call'"
    ):
        to_sample(bad)
