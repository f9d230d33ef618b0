"""``trajlab serve --upstream``: a recording front in front of a real ``trajlab serve`` (tiny model), both on
loopback ports, spoken to by the openai SDK."""

from __future__ import annotations

import socket

import httpx2 as httpx
import openai
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from tests.proxy.conftest import MODEL, running
from trajlab.cli import app
from trajlab.config import ServeSettings
from trajlab.proxy.recording import SessionRecorder, read_session
from trajlab.proxy.upstream import UpstreamBackend, create_upstream_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def front(hf_server, tmp_path_factory):
    records = tmp_path_factory.mktemp("front")
    with running(create_upstream_app(UpstreamBackend(hf_server.url + "/v1"), SessionRecorder(records),
                                     ServeSettings())) as url:
        yield url, records


def test_front_answers_as_the_upstream_and_records_its_token_ids(hf_server, front):
    url, records = front
    direct = OpenAI(base_url=hf_server.url + "/sessions/direct/v1", api_key="k", max_retries=0)
    proxied = OpenAI(base_url=url + "/sessions/s1/v1", api_key="k", max_retries=0)
    assert [m.id for m in proxied.models.list()] == [MODEL]

    want = direct.chat.completions.create(**CHAT, extra_body={"return_token_ids": True})
    got = proxied.chat.completions.create(**CHAT)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage == want.usage
    assert got.choices[0].logprobs is None and "token_ids" not in got.choices[0].model_extra  # not asked for

    (record,) = read_session(records / "s1.jsonl")
    assert record["status"] == 200 and record["text_only"] is False and record["request"] == CHAT
    assert record["prompts"][0]["token_ids"] == want.model_extra["prompt_token_ids"]
    assert record["choices"][0]["token_ids"] == want.choices[0].model_extra["token_ids"]
    assert len(record["choices"][0]["logprobs"]) == len(record["choices"][0]["token_ids"])
    assert record["request_id"] == got.id

    asked = proxied.chat.completions.create(**CHAT, logprobs=True, extra_body={"return_token_ids": True})
    assert asked.choices[0].model_extra["token_ids"] == want.choices[0].model_extra["token_ids"]
    assert asked.model_extra["prompt_token_ids"] == want.model_extra["prompt_token_ids"]
    assert asked.choices[0].logprobs is not None

    text = dict(model=MODEL, prompt="abc", max_tokens=5, temperature=0)
    want_text = direct.completions.create(**text, extra_body={"return_token_ids": True})
    got_text = proxied.completions.create(**text)
    assert got_text.choices[0].text == want_text.choices[0].text
    streamed = "".join(c.choices[0].delta.content or "" for c in proxied.chat.completions.create(**CHAT, stream=True)
                       if c.choices)
    assert streamed == want.choices[0].message.content
    completion = list(read_session(records / "s1.jsonl"))[2]
    assert completion["endpoint"] == "/v1/completions" and completion["prompts"][0]["text"] == "abc"
    assert completion["choices"][0]["token_ids"] == want_text.choices[0].model_extra["token_ids"]


def test_upstream_errors_keep_their_status_and_are_recorded(front):
    url, records = front
    proxied = OpenAI(base_url=url + "/sessions/bad/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        proxied.chat.completions.create(**{**CHAT, "model": "nope"})
    (record,) = read_session(records / "bad.jsonl")
    assert record["status"] == 404 and record["error"]["code"] == "model_not_found"


def test_unreachable_upstream_gives_502_and_the_front_keeps_serving(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    front_app = create_upstream_app(UpstreamBackend(f"http://127.0.0.1:{dead}/v1"), SessionRecorder(tmp_path),
                                    ServeSettings())
    with running(front_app) as url:
        for _ in range(2):
            response = httpx.post(url + "/sessions/down/v1/chat/completions", json=CHAT, timeout=30)
            assert response.status_code == 502
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert response.json()["error"]["code"] == "upstream_unreachable"
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    assert [r["status"] for r in read_session(tmp_path / "down.jsonl")] == [502, 502]


def test_serve_refuses_upstream_with_model(tiny_model_dir):
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), "--upstream", "http://x/v1"])
    assert result.exit_code == 2 and "--upstream" in " ".join(result.output.split())
    neither = CliRunner().invoke(app, ["serve"])
    assert neither.exit_code == 1 and "nothing to serve" in " ".join(neither.stdout.split())
