"""The HTTP server under ``trajlab serve``: uvicorn on its h11 protocol, whose own error answers are OpenAI's JSON.

A request the HTTP parser cannot read (a garbage request line, a header without a colon, a non-numeric
Content-Length, a broken chunked body, headers past the parser's buffer) never reaches a route: uvicorn answers it
itself, with a plain-text ``Invalid HTTP request received.``, and a client library then reports a parse failure
instead of the reason. :class:`OpenAIErrorsH11Protocol` answers those with the same error body as every route, the
status h11 suggests (400; 431 for oversized headers; 501 for an unsupported transfer coding) and the parser's reason.

The protocol is named, not ``auto``: auto picks httptools when it happens to be installed, whose errors this class
does not cover. WebSocket upgrades are off (``ws="none"``): an upgrade request is an ordinary request, answered by the
routes (405 for GET on a POST route) instead of a bare 403 from the WebSocket protocol.
"""

from __future__ import annotations

import json
import sys
from http import HTTPStatus

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADERS_LIMIT = 16 * 1024
"""h11's buffer for a request line and its headers (its default, which uvicorn keeps)."""


class OpenAIErrorsH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; a request it cannot parse gets OpenAI's JSON error body instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        """Called by ``handle_events`` inside its ``except h11.RemoteProtocolError``: the error is the one in flight."""
        error = sys.exception()
        status = getattr(error, "error_status_hint", 400)
        reason = str(error) if error is not None else msg
        if status == 431:
            reason = f"the request line and headers exceed {HEADERS_LIMIT} bytes"
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # else a response has begun: only closing is left
            error_body = {"message": f"malformed HTTP request: {reason}", "type": "invalid_request_error",
                          "param": None, "code": "invalid_http"}
            body = json.dumps({"error": error_body}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            phrase = HTTPStatus(status).phrase.encode()
            for event in (h11.Response(status_code=status, headers=headers, reason=phrase), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self.transport.close()


def run_server(app: FastAPI, host: str, port: int) -> None:
    """Serve ``app`` until interrupted, with :class:`OpenAIErrorsH11Protocol` and no WebSocket upgrades."""
    uvicorn.run(app, host=host, port=port, log_level="warning", http=OpenAIErrorsH11Protocol, ws="none")
