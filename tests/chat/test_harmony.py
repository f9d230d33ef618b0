"""gpt-oss's harmony format: openai-harmony offline, its renders against the Hugging Face template's, and the parser.

Where the two renderers agree, token for token (given the same date): the prompt after a call (reasoning kept, the
call, its result, the next generation prompt), and a conversation whose answer is followed by a later user message
(earlier reasoning dropped by both, the answer closed with <|end|>). Where they differ: a tool result (the template
writes it JSON-encoded, harmony as given), and the training render of a last answer (the template keeps that turn's
reasoning and drops the earlier call's; harmony drops both, or with auto_drop_analysis off keeps both).
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    RenderConversationConfig,
    Role,
    SystemContent,
    ToolDescription,
)

from trajlab.chat.parsers import HarmonyParser, ParsedResponse, ToolCall
from trajlab.models import harmony
from trajlab.models.families import load_family_tokenizer

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
CALL = {"id": "c00000000", "type": "function", "function": {"name": "lookup", "arguments": {"word": "apple"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_family_tokenizer("gpt-oss")


@pytest.fixture(scope="module")
def encoding():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(harmony.ENCODINGS_BASE_ENV, raising=False)
        yield harmony.harmony_encoding()


def test_o200k_base_is_rebuilt_from_the_shipped_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(harmony, "cache_root", lambda: tmp_path)
    folder = harmony.encodings_folder()
    data = (folder / harmony.O200K_BASE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == harmony.O200K_BASE_SHA256
    assert data.startswith(b"IQ== 0\n") and data.count(b"\n") == 199_998  # "!" is rank 0; special tokens are not in it
    stamp = (folder / harmony.O200K_BASE).stat().st_mtime_ns
    assert harmony.encodings_folder() == folder and (folder / harmony.O200K_BASE).stat().st_mtime_ns == stamp
    (folder / harmony.O200K_BASE).write_bytes(b"damaged")  # a bad copy is rebuilt, not trusted
    harmony.encodings_folder()
    assert hashlib.sha256((folder / harmony.O200K_BASE).read_bytes()).hexdigest() == harmony.O200K_BASE_SHA256


def test_the_rebuilt_vocabulary_tokenizes_like_the_tokenizer(tokenizer, encoding):
    text = "Hello, 世界 🌍 — def f(x):\n    return x**2  # ünïcödé"
    assert encoding.encode(text, allowed_special=set()) == tokenizer.encode(text, add_special_tokens=False)


def _hf(tokenizer, messages, *, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tools=[LOOKUP], tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _harmony(date: str, *messages: Message) -> Conversation:
    system = SystemContent.new().with_conversation_start_date(date)  # reasoning effort medium, as the template's
    tools = DeveloperContent.new().with_function_tools([ToolDescription.new(
        "lookup", "Look a word up.", parameters=LOOKUP["function"]["parameters"])])
    return Conversation.from_messages([Message.from_role_and_content(Role.SYSTEM, system),
                                       Message.from_role_and_content(Role.DEVELOPER, tools), *messages])


def _assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _call_and_result(result: str) -> list[Message]:
    return [_assistant("I should look.", "analysis"),
            _assistant('{"word": "apple"}', "commentary").with_recipient("functions.lookup").with_content_type("json"),
            Message.from_author_and_content(Author.new(Role.TOOL, "functions.lookup"), result)
            .with_channel("commentary").with_recipient("assistant")]


def _date(text: str) -> str:
    return re.search(r"Current date: (\d{4}-\d\d-\d\d)", text).group(1)


HISTORY = [{"role": "user", "content": "Look up apple."},
           {"role": "assistant", "content": "", "thinking": "I should look.", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "c00000000", "name": "lookup", "content": "a fruit"}]


def test_the_prompt_after_a_call_is_the_same_tokens(tokenizer, encoding):
    text = _hf(tokenizer, HISTORY, add_generation_prompt=True)
    user = Message.from_role_and_content(Role.USER, "Look up apple.")
    ours = _harmony(_date(text), user, *_call_and_result('"a fruit"'))  # the template writes the result as JSON
    assert encoding.render_conversation_for_completion(ours, Role.ASSISTANT) == tokenizer.encode(
        text, add_special_tokens=False)
    raw = _harmony(_date(text), user, *_call_and_result("a fruit"))  # harmony writes a result as it is given
    assert encoding.render_conversation_for_completion(raw, Role.ASSISTANT) != tokenizer.encode(
        text, add_special_tokens=False)


def test_an_answer_then_a_later_user_message_is_the_same_tokens(tokenizer, encoding):
    messages = [*HISTORY, {"role": "assistant", "content": "A fruit.", "thinking": "Got it."},
                {"role": "user", "content": "Thanks!"}]
    text = _hf(tokenizer, messages, add_generation_prompt=True)
    assert "I should look." not in text and "Got it." not in text  # reasoning of earlier turns: dropped by both
    conversation = _harmony(_date(text), Message.from_role_and_content(Role.USER, "Look up apple."),
                            *_call_and_result('"a fruit"'), _assistant("Got it.", "analysis"),
                            _assistant("A fruit.", "final"), Message.from_role_and_content(Role.USER, "Thanks!"))
    assert encoding.render_conversation_for_completion(conversation, Role.ASSISTANT) == tokenizer.encode(
        text, add_special_tokens=False)


def test_the_training_render_of_a_last_answer_differs(tokenizer, encoding):
    messages = [*HISTORY, {"role": "assistant", "content": "A fruit.", "thinking": "Got it."}]
    text = _hf(tokenizer, messages, add_generation_prompt=False)
    assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant"
                         "<|channel|>final<|message|>A fruit.<|return|>")
    assert "I should look." not in text  # the template keeps the last turn's reasoning only
    conversation = _harmony(_date(text), Message.from_role_and_content(Role.USER, "Look up apple."),
                            *_call_and_result('"a fruit"'), _assistant("Got it.", "analysis"),
                            _assistant("A fruit.", "final"))
    hf_ids = tokenizer.encode(text, add_special_tokens=False)
    for drop, missing in ((True, "Got it."), (False, None)):
        ids = encoding.render_conversation_for_training(conversation, RenderConversationConfig(auto_drop_analysis=drop))
        rendered = encoding.decode_utf8(ids)
        assert ids != hf_ids and rendered.endswith("<|channel|>final<|message|>A fruit.<|return|>")
        assert (missing not in rendered) if missing else ("I should look." in rendered and "Got it." in rendered)


@pytest.mark.parametrize("completion", [
    '<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant to=functions.lookup<|channel|>commentary json'
    '<|message|>{"word": "apple"}<|call|>',
    '<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary to=functions.lookup '
    '<|constrain|>json<|message|>{"word": "apple"}<|call|>',
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>A fruit. 果物<|return|>",
    "<|channel|>final<|message|>Done.<|return|>",
])
def test_the_parser_reads_what_openai_harmony_reads(tokenizer, encoding, completion):
    """Both parse the same completion (the template's call form, the recipient after the channel, answers)."""
    ids = tokenizer.encode(completion, add_special_tokens=False)
    reasoning, content, calls = [], [], []
    for message in encoding.parse_messages_from_completion_tokens(ids, Role.ASSISTANT):
        text = message.content[0].text
        if message.recipient:
            calls.append(ToolCall(message.recipient.removeprefix("functions."), json.loads(text)))
        else:
            (reasoning if message.channel == "analysis" else content).append(text)
    expected = ParsedResponse("\n".join(content), calls, [], "\n".join(reasoning) or None, "thinking")
    assert HarmonyParser().parse(tokenizer.decode(ids, skip_special_tokens=False)) == expected
