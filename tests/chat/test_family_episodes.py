"""Multi-turn tool episodes on the real tokenizers and templates of the chat families trajlab ships.

Each episode goes through the real engine with a scripted policy (a stand-in for the model, named as such: it writes
exactly the text the template renders for its turn): parallel calls where the template allows them, a tool that
fails, three tool turns, an answer, then a later user message and one more call. The episode's ids must equal a
fresh tokenization of the template's render of the final conversation, every call must parse back, and the drift
guard must pass. Qwen3 runs with thinking on and off (``chat_template_kwargs``); Llama's date is pinned, recorded,
and still checks out on another day.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from trajlab.chat.context import TemplateContext, context_for_run
from trajlab.chat.parsers import get_parser
from trajlab.chat.template import render, resolve_chat
from trajlab.env import Environment
from trajlab.env.registry import EnvSpec
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.families import load_family_tokenizer
from trajlab.rollout.drift import check_token_drift, find_drift
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode

WORDS = {"apple": "a fruit", "pear": "another fruit", "plum": "a stone fruit", "fig": "a sweet fruit"}
PARALLEL = {"qwen3": True, "qwen2.5": True, "llama3.1": False, "llama3.2": False}  # Llama takes one call a turn


class Dictionary(Environment):
    """Looks words up; an unknown word is an error. After the first answer the user asks one more question."""

    def reset(self, **task):
        super().reset()
        self.asked = False
        return "What do apple, pear and plum mean? 日本語でも説明して 🍎"

    def lookup(self, word: str) -> str:
        """Look a word up.

        Args:
            word: the word
        """
        if word not in WORDS:
            raise KeyError(f"no entry for {word!r}")
        return WORDS[word]

    def next_user_message(self, answer):
        if answer is None or self.asked:
            if answer is not None:
                self.reward, self.done = 1.0, True
            return None
        self.asked = True
        return "And fig?"


def call(word, index):
    return {"type": "function", "function": {"name": "lookup", "arguments": {"word": word}}}


def scripted_policy(parallel, thinking=True):
    """Stand-in for a model: lookups (two at once where allowed), a failing one, an answer, then fig, an answer;
    with thinking switched off it writes no reasoning, as the model would not."""
    plan = ([["apple", "pear"]] if parallel else [["apple"], ["pear"]]) + [["zzz"], ["plum"], [], ["fig"], []]

    def policy(task, messages):
        turn = sum(1 for m in messages if m["role"] == "assistant")
        words = plan[turn]
        if not words:
            return {"role": "assistant", "content": f"Answer {turn}: all fruits. 果物です。"}
        message = {"role": "assistant", "content": "", "tool_calls": [call(word, i) for i, word in enumerate(words)]}
        return message | ({"reasoning_content": f"Looking up {', '.join(words)}."} if thinking else {})

    return policy


def run(family, kwargs=None, today=None):
    tokenizer = load_family_tokenizer(family)
    template, context = resolve_chat(tokenizer, kwargs)
    if today is not None:
        context = context_for_run(template, kwargs, today=today)
    spec = EnvSpec(name="dictionary", env_cls=Dictionary, system_prompt="You know words.")
    thinking = (kwargs or {}).get("enable_thinking", True)
    generator = ScriptedGenerator(scripted_policy(PARALLEL[family], thinking), tokenizer, template, context=context)
    parser = get_parser("auto", tokenizer)
    engine = RolloutEngine(spec, generator, tokenizer, chat_template=template, parser=parser, seed=0, context=context)
    trajectory = asyncio.run(engine.run_episode(Episode("e", {})))
    return tokenizer, template, parser, trajectory


def check_episode(tokenizer, template, parser, trajectory):
    assert trajectory.status == "success", trajectory.error or trajectory.stop_reason
    roles = [m["role"] for m in trajectory.messages]
    assert roles.count("user") == 2 and trajectory.metrics["tool_calls"] >= 4
    assert trajectory.metrics["tool_errors"] == 1
    assert any("no entry for 'zzz'" in str(m["content"]) for m in trajectory.messages if m["role"] == "tool")
    tokens = trajectory.tokens
    context = TemplateContext.from_record(trajectory.template_context)
    rendered = render(tokenizer, trajectory.messages, trajectory.tools, chat_template=template, context=context)
    assert tokens.prompt_ids + tokens.completion_ids == tokenizer.encode(rendered, add_special_tokens=False)
    called = [c["function"]["arguments"]["word"] for m in trajectory.messages for c in m.get("tool_calls", [])]
    assert called[-2:] == ["plum", "fig"] and "zzz" in called
    assert find_drift(trajectory, _chat(tokenizer, template, trajectory), parser) is None
    assert check_token_drift([trajectory], tokenizer, template, parser, max_drift=0.0)[0] == [trajectory]


def _chat(tokenizer, template, trajectory):
    from trajlab.chat.template import ChatTemplate

    return ChatTemplate(tokenizer, trajectory.tools, template,
                        context=TemplateContext.from_record(trajectory.template_context))


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1"])
def test_episode_is_token_exact_on_the_real_tokenizer(family):
    check_episode(*run(family))


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_with_thinking_on_and_off(thinking):
    tokenizer, template, parser, trajectory = run("qwen3", {"enable_thinking": thinking})
    check_episode(tokenizer, template, parser, trajectory)
    assert trajectory.template_context == {"kwargs": {"enable_thinking": thinking}}
    first_turn = tokenizer.decode(trajectory.tokens.prompt_ids[-8:], skip_special_tokens=False)
    assert first_turn.endswith("<think>\n\n</think>\n\n") is not thinking  # thinking off: the template closes it
    other = trajectory.model_copy(update={"template_context": {"kwargs": {"enable_thinking": not thinking}}})
    assert check_token_drift([other], tokenizer, template, parser, max_drift=1.0)[1], "the kwargs matter"


def test_llama_date_is_pinned_recorded_and_checks_out_on_another_day():
    tokenizer, template, parser, trajectory = run("llama3.2", today=dt.date(2024, 7, 26))
    check_episode(tokenizer, template, parser, trajectory)
    assert trajectory.template_context == {"date": "2024-07-26"}
    prompt = tokenizer.decode(trajectory.tokens.prompt_ids, skip_special_tokens=False)
    assert "Today Date: 26 Jul 2024" in prompt
    # today is not 2024-07-26: a record without its date would render today's and drift
    undated = trajectory.model_copy(update={"template_context": {}})
    assert check_token_drift([undated], tokenizer, template, parser, max_drift=1.0)[1]


def test_a_run_pins_todays_date_only_for_templates_that_read_it():
    llama = load_family_tokenizer("llama3.2")
    assert context_for_run(llama.chat_template, today=dt.date(2026, 1, 2)).date == "2026-01-02"
    assert context_for_run(load_family_tokenizer("qwen3").chat_template).date is None


@pytest.mark.parametrize("bad, message", [({"messages": []}, "set by trajlab"), ({"1x": 1}, "not a template variable"),
                                          ({"strftime_now": "x"}, "date a template reads is pinned")])
def test_bad_template_kwargs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        TemplateContext(kwargs=bad)
