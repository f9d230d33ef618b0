"""Fake HTTP servers for the inference tests: a real ``http.server`` on a free loopback port, answering JSON.

A test subclasses ``JSONHandler`` with the ``do_GET``/``do_POST`` it needs and runs it with ``serving``."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator


class JSONHandler(http.server.BaseHTTPRequestHandler):
    """A quiet handler (no access log on the test's stderr) with one way to answer."""

    def answer(self, status: int, body: dict | bytes) -> None:
        """Sends ``body`` (a dict as JSON, bytes as they are) with ``status`` and a JSON content type."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[http.server.ThreadingHTTPServer]:
    """``handler`` served on 127.0.0.1 (a port of its own: ``server.server_port``) until the block ends.

    Handler threads are daemons, so one the test left waiting does not hold up the end of the block."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
