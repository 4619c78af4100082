"""The errors storage libraries raise through fsspec, for narrow ``except`` clauses.

fsspec filesystems do not translate every failure into `OSError`: s3fs lets botocore's
`NoCredentialsError` / `EndpointConnectionError` through, gcsfs google-auth's errors, the http
filesystem aiohttp's, and the Hugging Face hub client its HTTP library's. `storage_errors()`
returns the base classes of those libraries that are already imported: one that is not imported
cannot have raised, so nothing is imported here (the check costs no start-up time).
"""

from __future__ import annotations

import sys

_LIBRARY_ERRORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("botocore.exceptions", ("BotoCoreError", "ClientError")),
    ("aiohttp", ("ClientError",)),
    ("google.auth.exceptions", ("GoogleAuthError",)),
    ("httpx", ("HTTPError",)),
    ("httpx2", ("HTTPError",)),
)


def storage_errors() -> tuple[type[BaseException], ...]:
    """Base error classes of the storage libraries imported in this process."""
    errors: list[type[BaseException]] = []
    for module_name, names in _LIBRARY_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None:
            errors += [
                getattr(module, n) for n in names if isinstance(getattr(module, n, None), type)
            ]
    return tuple(errors)


def describe(e: BaseException) -> str:
    """One line for a storage error: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
