"""A scripted judge: a tiny real HTTP server on loopback answering chat completions with scripted text. It is a
FAKE standing in for a real judge LLM (none runs here); the judge client talks to it over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request

from tests.proxy.conftest import running


@dataclass
class ScriptedJudge:
    """What the fake judge answers (``reply``: the request's messages to the answer's text), how long it takes
    (``delay_s``), and what it saw."""

    url: str = ""
    reply: Callable[[list[dict]], str] = lambda messages: "Looks right.\nSCORE: 1"
    delay_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0


def judge_app(judge: ScriptedJudge) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "scripted-judge", "object": "model", "owned_by": "tests"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        judge.requests.append(body)
        judge.in_flight += 1
        judge.most_in_flight = max(judge.most_in_flight, judge.in_flight)
        try:
            await asyncio.sleep(judge.delay_s)
            text = judge.reply(body["messages"])
        finally:
            judge.in_flight -= 1
        return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}}

    return app


@pytest.fixture
def scripted_judge() -> Iterator[ScriptedJudge]:
    judge = ScriptedJudge()
    with running(judge_app(judge)) as url:
        judge.url = url + "/v1"
        yield judge
