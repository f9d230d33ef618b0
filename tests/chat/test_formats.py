"""The tool-call formats of Mistral, Qwen3-Coder/Qwen3.5 (XML) and gpt-oss (harmony) on their real tokenizers.

Round trips: for every assistant turn of a conversation with one call, parallel calls (where the template renders
them), a failing tool and a later user message, the text the real template renders for that turn must parse back
into the very calls (and ids, reasoning, content). Then each parser's errors for malformed calls, `auto`'s choice
per shipped family, the stop tokens per format and the engine's call ids.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from trajlab.chat.parsers import (
    HarmonyParser,
    MistralParser,
    ParsedResponse,
    QwenXmlParser,
    ToolCall,
    get_parser,
)
from trajlab.chat.template import ChatTemplate, own_template, resolve_chat_template, stop_token_ids
from trajlab.models.families import family_names, load_family_tokenizer
from trajlab.rollout.engine import call_id

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "required": ["word"], "properties": {
        "word": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
        "weight": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object"}, "note": {"type": ["string", "null"]}}}}}]
REASONING = {"mistral-nemo": None, "qwen3-coder": None, "qwen3.5": "reasoning_content", "gpt-oss": "thinking"}
PARALLEL = {"mistral-nemo": True, "qwen3-coder": True, "qwen3.5": True, "gpt-oss": False}  # gpt-oss: one a turn
FORMATS = {"mistral-nemo": MistralParser, "qwen3-coder": QwenXmlParser, "qwen3.5": QwenXmlParser,
           "gpt-oss": HarmonyParser}


def _call(ident: str, word: str, **more) -> dict:
    return {"id": ident, "type": "function", "function": {"name": "lookup", "arguments": {"word": word, **more}}}


def conversation(family: str) -> list[dict]:
    """One call (typed arguments, a multi-line string), parallel calls, a failing tool, an answer, a later user
    message and a call after it, and a last answer."""
    reasoning = REASONING[family]

    def assistant(content: str, calls: list[dict], thought: str) -> dict:
        message = {"role": "assistant", "content": content, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": content}
        return message | ({reasoning: thought} if reasoning else {})

    first = _call("c00000000", "apple\npie", limit=3, exact=True, weight=2.5, tags=["a", "b"],
                  options={"lang": "en", "depth": [1, 2]}, note=None)
    second = [_call("c00010000", "pear"), _call("c00010001", "plum")] if PARALLEL[family] else [
        _call("c00010000", "pear")]
    return [
        {"role": "system", "content": "You know words."},
        {"role": "user", "content": "What do apple, pear and plum mean?"},
        assistant("", [first], "Look apple up first."),
        {"role": "tool", "tool_call_id": "c00000000", "name": "lookup", "content": "a fruit"},
        assistant("", second, "Now the others."),
        *({"role": "tool", "tool_call_id": c["id"], "name": "lookup", "content": "Error: tool 'lookup' failed: "
           "KeyError: 'no entry'"} for c in second),
        assistant("", [_call("c00020000", "plum", exact=False)], "The lookup failed; try again."),
        {"role": "tool", "tool_call_id": "c00020000", "name": "lookup", "content": "a stone fruit"},
        assistant("All fruits.", [], "Done."),
        {"role": "user", "content": "And fig? 日本語で 🍎"},
        assistant("", [_call("c00040000", "fig")], "One more."),
        {"role": "tool", "tool_call_id": "c00040000", "name": "lookup", "content": "a sweet fruit"},
        assistant("A sweet fruit. 果物です。", [], "Answer."),
    ]


@pytest.fixture(scope="module", params=sorted(FORMATS))
def family(request):
    tokenizer = load_family_tokenizer(request.param)
    try:
        template = resolve_chat_template(tokenizer)
    except ValueError:  # Mistral and gpt-oss rewrite history: their own template, one turn at a time
        template = own_template(tokenizer)
    return request.param, tokenizer, ChatTemplate(tokenizer, TOOLS, template)


def turn_text(name: str, chat: ChatTemplate, history: list[dict], message: dict) -> tuple[str, str]:
    """(prompt, completion): what the model saw and the text the template renders for its turn, cut where the
    model's turn begins. Mistral and gpt-oss rewrite history, so their turn is found in the render that ends with it."""
    full = chat.render(history + [message])
    if name == "mistral-nemo":
        start = max(full.rfind("[/INST]") + len("[/INST]"), full.rfind("[/TOOL_RESULTS]") + len("[/TOOL_RESULTS]"))
    elif name == "gpt-oss":
        last = max(full.rfind("<|start|>user"), full.rfind("<|start|>functions."))
        start = full.index("<|end|>", last) + len("<|end|><|start|>assistant")
    else:
        prompt = chat.render(history, add_generation_prompt=True)
        assert full.startswith(prompt)
        start = len(prompt)
    return full[:start], full[start:]


def test_every_turn_parses_back_into_its_calls(family):
    name, tokenizer, chat = family
    messages = conversation(name)
    parser = get_parser("auto", tokenizer)
    assert isinstance(parser, FORMATS[name])
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for index in turns:
        message = messages[index]
        prompt, text = turn_text(name, chat, messages[:index], message)
        parsed = parser.parse(text, prefix=prompt[-200:], tools=TOOLS)
        assert parsed.errors == [], (index, text)
        expected = [ToolCall(c["function"]["name"], c["function"]["arguments"],
                             c["id"] if name == "mistral-nemo" else None) for c in message.get("tool_calls", [])]
        assert parsed.tool_calls == expected, (index, text)
        assert parsed.content == message["content"], (index, text)
        reasoning = REASONING[name]
        if reasoning:  # gpt-oss drops it from turns that a later answer follows, never from the turn's own render
            assert (parsed.reasoning, parsed.reasoning_field) == (message[reasoning], reasoning), (index, text)
    assert len(turns) == 6


def test_a_model_turn_is_a_few_real_tokens(family):
    """The markers are single special tokens of the real vocabulary, as the parsers and stop tokens assume."""
    name, tokenizer, chat = family
    markers = {"mistral-nemo": ["[TOOL_CALLS]", "</s>"], "qwen3-coder": ["<tool_call>", "</tool_call>"],
               "qwen3.5": ["<tool_call>", "</tool_call>", "<think>"], "gpt-oss": ["<|call|>", "<|channel|>"]}
    for marker in markers[name]:
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker


def test_gpt_oss_renders_one_call_a_turn():
    """Its template renders only the first call of a message: parallel calls cannot round-trip, so the engine's turn
    ends at the first <|call|> and each call is a turn of its own."""
    tokenizer = load_family_tokenizer("gpt-oss")
    chat = ChatTemplate(tokenizer, TOOLS, own_template(tokenizer))
    message = {"role": "assistant", "content": "", "tool_calls": [_call("c00000000", "pear"), _call("c00000001",
                                                                                                    "plum")]}
    text = turn_text("gpt-oss", chat, [{"role": "user", "content": "Pear and plum?"}], message)[1]
    assert "pear" in text and "plum" not in text


def test_auto_picks_the_format_of_every_shipped_family():
    expected = {"gpt-oss": "harmony", "mistral-nemo": "mistral", "qwen3-coder": "qwen3_xml", "qwen3.5": "qwen3_xml",
                "qwen3": "response_template", "qwen2.5": "response_template", "llama3.1": "response_template",
                "llama3.2": "response_template"}
    assert sorted(expected) == family_names()
    assert {name: get_parser("auto", load_family_tokenizer(name)).name for name in expected} == expected


def test_harmony_turns_stop_at_a_call_or_the_answer_only():
    gpt_oss = load_family_tokenizer("gpt-oss")
    ids = dict(zip(["<|call|>", "<|return|>", "<|end|>"], gpt_oss.convert_tokens_to_ids(
        ["<|call|>", "<|return|>", "<|end|>"]), strict=True))
    assert stop_token_ids(gpt_oss) == sorted([ids["<|call|>"], ids["<|return|>"]])
    qwen3 = load_family_tokenizer("qwen3")
    assert qwen3.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(qwen3)  # other formats keep theirs


def test_call_ids_are_nine_alphanumeric_characters_by_place():
    assert call_id(ToolCall("f", {}), 1, 2) == "c00010002"
    assert call_id(ToolCall("f", {}), 46_655, 1_679_615) == "c0zzzzzzz"
    assert all(re.fullmatch("[0-9a-z]{9}", call_id(ToolCall("f", {}), t, i)) for t in (0, 7, 300) for i in (0, 40))
    assert call_id(ToolCall("f", {}, "AbC123xyz"), 5, 0) == "AbC123xyz"  # the model's own (Mistral) is kept
    with pytest.raises(ValueError, match="base-36"):
        call_id(ToolCall("f", {}), 36**4, 0)


# ---------------------------------------------------------------------------------------------------- malformed


@pytest.mark.parametrize(("text", "expected"), [
    ('[TOOL_CALLS][{"name": "lookup", "arguments": {"word": }}]</s>', ["not valid JSON", "at character 42"]),
    ('[TOOL_CALLS]{"name": "lookup", "arguments": {}}</s>', ["JSON list", "JSON object"]),
    ('[TOOL_CALLS][{"arguments": {}}]</s>', ['no "name"']),
    ('[TOOL_CALLS][{"name": "lookup", "arguments": [1]}]</s>', ['"arguments" must be a JSON object']),
    ('[TOOL_CALLS][{"name": "lookup", "arguments": {}, "id": "call_0_0"}]', ['"id" must be 9 letters or digits',
                                                                             '"call_0_0"']),
    ('[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abcdefgh1"}, {"name": "b", "arguments": {}, '
     '"id": "abcdefgh1"}]', ["same id"]),
    ('[{"name": "lookup", "arguments": {"word": "x"}}]</s>', ["without the [TOOL_CALLS] token"]),
])
def test_mistral_malformed_calls_get_one_helpful_error(text, expected):
    parsed = MistralParser().parse(text)
    assert len(parsed.errors) == 1, parsed
    for fragment in expected:
        assert fragment in parsed.errors[0], parsed.errors[0]


def test_mistral_call_without_an_id_gets_the_engines():
    parsed = MistralParser().parse('Checking. [TOOL_CALLS][{"name": "lookup", "arguments": {"word": "x"}}]</s>')
    assert parsed == ParsedResponse("Checking.", [ToolCall("lookup", {"word": "x"})])
    assert MistralParser().parse("Paris is the capital.</s>") == ParsedResponse("Paris is the capital.")


def _xml(*parameters: str, name: str = "lookup") -> str:
    body = "".join(f"<parameter={p}\n</parameter>\n" for p in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize(("text", "expected"), [
    ("<tool_call>\n<function=lookup>\n<parameter=word>\nx\n</parameter>\n</function>\n", ["never closed",
                                                                                           "</tool_call>"]),
    ("<tool_call>\n<parameter=word>\nx\n</parameter>\n</tool_call>", ["does not start with <function="]),
    ("<tool_call>\n<function=lookup>\n<parameter=word>\nx\n</function>\n</tool_call>", ["<parameter=word> is never "
                                                                                        "closed"]),
    ("<tool_call>\n<function=lookup>\n<parameter=word>\nx\n</parameter>\n</tool_call>", ["not closed with "
                                                                                          "</function>"]),
    (_xml("word>\nx", "limit>\nthree"), ["value of 'limit' must be a JSON integer", "'three'"]),
    (_xml("word>\nx", "exact>\nyes"), ["'exact' must be a JSON boolean"]),
    (_xml("word>\nx", "weight>\n1.5.2"), ["'weight' must be a JSON number"]),
    (_xml("word>\nx", "tags>\n{\"a\": 1}"), ["'tags' must be a JSON array"]),
    (_xml("word>\nx", "word>\ny"), ["gives the parameter 'word' twice"]),
    ("<tool_call>\n<function=lookup>\nword: x\n</function>\n</tool_call>", ["text outside <parameter=...> tags"]),
    ("<function=lookup>\n<parameter=word>\nx\n</parameter>\n</function>", ["without <tool_call> tags"]),
    ("<function=lookup>\n</function>\n</tool_call>", ["without a matching <tool_call>"]),
])
def test_xml_malformed_calls_get_one_helpful_error(text, expected):
    parsed = QwenXmlParser().parse(text, tools=TOOLS)
    assert len(parsed.errors) == 1 and parsed.tool_calls == [], parsed
    for fragment in expected:
        assert fragment in parsed.errors[0], parsed.errors[0]


def test_xml_values_are_typed_by_the_schema_the_model_was_shown():
    text = _xml("word>\n75001", "limit>\n7", "note>\nNone", "exact>\nfalse", "weight>\n3", "extra>\n[1, 2]")
    (call,) = QwenXmlParser().parse(text, tools=TOOLS).tool_calls
    assert call.arguments == {"word": "75001", "limit": 7, "note": None, "exact": False, "weight": 3,
                              "extra": [1, 2]}  # a parameter the schema does not name: JSON when it parses
    untyped = QwenXmlParser().parse(text).tool_calls[0].arguments  # no tools known: JSON when it parses, else text
    assert untyped["word"] == 75001 and untyped["note"] == "None"


@pytest.mark.parametrize(("text", "expected"), [
    ("<|channel|>thinking<|message|>hm<|end|>", ["'thinking' is not a channel"]),
    ("<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|call|>", ["addressed to "
                                                                                         "'browser.search'"]),
    (" to=functions.lookup<|channel|>commentary json<|message|>{word: x}<|call|>", ["not valid JSON"]),
    (" to=functions.lookup<|channel|>commentary json<|message|>[\"x\"]<|call|>", ["must be a JSON object", "array"]),
    (" to=functions.lookup<|channel|>commentary json<|message|>{}<|end|>", ["must end with <|call|>"]),
    (" to=functions.lookup<|channel|>commentary json<|message|>{}<|call|><|start|>assistant to=functions.lookup"
     "<|channel|>commentary json<|message|>{}<|call|>", ["one call per turn"]),
    ("Paris.<|return|>", ["needs a header with its channel"]),
    ("<|channel|>analysis<|message|>hm<|end|>oops", ["must start a new one with <|start|>"]),
])
def test_harmony_malformed_turns_get_one_helpful_error(text, expected):
    parsed = HarmonyParser().parse(text)
    assert len(parsed.errors) == 1, parsed
    for fragment in expected:
        assert fragment in parsed.errors[0], parsed.errors[0]


def test_harmony_recipient_after_the_channel_and_a_preamble():
    text = ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json"
            '<|message|>{"word": "x"}<|call|>')
    assert HarmonyParser().parse(text) == ParsedResponse("Checking.", [ToolCall("lookup", {"word": "x"})], [],
                                                         "Need it.", "thinking")


# --------------------------------------------------------------------------------------------------- properties

FRAGMENTS = [
    "[TOOL_CALLS]", "</s>", "[", "]", "{", "}", '"name"', '"arguments"', '"id"', ":", ",", '"abcdefgh1"', "<tool_call>",
    "</tool_call>", "<function=lookup>", "<function=", "</function>", "<parameter=limit>", "<parameter=word>",
    "</parameter>", "\n", " ", "7", "True", "<think>", "</think>", "<|start|>", "assistant", " to=functions.lookup",
    " to=", "<|channel|>", "analysis", "commentary", "final", " json", "<|constrain|>", "<|message|>", "<|end|>",
    "<|call|>", "<|return|>", '{"word": "x"}',
]  # fmt: skip
fragment_text = st.one_of(st.text(), st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)),
                                              max_size=30).map("".join))
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(text=fragment_text, prefix=fragment_text)
def test_the_new_parsers_never_raise(text, prefix):
    for parser in (MistralParser(), QwenXmlParser(), HarmonyParser()):
        parsed = parser.parse(text, prefix=prefix, tools=TOOLS)
        assert isinstance(parsed.content, str) and all(isinstance(e, str) and e for e in parsed.errors)
        assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in parsed.tool_calls)


@PROPERTY
@given(head=fragment_text, tail=fragment_text)
def test_a_started_call_is_never_silently_lost(head, tail):
    assume("think>" not in head + tail)  # a call written inside reasoning is reasoning
    for parser, opener in ((MistralParser(), "[TOOL_CALLS]"), (QwenXmlParser(), "<tool_call>"),
                           (HarmonyParser(), " to=functions.lookup<|channel|>commentary")):
        text = ("" if isinstance(parser, HarmonyParser) else head) + opener + tail
        parsed = parser.parse(text, tools=TOOLS)
        assert parsed.tool_calls or parsed.errors, (parser.name, text)
