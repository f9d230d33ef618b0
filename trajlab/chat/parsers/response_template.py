"""The `response_template` parser: the tokenizer's own `parse_response`, as TRL's GRPOTrainer uses it."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trajlab.chat.parsers.base import (
    CALL_HINT,
    END_MARKERS,
    PYTHON_TAG,
    ParsedResponse,
    ToolCall,
    join_content,
    markers_for,
    strip_markers,
    to_call,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ResponseTemplateParser:
    """Delegates to `tokenizer.parse_response`, driven by the tokenizer's `response_template`.

    This is the parser TRL's GRPOTrainer uses, so parsing here matches parsing there. Its failures are turned into
    errors for the model, and a call in a near-miss format is reported rather than lost. `prefix` must be the
    rendered prompt (or ""): `parse_response` keeps only what follows the template's last assistant anchor in it,
    and a prefix without that anchor ends up in `content`.
    """

    name = "response_template"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        if tokenizer is None or getattr(tokenizer, "response_template", None) is None:
            raise ValueError(
                "The 'response_template' parser needs a tokenizer with a `response_template` (set one with "
                "`trl.chat_template_utils.add_response_schema(tokenizer)`), or use the 'hermes' or 'llama3' parser."
            )
        self.tokenizer = tokenizer
        self.markers = (*markers_for(tokenizer), PYTHON_TAG)
        self.format = _example_call(tokenizer) or "the tool-call format shown in the system prompt"

    def parse(self, text: str, prefix: str = "", tools: Sequence[dict[str, Any]] | None = None) -> ParsedResponse:
        try:
            message = self._parse_response(text, prefix, list(tools) if tools else None)
        except Exception as e:  # any failure of a third-party parser must reach the model as text
            error = f"Your tool call could not be parsed ({_first_lines(e)}). Write each call as {self.format}"
            return ParsedResponse(join_content([text], self.markers), [], [error])
        try:
            return self._convert(message)
        except Exception as e:  # an unexpected message shape is still only an error
            return ParsedResponse(join_content([text], self.markers), [], [f"Your reply could not be parsed ({e})."])

    def _parse_response(self, text: str, prefix: str, tools: list[dict[str, Any]] | None) -> dict:
        try:
            return self.tokenizer.parse_response(text, prefix=prefix, tools=tools)
        except Exception:
            # Some templates close a call with the end-of-turn token (Llama 3's `}<|eot_id|>`): retry with it, in case
            # the generator stripped the stop token.
            eos = getattr(self.tokenizer, "eos_token", None)
            if not isinstance(eos, str) or not eos or text.rstrip().endswith(eos):
                raise
            return self.tokenizer.parse_response(text + eos, prefix=prefix, tools=tools)

    def _convert(self, message: Any) -> ParsedResponse:
        if not isinstance(message, dict):
            raise TypeError(f"parse_response returned a {type(message).__name__}, not a message dict")
        content, reasoning = message.get("content"), message.get("reasoning_content")
        content = "" if content is None else content if isinstance(content, str) else json.dumps(content)
        calls: list[ToolCall] = []
        errors: list[str] = []
        raw_calls = message.get("tool_calls") or []
        for index, raw in enumerate(raw_calls if isinstance(raw_calls, list) else [raw_calls], start=1):
            function = raw.get("function", raw) if isinstance(raw, dict) else raw
            result = to_call(function, index, self.format)
            (calls if isinstance(result, ToolCall) else errors).append(result)
        # The template's own opener always yields a call or an exception; a call in a near-miss format (no tags,
        # "arguments" where the template expects "parameters") matches no opener and lands in the content.
        if not raw_calls and CALL_HINT.search(strip_markers(content, END_MARKERS)):
            errors.append(
                "Your reply looks like a tool call, but it is not in the expected format, so no tool was called. "
                f"Write each call as {self.format}"
            )
        reasoning = reasoning if isinstance(reasoning, str) and reasoning else None
        return ParsedResponse(join_content([content], self.markers), calls, errors, reasoning)


def _first_lines(error: Exception, limit: int = 300) -> str:
    message = " ".join(str(error).split())
    return message if len(message) <= limit else message[:limit] + "..."


def _example_call(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """Render one example call with the tokenizer's own chat template, so errors show the exact expected format."""
    call = {"type": "function", "function": {"name": "tool_name", "arguments": {"argument": "value"}}}
    user = {"role": "user", "content": "x"}
    try:
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
        full = tokenizer.apply_chat_template([user, assistant], tokenize=False)
    except Exception:  # templates without tool support simply get no example
        return None
    if not isinstance(full, str) or not isinstance(prompt, str) or not full.startswith(prompt):
        return None
    example = re.sub(r"^\s*<think>\s*</think>\s*", "", full[len(prompt) :])
    return strip_markers(example, END_MARKERS).strip() or None
