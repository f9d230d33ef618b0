"""JSON tool calls: Hermes-style `<tool_call>` blocks (Hermes, Qwen2.5, Qwen3) and Llama 3.1/3.2 bare calls."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trajlab.chat.parsers.base import (
    CALL_CLOSE,
    CALL_OPEN,
    HERMES_FORMAT,
    JSON_DECODER,
    LLAMA3_CALL_START,
    LLAMA3_FORMAT,
    PYTHON_TAG,
    SPACE,
    ParsedResponse,
    ToolCall,
    closed_block,
    join_content,
    markers_for,
    scan_call_blocks,
    snippet,
    split_reasoning,
    strip_markers,
    to_call,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks: Hermes, Qwen2.5 and Qwen3 models."""

    name = "hermes"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.markers = markers_for(tokenizer)

    def parse(self, text: str, prefix: str = "", tools: Sequence[dict[str, Any]] | None = None) -> ParsedResponse:
        reasoning, rest, think_error = split_reasoning(text, prefix)
        parts, calls, errors = scan_call_blocks(rest, HERMES_FORMAT, self._call)
        errors = [think_error, *errors] if think_error else errors
        if not calls and not errors and LLAMA3_CALL_START.match(rest.lstrip()):
            errors.append(
                f"Your reply looks like a tool call without {CALL_OPEN} tags. Write each call as {HERMES_FORMAT}"
            )
        return ParsedResponse(join_content(parts, self.markers), calls, errors, reasoning)

    @staticmethod
    def _call(text: str, start: int, index: int) -> tuple[ToolCall | str, int]:
        """Parse the call whose body starts at `start`; return (call or error, position after the block)."""
        # Decoding the JSON first lets string arguments contain "</tool_call>" without cutting the call short.
        body_start = SPACE.match(text, start).end()
        try:
            obj, end = JSON_DECODER.raw_decode(text, body_start)
        except (ValueError, RecursionError):
            end = -1
        if end != -1:
            tail = SPACE.match(text, end).end()
            if text.startswith(CALL_CLOSE, tail):
                return to_call(obj, index, HERMES_FORMAT), tail + len(CALL_CLOSE)
        # Otherwise the body runs to the next closing tag, or to the next call if this one was never closed.
        body, error, after = closed_block(text, start, index, HERMES_FORMAT)
        if body is None:
            return error, after
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            return (f"Tool call {index} is not valid JSON ({e}): {snippet(body)}. Write each call as "
                    f"{HERMES_FORMAT}"), after
        return to_call(obj, index, HERMES_FORMAT), after


# ----------------------------------------------------------------------------------------------------------- llama3


class Llama3Parser:
    """Llama 3.1/3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.

    Several calls may follow one another, separated by `;` or newlines. A completion that does not start with a
    call (or a `<|python_tag|>`) is plain prose, so a model may still answer in words, or in JSON without a name.
    """

    name = "llama3"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.markers = (*markers_for(tokenizer), PYTHON_TAG)

    def parse(self, text: str, prefix: str = "", tools: Sequence[dict[str, Any]] | None = None) -> ParsedResponse:
        head, tag, body = text.partition(PYTHON_TAG)
        if not tag:
            head, body = "", text
        parts, calls, errors = [head], [], []
        pos, index = 0, 0
        while True:
            pos = self._skip_separators(body, pos)
            if pos >= len(body):
                break
            looks_like_call = bool(tag) or LLAMA3_CALL_START.match(body, pos) is not None
            try:
                obj, end = JSON_DECODER.raw_decode(body, pos)
            except (ValueError, RecursionError) as e:
                if looks_like_call:
                    index += 1
                    where = f" at character {e.pos - pos}" if isinstance(e, json.JSONDecodeError) else ""
                    errors.append(
                        f"Tool call {index} is not valid JSON ({getattr(e, 'msg', e)}{where}): "
                        f"{snippet(strip_markers(body[pos:], self.markers))}. Write each call as {LLAMA3_FORMAT}"
                    )
                    pos = len(body)
                break
            if not (tag or (isinstance(obj, dict) and "name" in obj)):
                break  # JSON that is not a call, e.g. a structured final answer: leave it as content
            index += 1
            result = to_call(obj, index, LLAMA3_FORMAT, keys=("parameters", "arguments"))
            (calls if isinstance(result, ToolCall) else errors).append(result)
            pos = end
        parts.append(body[pos:])
        return ParsedResponse(join_content(parts, self.markers), calls, errors)

    def _skip_separators(self, text: str, pos: int) -> int:
        while pos < len(text):
            marker = next((m for m in self.markers if text.startswith(m, pos)), None)
            if marker:
                pos += len(marker)
            elif text[pos].isspace() or text[pos] == ";":
                pos += 1
            else:
                break
        return pos
