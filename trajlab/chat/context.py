"""What a chat template renders with besides the messages: the user's ``chat_template_kwargs`` and a pinned date.

Real templates read variables beyond the messages: Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``, and
Llama 3.x's system header, which writes today's date through ``strftime_now``. Token-exact training needs each
trajectory re-rendered exactly as it was rolled out, so both are fixed for a run and recorded with every trajectory:
a collection made yesterday still passes the drift guard today.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DATES = "trajlab_pinned_dates"
_PINNED_NOW = "{%- macro strftime_now(format) -%}{{- " + _DATES + "[format] -}}{%- endmacro -%}"
_DATE_CALL = re.compile(r"strftime_now\(\s*(?:\"([^\"]*)\"|'([^']*)')\s*\)")
_RESERVED = frozenset({_DATES, "messages", "tools", "documents", "add_generation_prompt", "strftime_now",
                       "raise_exception", "bos_token", "eos_token", "pad_token", "unk_token"})


@dataclass(frozen=True)
class TemplateContext:
    """The variables a chat template renders with, beyond the messages and tools.

    Attributes:
        kwargs: passed to the template as variables (``{"enable_thinking": False}``).
        date: the ISO date (``2026-11-27``) the template's ``strftime_now`` formats, or None when the template
            reads no date (then nothing is pinned).
    """

    kwargs: Mapping[str, Any] = field(default_factory=dict)
    date: str | None = None

    def __post_init__(self) -> None:
        check_template_kwargs(self.kwargs)
        if self.date is not None:
            dt.date.fromisoformat(self.date)  # raises ValueError naming the bad date

    def prepare(self, chat_template: str) -> tuple[str, dict[str, Any]]:
        """The template and variables to render with. A pinned date replaces ``strftime_now`` by a macro that
        returns the pinned date in each format the template asks for (a template's own macro shadows transformers'
        global; transformers passes only plain data as variables, never a function)."""
        values = dict(self.kwargs)
        if self.date is None:
            return chat_template, values
        pinned = dt.datetime.combine(dt.date.fromisoformat(self.date), dt.time())
        values[_DATES] = {fmt: pinned.strftime(fmt) for fmt in date_formats(chat_template)}
        return _PINNED_NOW + chat_template, values

    def record(self) -> dict[str, Any]:
        """How a trajectory stores it (empty when there is nothing to re-render with)."""
        return {key: value for key, value in (("kwargs", dict(self.kwargs)), ("date", self.date)) if value}

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> TemplateContext:
        record = record or {}
        return cls(kwargs=dict(record.get("kwargs") or {}), date=record.get("date"))


def date_formats(chat_template: str) -> list[str]:
    """The formats the template passes to ``strftime_now``.

    Raises:
        ValueError: the template calls it with something other than a string literal (its date cannot be pinned).
    """
    formats = [double or single for double, single in _DATE_CALL.findall(chat_template)]
    if chat_template.count("strftime_now(") != len(formats):
        raise ValueError("the chat template calls strftime_now with a format that is not a string literal, so trajlab "
                         "cannot pin the date it renders; pass the date through chat_template_kwargs instead")
    return formats


def context_for_run(chat_template: str, kwargs: Mapping[str, Any] | None = None,
                    today: dt.date | None = None) -> TemplateContext:
    """The context a run renders with: ``kwargs``, and today's date (UTC) pinned when the template reads the date."""
    date = None
    if "strftime_now" in chat_template:
        date = (today or dt.datetime.now(dt.UTC).date()).isoformat()
    return TemplateContext(kwargs=dict(kwargs or {}), date=date)


def check_template_kwargs(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """Refuse names a template cannot read as variables, and names trajlab itself passes.

    Raises:
        ValueError: naming the bad key and why.
    """
    for key in kwargs:
        if not isinstance(key, str) or not _IDENTIFIER.fullmatch(key):
            raise ValueError(f"chat_template_kwargs key {key!r} is not a template variable name (letters, digits, _)")
        if key in _RESERVED:
            raise ValueError(f"chat_template_kwargs key {key!r} is set by trajlab itself; the date a template reads "
                             "is pinned per run and recorded with each trajectory")
    return kwargs
