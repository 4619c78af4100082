"""The errors storage libraries raise through fsspec, for narrow ``except`` clauses, and a quick
check that an object store's explicit endpoint can be reached at all.

fsspec filesystems do not translate every failure into `OSError`: s3fs lets botocore's
`NoCredentialsError` / `EndpointConnectionError` through, gcsfs google-auth's errors, the http
filesystem aiohttp's, and the Hugging Face hub client its HTTP library's. `storage_errors()`
returns the base classes of those libraries that are already imported (one that is not imported
cannot have raised, so the check costs no start-up time). Both live in `packshard.packers.format`,
which the dataset reader shares.
"""

from __future__ import annotations

import socket
import urllib.parse
import urllib.request
from typing import Any

from packshard.packers.format import describe_error as describe
from packshard.packers.format import library_errors as storage_errors
from packshard.packers.urls import redact_url

__all__ = ["CONNECT_TIMEOUT_S", "describe", "storage_errors", "unreachable_endpoint"]

CONNECT_TIMEOUT_S = 3.0


def unreachable_endpoint(fs: Any) -> str | None:
    """Why an object store given an explicit endpoint (``endpoint_url``, as s3fs takes it, or
    in its ``client_kwargs``) cannot be used: it does not accept a TCP connection within
    CONNECT_TIMEOUT_S. None when it does, when the filesystem names no endpoint, or when its
    requests go through a proxy (a direct connection proves nothing then). Without this
    check an endpoint that refuses connections fails only after s3fs's and botocore's retries
    (5-10 s)."""
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get(
        "endpoint_url"
    )
    if not isinstance(endpoint, str) or "://" not in endpoint:
        return None
    parts = urllib.parse.urlsplit(endpoint)
    if _behind_proxy(fs, parts):
        return None  # the client reaches the endpoint through the proxy; a direct connect may not
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
            return None
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        return f"cannot connect to its endpoint {redact_url(endpoint)}: {why}"


def _behind_proxy(fs: Any, parts: urllib.parse.SplitResult) -> bool:
    """The client's requests to this endpoint go through a proxy: one set in botocore's config
    (``config_kwargs={"proxies": ...}``) or in the environment (``HTTP(S)_PROXY``, unless
    ``NO_PROXY`` covers the host), as botocore and aiohttp honour them."""
    if (getattr(fs, "config_kwargs", None) or {}).get("proxies"):
        return True
    return bool(
        urllib.request.getproxies().get(parts.scheme)
        and not urllib.request.proxy_bypass(parts.hostname or "")
    )
