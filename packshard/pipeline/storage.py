"""The errors storage libraries raise through fsspec, for narrow ``except`` clauses, and a quick
check that an object store's explicit endpoint can be reached at all.

fsspec filesystems do not translate every failure into `OSError`: s3fs lets botocore's
`NoCredentialsError` / `EndpointConnectionError` through, gcsfs google-auth's errors, the http
filesystem aiohttp's, and the Hugging Face hub client its HTTP library's. `storage_errors()` is
OSError and the base classes of those libraries that are already imported (one that is not
imported cannot have raised, so the check costs no start-up time). `unreachable_endpoint` is
one TCP connect to an explicit endpoint before any request. Both live in
`packshard.packers.format`, which the dataset reader shares; `storage_errors_with` adds the
other errors an ``except`` clause takes.
"""

from __future__ import annotations

from packshard.packers.format import (
    CONNECT_TIMEOUT_S,
    storage_errors,
    storage_errors_with,
    unreachable_endpoint,
)
from packshard.packers.format import describe_error as describe

__all__ = [
    "CONNECT_TIMEOUT_S",
    "describe",
    "storage_errors",
    "storage_errors_with",
    "unreachable_endpoint",
]
