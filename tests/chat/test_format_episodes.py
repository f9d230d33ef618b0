"""Multi-turn episodes of the XML-call families (Qwen3-Coder, Qwen3.5) through the real engine, token-exact.

The same episode and checks as test_family_episodes (parallel calls, a failing tool, three tool turns, an answer, a
later user message and one more call; ids equal to a fresh render, every call parses back, the drift guard passes),
with the `qwen3_xml` parser that `auto` picks for these templates. Qwen3.5's own template drops past reasoning, so it
runs on TRL's training variant; a model thinking there writes reasoning in every turn, as the scripted policy does.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.chat.test_family_episodes import Dictionary, _chat, check_episode
from trajlab.chat.parsers import QwenXmlParser, get_parser
from trajlab.chat.template import own_template
from trajlab.env.registry import EnvSpec
from trajlab.inference.policy import chat_of
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.families import load_family_tokenizer
from trajlab.rollout.drift import find_drift
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


def scripted_policy(reasoning: bool, answer_reasoning: bool = True):
    """Two lookups at once, a failing one, one more, an answer; after the later question one lookup and an answer.
    Arguments are typed (an integer and a boolean beside the word), so the schema's types must come back."""
    plan = [["apple", "pear"], ["zzz"], ["plum"], [], ["fig"], []]

    def policy(task, messages):
        turn = sum(1 for m in messages if m["role"] == "assistant")
        words = plan[turn]
        if not words:
            message = {"role": "assistant", "content": f"Answer {turn}: all fruits. 果物です。"}
            return message | ({"reasoning_content": "I know it now."} if reasoning and answer_reasoning else {})
        calls = [{"type": "function", "function": {"name": "lookup", "arguments": {"word": word}}} for word in words]
        message = {"role": "assistant", "content": "Let me look." if turn == 2 else "", "tool_calls": calls}
        return message | ({"reasoning_content": f"Looking up {', '.join(words)}."} if reasoning else {})

    return policy


def run(family: str, kwargs=None, *, reasoning: bool, answer_reasoning: bool = True):
    tokenizer = load_family_tokenizer(family)
    template, context = chat_of(tokenizer, kwargs)
    spec = EnvSpec(name="dictionary", env_cls=Dictionary, system_prompt="You know words.")
    generator = ScriptedGenerator(scripted_policy(reasoning, answer_reasoning), tokenizer, template, context=context)
    parser = get_parser("auto", tokenizer)
    assert isinstance(parser, QwenXmlParser)
    engine = RolloutEngine(spec, generator, tokenizer, chat_template=template, parser=parser, seed=0, context=context)
    return tokenizer, template, parser, asyncio.run(engine.run_episode(Episode("e", {})))


def test_qwen3_coder_episode_is_token_exact():
    tokenizer, template, parser, trajectory = run("qwen3-coder", reasoning=False)
    assert template == own_template(tokenizer)  # prefix-preserving as shipped
    check_episode(tokenizer, template, parser, trajectory)
    completion = tokenizer.decode(trajectory.tokens.completion_ids, skip_special_tokens=False)
    assert "<tool_call>\n<function=lookup>\n<parameter=word>\nzzz\n</parameter>\n</function>\n</tool_call>" in \
        completion and "Let me look.\n\n<tool_call>" in completion


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_5_episode_is_token_exact_on_the_training_template(thinking):
    tokenizer, template, parser, trajectory = run("qwen3.5", {"enable_thinking": thinking}, reasoning=thinking)
    assert template != own_template(tokenizer)  # the shipped one rewrites history: TRL's variant instead
    check_episode(tokenizer, template, parser, trajectory)
    reasoning = [m.get("reasoning_content") for m in trajectory.messages if m["role"] == "assistant"]
    assert all(reasoning) if thinking else not any(reasoning)


def test_qwen3_5_empty_reasoning_merges_across_the_prompt():
    """With thinking on, the prompt ends in `<think>\\n`; a turn that starts with `\\n</think>` (no reasoning) is
    tokenized apart from it by the engine, as a model writes it, but a fresh render merges the two newlines into one
    token. The record stays exact turn by turn (the drift guard passes); only its whole-text re-tokenization differs,
    and at that one place."""
    tokenizer, template, parser, trajectory = run("qwen3.5", reasoning=True, answer_reasoning=False)
    assert trajectory.status == "success"
    assert find_drift(trajectory, _chat(tokenizer, template, trajectory), parser) is None
    ids = trajectory.tokens.prompt_ids + trajectory.tokens.completion_ids
    fresh = tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False)
    at = next(i for i, (a, b) in enumerate(zip(ids, fresh, strict=False)) if a != b)
    assert [tokenizer.decode([t]) for t in ids[at - 1: at + 2]] == ["<think>", "\n", "\n"]
    assert [tokenizer.decode([t]) for t in fresh[at - 1: at + 1]] == ["<think>", "\n\n"]
