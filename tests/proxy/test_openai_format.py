"""OpenAI messages and tools to what chat templates expect, and the refusals in between."""

from __future__ import annotations

import pytest

from trajlab.proxy.errors import APIError
from trajlab.proxy.openai_format import parse_tool_choice, to_template_messages, validate_tools


def test_tool_call_arguments_become_objects_and_tool_results_get_their_call_name():
    messages = to_template_messages([
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "two"}]},
    ])
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [c["function"]["arguments"] for c in messages[2]["tool_calls"]] == [{"a": 1}, {}]
    assert messages[2]["content"] == ""
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "one"}
    assert messages[4]["name"] == "g" and messages[4]["content"] == "two"


@pytest.mark.parametrize("message", [
    {"role": "function", "content": "x"},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
])
def test_messages_templates_cannot_take_are_refused(message):
    with pytest.raises(APIError) as error:
        to_template_messages([message])
    assert error.value.status == 400 and error.value.param


def test_tools_are_checked_and_get_empty_parameters_when_they_have_none():
    (tool,) = validate_tools([{"type": "function", "function": {"name": "ping"}}])
    assert tool["function"]["parameters"] == {"type": "object", "properties": {}}
    for bad in ({"type": "retrieval"}, {"type": "function"}, {"type": "function", "function": {"name": ""}},
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
                {"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}):
        with pytest.raises(APIError):
            validate_tools([bad])


def test_tool_choice():
    assert parse_tool_choice(None, True) and not parse_tool_choice(None, False)
    assert parse_tool_choice("auto", True) and not parse_tool_choice("none", True)
    for unsupported in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError, match="not supported"):
            parse_tool_choice(unsupported, True)
