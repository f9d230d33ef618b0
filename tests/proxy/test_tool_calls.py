"""Tool calls on the response path, and every bad input, with a scripted fake generator behind the real app.

The tiny model never writes a tool call, so ``FakeReplyGenerator`` stands in for it here, for this one purpose:
it answers every prompt with a fixed text (tokenized by the real tokenizer), so the parser, the OpenAI message
shape, streaming of tool calls, and error handling are checked deterministically.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from urllib.parse import urlsplit

import pytest
from openai import OpenAI

from trajlab.chat.parsers import get_parser
from trajlab.config import ServeSettings
from trajlab.inference.base import GenerationRequest, GenerationResult
from trajlab.proxy import SessionRecorder, create_app
from trajlab.proxy.recording import read_session

from .conftest import MODEL, running
from .test_app import WEATHER

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
BROKEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call><|im_end|>'


class FakeReplyGenerator:
    """Replies with ``reply`` to every prompt (all of it, whatever max_new_tokens), logprob 0 per token; an empty
    ``reply`` makes every call fail, as a crashed backend would."""

    name = "fake"

    def __init__(self, tokenizer, reply: str) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.prompts: list[list[int]] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.prompts.append(request.prompt_ids)
        if self.reply == "":
            raise RuntimeError("the backend failed")
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        finish = "stop" if ids[-1] in request.params.stop_token_ids else "length"
        return GenerationResult(ids, [0.0] * len(ids), finish)


@pytest.fixture
def fake_server(tiny_tokenizer, tiny_template, tmp_path):
    def start(reply: str = CALL, serve: ServeSettings | None = None):
        generator = FakeReplyGenerator(tiny_tokenizer, reply)
        app = create_app(generator, tiny_tokenizer, tiny_template, get_parser("auto", tiny_tokenizer), MODEL,
                         SessionRecorder(tmp_path), serve or ServeSettings(max_context=256, max_body_bytes=4096),
                         tiny_tokenizer.model_max_length)
        return running(app)
    return start


def chat(url: str, **kwargs):
    api = OpenAI(base_url=f"{url}/sessions/calls/v1", api_key="k", max_retries=0)
    return api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER], max_tokens=64, **kwargs)


def test_a_tool_call_becomes_an_openai_tool_call_and_round_trips(fake_server, tiny_tokenizer, tmp_path):
    with fake_server() as url:
        response = chat(url, extra_body={"return_token_ids": True})
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert re.fullmatch("[0-9a-z]{9}", call.id), call.id  # the form Mistral's templates require of every id
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert tiny_tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=False) == CALL

        # The agent runs the tool and sends everything back: the call renders exactly as the model wrote it.
        api = OpenAI(base_url=f"{url}/sessions/calls/v1", api_key="k", max_retries=0)
        history = [{"role": "user", "content": "Weather in Paris?"},
                   choice.message.model_dump(exclude_none=True, exclude={"annotations", "audio", "refusal"}),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = api.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=64,
                                             extra_body={"return_token_ids": True})
    first_prompt = response.model_extra["prompt_token_ids"]
    second_prompt = second.model_extra["prompt_token_ids"]
    assert second_prompt[:len(first_prompt) + len(choice.model_extra["token_ids"])] == (
        first_prompt + choice.model_extra["token_ids"])  # append-only: the history is prompt + completion + more
    stored = list(read_session(tmp_path / "calls.jsonl"))
    assert [r["choices"][0]["finish_reason"] for r in stored] == ["tool_calls", "tool_calls"]
    assert stored[0]["choices"][0]["message"]["tool_calls"][0]["id"] == call.id


def test_tool_choice_none_and_malformed_calls_leave_the_text_as_content(fake_server, tmp_path):
    with fake_server() as url:
        plain = chat(url, tool_choice="none").choices[0]
        assert plain.finish_reason == "stop" and plain.message.tool_calls is None
        assert plain.message.content == CALL.removesuffix("<|im_end|>")
    with fake_server(BROKEN_CALL) as url:
        broken = chat(url).choices[0]
        assert broken.finish_reason == "stop" and broken.message.tool_calls is None
        assert "<tool_call>" in broken.message.content
    record = list(read_session(tmp_path / "calls.jsonl"))[-1]
    assert record["choices"][0]["parse_errors"]


def test_tool_calls_stream_as_deltas(fake_server):
    with fake_server() as url:
        chunks = list(chat(url, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_weather",
                                                                                        {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ------------------------------------------------------------------------------------------------------ bad input

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post(url: str, path: str, body: bytes | None, headers: dict | None = None, chunked: bool = False):
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        headers = {"Content-Type": "application/json", **(headers or {})}
        if chunked:
            pieces = [body[i:i + 1024] for i in range(0, len(body), 1024)]
            connection.request("POST", path, body=iter(pieces), headers=headers, encode_chunked=True)
        else:
            connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


BAD_INPUTS = {
    "malformed JSON": ("/v1/chat/completions", b'{"model": "tiny", "messages": [', {}, 400, "invalid_json"),
    "not an object": ("/v1/chat/completions", b"[1, 2]", {}, 400, None),
    "unknown model": ("/v1/chat/completions", json.dumps({**GOOD, "model": "gpt-9"}).encode(), {}, 404,
                      "model_not_found"),
    "oversized body": ("/v1/chat/completions", json.dumps({**GOOD, "pad": "x" * 5000}).encode(), {}, 413,
                       "request_too_large"),
    "tool without a name": ("/v1/chat/completions", json.dumps(
        {**GOOD, "tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}).encode(), {}, 400,
        None),
    "tool with array parameters": ("/v1/chat/completions", json.dumps(
        {**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]}).encode(), {}, 400,
        None),
    "session id with path characters": ("/sessions/..%2F..%2Fetc/v1/chat/completions", json.dumps(GOOD).encode(), {},
                                        400, "invalid_session_id"),
    "session header with a slash": ("/v1/chat/completions", json.dumps(GOOD).encode(),
                                    {"X-Trajlab-Session": "a/b"}, 400, "invalid_session_id"),
    "prompt longer than the context": ("/v1/chat/completions", json.dumps(
        {**GOOD, "messages": [{"role": "user", "content": "word " * 400}]}).encode(), {}, 400,
        "context_length_exceeded"),
    "unsupported tool_choice": ("/v1/chat/completions", json.dumps({**GOOD, "tool_choice": "required"}).encode(), {},
                                400, None),
    "bad tool-call arguments": ("/v1/chat/completions", json.dumps({**GOOD, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{oops"}}]}]}).encode(), {}, 400,
        None),
    "unknown role": ("/v1/chat/completions", json.dumps(
        {**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}).encode(), {}, 400, None),
    "bad temperature": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), {},
                        400, None),
    "unknown route": ("/v1/embeddings", json.dumps(GOOD).encode(), {}, 404, None),
    "number beyond float range": ("/v1/chat/completions", json.dumps(GOOD)[:-1].encode() + b', "x": 1e400}', {}, 400,
                                  "invalid_json"),
    "lone UTF-16 surrogate": ("/v1/chat/completions", json.dumps(
        {**GOOD, "messages": [{"role": "user", "content": "\ud800"}]}).encode(), {}, 400, "invalid_json"),
    "nesting too deep": ("/v1/chat/completions", b"[" * 3000, {}, 400, "invalid_json"),
    "denormal temperature": ("/v1/chat/completions", json.dumps({**GOOD, "temperature": 1e-320}).encode(), {}, 400,
                             None),
}


def test_each_bad_input_gets_an_openai_error_and_the_server_keeps_serving(fake_server):
    with fake_server() as url:
        for name, (path, body, headers, status, code) in BAD_INPUTS.items():
            got, error = post(url, path, body, headers)
            assert got == status, (name, error)
            assert set(error["error"]) == {"message", "type", "param", "code"}, name
            assert error["error"]["message"], name
            if code is not None:
                assert error["error"]["code"] == code, name
            ok, answer = post(url, "/v1/chat/completions", json.dumps(GOOD).encode())
            assert ok == 200 and answer["choices"], name
        # Oversized without a Content-Length (chunked) is cut off while reading, before parsing.
        got, error = post(url, "/v1/chat/completions", json.dumps({**GOOD, "pad": "x" * 9000}).encode(),
                          chunked=True)
        assert got == 413 and error["error"]["code"] == "request_too_large"


def test_the_sdk_raises_its_own_errors(fake_server):
    import openai

    with fake_server() as url:
        api = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            api.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="tools"):
            api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        tools=[{"type": "function", "function": {"description": "no name"}}])


def test_refused_calls_are_recorded_in_their_session(fake_server, tmp_path):
    with fake_server() as url:
        post(url, "/sessions/refused/v1/chat/completions", json.dumps({**GOOD, "model": "gpt-9"}).encode())
    (record,) = read_session(tmp_path / "refused.jsonl")
    assert record["status"] == 404 and record["error"]["code"] == "model_not_found" and "choices" not in record


def test_a_failing_backend_gives_a_500_in_openai_format_and_is_recorded(fake_server, tmp_path):
    with fake_server("") as url:
        for _ in range(2):  # and the server still answers afterwards
            status, error = post(url, "/sessions/crash/v1/chat/completions", json.dumps(GOOD).encode())
            assert status == 500 and error["error"]["type"] == "server_error"
            assert "the backend failed" in error["error"]["message"]
    assert [r["status"] for r in read_session(tmp_path / "crash.jsonl")] == [500, 500]


def test_a_body_shorter_than_its_content_length_gets_408_and_is_recorded(fake_server, tmp_path):
    """A client that promises 100 bytes and sends 10 would hold its connection forever: after body_timeout_s it
    gets an OpenAI-format 408, and the refused call is in its session's record."""
    serve = ServeSettings(max_context=256, max_body_bytes=4096, body_timeout_s=0.5)
    with fake_server(serve=serve) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /sessions/slow/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"model": ')
            started = time.monotonic()
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                piece = sock.recv(4096)
                if not piece:
                    break
                reply += piece
        waited = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert 0.4 < waited < 5
        ok, answer = post(url, "/v1/chat/completions", json.dumps(GOOD).encode())
        assert ok == 200
    (record,) = [json.loads(line) for line in (tmp_path / "slow.jsonl").open()]
    assert record["status"] == 408
