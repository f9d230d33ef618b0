"""Reasoning through the recording server: returned as ``reasoning_content``, sent back under the name the client
uses, rendered under the name the model's chat template reads (gpt-oss's ``thinking``, Qwen3's
``reasoning_content``), so a tool-calling session merges into one token-exact trajectory.

``IdsGenerator`` stands in for a trained gpt-oss, which cannot run here: it answers with the token ids of the
template's own rendering of each reply, as a trained model writes them.
"""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat
from trajlab.config import ServeSettings
from trajlab.data.store import read_trajectories
from trajlab.models.families import load_family_tokenizer
from trajlab.proxy import SessionRecorder, create_app
from trajlab.proxy.export import export_sessions, session_files
from trajlab.proxy.openai_format import to_template_messages
from trajlab.rollout.drift import check_token_drift

from .conftest import MODEL, running
from .test_utf8 import IdsGenerator

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
CALL = {"id": "c00000000", "type": "function", "function": {"name": "lookup", "arguments": {"word": "apple"}}}
QUESTION = {"role": "user", "content": "What is an apple?"}
RESULT = {"role": "tool", "tool_call_id": "c00000000", "content": "A fruit."}


REPLIES = ['<|channel|>analysis<|message|>I should look it up.<|end|><|start|>assistant to=functions.lookup'
           '<|channel|>commentary json<|message|>{"word": "apple"}<|call|>',
           '<|channel|>analysis<|message|>The tool answered.<|end|><|start|>assistant<|channel|>final<|message|>'
           'It is a fruit.<|return|>']
"""What a trained gpt-oss writes after each prompt: the template's own rendering of the two turns."""


@pytest.mark.parametrize("sent_as", ["reasoning_content", "reasoning", "thinking"])
def test_to_template_messages_renames_reasoning_to_what_the_template_reads(sent_as):
    sent = [QUESTION, {"role": "assistant", "content": "", sent_as: "Look it up."}]
    assert to_template_messages(sent, reasoning_field="thinking")[1]["thinking"] == "Look it up."
    assert to_template_messages(sent)[1]["reasoning_content"] == "Look it up."
    assert sent_as == "reasoning_content" or sent_as not in to_template_messages(sent)[1]


def test_a_gpt_oss_tool_session_keeps_its_reasoning_and_merges_token_exact(tmp_path):
    tokenizer = load_family_tokenizer("gpt-oss")
    template, context = resolve_chat(tokenizer, {})
    ids = [tokenizer.encode(reply, add_special_tokens=False) for reply in REPLIES]
    app = create_app(IdsGenerator(ids), tokenizer, template, get_parser("auto", tokenizer), MODEL,
                     SessionRecorder(tmp_path), ServeSettings(), 32768, context=context)
    with running(app) as url:
        api = OpenAI(base_url=f"{url}/sessions/oss/v1", api_key="k", max_retries=0, timeout=60)
        first = api.chat.completions.create(model=MODEL, messages=[QUESTION], tools=[LOOKUP], max_tokens=64)
        message = first.choices[0].message.model_dump(exclude_none=True)
        assert message["reasoning_content"] == "I should look it up."
        (call,) = message["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"word": "apple"}
        result = RESULT | {"tool_call_id": call["id"]}
        second = api.chat.completions.create(model=MODEL, messages=[QUESTION, message, result], tools=[LOOKUP],
                                             max_tokens=64)
    assert second.choices[0].message.content == "It is a fruit."
    summary = export_sessions(session_files(tmp_path), tmp_path / "out.jsonl", tokenizer, template)
    assert summary["calls"] == 2 and summary["samples"] == 1
    (trajectory,) = read_trajectories(tmp_path / "out.jsonl")
    # gpt-oss drops a call's reasoning once an answer follows: the session is one sample per call, each its prompt
    # as served (the call's reasoning kept, as the template's generation prompt keeps it) and its reply.
    assert trajectory.tokens is None and trajectory.metrics["template_match"] == 1.0
    assert trajectory.metrics["turns"] == 2 and trajectory.metrics["model_tokens"] == len(ids[0]) + len(ids[1])
    assert trajectory.messages[1]["thinking"] == "I should look it up."
    first, second_turn = trajectory.branches
    assert first.completion_ids == ids[0] and second_turn.completion_ids == ids[1]
    assert second_turn.prompt_ids == first.prompt_ids + ids[0] + second_turn.prompt_ids[len(first.prompt_ids) +
                                                                                         len(ids[0]):]
    assert "I should look it up." in tokenizer.decode(second_turn.prompt_ids)
    kept, _ = check_token_drift([trajectory], tokenizer, template, get_parser("auto", tokenizer), max_drift=0.0)
    assert kept == [trajectory]

