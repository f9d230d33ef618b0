"""Tests for trajlab.chat.parsers: well-formed calls, helpful errors for malformed ones, and `parse` never raising."""

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.chat.families import family_tokenizer
from trajlab.chat.parsers import (
    HermesParser,
    Llama3Parser,
    ParsedResponse,
    ResponseTemplateParser,
    ToolCall,
    get_parser,
    register_parser,
)


@pytest.fixture(scope="module")
def qwen3():
    return family_tokenizer("qwen3")


@pytest.fixture(scope="module")
def qwen2_5():
    return family_tokenizer("qwen2_5")


@pytest.fixture(scope="module")
def llama3():
    return family_tokenizer("llama3_1")


def assistant_turn(tok, calls: list[ToolCall], content: str = "", **extra) -> tuple[str, str]:
    """Render a tool-calling assistant turn and cut it the way a rollout sees it: (prefix, decoded completion)."""
    user = {"role": "user", "content": "What is the weather?"}
    assistant = {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls],
        **extra,
    }
    prompt_ids = tok.apply_chat_template([user], add_generation_prompt=True, return_dict=False)
    full_ids = tok.apply_chat_template([user, assistant], return_dict=False)
    assert full_ids[: len(prompt_ids)] == prompt_ids
    return tok.decode(prompt_ids), tok.decode(full_ids[len(prompt_ids) :])


def call_block(call: ToolCall) -> str:
    return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"


WEATHER = ToolCall("get_weather", {"city": "Paris", "days": 3})
TIME = ToolCall("get_time", {"tz": {"name": "CET", "offset": [1, 0]}, "exact": True, "note": None})


# --------------------------------------------------------------------------------------------------------- hermes


def test_hermes_single_call_strips_end_marker():
    parsed = HermesParser().parse(call_block(WEATHER) + "<|im_end|>")
    assert parsed == ParsedResponse(content="", tool_calls=[WEATHER], errors=[], reasoning=None)


def test_hermes_multiple_calls_content_and_reasoning():
    text = (
        "<think>\nI need the weather and the time.\n</think>\n\nLet me check."
        f"{call_block(WEATHER)}\n{call_block(TIME)}\nDone.<|im_end|>"
    )
    parsed = HermesParser().parse(text)
    assert parsed.tool_calls == [WEATHER, TIME]
    assert parsed.reasoning == "I need the weather and the time."
    assert parsed.content == "Let me check.\nDone."
    assert parsed.errors == []


def test_hermes_whitespace_and_string_arguments():
    arguments = json.dumps(json.dumps(WEATHER.arguments))
    text = f'<tool_call>  {{"name": "get_weather", "arguments": {arguments}}}\n\n</tool_call>'
    assert HermesParser().parse(text).tool_calls == [WEATHER]


def test_hermes_missing_arguments_means_no_arguments():
    assert HermesParser().parse('<tool_call>{"name": "ping"}</tool_call>').tool_calls == [ToolCall("ping", {})]


def test_hermes_think_opened_by_the_prompt():
    completion = "planning\n</think>\n\n" + call_block(WEATHER)
    parsed = HermesParser().parse(completion, prefix="<|im_start|>assistant\n<think>\n")
    assert parsed.reasoning == "planning"
    assert parsed.tool_calls == [WEATHER]
    assert parsed.content == ""


def test_hermes_close_tag_inside_a_string_argument():
    call = ToolCall("write", {"text": "the tag </tool_call> and <tool_call>"})
    assert HermesParser().parse(call_block(call)).tool_calls == [call]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>', ["not valid JSON", "column 34"]),
        ('<tool_call>{"arguments": {}}</tool_call>', ['no "name"']),
        ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', ['"name" must be', "JSON number"]),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', ['"name" must be', "empty string"]),
        ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', ['"arguments" must be a JSON object', "array"]),
        ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', ['"arguments" must be', "string"]),
        ('<tool_call>["f", {}]</tool_call>', ["must be a JSON object", "JSON array"]),
        ('<tool_call>{"name": "f", "arguments": {}}', ["never closed", "</tool_call>"]),
        ('{"name": "f", "arguments": {}}</tool_call>', ["without a matching <tool_call>"]),
        ('{"name": "f", "arguments": {}}', ["without <tool_call> tags"]),
        ('<think>let me call <tool_call>{"name": "f"}</tool_call>', ["unclosed <think>"]),
        ("<tool_call>" + "[" * 50_000 + "</tool_call>", ["not valid JSON"]),
    ],
)
def test_hermes_malformed_call_gives_one_helpful_error(text, expected):
    parsed = HermesParser().parse(text)
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1
    for fragment in expected:
        assert fragment in parsed.errors[0]


def test_hermes_errors_state_the_expected_format():
    error = HermesParser().parse("<tool_call>{oops}</tool_call>").errors[0]
    assert '<tool_call>\n{"name": "<tool name>", "arguments":' in error


def test_hermes_bad_call_does_not_lose_its_neighbours():
    text = f'{call_block(WEATHER)}<tool_call>{{"name": "f", "arguments": {{</tool_call>{call_block(TIME)}'
    parsed = HermesParser().parse(text)
    assert parsed.tool_calls == [WEATHER, TIME]
    assert len(parsed.errors) == 1 and "Tool call 2" in parsed.errors[0]


def test_hermes_unclosed_call_before_the_next_one():
    parsed = HermesParser().parse('<tool_call>{"name": "f"' + call_block(WEATHER))
    assert parsed.tool_calls == [WEATHER]
    assert "never closed" in parsed.errors[0]


# --------------------------------------------------------------------------------------------------------- llama3


def llama_json(call: ToolCall, key: str = "parameters") -> str:
    return json.dumps({"name": call.name, key: call.arguments})


def test_llama3_single_call_with_and_without_python_tag():
    for text in (llama_json(WEATHER) + "<|eot_id|>", "<|python_tag|>" + llama_json(WEATHER) + "<|eom_id|>"):
        assert Llama3Parser().parse(text) == ParsedResponse(content="", tool_calls=[WEATHER], errors=[])


def test_llama3_multiple_calls_and_arguments_alias():
    text = f"{llama_json(WEATHER)}; {llama_json(TIME, 'arguments')}\n{llama_json(WEATHER)}<|eot_id|>"
    parsed = Llama3Parser().parse(text)
    assert parsed.tool_calls == [WEATHER, TIME, WEATHER]
    assert parsed.errors == []


def test_llama3_prose_and_non_call_json_are_content():
    assert Llama3Parser().parse("It is sunny in Paris.<|eot_id|>") == ParsedResponse("It is sunny in Paris.", [], [])
    assert Llama3Parser().parse('{"answer": 42}').content == '{"answer": 42}'


def test_llama3_text_before_python_tag_is_content():
    parsed = Llama3Parser().parse("Checking.<|python_tag|>" + llama_json(WEATHER))
    assert (parsed.content, parsed.tool_calls) == ("Checking.", [WEATHER])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "f", "parameters": {"a": }}<|eot_id|>', ["not valid JSON", "character 34"]),
        ('{"name": "f", "parameters": {"a"', ["not valid JSON"]),
        ('{"name": null, "parameters": {}}', ['"name" must be', "null"]),
        ('{"name": "f", "parameters": 3}', ['"parameters" must be a JSON object', "number"]),
        ("<|python_tag|>[1, 2]", ["must be a JSON object", "array"]),
        ("<|python_tag|>search the web", ["not valid JSON"]),
    ],
)
def test_llama3_malformed_call_gives_one_helpful_error(text, expected):
    parsed = Llama3Parser().parse(text)
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1
    for fragment in expected:
        assert fragment in parsed.errors[0]
    assert '"parameters": {"<argument>"' in parsed.errors[0]


# ---------------------------------------------------------------------------------------------- response_template


@pytest.mark.parametrize("tok_name", ["qwen3", "qwen2_5", "llama3"])
def test_response_template_single_call_matches_rendered_call(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    prefix, completion = assistant_turn(tok, [WEATHER])
    parsed = get_parser("response_template", tok).parse(completion, prefix=prefix)
    assert parsed == ParsedResponse(content="", tool_calls=[WEATHER], errors=[], reasoning=None)


@pytest.mark.parametrize("tok_name", ["qwen3", "qwen2_5"])
def test_response_template_multiple_calls_and_content(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    prefix, completion = assistant_turn(tok, [WEATHER, TIME], content="Let me check.")
    parsed = get_parser("response_template", tok).parse(completion, prefix=prefix)
    assert (parsed.content, parsed.tool_calls, parsed.errors) == ("Let me check.", [WEATHER, TIME], [])


def test_response_template_reasoning(qwen3):
    prefix, completion = assistant_turn(qwen3, [WEATHER], reasoning_content="Paris, 3 days.")
    parsed = get_parser("response_template", qwen3).parse(completion, prefix=prefix)
    assert parsed.reasoning == "Paris, 3 days."
    assert parsed.tool_calls == [WEATHER]


def test_response_template_without_end_token_or_prefix(llama3, qwen3):
    # Llama 3's template closes a call with `}<|eot_id|>`; the parser retries with the eos token appended.
    parser = get_parser("response_template", llama3)
    assert parser.parse(llama_json(WEATHER), prefix="").tool_calls == [WEATHER]
    assert get_parser("response_template", qwen3).parse(call_block(WEATHER), prefix="").tool_calls == [WEATHER]


def test_response_template_strips_end_markers_from_content(qwen3):
    parsed = get_parser("response_template", qwen3).parse("All done.<|endoftext|>", prefix="")
    assert parsed.content == "All done."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call><|im_end|>', ["could not be parsed", "column"]),
        ('<tool_call>\n{"name": "f"', ["could not be parsed"]),
        ('<tool_call>{"arguments": {}}</tool_call>', ['no "name"']),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ['"arguments" must be a JSON object']),
        ("<tool_call>[1]</tool_call>", ["must be a JSON object"]),
        ('{"name": "f", "arguments": {}}<|im_end|>', ["not in the expected format"]),
    ],
)
def test_response_template_malformed_qwen(qwen3, text, expected):
    parsed = get_parser("response_template", qwen3).parse(text, prefix="<|im_start|>assistant\n")
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1
    for fragment in expected:
        assert fragment in parsed.errors[0]
    assert '<tool_call>\n{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>' in parsed.errors[0]


def test_a_call_drafted_in_reasoning_is_not_an_error(qwen3):
    text = f"<think>I could write {call_block(TIME)}</think>{call_block(WEATHER)}<|im_end|>"
    for parser in (HermesParser(), get_parser("response_template", qwen3)):
        parsed = parser.parse(text, prefix="")
        assert (parsed.tool_calls, parsed.errors) == ([WEATHER], [])
        assert "get_time" in parsed.reasoning


def test_response_template_llama3_call_it_cannot_read_is_reported(llama3):
    # Llama 3's response template only knows "parameters": a call with "arguments" must not vanish into content.
    parsed = get_parser("response_template", llama3).parse(llama_json(WEATHER, "arguments") + "<|eot_id|>", prefix="")
    assert parsed.tool_calls == []
    assert "not in the expected format" in parsed.errors[0]
    assert '{"name": "tool_name", "parameters": {"argument": "value"}}' in parsed.errors[0]


def test_response_template_needs_a_template():
    with pytest.raises(ValueError, match="add_response_schema"):
        get_parser("response_template", None)


# ----------------------------------------------------------------------------------------------------------- registry


def test_auto_picks_response_template_when_available(qwen3):
    assert isinstance(get_parser("auto", qwen3), ResponseTemplateParser)
    assert isinstance(get_parser("auto"), HermesParser)


def test_unknown_parser_suggests_the_closest():
    with pytest.raises(ValueError, match="Did you mean 'hermes'") as info:
        get_parser("hermse")
    assert "llama3" in str(info.value) and "response_template" in str(info.value)


def test_register_parser():
    register_parser("test_llama", lambda tok: Llama3Parser(tok))
    assert isinstance(get_parser("test_llama"), Llama3Parser)


# -------------------------------------------------------------------------------------------------------- properties

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", "[", "]", '"', '"name"', '"arguments"',
    '"parameters"', ":", ",", ";", "\n", " ", "null", "1", '"f"', "\\", "<|python_tag|>", "<|im_end|>",
    "<|eot_id|>", "<|eom_id|>", "<|im_start|>assistant\n", '{"name": "f", "arguments": {}}',
]  # fmt: skip
fragment_text = st.one_of(
    st.text(),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=30).map("".join),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
tool_calls = st.builds(
    ToolCall,
    name=st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True),
    arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEMPLATE_PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


def check_never_raises(parser, text: str, prefix: str) -> None:
    parsed = parser.parse(text, prefix=prefix)
    assert isinstance(parsed.content, str)
    assert all(isinstance(call, ToolCall) and isinstance(call.arguments, dict) for call in parsed.tool_calls)
    assert all(isinstance(error, str) and error for error in parsed.errors)


@PROPERTY
@given(text=fragment_text, prefix=fragment_text)
def test_builtin_parsers_never_raise(text, prefix):
    check_never_raises(HermesParser(), text, prefix)
    check_never_raises(Llama3Parser(), text, prefix)


@TEMPLATE_PROPERTY
@given(text=fragment_text, prefix=fragment_text)
def test_response_template_parser_never_raises(qwen3, llama3, text, prefix):
    check_never_raises(get_parser("response_template", qwen3), text, prefix)
    check_never_raises(get_parser("response_template", llama3), text, prefix)


@TEMPLATE_PROPERTY
@given(head=fragment_text, tail=fragment_text)
def test_a_started_call_is_never_silently_lost(qwen3, head, tail):
    text = head + "<tool_call>" + tail
    assume("think>" not in text)  # a call written inside reasoning is reasoning
    for parser in (HermesParser(), get_parser("response_template", qwen3)):
        parsed = parser.parse(text, prefix="<|im_start|>assistant\n")
        assert parsed.tool_calls or parsed.errors


@PROPERTY
@given(calls=st.lists(tool_calls, max_size=4), ascii_only=st.booleans(), glue=st.sampled_from(["", "\n", " ok "]))
def test_hermes_round_trip(calls, ascii_only, glue):
    blocks = [
        f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=ascii_only)}\n</tool_call>"
        for c in calls
    ]
    parsed = HermesParser().parse(glue.join(blocks) + "<|im_end|>")
    assert parsed.tool_calls == calls
    assert parsed.errors == []


@PROPERTY
@given(calls=st.lists(tool_calls, min_size=1, max_size=4), sep=st.sampled_from([";", "; ", "\n"]), tag=st.booleans())
def test_llama3_round_trip(calls, sep, tag):
    text = ("<|python_tag|>" if tag else "") + sep.join(llama_json(c) for c in calls) + "<|eot_id|>"
    parsed = Llama3Parser().parse(text)
    assert parsed.tool_calls == calls
    assert parsed.errors == []


@TEMPLATE_PROPERTY
@given(calls=st.lists(tool_calls, min_size=1, max_size=3))
def test_response_template_round_trip_qwen3(qwen3, calls):
    assume(all("</tool_call>" not in json.dumps(c.arguments, ensure_ascii=False) for c in calls))
    prefix, completion = assistant_turn(qwen3, calls)
    parsed = get_parser("response_template", qwen3).parse(completion, prefix=prefix)
    assert parsed.tool_calls == calls
    assert parsed.errors == []


@TEMPLATE_PROPERTY
@given(call=tool_calls)
def test_response_template_round_trip_llama3(llama3, call):
    assume("}<|eot_id|>" not in json.dumps(call.arguments, ensure_ascii=False))
    prefix, completion = assistant_turn(llama3, [call])
    parsed = get_parser("response_template", llama3).parse(completion, prefix=prefix)
    assert parsed.tool_calls == [call]
    assert parsed.errors == []
