"""The engine against envs that misbehave, with a scripted text policy standing in for a model.

``ReplayText`` is a fake model: it emits fixed assistant texts as tokens, so each malformed output can be tested
on purpose. Real-model rollouts are tested in tests/inference/test_hf.py.
"""

import asyncio
import time

import pytest

from trajlab.chat.parsers import get_parser
from trajlab.env import Environment
from trajlab.env.registry import EnvSpec
from trajlab.inference.base import GenerationRequest, GenerationResult
from trajlab.rollout.engine import Episode, RolloutEngine


class ReplayText:
    """Fake model: replays scripted assistant texts (one per turn) as token ids."""

    name = "replay"

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, texts

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        turn = sum(m["role"] == "assistant" for m in request.messages)
        ids = self.tokenizer.encode(self.texts[turn], add_special_tokens=False)
        limit = request.params.max_new_tokens
        if len(ids) > limit:
            return GenerationResult(ids[:limit], [-1.0] * limit, "length")
        return GenerationResult(ids, [-1.0] * len(ids), "stop")


class Flaky(Environment):
    """Tools that fail in every way a tool can."""

    def reset(self, **task):
        super().reset()
        if task.get("explode"):
            raise RuntimeError("reset failed")
        return "Go."

    def boom(self, x: int) -> str:
        """Raise.

        Args:
            x: anything
        """
        raise RuntimeError("kaboom")

    def slow(self) -> str:
        """Sleep past the timeout."""
        time.sleep(1.0)
        return "late"

    def add(self, a: int, b: int) -> str:
        """Add.

        Args:
            a: first
            b: second
        """
        return str(a + b)

    def finish(self) -> str:
        """End the episode successfully."""
        self.done, self.reward = True, 1.0
        return "Done."


SPEC = EnvSpec(name="flaky", env_cls=Flaky, system_prompt="Test.")


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'


def make_engine(tokenizer, template, texts, **limits):
    return RolloutEngine(SPEC, ReplayText(tokenizer, texts), tokenizer, chat_template=template,
                         parser=get_parser("hermes"), limits=dict(tool_timeout_s=0.2, **limits))


def check_tokens(trajectory, tokenizer, template, add_generation_prompt=False):
    tokens = trajectory.tokens
    assert len(tokens.completion_ids) == len(tokens.loss_mask) == len(tokens.logprobs)
    rendered = tokenizer.apply_chat_template(trajectory.messages, tools=trajectory.tools, tokenize=False,
                                             chat_template=template, add_generation_prompt=add_generation_prompt)
    assert tokenizer.decode(tokens.prompt_ids + tokens.completion_ids, skip_special_tokens=False) == rendered


def test_errors_become_observations_and_the_episode_goes_on(tiny_tokenizer, tiny_template):
    texts = [
        call("boom", '{"x": 1}'),
        call("slow", "{}"),
        call("add", '{"a": "abc", "c": 1}'),
        call("nope", "{}"),
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call><|im_end|>',
        call("add", '{"a": 2, "b": 3}'),
        call("finish", "{}"),
    ]
    engine = make_engine(tiny_tokenizer, tiny_template, texts, max_turns=10)
    started = time.perf_counter()
    trajectory = asyncio.run(engine.run_episode(Episode("e0", {})))
    assert time.perf_counter() - started < 1.0, "a timed-out tool must not hold the episode"
    assert trajectory.status == "success" and trajectory.stop_reason == "env_done"
    m = trajectory.metrics
    assert m["tool_calls"] == 6 and m["tool_errors"] == 4 and m["parse_errors"] == 1 and m["turns"] == 7
    for kind in ("exception", "timeout", "bad_arguments", "unknown_tool"):
        assert m[f"tool_errors/{kind}"] == 1
    observations = [msg["content"] for msg in trajectory.messages if msg["role"] in ("tool", "user")][1:]
    assert "kaboom" in observations[0]
    assert "did not finish within 0.2 seconds" in observations[1]
    assert "argument 'a'" in observations[2] and "unknown argument 'c'" in observations[2]
    assert "missing required argument 'b'" in observations[2]
    assert "Expected add(a: integer, b: integer)" in observations[2]
    assert "unknown tool 'nope'" in observations[3] and "add, boom, finish, slow" in observations[3]
    assert observations[4].startswith("Nothing in your last turn was executed. ")
    assert "not valid JSON" in observations[4]
    assert observations[5] == "5"
    check_tokens(trajectory, tiny_tokenizer, tiny_template)


def test_loss_mask_is_one_on_exactly_the_model_tokens(tiny_tokenizer, tiny_template):
    texts = [call("add", '{"a": 2, "b": 3}'), call("finish", "{}")]
    trajectory = asyncio.run(make_engine(tiny_tokenizer, tiny_template, texts).run_episode(Episode("e", {})))
    tokens = trajectory.tokens
    model_ids = [tok for tok, bit in zip(tokens.completion_ids, tokens.loss_mask, strict=True) if bit]
    expected = sum((tiny_tokenizer.encode(t, add_special_tokens=False) for t in texts), [])
    assert model_ids == expected
    assert all(lp == -1.0 for lp, bit in zip(tokens.logprobs, tokens.loss_mask, strict=True) if bit)
    assert all(lp is None for lp, bit in zip(tokens.logprobs, tokens.loss_mask, strict=True) if not bit)


def test_max_turns_truncates(tiny_tokenizer, tiny_template):
    texts = [call("add", '{"a": 1, "b": 1}')] * 3
    trajectory = asyncio.run(make_engine(tiny_tokenizer, tiny_template, texts, max_turns=3).run_episode(
        Episode("e", {})))
    assert trajectory.status == "truncated" and trajectory.stop_reason == "max_turns"
    assert trajectory.metrics["turns"] == 3
    check_tokens(trajectory, tiny_tokenizer, tiny_template)


def test_plain_answer_ends_the_episode_as_failure(tiny_tokenizer, tiny_template):
    trajectory = asyncio.run(make_engine(tiny_tokenizer, tiny_template, ["I give up.<|im_end|>"]).run_episode(
        Episode("e", {})))
    assert trajectory.status == "failure" and trajectory.stop_reason == "no_tool_call"
    assert trajectory.messages[-1] == {"role": "assistant", "content": "I give up."}
    check_tokens(trajectory, tiny_tokenizer, tiny_template)


def test_a_broken_episode_is_recorded_and_the_batch_goes_on(tiny_tokenizer, tiny_template):
    engine = make_engine(tiny_tokenizer, tiny_template, [call("finish", "{}")])
    results = asyncio.run(engine.run([Episode("bad", {"explode": True}), Episode("good", {})], concurrency=2))
    by_id = {t.id: t for t in results}
    assert by_id["bad"].status == "error" and "reset failed" in by_id["bad"].error
    assert by_id["good"].status == "success"


@pytest.mark.parametrize("room", [45, 70])
def test_model_tokens_never_exceed_the_episode_budget(tiny_tokenizer, tiny_template, room):
    texts = [call("add", '{"a": 1, "b": 1}')] * 8
    free = asyncio.run(make_engine(tiny_tokenizer, tiny_template, texts, max_turns=8).run_episode(Episode("e", {})))
    budget = len(free.tokens.prompt_ids) + room
    assert budget < len(free.tokens.prompt_ids) + len(free.tokens.completion_ids), "budget must bite mid-episode"
    trajectory = asyncio.run(make_engine(tiny_tokenizer, tiny_template, texts, max_turns=8,
                                         max_episode_tokens=budget).run_episode(Episode("e", {})))
    tokens = trajectory.tokens
    last_model_token = max(i for i, bit in enumerate(tokens.loss_mask) if bit)
    assert len(tokens.prompt_ids) + last_model_token + 1 <= budget
    assert trajectory.status == "truncated"
    assert trajectory.stop_reason in ("max_episode_tokens", "max_new_tokens")


def test_turn_rewards_align_with_model_turns(tiny_tokenizer, tiny_template):
    # Flaky has no dense rewards, so a turn's reward is its change in env.reward: only `finish` pays.
    texts = [call("add", '{"a": 2, "b": 3}'), "thinking<|im_end|>"]
    trajectory = asyncio.run(make_engine(tiny_tokenizer, tiny_template, texts).run_episode(Episode("e", {})))
    assert trajectory.turn_rewards == [0.0, 0.0]
    trajectory = asyncio.run(make_engine(tiny_tokenizer, tiny_template, [call("add", '{"a": 2, "b": 3}'),
                                                                          call("finish", "{}")]).run_episode(
        Episode("e", {})))
    assert trajectory.turn_rewards == [0.0, 1.0]


class Conversation(Environment):
    """Two user turns; the second announces a tool the first did not offer (BFCL's missing-function turns)."""

    def reset(self, **task):
        super().reset()
        self.episode_tools = [t for t in CONVERSATION.tools if t["function"]["name"] == "add"]
        self.answers = []
        return "What is 2 + 3?"

    def add(self, a: int, b: int) -> str:
        """Add.

        Args:
            a: first
            b: second
        """
        return str(a + b)

    def mul(self, a: int, b: int) -> str:
        """Multiply.

        Args:
            a: first
            b: second
        """
        return str(a * b)

    def _next_user_message(self, answer):
        if answer is None:
            return None
        self.answers.append(answer)
        self.reward += 0.5
        if len(self.answers) == 1:
            self.episode_tools = CONVERSATION.tools
            return "You can now use mul. What is 4 * 5?"
        self.done = True
        return None


CONVERSATION = EnvSpec(name="conversation", env_cls=Conversation)


def test_an_env_can_offer_some_tools_and_speak_again_after_an_answer(tiny_tokenizer, tiny_template):
    texts = [
        call("mul", '{"a": 2, "b": 3}'),  # not offered yet: an unknown tool
        call("add", '{"a": 2, "b": 3}'),
        "5<|im_end|>",
        call("mul", '{"a": 4, "b": 5}'),
        "20<|im_end|>",
    ]
    engine = RolloutEngine(CONVERSATION, ReplayText(tiny_tokenizer, texts), tiny_tokenizer,
                           chat_template=tiny_template, parser=get_parser("hermes"))
    trajectory = asyncio.run(engine.run_episode(Episode("c", {})))

    assert [t["function"]["name"] for t in trajectory.tools] == ["add"]
    prompt = tiny_tokenizer.decode(trajectory.tokens.prompt_ids)
    assert "- add(" in prompt and "mul" not in prompt
    observations = [m["content"] for m in trajectory.messages if m["role"] in ("tool", "user")]
    assert observations[1].startswith("Error: unknown tool 'mul'. Available tools: add.")
    assert observations[2:] == ["5", "You can now use mul. What is 4 * 5?", "20"]
    assert trajectory.stop_reason == "env_done" and trajectory.reward == 1.0
    assert trajectory.turn_rewards == [0.0, 0.0, 0.5, 0.0, 0.5], "an answer's reward is credited to its turn"
    check_tokens(trajectory, tiny_tokenizer, tiny_template)


def test_episode_tools_must_be_tools_of_the_class(tiny_tokenizer, tiny_template):
    class Lying(Conversation):
        def reset(self, **task):
            super().reset()
            self.episode_tools = [{"type": "function", "function": {"name": "rm", "parameters": {}}}]
            return "Go."

    engine = RolloutEngine(EnvSpec(name="lying", env_cls=Lying), ReplayText(tiny_tokenizer, ["hi<|im_end|>"]),
                           tiny_tokenizer, chat_template=tiny_template, parser=get_parser("hermes"))
    trajectory = asyncio.run(engine.run_episode(Episode("l", {})))
    assert trajectory.status == "error" and "names ['rm'], which are not tools of the class" in trajectory.error
