"""``KEY=VALUE`` command-line options: fsspec storage options and chat-template variables.

`packshard pack`, `stats` and `verify` all take ``--storage-option KEY=VALUE`` (repeatable) for
filesystem settings such as an S3 endpoint or a GCS project; ``pack`` also takes
``--template-kwarg KEY=VALUE`` for chat-template variables. A VALUE is parsed as JSON when it
can be (``true``, ``3``, ``{"a": 1}``), else kept as a string. fsspec's own
``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables work beside them. This module imports
nothing beyond the standard library, so the core install's ``stats`` / ``verify`` and the pack
job's config share it without importing each other.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors quote no credentials: "unrecognized arguments:
    gs://alice:PW@bucket/x" names the URL as `redact_text` writes it."""

    def error(self, message: str) -> NoReturn:
        from packshard.packers.urls import redact_text

        super().error(redact_text(message))


def parse_key_values(pairs: Sequence[str] | None, flag: str = "--storage-option") -> dict[str, Any]:
    """``['key=value', ...]`` -> ``{key: json-or-string value}``; ValueError names `flag`.
    Python's ``True`` / ``False`` / ``None`` read as JSON's true / false / null: kept as the
    strings, ``enable_thinking=False`` would be truthy in a chat template and ``anon=False``
    in a filesystem's options."""
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            got = (  # a storage option's value may be a secret: not echoed
                "an argument without " + ("a key" if sep else "'='")
                if flag == "--storage-option"
                else repr(pair)
            )
            raise ValueError(f"{flag} expects KEY=VALUE, got {got}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = _PYTHON_LITERALS.get(value, value)
        if (
            flag == "--storage-option"
            and key in _OBJECT_OPTIONS
            and not isinstance(options[key], dict)
        ):
            raise ValueError(
                f"{flag} {key}=... must be a JSON object, e.g. "
                f"""{key}='{{"endpoint_url": "http://127.0.0.1:9000"}}'"""
                if key == "client_kwargs"
                else f"{flag} {key}=... must be a JSON object ({{...}})"
            )
    return options


# fsspec clients' options that take a dict (fsspec's http, s3fs): a string there fails deep in
# the client (s3fs: "'str' object has no attribute 'copy'" at its first request)
_OBJECT_OPTIONS = frozenset({"client_kwargs", "config_kwargs", "s3_additional_kwargs"})


_PYTHON_LITERALS: dict[str, Any] = {"True": True, "False": False, "None": None}


def add_storage_option_flag(parser: argparse.ArgumentParser | Any) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) on a parser or argument group."""
    parser.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec filesystem option, e.g. endpoint_url=http://127.0.0.1:5000 (repeatable)",
    )
