"""What every tool-call parser returns (`ParsedResponse`), the protocol it follows, and helpers they share."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")
"""End-of-turn tokens that may close a completion decoded with special tokens kept; never part of `content`."""

PYTHON_TAG = "<|python_tag|>"
HERMES_FORMAT = '<tool_call>\n{"name": "<tool name>", "arguments": {"<argument>": <value>, ...}}\n</tool_call>'
LLAMA3_FORMAT = '{"name": "<tool name>", "parameters": {"<argument>": <value>, ...}}'

JSON_DECODER = json.JSONDecoder()
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# What a tool call looks like when no parser-specific opener matched: used to refuse silent loss of a call.
CALL_HINT = re.compile(r"<tool_call>|^\s*(?:<\|python_tag\|>)?\s*\{\s*\"name\"\s*:")
LLAMA3_CALL_START = re.compile(r"\{\s*\"name\"\s*:")
SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call: the tool's name, its decoded keyword arguments, and the call id the model wrote.

    Most formats leave ids to the engine (`id` None); Mistral's model writes them itself, and the rendered
    conversation must hold the very id it wrote.
    """

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass
class ParsedResponse:
    """One assistant turn, split into what the model said, what it thought and what it called.

    Attributes:
        content: Assistant text outside tool calls, without end-of-turn markers.
        tool_calls: Well-formed calls, in the order the model wrote them.
        errors: One message per malformed call, addressed to the model: what was wrong and the expected format.
        reasoning: The `<think>` content (harmony: the analysis channel) when present.
        reasoning_field: The assistant message key the chat template reads reasoning from: `reasoning_content`
            for most, `thinking` for gpt-oss.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning: str | None = None
    reasoning_field: str = "reasoning_content"


class ToolCallParser(Protocol):
    """Anything that splits a completion into a `ParsedResponse`; `parse` must never raise.

    `prefix` is the end of the rendered prompt; `tools` are the schemas the model was shown, for formats that write
    arguments as text and need the schema to type them (Qwen3-Coder and Qwen3.5 XML calls).
    """

    name: str

    def parse(self, text: str, prefix: str = "", tools: Sequence[dict[str, Any]] | None = None) -> ParsedResponse: ...


# --------------------------------------------------------------------------------------------------- shared helpers


def json_type(value: Any) -> str:
    """Name a decoded value by its JSON type, the vocabulary the model writes in."""
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((dict, "object"), (list, "array"), (str, "string"), ((int, float), "number")):
        if isinstance(value, kind):
            return name
    return "null"


def snippet(text: str, limit: int = 200) -> str:
    """A short quote of what the model wrote, for an error message it can act on."""
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def strip_markers(text: str, markers: tuple[str, ...]) -> str:
    """`text` without end-of-turn markers, which are never content."""
    for marker in markers:
        text = text.replace(marker, "")
    return text


def join_content(parts: list[str], markers: tuple[str, ...]) -> str:
    """Join the text pieces found between calls into one content string."""
    pieces = (strip_markers(part, markers).strip() for part in parts)
    return "\n".join(piece for piece in pieces if piece)


def markers_for(tokenizer: PreTrainedTokenizerBase | None) -> tuple[str, ...]:
    """The known end-of-turn markers plus this tokenizer's own eos token."""
    eos = getattr(tokenizer, "eos_token", None)
    return (*END_MARKERS, eos) if isinstance(eos, str) and eos and eos not in END_MARKERS else END_MARKERS


def to_call(obj: Any, index: int, fmt: str, keys: tuple[str, ...] = ("arguments",)) -> ToolCall | str:
    """Validate one decoded call; return the `ToolCall`, or an error message for the model.

    Arguments written as a JSON-encoded string of an object are accepted (OpenAI's wire format does this), and a
    call without arguments means a call with none, so tools without parameters stay easy to call.
    """
    where = f"Tool call {index}"
    if not isinstance(obj, dict):
        return f"{where} must be a JSON object, but it is a JSON {json_type(obj)}. Write each call as {fmt}"
    name = obj.get("name")
    if "name" not in obj:
        return f'{where} has no "name" field ({snippet(json.dumps(obj))}). Write each call as {fmt}'
    if not isinstance(name, str) or not name.strip():
        got = "an empty string" if isinstance(name, str) else f"a JSON {json_type(name)}"
        return f'{where}: "name" must be the tool name as a non-empty string, got {got}. Write each call as {fmt}'
    key = next((k for k in keys if k in obj), None)
    arguments = obj[key] if key else {}
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else arguments
    if not isinstance(arguments, dict):
        return (
            f'{where} ({name}): "{key}" must be a JSON object mapping argument names to values, '
            f"got a JSON {json_type(arguments)}. Write each call as {fmt}"
        )
    return ToolCall(name=name, arguments=arguments)


def split_reasoning(text: str, prefix: str) -> tuple[str | None, str, str | None]:
    """Split a leading `<think>` block off `text`; return (reasoning, rest, error).

    The block may have been opened by the prompt itself (templates that prefill `<think>`), hence `prefix`.
    """
    stripped = text.lstrip()
    opened_in_prefix = prefix.rfind(THINK_OPEN) > prefix.rfind(THINK_CLOSE)
    if stripped.startswith(THINK_OPEN):
        body = stripped[len(THINK_OPEN) :]
    elif opened_in_prefix:
        body = text
    else:
        return None, text, None
    reasoning, closed, rest = body.partition(THINK_CLOSE)
    if closed:
        return reasoning.strip(), rest, None
    error = None
    if CALL_OPEN in body:
        error = f"A tool call was written inside an unclosed {THINK_OPEN} block; close it with {THINK_CLOSE} first."
    return body.strip(), "", error


# ------------------------------------------------------------------------------------------- `<tool_call>` blocks

BlockReader = Callable[[str, int, int], tuple["ToolCall | str", int]]
"""Parses the block whose body starts at a position of a text, given the call's 1-based index: the call or an error
for the model, and the position after the block."""


def scan_call_blocks(text: str, call_format: str, read: BlockReader) -> tuple[list[str], list[ToolCall], list[str]]:
    """Every `<tool_call>` block of ``text``, each body parsed by ``read``: the content between blocks, the calls,
    and one error per malformed block or stray closing tag (each ending with ``call_format``), in order."""
    parts: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = index = 0
    while (start := text.find(CALL_OPEN, pos)) != -1:
        parts.append(_outside_blocks(text[pos:start], errors, call_format))
        index += 1
        result, pos = read(text, start + len(CALL_OPEN), index)
        (calls if isinstance(result, ToolCall) else errors).append(result)
    parts.append(_outside_blocks(text[pos:], errors, call_format))
    return parts, calls, errors


def _outside_blocks(piece: str, errors: list[str], call_format: str) -> str:
    if CALL_CLOSE in piece:  # a call whose opener is missing would otherwise vanish into the content
        errors.append(f"Found {CALL_CLOSE} without a matching {CALL_OPEN} before it: {snippet(piece)}. "
                      f"Write each call as {call_format}")
    return piece


def closed_block(text: str, start: int, index: int, call_format: str) -> tuple[str | None, str | None, int]:
    """The body of the block whose body starts at ``start``, up to its closing tag: ``(body, None, position after
    the tag)``; or, never closed before the next block or the end, ``(None, error, where the next block starts)``."""
    reopen = text.find(CALL_OPEN, start)
    close = text.find(CALL_CLOSE, start, len(text) if reopen == -1 else reopen)
    if close == -1:
        stop = len(text) if reopen == -1 else reopen
        return None, (f"Tool call {index} was opened with {CALL_OPEN} but never closed with {CALL_CLOSE}: "
                      f"{snippet(text[start:stop])}. Write each call as {call_format}"), stop
    return text[start:close], None, close + len(CALL_CLOSE)
