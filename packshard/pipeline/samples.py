"""From one raw input record (a dict) to one typed sample, or a `BadRecord` naming the reason.

Sample kinds (`--kind`, detected per record when ``auto``):

- ``messages``: a chat, ``{"messages": [{"role", "content", ...}], "tools": [...]?}``. Roles are
  ``system``, ``user``, ``assistant`` and ``tool``; other message keys (``tool_calls``,
  ``tool_call_id``, ``reasoning_content``, ``name``) pass through to the chat template untouched.
  ``tools`` may be a list of JSON schemas or a JSON string of one. ShareGPT's layout reads
  the same: a ``conversations`` field (where the record has no ``messages`` and --columns maps
  none) of ``{"from", "value"}`` turns, ``from`` one of `SHAREGPT_ROLES`.
- ``prompt_completion``: ``prompt`` + ``completion``, each a string or a list of messages. With a
  chat template it becomes a chat whose loss covers only the completion's messages; with a
  tokenizer that has no chat template it is plain text, loss on the completion and EOS.
- ``text``: a plain document; EOS is appended and every token is a loss token.
- ``input_ids``: pre-tokenized ids (offline RL data), with an optional ``loss_mask`` of the same
  length (all tokens are loss tokens without one).

Detection order in ``auto``: messages, then prompt + completion, then input_ids, then text: the
first kind whose fields the record has wins. `--columns prompt=question,completion=answer` maps
the canonical field names to a dataset's own (a mapped field is looked up only under its source
name). A single mapping serves a mix of datasets because a record that lacks a field simply does
not match that kind.

Every rejection is a `BadRecord` whose `reason` is a short stable key (counted per reason in the
manifest under ``--skip-bad-records``) and whose `detail` says what was wrong and how to fix it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["auto", "messages", "prompt_completion", "text", "input_ids"]
KINDS: tuple[str, ...] = ("auto", "messages", "prompt_completion", "text", "input_ids")
KNOWN_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})
# ShareGPT's turn authors (``{"from": ..., "value": ...}``) as roles
SHAREGPT_ROLES: dict[str, str] = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "tool": "tool", "observation": "tool", "function_response": "tool",
}  # fmt: skip
SHAREGPT_FIELD = "conversations"  # where ShareGPT keeps a chat
CANONICAL_FIELDS: tuple[str, ...] = (
    "messages",
    "tools",
    "prompt",
    "completion",
    "text",
    "input_ids",
    "loss_mask",
)
# Every reason a record can be rejected for (status code = index + 1 in tokenized blocks).
REASONS: tuple[str, ...] = (
    "not_an_object",
    "missing_fields",
    "bad_field_type",
    "empty_conversation",
    "unknown_role",
    "empty_text",
    "empty_input_ids",
    "loss_mask_length",
    "invalid_utf8",
    "malformed_json",
    "no_tokenizer",
    "no_chat_template",
    "template_error",
    "role_not_in_template",
    "tools_not_in_template",
    "special_token_in_content",
    "template_not_prefix_stable",
    "no_loss_tokens",
    "token_out_of_range",
    "no_loss_after_truncate",
    "tool_calls_not_in_template",
    "content_inside_generation_prompt",
)
# Reasons the user's --overlong policy decides, not bad input: counted and listed like bad
# records, but they never fail a job run without --skip-bad-records.
POLICY_DROPS: frozenset[str] = frozenset({"no_loss_after_truncate"})


class BadRecord(ValueError):
    """A record that cannot become a training sample; `reason` is a stable counting key."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise AssertionError(f"unregistered bad-record reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation; messages from index `loss_from` on may carry loss (by role)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    loss_from: int = 0


@dataclass(frozen=True, slots=True)
class PlainPromptCompletion:
    """prompt + completion strings for a tokenizer without a chat template."""

    prompt: str
    completion: str


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Tokens:
    input_ids: list[int]
    loss_mask: list[bool] | None = None


Sample = Chat | PlainPromptCompletion | Text | Tokens


def parse_columns(specs: Sequence[str] | None) -> dict[str, str]:
    """``["prompt=question,completion=answer", ...]`` -> ``{"prompt": "question", ...}``."""
    mapping: dict[str, str] = {}
    for spec in specs or ():
        for pair in spec.split(","):
            if not pair.strip():
                continue
            key, sep, value = pair.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise ValueError(f"--columns expects CANONICAL=FIELD pairs, got {pair!r}")
            if key not in CANONICAL_FIELDS:
                raise ValueError(
                    f"--columns: {key!r} is not a field packshard reads; "
                    f"choose from {list(CANONICAL_FIELDS)}"
                )
            if mapping.get(key, value) != value:
                raise ValueError(
                    f"--columns maps {key!r} twice ({mapping[key]!r} and {value!r}); give it once"
                )
            mapping[key] = value
    return mapping


def source_fields(columns: Mapping[str, str]) -> list[str]:
    """Every raw field name a record may be read under (for column projection of parquet)."""
    fields = {columns.get(f, f) for f in CANONICAL_FIELDS}
    return sorted(fields if "messages" in columns else fields | {SHAREGPT_FIELD})


def _with_sharegpt(
    columns: Mapping[str, str], present: Callable[[str], bool], kind: str
) -> Mapping[str, str]:
    """`columns`, reading messages from ShareGPT's ``conversations`` where the record (or
    schema) has that and no ``messages``, --columns maps no messages field, and the record is
    no other kind (`--kind messages`, or under ``auto`` no other kind's fields are there: a
    text or prompt/completion record that also carries conversations stays what it was)."""
    if "messages" in columns or present("messages") or not present(SHAREGPT_FIELD):
        return columns
    if kind not in ("auto", "messages") or (
        kind == "auto" and detect_kind(lambda f: present(columns.get(f, f))) is not None
    ):
        return columns
    return {**columns, "messages": SHAREGPT_FIELD}


KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "input_ids": ("input_ids",),
    "text": ("text",),
}


def detect_kind(has: Callable[[str], bool]) -> Kind | None:
    """The first kind (messages, prompt + completion, input_ids, text) whose fields `has`."""
    for kind, needed in KIND_FIELDS.items():
        if all(has(f) for f in needed):
            return kind  # type: ignore[return-value]
    return None


def _wanted(columns: Mapping[str, str]) -> str:
    names = [columns.get(f, f) for f in ("messages", "prompt", "completion", "input_ids", "text")]
    return ", ".join(dict.fromkeys(names))


def _nested_hint(names: Collection[str], columns: Mapping[str, str]) -> str:
    """A hint when a --columns value is a dotted path into a struct column that exists."""
    for value in columns.values():
        head = value.split(".", 1)[0]
        if "." in value and value not in names and head in names:
            return (
                f" ({value!r} is a field inside column {head!r}: packshard reads top-level "
                "columns only; flatten it first, e.g. datasets' Dataset.flatten())"
            )
    return ""


def column_problem(
    names: Collection[str], *, kind: str = "auto", columns: Mapping[str, str] | None = None
) -> str | None:
    """Why records with these columns (a parquet / Arrow schema) cannot be samples of `kind`,
    or None when they can (values are checked per record later)."""
    present = set(names)
    columns = _with_sharegpt(columns or {}, present.__contains__, kind)

    def has(field: str) -> bool:
        return columns.get(field, field) in present

    if kind == "auto" and detect_kind(has) is not None:
        return None
    if kind != "auto" and all(has(f) for f in KIND_FIELDS[kind]):
        return None
    wanted = (
        f"one of [{_wanted(columns)}]"
        if kind == "auto"
        else f"{[columns.get(f, f) for f in KIND_FIELDS[kind]]} for --kind {kind}"
    )
    return (
        f"its columns are {sorted(present)[:20]}, and packshard reads {wanted}; map yours with "
        "--columns (e.g. --columns prompt=question,completion=answer)"
        + _nested_hint(present, columns)
    )


def to_sample(
    record: Any,
    *,
    kind: Kind = "auto",
    columns: Mapping[str, str] | None = None,
    has_chat_template: bool = True,
) -> Sample:
    """Turn one decoded record into a sample; raises `BadRecord`."""
    if not isinstance(record, Mapping):
        raise BadRecord(
            "not_an_object", f"a record must be a JSON object, got {type(record).__name__}"
        )
    columns = _with_sharegpt(columns or {}, lambda n: record.get(n) is not None, kind)

    def get(field: str) -> Any:
        return record.get(columns.get(field, field))

    def has(field: str) -> bool:
        return get(field) is not None

    def missing(fields: Sequence[str]) -> BadRecord:
        """The error for required fields that are absent, or present but null."""
        names = [columns.get(f, f) for f in fields if not has(f)]
        detail = "; ".join(f"{n!r} is null" if n in record else f"no {n!r} field" for n in names)
        if any(n not in record for n in names):
            detail += (
                f" (the record has {sorted(record)[:12]}; map yours with --columns)"
                + _nested_hint(list(record), columns)
            )
        return BadRecord("missing_fields", detail)

    if kind == "auto":
        detected = detect_kind(has)
        if detected is None:
            for needed in KIND_FIELDS.values():  # a kind whose columns are all there, some null
                if all(columns.get(f, f) in record for f in needed):
                    raise missing(needed)
            for needed in KIND_FIELDS.values():  # a kind the mapping names, partly present
                mapped = any(f in columns for f in needed)
                if mapped and any(columns.get(f, f) in record for f in needed):
                    raise missing(needed)
            raise BadRecord(
                "missing_fields",
                f"no sample fields: expected one of [{_wanted(columns)}], the record has "
                f"{sorted(record)[:12]}; map yours with --columns (e.g. --columns prompt=question,completion=answer)"
                + _nested_hint(list(record), columns),
            )
        kind = detected
    if kind not in KIND_FIELDS:
        raise ValueError(f"kind={kind!r} is not known; choose one of {list(KINDS)}")
    if not all(has(f) for f in KIND_FIELDS[kind]):
        raise missing(KIND_FIELDS[kind])
    if kind == "messages":
        field = columns.get("messages", "messages")
        return Chat(_messages(_json_text(get("messages"), field), field), _tools(get("tools")))
    if kind == "prompt_completion":
        return _prompt_completion(get("prompt"), get("completion"), columns, has_chat_template)
    if kind == "input_ids":
        return _tokens(get("input_ids"), get("loss_mask"), columns)
    text = get("text")
    if not isinstance(text, str):
        raise BadRecord("bad_field_type", f"text must be a string, got {type(text).__name__}")
    if not text:
        raise BadRecord("empty_text", "the text is empty")
    return Text(text)


def _json_text(value: Any, field: str) -> Any:
    """A messages list stored as JSON text (a string column of `json.dumps(messages)`), parsed;
    any other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise BadRecord(
            "bad_field_type", f"{field} is a string but not a JSON list of messages ({e})"
        ) from None


def _messages(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRecord(
            "bad_field_type", f"{field} must be a list of messages, got {type(value).__name__}"
        )
    if not value:
        raise BadRecord("empty_conversation", f"{field} is an empty list")
    value = [
        _from_sharegpt(m, f"{field}[{i}]")
        if isinstance(m, Mapping) and "role" not in m and "from" in m
        else m
        for i, m in enumerate(value)
    ]
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise BadRecord(
                "bad_field_type", f"{field}[{i}] must be an object, got {type(m).__name__}"
            )
        role = m.get("role")
        if role is None:
            raise BadRecord("missing_fields", f"{field}[{i}] has no 'role'")
        if not isinstance(role, str) or role not in KNOWN_ROLES:
            raise BadRecord(
                "unknown_role",
                f"{field}[{i}] has role {role!r}; known roles are {sorted(KNOWN_ROLES)}",
            )
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise BadRecord("missing_fields", f"{field}[{i}] ({role}) has no 'content'")
        if content is not None and not isinstance(content, str):
            raise BadRecord(
                "bad_field_type",
                f"{field}[{i}].content must be a string, got {type(content).__name__} "
                "(flatten multi-part content to text first)",
            )
    return [dict(m) for m in value]


def _from_sharegpt(turn: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ShareGPT turn ``{"from": "human", "value": "..."}`` as a message."""
    author = turn.get("from")
    role = SHAREGPT_ROLES.get(author) if isinstance(author, str) else None
    if role is None:
        raise BadRecord(
            "unknown_role",
            f"{where} is a ShareGPT turn from {author!r}; packshard reads "
            f"{sorted(SHAREGPT_ROLES)} (convert other turns, such as function calls, to messages "
            "with tool_calls)",
        )
    rest = {k: v for k, v in turn.items() if k not in ("from", "value")}
    return {"role": role, "content": turn.get("value"), **rest}


def _tools(value: Any) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_field_type", f"tools is a string but not JSON ({e})") from None
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise BadRecord("bad_field_type", "tools must be a list of JSON schemas (objects)")
    return list(value) or None


def _prompt_completion(
    prompt: Any, completion: Any, columns: Mapping[str, str], has_chat_template: bool
) -> Sample:
    pname, cname = columns.get("prompt", "prompt"), columns.get("completion", "completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        if not has_chat_template:
            return PlainPromptCompletion(prompt, completion)
        return Chat(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
            loss_from=1,
        )
    if not has_chat_template:
        raise BadRecord(
            "bad_field_type",
            "message-list prompt/completion needs a tokenizer with a chat template",
        )
    head = (
        [{"role": "user", "content": prompt}]
        if isinstance(prompt, str)
        else _messages(prompt, pname)
    )
    if isinstance(completion, str):
        tail = [{"role": "assistant", "content": completion}]
    else:
        tail = _messages(completion, cname)
    return Chat(head + tail, loss_from=len(head))


def _tokens(ids: Any, mask: Any, columns: Mapping[str, str]) -> Tokens:
    name = columns.get("input_ids", "input_ids")
    if not isinstance(ids, (list, tuple)):
        raise BadRecord(
            "bad_field_type", f"{name} must be a list of integers, got {type(ids).__name__}"
        )
    if not ids:
        raise BadRecord("empty_input_ids", f"{name} is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRecord("bad_field_type", f"{name} must hold integers only")
    if mask is None:
        return Tokens(list(ids))
    mname = columns.get("loss_mask", "loss_mask")
    if not isinstance(mask, (list, tuple)) or not all(isinstance(m, (bool, int)) for m in mask):
        raise BadRecord("bad_field_type", f"{mname} must be a list of booleans or 0/1")
    if len(mask) != len(ids):
        raise BadRecord(
            "loss_mask_length", f"{mname} has {len(mask)} entries, {name} has {len(ids)}"
        )
    return Tokens(list(ids), [bool(m) for m in mask])
