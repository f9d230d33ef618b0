"""A prompt that cannot fit the context is refused before it is tokenized (tokenizing megabytes cost half a gigabyte
and seconds of the event loop), and the bound that decides it never refuses a prompt that fits."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

import trajlab.proxy.app as app_module
from trajlab.chat.parsers import get_parser
from trajlab.chat.template import ChatTemplate
from trajlab.config import ServeSettings
from trajlab.proxy import SessionRecorder, create_app
from trajlab.proxy.limits import TokenFloor

from .conftest import MODEL, running
from .test_tool_calls import GOOD, FakeReplyGenerator, post


@pytest.fixture
def encoded_lengths(tiny_tokenizer, monkeypatch) -> list[int]:
    """The length of every text the tiny tokenizer encodes while the test runs (the server runs in a thread)."""
    lengths: list[int] = []
    encode = type(tiny_tokenizer).encode

    def spy(self, text, *args, **kwargs):
        lengths.append(len(text))
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tiny_tokenizer), "encode", spy)
    return lengths


def fake_app(tiny_tokenizer, tiny_template, tmp_path, serve: ServeSettings):
    return create_app(FakeReplyGenerator(tiny_tokenizer, "ok"), tiny_tokenizer, tiny_template,
                      get_parser("auto", tiny_tokenizer), MODEL, SessionRecorder(tmp_path), serve,
                      tiny_tokenizer.model_max_length)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "ab " * 100_000}]}),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "hi"}] * 20_000}),
    ("/v1/completions", {"model": MODEL, "prompt": ["short", "ab " * 100_000]}),
])
def test_a_prompt_past_the_context_is_refused_without_tokenizing_it(tiny_tokenizer, tiny_template, tmp_path,
                                                                    encoded_lengths, path, body):
    with running(fake_app(tiny_tokenizer, tiny_template, tmp_path,
                          ServeSettings(max_context=256, max_body_bytes=1 << 20))) as url:
        status, error = post(url, path, json.dumps(body).encode())
    assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
    assert max(encoded_lengths, default=0) < 10_000, "the long prompt was tokenized"
    assert "at least" in error["error"]["message"]


def test_the_floor_never_exceeds_the_real_token_count(tiny_tokenizer):
    floor, rng = TokenFloor(tiny_tokenizer), random.Random(0)
    alphabet = ["a", "b", " ", "  ", "\n", "é", "日本", "🙂", "<|im_start|>", "<tool_call>", "the ", "0123", "\t"]
    assert floor.max_token_bytes is not None
    for _ in range(300):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 400)))
        assert floor(text) <= len(tiny_tokenizer.encode(text, add_special_tokens=False)), text


def test_a_request_asking_for_more_choices_than_max_choices_is_refused_before_any_is_generated(
        tiny_tokenizer, tiny_template, tmp_path):
    """A completions request may list prompts by the thousand, each n generations and a record's worth of ids."""
    with running(fake_app(tiny_tokenizer, tiny_template, tmp_path, ServeSettings())) as url:
        within, _ = post(url, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": ["a"] * 16, "n": 16, "max_tokens": 1}).encode())
        assert within == 200
        for body in ({"model": MODEL, "prompt": ["a"] * 257, "max_tokens": 1},
                     {"model": MODEL, "prompt": ["a"] * 17, "n": 16, "max_tokens": 1}):
            status, error = post(url, "/v1/completions", json.dumps(body).encode())
            assert status == 400 and error["error"]["code"] == "too_many_choices", error
            assert "serve.max_choices" in error["error"]["message"]
    with running(fake_app(tiny_tokenizer, tiny_template, tmp_path, ServeSettings(max_choices=4))) as url:
        status, error = post(url, "/v1/chat/completions", json.dumps({**GOOD, "n": 5}).encode())
        assert status == 400 and error["error"]["param"] == "n", error


def test_more_messages_than_the_context_has_tokens_are_refused_before_they_are_rendered(
        tiny_tokenizer, tiny_template, tmp_path, monkeypatch):
    """100,000 messages in under 4 MiB took 100 MB of objects and seconds of the event loop to render, only to be
    found past the context afterwards."""
    rendered = []
    render = ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, *a, **k: rendered.append(1) or render(self, *a, **k))
    with running(fake_app(tiny_tokenizer, tiny_template, tmp_path, ServeSettings(max_context=256))) as url:
        status, error = post(url, "/v1/chat/completions", json.dumps(
            {**GOOD, "messages": [{"role": "user", "content": ""}] * 257}).encode())
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert "257 messages" in error["error"]["message"] and not rendered
        status, _ = post(url, "/v1/chat/completions", json.dumps(
            {**GOOD, "messages": [{"role": "user", "content": "hi"}] * 3}).encode())
        assert status == 200 and rendered


def test_large_bodies_are_prepared_one_at_a_time_and_small_ones_pass_them(tiny_tokenizer, tiny_template, tmp_path,
                                                                         monkeypatch):
    """A refused large body's objects live until its record is written (a thread); the next large body waits for
    that rather than parse beside it, while small calls go on."""
    parsed, release = [], threading.Event()
    loads = json.loads
    monkeypatch.setattr(app_module, "json", SimpleNamespace(loads=lambda data, **k: parsed.append(len(data))
                                                            or loads(data, **k)))
    append = SessionRecorder.append

    def slow_append(self, session, record, *args):
        if record["status"] == 400:
            release.wait(timeout=30)
        return append(self, session, record, *args)

    monkeypatch.setattr(SessionRecorder, "append", slow_append)
    large = json.dumps({**GOOD, "messages": [{"role": "user", "content": "ab " * 400_000}]}).encode()
    assert len(large) > app_module.LARGE_BODY_BYTES
    with running(fake_app(tiny_tokenizer, tiny_template, tmp_path, ServeSettings(max_context=256))) as url, \
            ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, url, "/v1/chat/completions", large)
        _wait_for(lambda: len(parsed) == 1)
        second = pool.submit(post, url, "/v1/chat/completions", large)
        assert post(url, "/v1/chat/completions", json.dumps(GOOD).encode())[0] == 200
        time.sleep(0.5)
        assert [size > app_module.LARGE_BODY_BYTES for size in parsed] == [True, False], \
            "the second large body was parsed while the first one's record was being written"
        release.set()
        assert first.result()[0] == second.result()[0] == 400
    assert [size > app_module.LARGE_BODY_BYTES for size in parsed] == [True, False, True]


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
