"""Multi-turn episodes of the new formats' families through the real engine, token-exact.

Qwen3-Coder and Qwen3.5 (XML calls) as one sequence: the same episode and checks as test_family_episodes (parallel
calls, a failing tool, three tool turns, an answer, a later user message and one more call; ids equal to a fresh
render, every call parses back, the drift guard passes), with the `qwen3_xml` parser that `auto` picks. Qwen3.5's own
template drops past reasoning, so it runs on TRL's training variant; a model thinking there writes reasoning in every
turn, as the scripted policy does. gpt-oss and Mistral rewrite earlier turns: their episodes branch into one exact
sample per turn.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.chat.test_family_episodes import Dictionary, _chat, check_episode
from trajlab.chat.context import context_for_run
from trajlab.chat.parsers import QwenXmlParser, get_parser
from trajlab.chat.template import ChatTemplate, own_template, resolve_chat, resolve_chat_template
from trajlab.env.registry import EnvSpec
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.families import load_family_tokenizer
from trajlab.rollout.drift import check_token_drift, find_drift
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
    template, context = resolve_chat(tokenizer, kwargs)
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


def _branched_policy(family: str):
    """Mistral: parallel calls, with the 9-character ids its model writes; gpt-oss: one call a turn, each with its
    analysis, and answers with theirs. Both: a failing lookup, an answer, a later question, a call, an answer."""
    plan = [["apple", "pear"], ["zzz"], ["plum"], [], ["fig"], []] if family == "mistral-nemo" else [
        ["apple"], ["pear"], ["zzz"], ["plum"], [], ["fig"], []]
    ids = iter(f"mIsTrAl{n:02d}" for n in range(20))

    def policy(task, messages):
        turn = sum(1 for m in messages if m["role"] == "assistant")
        words = plan[turn]
        message = {"role": "assistant", "content": "" if words else f"Answer {turn}: all fruits. 果物です。"}
        if words:
            message["tool_calls"] = [{"id": next(ids), "type": "function", "function": {
                "name": "lookup", "arguments": {"word": word}}} for word in words]
        return message | ({"thinking": f"Turn {turn}."} if family == "gpt-oss" else {})

    return policy


@pytest.mark.parametrize("family", ["mistral-nemo", "gpt-oss"])
def test_history_rewriting_families_branch_one_exact_sample_per_turn(family):
    """Their templates rewrite earlier turns (Mistral's system prompt and tool list follow the last user message,
    gpt-oss drops earlier analysis once an answer follows), so the episode is one sample per turn: each prompt the
    fresh render of the conversation before it, each completion the turn as the template writes it, which parses
    back into the turn's message."""
    tokenizer = load_family_tokenizer(family)
    template = resolve_chat_template(tokenizer, on_unsafe="branch")
    assert template == own_template(tokenizer)
    context = context_for_run(template)
    spec = EnvSpec(name="dictionary", env_cls=Dictionary, system_prompt="You know words.")
    parser = get_parser("auto", tokenizer)
    engine = RolloutEngine(spec, ScriptedGenerator(_branched_policy(family), tokenizer, template, context=context),
                           tokenizer, chat_template=template, parser=parser, seed=0, context=context)
    if family == "gpt-oss":  # a turn ends at its call or its answer, not at the <|end|> closing its analysis
        assert set(engine.sampling.stop_token_ids) == set(tokenizer.convert_tokens_to_ids(["<|call|>", "<|return|>"]))
    trajectory = asyncio.run(engine.run_episode(Episode("e", {})))
    assert trajectory.status == "success" and trajectory.tokens is None and trajectory.metrics["tool_errors"] == 1
    assert trajectory.metrics["parse_errors"] == 0 and [m["role"] for m in trajectory.messages].count("user") == 2
    chat = ChatTemplate(tokenizer, trajectory.tools, template, context=context)
    assistants = [i for i, m in enumerate(trajectory.messages) if m["role"] == "assistant"]
    assert len(trajectory.branches) == len(assistants)
    ends = {"mistral-nemo": ("</s>",), "gpt-oss": ("<|call|>", "<|return|>")}[family]
    for branch, index in zip(trajectory.branches, assistants, strict=True):
        history, message = trajectory.messages[:index], trajectory.messages[index]
        assert branch.prompt_ids == tokenizer.encode(chat.render(history, add_generation_prompt=True),
                                                     add_special_tokens=False)
        text = tokenizer.decode(branch.completion_ids, skip_special_tokens=False)
        calling = text.startswith("[TOOL_CALLS]") if family == "mistral-nemo" else text.endswith("<|call|>")
        assert text.endswith(ends) and calling == ("tool_calls" in message), text
        if family == "gpt-oss":  # every turn keeps its own analysis, answers included
            assert text.startswith(f"<|channel|>analysis<|message|>{message['thinking']}<|end|>"), text
        parsed = parser.parse(text, tools=trajectory.tools)
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    called = [c["id"] for m in trajectory.messages for c in m.get("tool_calls", [])]
    if family == "mistral-nemo":  # the model's own ids, answered by the tool results
        assert called[:2] == ["mIsTrAl00", "mIsTrAl01"]
        assert [m["tool_call_id"] for m in trajectory.messages if m["role"] == "tool"] == called
    assert check_token_drift([trajectory], tokenizer, template, parser, max_drift=0.0)[0] == [trajectory]
