"""A local HTTP server over a directory, for the tests of URLs with credentials or signatures.
It ignores credentials and query strings, as a server that accepted them would, and records the
Authorization header of every GET."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def serving(
    root: Path, paths: list[str] | None = None, refuse: dict[str, Any] | None = None
) -> Iterator[tuple[str, list[str]]]:
    """("127.0.0.1:port", the Authorization headers seen, in order) while the block runs; every
    request's path and query are appended to `paths` when given. While `refuse` holds a
    "status" (an expired signature's 403, a 503), every request gets that answer (with
    "get_only" set, every GET: the lookup's HEAD succeeds, the read fails; with "under", only
    the requests of paths that start with it)."""
    seen: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def _refused(self) -> bool:
            if (
                refuse
                and refuse.get("status")
                and (self.command == "GET" or not refuse.get("get_only"))
                and self.path.startswith(str(refuse.get("under", "/")))
            ):
                self.send_error(refuse["status"])
                return True
            return False

        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            if paths is not None:
                paths.append(self.path)
            if not self._refused():
                super().do_GET()

        def do_HEAD(self) -> None:
            if paths is not None:
                paths.append(self.path)
            if not self._refused():
                super().do_HEAD()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
