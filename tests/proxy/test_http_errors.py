"""Malformed HTTP against ``trajlab serve`` itself (a real subprocess, raw sockets): every answer is OpenAI's JSON
error body, ``{"error": {"message", "type", "param", "code"}}``, including the errors the HTTP parser finds before
any route runs."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from .test_server import free_port, serving

GOOD = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[int]:
    port = free_port()
    records = tmp_path_factory.mktemp("sessions")
    with serving("--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
                 "--record-dir", str(records), "--max-body-bytes", "20000", port=port):
        yield port


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` as it is on a fresh connection; the status, headers and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return int(status_line.split()[1]), headers, body


def _unchunk(data: bytes) -> bytes:
    out = b""
    while True:
        size, _, rest = data.partition(b"\r\n")
        if not int(size, 16):
            return out
        out, data = out + rest[: int(size, 16)], rest[int(size, 16) + 2:]


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    """A request as bytes; header names from keywords (``Content_Type``), ``Connection: close`` unless given."""
    headers = {"Host": "x", "Connection": "close", **headers}
    lines = [f"{method} {path} HTTP/1.1", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


MALFORMED = {
    "garbage request line": (b"GARBAGE\r\n\r\n", 400),
    "header line without a colon": (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    "non-numeric Content-Length": (request("POST", "/v1/chat/completions", GOOD, Content_Length="ten"), 400),
    # Unfinished: the parser answers once 16 KiB of headers have no end (more would be refused unread, a reset).
    "headers past the parser's limit": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000, 431),
    "broken chunked body": (request("POST", "/v1/chat/completions", b"zz\r\nnot hex\r\n0\r\n\r\n",
                                    Transfer_Encoding="chunked", Content_Type="application/json"), 400),
    "two Transfer-Encodings": (request("POST", "/v1/chat/completions", b"0\r\n\r\n", Transfer_Encoding="chunked",
                                       transfer_encoding="gzip"), 501),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_http_gets_an_openai_json_error(server, name):
    raw, status = MALFORMED[name]
    got, headers, body = exchange(server, raw)
    assert got == status, body
    assert headers["content-type"] == "application/json", (headers, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http"
    assert "malformed HTTP request" in error["message"]


ROUTING = {
    "unknown route": (request("GET", "/v1/embeddings"), 404, "not_found"),
    "wrong method": (request("GET", "/v1/chat/completions"), 405, "method_not_allowed"),
    "form-encoded body": (request("POST", "/v1/chat/completions", b"model=tiny&messages=hi",
                                  Content_Type="application/x-www-form-urlencoded", Content_Length="22"), 400,
                          "invalid_json"),
    "oversized body": (request("POST", "/v1/chat/completions", Content_Type="application/json",
                               Content_Length="30000"), 413, "request_too_large"),
    "websocket upgrade": (request("GET", "/v1/chat/completions", Upgrade="websocket", Connection="close, Upgrade",
                                  Sec_WebSocket_Key="dGhlIHNhbXBsZSBub25jZQ==", Sec_WebSocket_Version="13"), 405,
                          "method_not_allowed"),
}


@pytest.mark.parametrize("name", ROUTING)
def test_requests_no_route_takes_get_an_openai_json_error(server, name):
    raw, status, code = ROUTING[name]
    got, headers, body = exchange(server, raw)
    assert got == status, body
    assert headers["content-type"] == "application/json", (headers, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error


def test_the_server_still_answers_after_malformed_http(server):
    for raw, _ in MALFORMED.values():
        exchange(server, raw)
    status, _, body = exchange(server, request("POST", "/v1/chat/completions", GOOD, Content_Type="application/json",
                                               Content_Length=str(len(GOOD))))
    assert status == 200 and json.loads(body)["choices"]
