"""The official ``openai`` SDK against the tiny model served on loopback; every call checked against its record."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
import torch
from openai import OpenAI

from trajlab.chat.template import render
from trajlab.chat.utf8 import shown_text
from trajlab.proxy.openai_format import to_template_messages
from trajlab.proxy.recording import read_session

from .conftest import MODEL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOKEN_IDS = {"return_token_ids": True}


def client(url: str, session: str | None = None, **kwargs) -> OpenAI:
    base = f"{url}/sessions/{session}/v1" if session else f"{url}/v1"
    return OpenAI(base_url=base, api_key=kwargs.pop("api_key", "sk-test"), max_retries=0, timeout=60, **kwargs)


def records(served, session: str) -> list[dict]:
    return list(read_session(served.records / f"{session}.jsonl"))


def as_dict(message) -> dict:
    """An SDK response message as the next request's message (what an agent framework sends back)."""
    return message.model_dump(exclude_none=True, exclude={"annotations", "audio", "refusal"})


def test_models_lists_the_served_name(hf_server):
    assert [m.id for m in client(hf_server.url).models.list()] == [MODEL]
    assert [m.id for m in client(hf_server.url, "any-session").models.list()] == [MODEL]


def test_multi_turn_tool_conversation_is_recorded_with_exact_tokens(hf_server):
    api = client(hf_server.url, "tools-1")
    messages = [{"role": "system", "content": "You answer with tools."},
                {"role": "user", "content": "Weather in Paris?"}]
    responses = []

    def turn():
        response = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=6,
                                               temperature=0, logprobs=True, extra_body=TOKEN_IDS)
        responses.append((json.loads(json.dumps(messages)), response))
        return response

    first = turn()
    assert first.choices[0].finish_reason in ("stop", "length")
    # The tiny model calls no tool on its own: continue as an agent that did, with OpenAI's string arguments.
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"})
    second = turn()
    messages.append(as_dict(second.choices[0].message))
    messages.append({"role": "user", "content": "And tomorrow?"})
    turn()

    stored = records(hf_server, "tools-1")
    assert len(stored) == len(responses) == 3
    tokenizer = hf_server.tokenizer
    for record, (sent, response) in zip(stored, responses, strict=True):
        assert record["request_id"] == response.id and record["session_id"] == "tools-1"
        assert record["session_source"] == "path" and record["status"] == 200 and record["error"] is None
        assert record["request"]["messages"] == sent and record["request"]["tools"] == [WEATHER]
        rendered = render(tokenizer, to_template_messages(sent), [WEATHER], add_generation_prompt=True,
                          chat_template=hf_server.template)
        prompt = record["prompts"][0]
        assert prompt["text"] == rendered
        assert shown_text(tokenizer, prompt["token_ids"]) == rendered
        assert prompt["token_ids"] == response.model_extra["prompt_token_ids"]
        choice, answer = record["choices"][0], response.choices[0]
        assert choice["token_ids"] == answer.model_extra["token_ids"]
        assert len(choice["logprobs"]) == len(choice["token_ids"]) == response.usage.completion_tokens
        assert choice["logprobs"] == [entry.logprob for entry in answer.logprobs.content]
        assert choice["message"]["content"] == answer.message.content
    # Tool results and string arguments reached the template as it expects them.
    assert '"arguments": {"city": "Paris"}' in stored[1]["prompts"][0]["text"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in stored[1]["prompts"][0]["text"]
    # Greedy logprobs are the model's own: log_softmax of its logits at each generated position.
    ids = stored[2]["prompts"][0]["token_ids"] + stored[2]["choices"][0]["token_ids"]
    with torch.no_grad():
        logits = hf_server.model(torch.tensor([ids])).logits[0].float()
    start = len(stored[2]["prompts"][0]["token_ids"])
    expected = torch.log_softmax(logits[start - 1:-1], -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]
    assert torch.allclose(expected, torch.tensor(stored[2]["choices"][0]["logprobs"]), atol=1e-4)


def test_streaming_matches_the_whole_response(hf_server):
    api = client(hf_server.url, "stream-1")
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 12,
               "temperature": 0, "extra_body": TOKEN_IDS}
    whole = api.chat.completions.create(**request)
    chunks = list(api.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content and finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed_ids = [c.choices[0].model_extra["token_ids"] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert streamed_ids == [whole.choices[0].model_extra["token_ids"]]
    stored = records(hf_server, "stream-1")
    assert [r["request"].get("stream", False) for r in stored] == [False, True]
    assert stored[1]["choices"][0]["token_ids"] == streamed_ids[0]


def test_n_choices_are_generated_and_recorded(hf_server):
    response = client(hf_server.url, "n-2").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], n=2, max_tokens=5, temperature=1.0,
        top_p=0.9, extra_body=TOKEN_IDS)
    assert [c.index for c in response.choices] == [0, 1]
    (record,) = records(hf_server, "n-2")
    assert [c["token_ids"] for c in record["choices"]] == [c.model_extra["token_ids"] for c in response.choices]
    assert response.usage.completion_tokens == sum(len(c["token_ids"]) for c in record["choices"])
    assert record["sampling"]["n"] == 2 and record["sampling"]["top_p"] == 0.9


def test_a_seed_makes_the_choices_reproducible(hf_server):
    def ask(seed: int) -> list[list[int]]:
        response = client(hf_server.url, f"seeded-{seed}").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say something."}], n=2, max_tokens=12,
            temperature=1.0, seed=seed, extra_body=TOKEN_IDS)
        return [c.model_extra["token_ids"] for c in response.choices]

    first, again, other = ask(7), ask(7), ask(8)
    assert first == again and first[0] != first[1] and first != other


def test_stop_string_cuts_text_and_tokens(hf_server):
    api = client(hf_server.url, "stop-1")
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me more."}], "max_tokens": 10,
               "temperature": 0, "extra_body": TOKEN_IDS}
    full = api.chat.completions.create(**request)
    text, ids = full.choices[0].message.content, full.choices[0].model_extra["token_ids"]
    if len(text.strip()) < 4:
        pytest.skip("greedy output too short to cut")
    stop = text.strip()[2:4]
    cut = api.chat.completions.create(**request, stop=[stop])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == text[:text.find(stop)]
    kept = choice.model_extra["token_ids"]
    tokenizer = hf_server.tokenizer
    assert kept == ids[:len(kept)] and stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])
    record = records(hf_server, "stop-1")[1]
    assert record["choices"][0]["stop"] == stop and record["choices"][0]["token_ids"] == kept


def test_completions_endpoint_and_sessions_from_header_and_api_key(hf_server):
    api = client(hf_server.url, default_headers={"X-Trajlab-Session": "by-header"})
    response = api.completions.create(model=MODEL, prompt="The weather", max_tokens=4, temperature=0,
                                      extra_body=TOKEN_IDS)
    assert response.object == "text_completion" and response.choices[0].finish_reason in ("stop", "length")
    (record,) = records(hf_server, "by-header")
    assert record["endpoint"] == "/v1/completions" and record["session_source"] == "header"
    assert record["choices"][0]["token_ids"] == response.choices[0].model_extra["token_ids"]
    assert record["choices"][0]["text"] == response.choices[0].text

    client(hf_server.url, api_key="secret-key-123").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    (keyed,) = [path for path in hf_server.records.glob("key-*.jsonl")]
    assert "secret-key-123" not in keyed.read_text()
    assert next(read_session(keyed))["session_source"] == "api_key"


def test_a_client_that_disconnects_cancels_its_generation(hf_server):
    """A long generation whose client goes away stops: the next call is answered at once instead of waiting for
    it (the hf generator ends abandoned rows), and the abandoned call is recorded as 499."""
    # a prompt after which the greedy tiny model (seed 0) writes all 1500 tokens; after [7, 8, 9] it stops at 53
    long_call = {"model": MODEL, "prompt": [10, 11, 12], "max_tokens": 1500, "temperature": 0}
    api = client(hf_server.url, "full-length")
    started = time.monotonic()
    whole = api.completions.create(**long_call)
    full_s = time.monotonic() - started
    if whole.usage.completion_tokens < 1500 or full_s < 1.5:
        pytest.skip(f"the tiny model stopped after {whole.usage.completion_tokens} tokens ({full_s:.1f} s): too "
                    "short to tell a cancelled generation from a finished one")
    host, port = hf_server.url.removeprefix("http://").split(":")
    body = json.dumps(long_call).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /sessions/gone/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)  # generating by now
    started = time.monotonic()
    client(hf_server.url, "next").completions.create(model=MODEL, prompt=[5, 6], max_tokens=4, temperature=0)
    next_s = time.monotonic() - started
    assert next_s < full_s / 3, f"the next call waited {next_s:.1f} s; a whole generation takes {full_s:.1f} s"
    deadline = time.monotonic() + 10
    while not (hf_server.records / "gone.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = records(hf_server, "gone")
    assert record["status"] == 499 and record["error"]["type"] == "client_closed_request"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_that_disconnects_while_sending_its_body_is_a_quiet_499(hf_server, caplog, framing):
    """A client gone before its whole body arrived is not the server's failure: it was logged as an ERROR with a
    traceback and recorded as a 500; now one log line without a traceback, and a 499 record."""
    session = f"cut-{framing}"
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    framed = {"content-length": b"Content-Length: 5000\r\n\r\n" + body[:30],
              "chunked": b"Transfer-Encoding: chunked\r\n\r\n100\r\n" + body[:30]}[framing]
    host, port = hf_server.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO, logger="trajlab"):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST /sessions/{session}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n".encode()
                         + b"Content-Type: application/json\r\n" + framed)
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while not (hf_server.records / f"{session}.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)
    (record,) = records(hf_server, session)
    assert record["status"] == 499 and record["error"]["type"] == "client_closed_request", record
    assert "while sending its body (30 bytes received)" in record["error"]["message"]
    logged = [r for r in caplog.records if r.name.startswith("trajlab.proxy")]
    assert [(r.levelno, r.exc_info) for r in logged] == [(logging.INFO, None)], [r.getMessage() for r in logged]
    assert "client closed request (499)" in logged[0].getMessage()


def test_freed_heap_pages_go_back_to_the_system_after_a_burst_of_calls(hf_server, monkeypatch):
    """glibc keeps what a large call freed resident: the server hands it back after calls (at most once a second,
    and always after the last call of a burst)."""
    import trajlab.proxy.app

    releases: list[float] = []
    monkeypatch.setattr(trajlab.proxy.app, "release_freed_memory", lambda: releases.append(time.monotonic()),
                        raising=False)
    api = client(hf_server.url, "release")
    for _ in range(3):
        last_sent = time.monotonic()
        api.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, temperature=0)
    deadline = time.monotonic() + 5
    while (not releases or releases[-1] < last_sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert releases and releases[-1] >= last_sent, "no release after the last call"
    assert len(releases) <= 3
