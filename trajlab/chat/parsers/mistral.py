"""Mistral's tool calls: `[TOOL_CALLS]` and a JSON list of calls, each with the 9-character id the model writes.

Mistral's chat templates render an assistant turn with calls as
`[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}, ...]</s>` and refuse any id that is not nine
letters or digits. The model learns to write the ids itself, so an id it wrote is kept (`ToolCall.id`) and the
conversation renders exactly what it wrote; a call without one gets the engine's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trajlab.chat.parsers.base import (
    JSON_DECODER,
    LLAMA3_CALL_START,
    SPACE,
    ParsedResponse,
    ToolCall,
    join_content,
    json_type,
    markers_for,
    snippet,
    strip_markers,
    to_call,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_FORMAT = ('[TOOL_CALLS][{"name": "<tool name>", "arguments": {"<argument>": <value>, ...}, '
                  '"id": "<9 letters or digits>"}]')
CALL_ID = re.compile(r"[A-Za-z0-9]{9}")
_BARE_CALLS = re.compile(r"\[\s*\{\s*\"name\"\s*:")


class MistralParser:
    """`[TOOL_CALLS][...]` JSON lists (Mistral-Nemo, Mistral 7B v0.3, Mistral Small): content, calls and their ids."""

    name = "mistral"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.markers = tuple(dict.fromkeys((*markers_for(tokenizer), "</s>")))  # Mistral's eos, known or not

    def parse(self, text: str, prefix: str = "", tools: Sequence[dict[str, Any]] | None = None) -> ParsedResponse:
        parts: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        while (start := text.find(TOOL_CALLS, pos)) != -1:
            parts.append(text[pos:start])
            pos = self._calls(text, start + len(TOOL_CALLS), len(calls) + len(errors), calls, errors)
        parts.append(text[pos:])
        if not calls and not errors:
            bare = strip_markers(text, self.markers).lstrip()
            if _BARE_CALLS.match(bare) or LLAMA3_CALL_START.match(bare):
                errors.append(f"Your reply looks like a tool call without the {TOOL_CALLS} token before it. "
                              f"Write your calls as {MISTRAL_FORMAT}")
        ids = [call.id for call in calls if call.id is not None]
        if len(set(ids)) < len(ids):
            errors.append(f"Two tool calls of this turn have the same id; give each call its own. Write your calls "
                          f"as {MISTRAL_FORMAT}")
        return ParsedResponse(join_content(parts, self.markers), calls, errors)

    def _calls(self, text: str, start: int, before: int, calls: list[ToolCall], errors: list[str]) -> int:
        """Read the JSON list after one `[TOOL_CALLS]`; return the position after it."""
        body_start = SPACE.match(text, start).end()
        try:
            listed, end = JSON_DECODER.raw_decode(text, body_start)
        except (ValueError, RecursionError) as e:
            where = f" at character {e.pos - body_start}" if isinstance(e, json.JSONDecodeError) else ""
            body = strip_markers(text[body_start:], self.markers)
            errors.append(f"The tool calls after {TOOL_CALLS} are not valid JSON ({getattr(e, 'msg', e)}{where}): "
                          f"{snippet(body)}. Write your calls as {MISTRAL_FORMAT}")
            next_block = text.find(TOOL_CALLS, start)
            return len(text) if next_block == -1 else next_block
        if not isinstance(listed, list):
            errors.append(f"{TOOL_CALLS} must be followed by a JSON list of calls, but it is a JSON "
                          f"{json_type(listed)}. Write your calls as {MISTRAL_FORMAT}")
            return end
        for index, item in enumerate(listed, start=before + 1):
            result = _call(item, index)
            (calls if isinstance(result, ToolCall) else errors).append(result)
        return end


def _call(item: Any, index: int) -> ToolCall | str:
    """One listed call with its id checked against Mistral's rule, or an error for the model."""
    result = to_call(item, index, MISTRAL_FORMAT)
    if isinstance(result, str) or "id" not in item:
        return result
    call_id = item["id"]
    if not isinstance(call_id, str) or not CALL_ID.fullmatch(call_id):
        return (f'Tool call {index} ({result.name}): "id" must be 9 letters or digits, got {json.dumps(call_id)}. '
                f"Write your calls as {MISTRAL_FORMAT}")
    return ToolCall(result.name, result.arguments, call_id)
