"""OpenAI request bodies in, chat-template messages out; generated choices back in OpenAI's response shapes.

Requests accept fields this server does not act on (``user``, ``parallel_tool_calls``, ...) because
clients send them routinely; fields whose non-default values would change the answer and that are not supported
(``tool_choice: "required"``, ``top_logprobs``, ``echo``, ...) are refused with a 400 instead of being ignored.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trajlab.chat.parsers import ParsedResponse
from trajlab.chat.template import REASONING_FIELDS
from trajlab.proxy.errors import bad_request
from trajlab.rollout.images import is_image_id

MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 1e-4
_Model = TypeVar("_Model", bound=BaseModel)


class _Request(BaseModel):
    # Unknown fields are accepted (clients send many); the recording keeps the body exactly as received.
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """0 is greedy; a positive temperature below MIN_TEMPERATURE is refused (logits / 1e-320 overflow)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    """Seeds the sampling: the same request with the same seed gets the same choices, whatever else is served."""
    return_token_ids: bool = False
    """vLLM's extra field: add ``prompt_token_ids`` and each choice's ``token_ids`` to the response."""

    @field_validator("temperature")
    @classmethod
    def _usable_temperature(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {value!r}")
        return value

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise bad_request(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for legacy completions

    def token_budget(self) -> int | None:
        return self.max_tokens


def parse_request(model: type[_Model], body: Any) -> _Model:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param) from exc


# ------------------------------------------------------------------------------------------------- tools and choice


def validate_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Check each tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``.

    Returns the tools as the chat template gets them: a tool without ``parameters`` takes none.
    """
    checked = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f'{where} must be an object with "type": "function"', param=where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f'{where} has no "function" object', param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 256:
            raise bad_request(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if not isinstance(function.get("description", ""), str):
            raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object" or not isinstance(
            parameters.get("properties", {}), dict
        ):
            raise bad_request(
                f'{where}.function.parameters must be a JSON Schema of type "object" with object "properties"',
                param=f"{where}.function.parameters",
            )
        checked.append({"type": "function", "function": {**function, "parameters": parameters}})
    return checked


def parse_tool_choice(tool_choice: str | dict[str, Any] | None, has_tools: bool) -> bool:
    """Whether tool calls are parsed from the completion: "auto" (the default with tools) or "none"."""
    if tool_choice is None:
        return has_tools
    if tool_choice == "none":
        return False
    if tool_choice == "auto":
        return has_tools
    raise bad_request(
        f"tool_choice {json.dumps(tool_choice)} is not supported by this server; use \"auto\" or \"none\"",
        param="tool_choice",
    )


# ---------------------------------------------------------------------------------------------------------- messages


def _text(content: Any, where: str) -> str:
    """Message content as one string: a string, null, or a list of text parts."""
    content = _content(content, where)
    if isinstance(content, list):
        raise bad_request(f"{where}.content: image parts are taken in user and tool messages only",
                          param=f"{where}.content")
    return content


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Message content as the template takes it: one string, or text and image parts when it holds an image.

    An image part is ``{"type": "image_url", "image_url": {"url": <image id>}}``, as
    :func:`trajlab.proxy.images.inline_images` leaves it (and recordings hold it); it becomes
    ``{"type": "image", "image": <image id>}``, the form trajectories use.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string, null or a list of text and image_url parts",
                          param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part["image_url"].get("url") if isinstance(part.get("image_url"), dict) else None
            if not is_image_id(url):
                raise bad_request(f"{where}.content[{j}]: send the image inline as a data URL "
                                  "(data:image/png;base64,...)", param=f"{where}.content")
            parts.append({"type": "image", "image": url})
        else:
            raise bad_request(f"{where}.content[{j}]: only text and image_url parts are supported",
                              param=f"{where}.content")
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{"name", "arguments"}}}}', param=where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise bad_request(f"{where}.function.arguments is not valid JSON: {exc}",
                              param=f"{where}.function.arguments") from exc
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must encode a JSON object", param=f"{where}.function.arguments")
    converted = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        converted["id"] = call["id"]
    return converted


def to_template_messages(messages: list[dict[str, Any]],
                         reasoning_field: str = "reasoning_content") -> list[dict[str, Any]]:
    """OpenAI chat messages to what chat templates expect.

    Tool-call arguments arrive as JSON strings and templates want objects; ``developer`` is OpenAI's new name for
    ``system``; a tool result gets the ``name`` of the call it answers (templates such as Llama's print it). User
    and tool messages may hold images, named by id (:func:`trajlab.proxy.images.inline_images` puts the ids in).
    An assistant's reasoning, sent under any of :data:`REASONING_FIELDS`, goes under ``reasoning_field``: the key
    the chat template reads (:func:`trajlab.chat.template.reasoning_field`), or the template would drop it.
    """
    converted: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            converted.append({"role": "system", "content": _text(message.get("content"), where)})
        elif role == "user":
            converted.append({"role": "user", "content": _content(message.get("content"), where)})
        elif role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": _text(message.get("content"), where)}
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            if calls:
                out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
                call_names.update({c["id"]: c["function"]["name"] for c in out["tool_calls"] if "id" in c})
            reasoning = next((message[key] for key in REASONING_FIELDS if isinstance(message.get(key), str)), None)
            if reasoning is not None:
                out[reasoning_field] = reasoning
            converted.append(out)
        elif role == "tool":
            call_id = message.get("tool_call_id")
            out = {"role": "tool", "content": _content(message.get("content"), where)}
            if isinstance(call_id, str):
                out["tool_call_id"] = call_id
            name = message.get("name") or call_names.get(call_id)
            if isinstance(name, str):
                out["name"] = name
            converted.append(out)
        else:
            raise bad_request(f"{where}.role must be system, developer, user, assistant or tool; got {role!r}",
                              param=f"{where}.role")
    return converted


# ----------------------------------------------------------------------------------------------------------- choices


@dataclass
class Choice:
    """One generated choice: exact tokens plus what they mean as an OpenAI message.

    ``text`` is the decoded completion without its stop token (and cut before a matched stop string);
    ``stop`` names what ended it: the stop token id, the stop string, or None when it ran out of tokens.
    """

    index: int
    token_ids: list[int]
    logprobs: list[float | None]
    text: str
    finish_reason: Literal["stop", "length", "tool_calls"]
    stop: int | str | None = None
    parsed: ParsedResponse | None = None
    tool_call_ids: list[str] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message as OpenAI returns it: ``arguments`` are JSON strings."""
        if self.parsed is None or self.parsed.errors or not self.parsed.tool_calls:
            content = self.text if self.parsed is None or self.parsed.errors else self.parsed.content
            message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": None}
        else:
            calls = [
                {"id": call_id, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                for call_id, call in zip(self.tool_call_ids, self.parsed.tool_calls, strict=True)
            ]
            message = {"role": "assistant", "content": self.parsed.content or None, "tool_calls": calls}
        if self.parsed is not None and self.parsed.reasoning:
            message["reasoning_content"] = self.parsed.reasoning
        return message


def new_tool_call_id() -> str:
    """A fresh id for a call the model wrote without one: nine alphanumeric characters, the only form Mistral's
    templates accept when the client sends the call back (OpenAI's clients take any string)."""
    return uuid.uuid4().hex[:9]


def chat_logprobs(choice: Choice, token_texts: list[str], token_bytes: list[bytes]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: one entry per generated token (top alternatives are not available); ``bytes``
    are the token's own, part of a character's when the token holds only part of one."""
    return {"content": [
        {"token": text, "logprob": lp, "bytes": list(data), "top_logprobs": []}
        for text, data, lp in zip(token_texts, token_bytes, choice.logprobs, strict=True)
    ]}


def completion_logprobs(choice: Choice, token_texts: list[str]) -> dict[str, Any]:
    """The legacy completions ``logprobs`` shape, with ``text_offset`` into the choice's text."""
    offsets, at = [], 0
    for text in token_texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": token_texts, "token_logprobs": choice.logprobs, "top_logprobs": None, "text_offset": offsets}
