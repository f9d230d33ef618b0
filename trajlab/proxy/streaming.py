"""``stream: true``: a finished response replayed as server-sent events in OpenAI's chunk format.

The whole completion is generated (and recorded) first, then sent in chunks: clients that consume streams work
unchanged, but the first chunk arrives only when generation is done, so streaming does not lower latency here.
Token ids and logprobs of a choice come in one piece, on its last chunk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

CHUNK_CHARS = 32


def _pieces(text: str | None) -> list[str]:
    return [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] if text else []


def chat_chunks(response: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` objects for a ``chat.completion`` response."""
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": choices, **extra}

    for choice in response["choices"]:
        index, message = choice["index"], choice["message"]
        first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        extra = {"prompt_token_ids": response["prompt_token_ids"]} if "prompt_token_ids" in response else {}
        yield chunk([first], **extra)
        for piece in _pieces(message.get("content")):
            yield chunk([{"index": index, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}])
        for at, call in enumerate(message.get("tool_calls") or []):
            delta = {"tool_calls": [{"index": at, **call}]}
            yield chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
        last = {"index": index, "delta": {}, "logprobs": choice.get("logprobs"),
                "finish_reason": choice["finish_reason"]}
        if "token_ids" in choice:
            last["token_ids"] = choice["token_ids"]
        yield chunk([last])
    if include_usage:
        yield chunk([], usage=response["usage"])


def completion_chunks(response: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """``text_completion`` chunks for a ``text_completion`` response."""
    head = {"id": response["id"], "object": "text_completion", "created": response["created"],
            "model": response["model"]}
    for choice in response["choices"]:
        for piece in _pieces(choice["text"]):
            yield {**head, "choices": [{"index": choice["index"], "text": piece, "logprobs": None,
                                        "finish_reason": None}]}
        last = {key: value for key, value in choice.items() if key != "text"}
        yield {**head, "choices": [{**last, "text": ""}]}
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[str]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
