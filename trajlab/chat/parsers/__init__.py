"""Tool-call parsers: turn one decoded assistant turn into content, reasoning, tool calls and errors.

The same parser is used in every stage (collection, SFT data checks, RL, evaluation), so a malformed call is never
an exception: it becomes an entry in `ParsedResponse.errors`, written for the model so that it can be sent back as
the observation. A call that is silently dropped would teach the model nothing, so text that starts a tool call but
yields none is reported too.

Parsers are looked up by name with `get_parser`; `register_parser` adds new ones.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TYPE_CHECKING

from trajlab.chat.parsers.base import END_MARKERS, ParsedResponse, ToolCall, ToolCallParser
from trajlab.chat.parsers.harmony import HarmonyParser
from trajlab.chat.parsers.json_calls import HermesParser, Llama3Parser
from trajlab.chat.parsers.mistral import TOOL_CALLS, MistralParser
from trajlab.chat.parsers.qwen_xml import QwenXmlParser
from trajlab.chat.parsers.response_template import ResponseTemplateParser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["END_MARKERS", "HarmonyParser", "HermesParser", "Llama3Parser", "MistralParser", "ParsedResponse",
           "QwenXmlParser", "ResponseTemplateParser", "ToolCall", "ToolCallParser", "get_parser", "register_parser"]

ParserFactory = Callable[["PreTrainedTokenizerBase | None"], ToolCallParser]


def _auto(tokenizer: PreTrainedTokenizerBase | None) -> ToolCallParser:
    """The parser for the tool-call format the tokenizer's chat template writes, found by that format's markers."""
    template = getattr(tokenizer, "chat_template", None)
    template = template.get("default", "") if isinstance(template, dict) else template or ""
    if "<|channel|>" in template and "<|call|>" in template:
        return HarmonyParser(tokenizer)
    if TOOL_CALLS in template:
        return MistralParser(tokenizer)
    if "<function=" in template and "<parameter=" in template:
        return QwenXmlParser(tokenizer)
    if getattr(tokenizer, "response_template", None) is not None:
        return ResponseTemplateParser(tokenizer)
    return HermesParser(tokenizer)


_PARSERS: dict[str, ParserFactory] = {
    "auto": _auto,
    "harmony": HarmonyParser,
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "qwen3_xml": QwenXmlParser,
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
        name: "hermes", "llama3", "mistral", "qwen3_xml", "harmony", "response_template", "auto" (the format the
            chat template writes: harmony, mistral or qwen3_xml by their markers, else response_template when the
            tokenizer has a `response_template`, else hermes), or any name added with `register_parser`.
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
