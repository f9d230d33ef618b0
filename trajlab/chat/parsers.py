"""Tool-call parsers: turn one decoded assistant turn into content, reasoning, tool calls and errors.

The same parser is used in every stage (collection, SFT data checks, RL, evaluation), so a malformed call is never
an exception: it becomes an entry in `ParsedResponse.errors`, written for the model so that it can be sent back as
the observation. A call that is silently dropped would teach the model nothing, so text that starts a tool call but
yields none is reported too.

Parsers are looked up by name with `get_parser`; `register_parser` adds new ones.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")
"""End-of-turn tokens that may close a completion decoded with special tokens kept; never part of `content`."""

PYTHON_TAG = "<|python_tag|>"
HERMES_FORMAT = '<tool_call>\n{"name": "<tool name>", "arguments": {"<argument>": <value>, ...}}\n</tool_call>'
LLAMA3_FORMAT = '{"name": "<tool name>", "parameters": {"<argument>": <value>, ...}}'

_JSON = json.JSONDecoder()
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
# What a tool call looks like when no parser-specific opener matched: used to refuse silent loss of a call.
_CALL_HINT = re.compile(r"<tool_call>|^\s*(?:<\|python_tag\|>)?\s*\{\s*\"name\"\s*:")
_LLAMA3_CALL_START = re.compile(r"\{\s*\"name\"\s*:")
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call: the tool's name and its decoded keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedResponse:
    """One assistant turn, split into what the model said, what it thought and what it called.

    Attributes:
        content: Assistant text outside tool calls, without end-of-turn markers.
        tool_calls: Well-formed calls, in the order the model wrote them.
        errors: One message per malformed call, addressed to the model: what was wrong and the expected format.
        reasoning: The `<think>` content when present.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning: str | None = None


class ToolCallParser(Protocol):
    """Anything that splits a completion into a `ParsedResponse`; `parse` must never raise."""

    name: str

    def parse(self, text: str, prefix: str = "") -> ParsedResponse: ...


# --------------------------------------------------------------------------------------------------- shared helpers


def _json_type(value: Any) -> str:
    """Name a decoded value by its JSON type, the vocabulary the model writes in."""
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((dict, "object"), (list, "array"), (str, "string"), ((int, float), "number")):
        if isinstance(value, kind):
            return name
    return "null"


def _snippet(text: str, limit: int = 200) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _strip_markers(text: str, markers: tuple[str, ...]) -> str:
    for marker in markers:
        text = text.replace(marker, "")
    return text


def _join(parts: list[str], markers: tuple[str, ...]) -> str:
    """Join the text pieces found between calls into one content string."""
    pieces = (_strip_markers(part, markers).strip() for part in parts)
    return "\n".join(piece for piece in pieces if piece)


def _markers_for(tokenizer: PreTrainedTokenizerBase | None) -> tuple[str, ...]:
    eos = getattr(tokenizer, "eos_token", None)
    return (*END_MARKERS, eos) if isinstance(eos, str) and eos and eos not in END_MARKERS else END_MARKERS


def _to_call(obj: Any, index: int, fmt: str, keys: tuple[str, ...] = ("arguments",)) -> ToolCall | str:
    """Validate one decoded call; return the `ToolCall`, or an error message for the model.

    Arguments written as a JSON-encoded string of an object are accepted (OpenAI's wire format does this), and a
    call without arguments means a call with none, so tools without parameters stay easy to call.
    """
    where = f"Tool call {index}"
    if not isinstance(obj, dict):
        return f"{where} must be a JSON object, but it is a JSON {_json_type(obj)}. Write each call as {fmt}"
    name = obj.get("name")
    if "name" not in obj:
        return f'{where} has no "name" field ({_snippet(json.dumps(obj))}). Write each call as {fmt}'
    if not isinstance(name, str) or not name.strip():
        got = "an empty string" if isinstance(name, str) else f"a JSON {_json_type(name)}"
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
            f"got a JSON {_json_type(arguments)}. Write each call as {fmt}"
        )
    return ToolCall(name=name, arguments=arguments)


def _split_reasoning(text: str, prefix: str) -> tuple[str | None, str, str | None]:
    """Split a leading `<think>` block off `text`; return (reasoning, rest, error).

    The block may have been opened by the prompt itself (templates that prefill `<think>`), hence `prefix`.
    """
    stripped = text.lstrip()
    opened_in_prefix = prefix.rfind(_THINK_OPEN) > prefix.rfind(_THINK_CLOSE)
    if stripped.startswith(_THINK_OPEN):
        body = stripped[len(_THINK_OPEN) :]
    elif opened_in_prefix:
        body = text
    else:
        return None, text, None
    reasoning, closed, rest = body.partition(_THINK_CLOSE)
    if closed:
        return reasoning.strip(), rest, None
    error = None
    if _CALL_OPEN in body:
        error = f"A tool call was written inside an unclosed {_THINK_OPEN} block; close it with {_THINK_CLOSE} first."
    return body.strip(), "", error


# ----------------------------------------------------------------------------------------------------------- hermes


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks: Hermes, Qwen2.5 and Qwen3 models."""

    name = "hermes"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.markers = _markers_for(tokenizer)

    def parse(self, text: str, prefix: str = "") -> ParsedResponse:
        reasoning, rest, think_error = _split_reasoning(text, prefix)
        parts: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = [think_error] if think_error else []
        pos = index = 0
        while (start := rest.find(_CALL_OPEN, pos)) != -1:
            parts.append(self._content(rest[pos:start], errors))
            index += 1
            body_start = start + len(_CALL_OPEN)
            result, pos = self._call(rest, body_start, index)
            (calls if isinstance(result, ToolCall) else errors).append(result)
        parts.append(self._content(rest[pos:], errors))
        if not index and not errors and _LLAMA3_CALL_START.match(rest.lstrip()):
            errors.append(
                f"Your reply looks like a tool call without {_CALL_OPEN} tags. Write each call as {HERMES_FORMAT}"
            )
        return ParsedResponse(_join(parts, self.markers), calls, errors, reasoning)

    @staticmethod
    def _content(piece: str, errors: list[str]) -> str:
        if _CALL_CLOSE in piece:  # a call whose opener is missing would otherwise vanish into the content
            errors.append(
                f"Found {_CALL_CLOSE} without a matching {_CALL_OPEN} before it: {_snippet(piece)}. "
                f"Write each call as {HERMES_FORMAT}"
            )
        return piece

    @staticmethod
    def _call(text: str, start: int, index: int) -> tuple[ToolCall | str, int]:
        """Parse the call whose body starts at `start`; return (call or error, position after the block)."""
        # Decoding the JSON first lets string arguments contain "</tool_call>" without cutting the call short.
        body_start = _SPACE.match(text, start).end()
        try:
            obj, end = _JSON.raw_decode(text, body_start)
        except (ValueError, RecursionError):
            end = -1
        if end != -1:
            tail = _SPACE.match(text, end).end()
            if text.startswith(_CALL_CLOSE, tail):
                return _to_call(obj, index, HERMES_FORMAT), tail + len(_CALL_CLOSE)
        # Otherwise the body runs to the next closing tag, or to the next call if this one was never closed.
        reopen = text.find(_CALL_OPEN, start)
        close = text.find(_CALL_CLOSE, start, len(text) if reopen == -1 else reopen)
        if close == -1:
            stop = len(text) if reopen == -1 else reopen
            error = (
                f"Tool call {index} was opened with {_CALL_OPEN} but never closed with {_CALL_CLOSE}: "
                f"{_snippet(text[start:stop])}. Write each call as {HERMES_FORMAT}"
            )
            return error, stop
        body = text[start:close]
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            error = f"Tool call {index} is not valid JSON ({e}): {_snippet(body)}. Write each call as {HERMES_FORMAT}"
            return error, close + len(_CALL_CLOSE)
        return _to_call(obj, index, HERMES_FORMAT), close + len(_CALL_CLOSE)


# ----------------------------------------------------------------------------------------------------------- llama3


class Llama3Parser:
    """Llama 3.1/3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.

    Several calls may follow one another, separated by `;` or newlines. A completion that does not start with a
    call (or a `<|python_tag|>`) is plain prose, so a model may still answer in words, or in JSON without a name.
    """

    name = "llama3"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.markers = (*_markers_for(tokenizer), PYTHON_TAG)

    def parse(self, text: str, prefix: str = "") -> ParsedResponse:
        head, tag, body = text.partition(PYTHON_TAG)
        if not tag:
            head, body = "", text
        parts, calls, errors = [head], [], []
        pos, index = 0, 0
        while True:
            pos = self._skip_separators(body, pos)
            if pos >= len(body):
                break
            looks_like_call = bool(tag) or _LLAMA3_CALL_START.match(body, pos) is not None
            try:
                obj, end = _JSON.raw_decode(body, pos)
            except (ValueError, RecursionError) as e:
                if looks_like_call:
                    index += 1
                    where = f" at character {e.pos - pos}" if isinstance(e, json.JSONDecodeError) else ""
                    errors.append(
                        f"Tool call {index} is not valid JSON ({getattr(e, 'msg', e)}{where}): "
                        f"{_snippet(_strip_markers(body[pos:], self.markers))}. Write each call as {LLAMA3_FORMAT}"
                    )
                    pos = len(body)
                break
            if not (tag or (isinstance(obj, dict) and "name" in obj)):
                break  # JSON that is not a call, e.g. a structured final answer: leave it as content
            index += 1
            result = _to_call(obj, index, LLAMA3_FORMAT, keys=("parameters", "arguments"))
            (calls if isinstance(result, ToolCall) else errors).append(result)
            pos = end
        parts.append(body[pos:])
        return ParsedResponse(_join(parts, self.markers), calls, errors)

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


# ------------------------------------------------------------------------------------------------ response_template


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
        self.markers = (*_markers_for(tokenizer), PYTHON_TAG)
        self.format = _example_call(tokenizer) or "the tool-call format shown in the system prompt"

    def parse(self, text: str, prefix: str = "") -> ParsedResponse:
        try:
            message = self._parse_response(text, prefix)
        except Exception as e:  # any failure of a third-party parser must reach the model as text
            error = f"Your tool call could not be parsed ({_first_lines(e)}). Write each call as {self.format}"
            return ParsedResponse(_join([text], self.markers), [], [error])
        try:
            return self._convert(message)
        except Exception as e:  # an unexpected message shape is still only an error
            return ParsedResponse(_join([text], self.markers), [], [f"Your reply could not be parsed ({e})."])

    def _parse_response(self, text: str, prefix: str) -> dict:
        try:
            return self.tokenizer.parse_response(text, prefix=prefix)
        except Exception:
            # Some templates close a call with the end-of-turn token (Llama 3's `}<|eot_id|>`): retry with it, in case
            # the generator stripped the stop token.
            eos = getattr(self.tokenizer, "eos_token", None)
            if not isinstance(eos, str) or not eos or text.rstrip().endswith(eos):
                raise
            return self.tokenizer.parse_response(text + eos, prefix=prefix)

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
            result = _to_call(function, index, self.format)
            (calls if isinstance(result, ToolCall) else errors).append(result)
        # The template's own opener always yields a call or an exception; a call in a near-miss format (no tags,
        # "arguments" where the template expects "parameters") matches no opener and lands in the content.
        if not raw_calls and _CALL_HINT.search(_strip_markers(content, END_MARKERS)):
            errors.append(
                "Your reply looks like a tool call, but it is not in the expected format, so no tool was called. "
                f"Write each call as {self.format}"
            )
        reasoning = reasoning if isinstance(reasoning, str) and reasoning else None
        return ParsedResponse(_join([content], self.markers), calls, errors, reasoning)


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
    return _strip_markers(example, END_MARKERS).strip() or None


# --------------------------------------------------------------------------------------------------------- registry

ParserFactory = Callable[["PreTrainedTokenizerBase | None"], ToolCallParser]


def _auto(tokenizer: PreTrainedTokenizerBase | None) -> ToolCallParser:
    if getattr(tokenizer, "response_template", None) is not None:
        return ResponseTemplateParser(tokenizer)
    return HermesParser(tokenizer)


_PARSERS: dict[str, ParserFactory] = {
    "auto": _auto,
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "response_template": ResponseTemplateParser,
}


def register_parser(name: str, factory: ParserFactory) -> None:
    """Register a parser factory under `name`, replacing any parser of that name.

    Args:
        name: The name configs and `get_parser` use.
        factory: Called with the tokenizer (or None) each time the parser is requested.
    """
    _PARSERS[name] = factory


def get_parser(name: str, tokenizer: PreTrainedTokenizerBase | None = None) -> ToolCallParser:
    """Build the parser registered as `name`.

    Args:
        name: "hermes", "llama3", "response_template", "auto" (response_template when the tokenizer has a
            `response_template`, else hermes), or any name added with `register_parser`.
        tokenizer: The policy's tokenizer; needed by "response_template", used by the others for its eos token.

    Raises:
        ValueError: For an unknown name, listing the registered names and the closest one.
    """
    if name not in _PARSERS:
        names = sorted(_PARSERS)
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown tool-call parser {name!r}. Registered parsers: {', '.join(names)}.{hint}")
    return _PARSERS[name](tokenizer)
