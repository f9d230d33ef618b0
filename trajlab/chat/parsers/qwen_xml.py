"""Qwen3-Coder and Qwen3.5 XML tool calls, with each argument typed by the tool's schema.

Their templates render a call as
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, a value as raw
text (`"75001"` and `75001` both as `75001`; objects and lists as JSON; Python's `True` for true). Only the schema the
model was shown tells them apart, so `parse` types each value by it and refuses a value of the wrong type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trajlab.chat.parsers.base import (
    CALL_CLOSE,
    CALL_OPEN,
    ParsedResponse,
    ToolCall,
    closed_block,
    join_content,
    markers_for,
    scan_call_blocks,
    snippet,
    split_reasoning,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

XML_FORMAT = ("<tool_call>\n<function=TOOL_NAME>\n<parameter=ARGUMENT_NAME>\nvalue\n</parameter>\n</function>\n"
              "</tool_call>")
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_FUNCTION_CLOSE = re.compile(r"\s*</function>\s*$")
_PARAMETER_CLOSE = "</parameter>"
_CALL_START = re.compile(r"<function=[^>\n]+>")


class QwenXmlParser:
    """`<tool_call>` blocks of `<function=...>` and `<parameter=...>` tags: Qwen3-Coder, Qwen3.5."""

    name = "qwen3_xml"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.markers = markers_for(tokenizer)

    def parse(self, text: str, prefix: str = "", tools: Sequence[dict[str, Any]] | None = None) -> ParsedResponse:
        reasoning, rest, think_error = split_reasoning(text, prefix)
        schemas = _parameter_schemas(tools)

        def read(text: str, start: int, index: int) -> tuple[ToolCall | str, int]:
            body, error, after = closed_block(text, start, index, XML_FORMAT)
            return (error if body is None else _call(body, index, schemas)), after

        parts, calls, errors = scan_call_blocks(rest, XML_FORMAT, read)
        errors = [think_error, *errors] if think_error else errors
        if not calls and not errors and _CALL_START.search(rest):
            errors.append(f"Your reply looks like a tool call without {CALL_OPEN} tags. Write each call as "
                          f"{XML_FORMAT}")
        return ParsedResponse(join_content(parts, self.markers), calls, errors, reasoning)


def _parameter_schemas(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schemas by name, from OpenAI-style tool schemas."""
    schemas = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(function.get("name"), str):
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def _call(body: str, index: int, schemas: dict[str, dict[str, Any]]) -> ToolCall | str:
    """One call's body (between the `<tool_call>` tags): the typed call, or an error for the model."""
    where = f"Tool call {index}"
    opened = _FUNCTION.match(body)
    if opened is None:
        return f"{where} does not start with <function=TOOL_NAME>: {snippet(body)}. Write each call as {XML_FORMAT}"
    name = opened.group(1).strip()
    where = f"{where} ({name})"
    closed = _FUNCTION_CLOSE.search(body, opened.end())
    if closed is None:
        return f"{where} is not closed with </function> before {CALL_CLOSE}. Write each call as {XML_FORMAT}"
    arguments: dict[str, Any] = {}
    pos, end = opened.end(), closed.start()
    while pos < end:
        tag = _PARAMETER.match(body, pos, end)
        if tag is None:
            if body[pos:end].strip():
                return (f"{where} holds text outside <parameter=...> tags: {snippet(body[pos:end])}. "
                        f"Write each call as {XML_FORMAT}")
            break
        key = tag.group(1).strip()
        value_end = body.find(_PARAMETER_CLOSE, tag.end(), end)
        if value_end == -1:
            return (f"{where}: <parameter={key}> is never closed with {_PARAMETER_CLOSE}. "
                    f"Write each call as {XML_FORMAT}")
        if key in arguments:
            return f"{where} gives the parameter {key!r} twice; give each parameter once."
        value = _strip_one_newline(body[tag.end():value_end])
        typed = _typed(value, schemas.get(name, {}).get(key))
        if isinstance(typed, _Invalid):
            return f"{where}: the value of {key!r} must be {typed.expected}, got {snippet(value)}."
        arguments[key] = typed
        pos = value_end + len(_PARAMETER_CLOSE)
    return ToolCall(name, arguments)


def _strip_one_newline(value: str) -> str:
    """The value as the template wrote it: it puts exactly one newline on each side, the rest is the value's."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class _Invalid:
    """A value that fits none of its schema's types; `expected` names them for the model."""

    def __init__(self, expected: str) -> None:
        self.expected = expected


def _typed(value: str, schema: Any) -> Any:
    """The value as its schema types it; untyped (no schema, or no type in it) it is JSON if it parses, else text.

    Types other than string come first: the template renders the string "3" and the number 3 alike, and a schema
    that allows both most likely means the number.
    """
    types = _schema_types(schema)
    if not types:
        return _json_or_text(value)
    for kind in sorted(types, key=lambda t: t == "string"):
        converted = _convert(value.strip() if kind != "string" else value, kind)
        if not isinstance(converted, _Invalid):
            return converted
    return _Invalid(" or ".join(f"a JSON {kind}" if kind != "string" else "text" for kind in types))


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows (`type`, a list of them, or the variants of anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    variants = schema.get("anyOf") or schema.get("oneOf") or []
    return [k for variant in variants for k in _schema_types(variant)]


def _convert(value: str, kind: str) -> Any:
    """`value` as one JSON type, or `_Invalid`."""
    if kind == "string":
        return value
    if kind == "boolean":  # Jinja renders Python's True and False; JSON's true and false are as good
        lowered = value.lower()
        return lowered == "true" if lowered in ("true", "false") else _Invalid(kind)
    if kind == "null":
        return None if value in ("null", "None") else _Invalid(kind)
    decoded = _json_or_text(value)
    wanted = {"integer": int, "number": (int, float), "object": dict, "array": list}.get(kind)
    if wanted is None:
        return decoded  # a type JSON Schema does not define: keep what the model wrote
    if isinstance(decoded, bool) or not isinstance(decoded, wanted):
        return _Invalid(kind)
    return decoded


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value
