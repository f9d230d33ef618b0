"""``trajlab serve --upstream URL``: forward calls to another OpenAI-compatible server and record them in between.

The upstream (vLLM, SGLang, another ``trajlab serve``) generates; this server only forwards and records, with the
same routes, sessions, error format and record schema as the local backend. Each call is sent non-streamed with
``return_token_ids: true`` and logprobs requested, so the record gets the upstream's exact prompt and completion
token ids; what the client did not ask for (token ids, logprobs) is removed from the response it gets. An upstream
that returns no token ids is recorded text-only: token ids ``null`` and ``text_only: true`` in the record.
``stream: true`` replays the finished response as chunks, as the local backend does.

No tokenizer is loaded: a chat call's prompt ``text`` is recorded as ``null`` (the messages are in ``request``), a
completion call's as its prompt string.
"""

from __future__ import annotations

from typing import Any

import httpx2 as httpx
from fastapi import FastAPI, Request

from trajlab.config import ServeSettings
from trajlab.proxy.app import CallContext, openai_app, read_body
from trajlab.proxy.errors import APIError, bad_request
from trajlab.proxy.recording import SessionRecorder
from trajlab.proxy.streaming import chat_chunks, completion_chunks

UNREACHABLE = 502


class UpstreamBackend:
    """Sends calls to one upstream server and reads what the record needs out of its answers.

    Args:
        base_url: the upstream's OpenAI base URL, e.g. ``http://127.0.0.1:8001/v1``.
        timeout_s: seconds to wait for one upstream response (generation included).
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def send(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The upstream's JSON answer; an ``APIError`` with 502 when unreachable, else with the upstream's status."""
        url = self.base_url + path
        try:
            response = await self.client.request(method, url, json=body)
        except httpx.HTTPError as exc:
            raise APIError(UNREACHABLE, f"upstream {url} unreachable: {type(exc).__name__}: {exc}",
                           type="server_error", code="upstream_unreachable") from exc
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200:
            error = answer.get("error") if isinstance(answer, dict) else None
            if not isinstance(error, dict):
                error = {"message": f"upstream {url} answered {response.status_code}: {response.text[:500]}"}
            raise APIError(response.status_code, str(error.get("message")), param=error.get("param"),
                           code=error.get("code"), type=error.get("type") or (
                               "server_error" if response.status_code >= 500 else "invalid_request_error"))
        if not isinstance(answer, dict):
            raise APIError(UNREACHABLE, f"upstream {url} answered with no JSON object", type="server_error",
                           code="upstream_bad_response")
        return answer

    async def close(self) -> None:
        await self.client.aclose()


def create_upstream_app(backend: UpstreamBackend, recorder: SessionRecorder, serve: ServeSettings) -> FastAPI:
    """The recording server in front of ``backend``: same routes, sessions, errors and records as ``create_app``.

    Of ``serve`` only the body limits apply (``max_body_bytes``, ``body_timeout_s``): the upstream has its own
    context and token budget.
    """

    async def request_body(request: Request, call: CallContext) -> dict[str, Any]:
        body = await read_body(request, call, serve)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        if not isinstance(body.get("model"), str):
            raise bad_request("model: a string is required", param="model")
        call.model = body["model"]
        call.release_gate()  # forwarding overlaps other calls
        return body

    async def chat_work(request: Request, call: CallContext):
        body = await request_body(request, call)
        forwarded = {**_forwarded(body), "logprobs": True}
        response = await backend.send("POST", "/chat/completions", forwarded)
        prompt_ids = response.pop("prompt_token_ids", None)
        choices = [_recorded_choice(c, 0, _chat_logprob_values(c.get("logprobs")), _message_text(c)) for c in
                   response.get("choices", [])]
        fields = _record_fields(body, [{"text": None, "token_ids": prompt_ids}], choices, response)
        _strip(response, body)
        if body.get("return_token_ids"):
            response["prompt_token_ids"] = prompt_ids
        response["id"] = call.request_id
        return response, fields, chat_chunks(response, _include_usage(body)) if body.get("stream") else None

    async def completion_work(request: Request, call: CallContext):
        body = await request_body(request, call)
        forwarded = {**_forwarded(body), "logprobs": body.get("logprobs") or 0}
        response = await backend.send("POST", "/completions", forwarded)
        prompts = body.get("prompt")
        texts = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts or [])
        n = int(body.get("n") or 1)
        records: list[dict[str, Any]] = [{"text": t if isinstance(t, str) else None, "token_ids": None} for t in texts]
        choices = []
        for c in response.get("choices", []):
            p = min(c.get("index", 0) // n, len(records) - 1) if records else 0
            if records and c.get("prompt_token_ids") is not None:
                records[p]["token_ids"] = c["prompt_token_ids"]
            logprobs = c.get("logprobs")
            values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
            choices.append(_recorded_choice(c, p, values, c.get("text")))
        fields = _record_fields(body, records, choices, response)
        _strip(response, body)
        response["id"] = call.request_id
        return response, fields, completion_chunks(response, _include_usage(body)) if body.get("stream") else None

    async def list_models() -> dict[str, Any]:
        return await backend.send("GET", "/models")

    return openai_app(chat_work, completion_work, list_models, recorder, "upstream", on_shutdown=backend.close)


def _forwarded(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as sent upstream: never streamed, always asking for token ids."""
    out = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    out["return_token_ids"] = True
    return out


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _is_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, int) for p in prompt)


def _chat_logprob_values(logprobs: Any) -> list[float | None] | None:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [entry.get("logprob") for entry in content] if isinstance(content, list) else None


def _message_text(choice: dict[str, Any]) -> str | None:
    message = choice.get("message")
    return message.get("content") if isinstance(message, dict) else None


def _recorded_choice(choice: dict[str, Any], prompt_index: int, logprobs: list | None, text: str | None):
    return {"index": choice.get("index"), "prompt_index": prompt_index, "token_ids": choice.get("token_ids"),
            "logprobs": logprobs, "text": text, "finish_reason": choice.get("finish_reason"),
            "stop": choice.get("stop_reason"), "message": choice.get("message"), "parse_errors": []}


def _record_fields(body, prompts, choices, response) -> dict[str, Any]:
    """The token-level part of the record, in the local backend's shape; ``text_only`` when ids are missing."""
    stop = body.get("stop")
    text_only = any(p["token_ids"] is None for p in prompts) or any(c["token_ids"] is None for c in choices)
    return {
        "prompts": prompts,
        "sampling": {"n": body.get("n", 1), "max_new_tokens": body.get("max_completion_tokens") or body.get(
            "max_tokens"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "stop": [stop] if isinstance(stop, str) else list(stop or []), "stop_token_ids": None},
        "choices": choices,
        "usage": response.get("usage"),
        "upstream": {"id": response.get("id"), "model": response.get("model")},
        "text_only": text_only,
    }


def _strip(response: dict[str, Any], body: dict[str, Any]) -> None:
    """Remove what this server asked the upstream for and the client did not: token ids and logprobs."""
    for choice in response.get("choices", []):
        if not body.get("return_token_ids"):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if body.get("logprobs") is None or body.get("logprobs") is False:  # completions' logprobs=0 is a request
            choice["logprobs"] = None
