"""gpt-oss's harmony format: one turn is a run of messages, each on a channel, and ends at a call or the answer.

After the prompt's `<|start|>assistant`, the model writes messages such as
`<|channel|>analysis<|message|>REASONING<|end|>`, then `<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>{ARGUMENTS}<|call|>` (the recipient may also follow the channel: `<|channel|>commentary
to=functions.NAME <|constrain|>json`), or `<|start|>assistant<|channel|>final<|message|>ANSWER<|return|>`. The turn
ends at `<|call|>` or `<|return|>` (`trajlab.chat.template.HARMONY_TURN_ENDS`), so it holds at most one call.
Reasoning goes to the `thinking` field, which gpt-oss's template reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trajlab.chat.parsers.base import ParsedResponse, ToolCall, join_content, json_type, snippet

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
HARMONY_FORMAT = ("<|start|>assistant to=functions.TOOL_NAME<|channel|>commentary json<|message|>"
                  '{"ARGUMENT": VALUE, ...}<|call|>')
CHANNELS = ("analysis", "commentary", "final")
_HEADER = re.compile(r"\s*(?:assistant)?\s*(?:to=(?P<before>[^\s<]+))?\s*<\|channel\|>(?P<channel>[^\s<]+)"
                     r"(?:\s*to=(?P<after>[^\s<]+))?\s*(?:<\|constrain\|>)?\s*(?P<type>[^\s<]*)\s*$")
_ENDS = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_FUNCTIONS = "functions."


@dataclass
class _Message:
    channel: str
    recipient: str | None
    body: str
    end: str


class HarmonyParser:
    """Harmony turns (gpt-oss): analysis as reasoning, `functions.NAME` commentary as the call, final as content."""

    name = "harmony"

    def __init__(self, tokenizer: Any = None):
        del tokenizer  # the format's own tokens mark everything; the tokenizer adds nothing

    def parse(self, text: str, prefix: str = "", tools: Sequence[dict[str, Any]] | None = None) -> ParsedResponse:
        messages, error = _split(text)
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        errors = [error] if error else []
        for message in messages:
            if message.recipient is not None:
                result = _call(message, len(calls) + 1)
                (calls if isinstance(result, ToolCall) else errors).append(result)
            elif message.channel == "analysis":
                reasoning.append(message.body)
            else:
                content.append(message.body)
            if message.end == CALL and message is not messages[-1]:
                errors.append(f"A turn ends at its call's {CALL}: write one call per turn, and wait for its result.")
                break
        thinking = "\n".join(reasoning) if reasoning else None
        return ParsedResponse(join_content(content, ()), calls, errors, thinking, reasoning_field="thinking")


def _split(text: str) -> tuple[list[_Message], str | None]:
    """The turn's messages, in order, and an error for the model where the text leaves the format."""
    messages: list[_Message] = []
    pos = 0
    while pos < len(text) and text[pos:].strip():
        if messages:
            if not text.startswith(START, pos):
                return messages, (f"Text after the end of a message must start a new one with {START}: "
                                  f"{snippet(text[pos:])}. Write each call as {HARMONY_FORMAT}")
            pos += len(START)
        body_start = text.find(MESSAGE, pos)
        header = _HEADER.match(text, pos, body_start) if body_start != -1 else None
        if header is None:
            return messages, (f"Every message needs a header with its channel, such as "
                              f"{CHANNEL}final{MESSAGE}ANSWER{RETURN}; got {snippet(text[pos:])}. "
                              f"Write each call as {HARMONY_FORMAT}")
        body_start += len(MESSAGE)
        ended = _ENDS.search(text, body_start)
        body_end, end = (ended.start(), ended.group()) if ended else (len(text), "")  # the stop token was stripped
        channel = header.group("channel")
        if channel not in CHANNELS:
            return messages, (f"{channel!r} is not a channel; the valid channels are {', '.join(CHANNELS)}. "
                              f"Write each call as {HARMONY_FORMAT}")
        recipient = header.group("before") or header.group("after")
        messages.append(_Message(channel, recipient, text[body_start:body_end], end))
        pos = ended.end() if ended else len(text)
    return messages, None


def _call(message: _Message, index: int) -> ToolCall | str:
    """A message to a recipient: the call it makes, or an error for the model."""
    where = f"Tool call {index}"
    if not message.recipient.startswith(_FUNCTIONS) or len(message.recipient) == len(_FUNCTIONS):
        return (f"{where} is addressed to {message.recipient!r}; address your tools as functions.TOOL_NAME. "
                f"Write each call as {HARMONY_FORMAT}")
    name = message.recipient[len(_FUNCTIONS):]
    where = f"{where} ({name})"
    if message.end not in (CALL, ""):
        return f"{where} must end with {CALL}, not {message.end}. Write each call as {HARMONY_FORMAT}"
    try:
        arguments = json.loads(message.body) if message.body.strip() else {}
    except (ValueError, RecursionError) as e:
        return (f"{where}: the arguments are not valid JSON ({e}): {snippet(message.body)}. "
                f"Write each call as {HARMONY_FORMAT}")
    if not isinstance(arguments, dict):
        return (f"{where}: the arguments must be a JSON object mapping argument names to values, got a JSON "
                f"{json_type(arguments)}. Write each call as {HARMONY_FORMAT}")
    return ToolCall(name, arguments)
