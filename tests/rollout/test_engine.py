"""The engine against envs that misbehave, with a scripted text policy standing in for a model.

``ReplayText`` is a fake model: it emits fixed assistant texts as tokens, so each malformed output can be tested
on purpose. Real-model rollouts are tested in tests/inference/test_hf.py.
"""

import asyncio
import threading
import time

import pytest

from trajlab.chat.parsers import get_parser
from trajlab.env import Environment
from trajlab.env.limits import EpisodeLimits
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.errors import InfrastructureError
from trajlab.inference.base import GenerationRequest, GenerationResult, SamplingParams
from trajlab.rollout import engine as engine_module
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


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
                         parser=get_parser("hermes"), limits={"tool_timeout_s": 0.2, **limits}, seed=0)


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
    results = asyncio.run(engine.run([Episode("bad", {"explode": True}), Episode("good", {})], concurrency=2,
                                     retries=0, retry_backoff_s=1.0))
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

    def next_user_message(self, answer):
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
                           chat_template=tiny_template, parser=get_parser("hermes"), seed=0)
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
                           tiny_tokenizer, chat_template=tiny_template, parser=get_parser("hermes"), seed=0)
    trajectory = asyncio.run(engine.run_episode(Episode("l", {})))
    assert trajectory.status == "error" and "names ['rm'], which are not tools of the class" in trajectory.error


class Closing(Flaky):
    """Records its close() calls; fails to close when the task says so."""

    closed: list[str] = []

    def reset(self, **task):
        self.task = task
        return super().reset(**task)

    def close(self):
        Closing.closed.append(self.task.get("name", "?"))
        if self.task.get("bad_close"):
            raise OSError("disk gone")


def test_close_is_called_once_for_every_episode_however_it_ends(tiny_tokenizer, tiny_template):
    spec = EnvSpec(name="closing", env_cls=Closing, system_prompt="Test.")
    texts = [call("boom", '{"x": 1}'), call("finish", "{}")]
    engine = RolloutEngine(spec, ReplayText(tiny_tokenizer, texts), tiny_tokenizer, chat_template=tiny_template,
                           parser=get_parser("hermes"), seed=0)
    Closing.closed.clear()
    tasks = {"ok": {}, "reset raises": {"explode": True}, "close raises": {"bad_close": True}}
    with engine:
        results = asyncio.run(engine.run([Episode(name, {"name": name, **task}) for name, task in tasks.items()],
                                         concurrency=3, retries=0, retry_backoff_s=1.0))
    by_id = {t.id: t for t in results}
    assert sorted(Closing.closed) == sorted(tasks), "one close() per episode, also after reset or a tool raised"
    assert by_id["ok"].status == "success" and by_id["ok"].error is None
    assert by_id["ok"].metrics["tool_errors/exception"] == 1
    assert by_id["reset raises"].status == "error" and by_id["reset raises"].error == "RuntimeError: reset failed"
    assert by_id["close raises"].status == "success", "the episode's outcome stands; the failed close is recorded"
    assert by_id["close raises"].error == "close() failed: OSError: disk gone"


class Stuck(Flaky):
    def hang(self) -> str:
        """Block far past the timeout."""
        time.sleep(2.0)
        return "late"


def trajlab_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("trajlab-stuck")]


def test_a_stuck_tool_never_starves_other_episodes_and_closing_the_engine_stops_its_threads(
        tiny_tokenizer, tiny_template):
    spec = EnvSpec(name="stuck", env_cls=Stuck, system_prompt="Test.")
    texts = [call("hang", "{}"), call("add", '{"a": 1, "b": 2}'), call("finish", "{}")]
    engine = RolloutEngine(spec, ReplayText(tiny_tokenizer, texts), tiny_tokenizer, chat_template=tiny_template,
                           parser=get_parser("hermes"), limits={"tool_timeout_s": 0.2}, seed=0)
    started = time.perf_counter()
    results = asyncio.run(engine.run([Episode(str(i), {}) for i in range(6)], concurrency=2, retries=0,
                                     retry_backoff_s=1.0))
    assert time.perf_counter() - started < 1.5, "six episodes, each with a stuck tool, ran without waiting for one"
    assert all(t.status == "success" and t.metrics["tool_errors/timeout"] == 1 for t in results)
    assert all(t.messages[5]["content"] == "3" for t in results), "the call after a timeout got a thread at once"
    assert engine._threads.size == 2, "threads are sized by the episodes in flight"
    derived = engine.with_env(spec.with_tool_descriptions({"add": "Add two numbers."}))
    assert derived._threads is engine._threads, "an engine derived with with_env shares its threads"
    derived.close()
    assert not engine._threads.closed, "only the owner closes them"
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(engine.run_episode(Episode("late", {})))
    deadline = time.monotonic() + 5
    while trajlab_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not trajlab_threads(), "every thread exits: idle ones at close, stuck ones when their call returns"


def test_limits_are_the_envs_own_with_the_users_overrides(tiny_tokenizer, tiny_template):
    spec = EnvSpec(name="limited", env_cls=Flaky, limits=EpisodeLimits(max_turns=3, max_new_tokens=40))
    engine = RolloutEngine(spec, ReplayText(tiny_tokenizer, []), tiny_tokenizer, chat_template=tiny_template,
                           parser=get_parser("hermes"), sampling=SamplingParams(max_new_tokens=999, temperature=0.5),
                           limits={"max_turns": 5, "max_new_tokens": None}, seed=0)
    assert engine.limits == EpisodeLimits(max_turns=5, max_new_tokens=40)
    assert engine.sampling.max_new_tokens == 40 and engine.sampling.temperature == 0.5
    assert engine.with_env(spec).limits == engine.limits

    mixture = EnvMixture({"limited": spec, "plain": EnvSpec(name="plain", env_cls=Flaky)})
    with engine_module.make_engine(mixture, ReplayText(tiny_tokenizer, []), tiny_tokenizer, chat_template=tiny_template,
                                   parser=get_parser("hermes"), limits={"tool_timeout_s": 1.0}, seed=0) as mixed:
        assert mixed.engines["limited"].limits == EpisodeLimits(max_turns=3, max_new_tokens=40, tool_timeout_s=1.0)
        assert mixed.engines["plain"].limits == EpisodeLimits(tool_timeout_s=1.0)
    assert all(sub._threads.closed for sub in mixed.engines.values()), "a mixture closes its envs' engines"


def test_an_episodes_group_is_recorded_and_turns_read_the_vocabulary_no_more(
        tiny_tokenizer, tiny_template, monkeypatch):
    texts = [call("add", '{"a": 1, "b": 1}')] * 3 + [call("finish", "{}")]
    engine = make_engine(tiny_tokenizer, tiny_template, texts)
    reads = []
    real = tiny_tokenizer.get_vocab
    monkeypatch.setattr(tiny_tokenizer, "get_vocab", lambda: reads.append(1) or real())
    trajectory = asyncio.run(engine.run_episode(Episode("e", {}, group="task-7")))
    assert trajectory.group == "task-7" and trajectory.metrics["turns"] == 4
    assert reads == [], "the vocabulary is read when the engine is built, not on every turn"


class Outage:
    """Fault injection, named as such: the replayed policy behind a server that refuses its first ``failures``
    requests, as a generator server does while it restarts."""

    name = "outage"

    def __init__(self, policy: ReplayText, failures: int):
        self.policy, self.failures = policy, failures

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("connection refused")
        return await self.policy.generate(request)


class Crashing(Flaky):
    """A tool whose sandbox the host killed: the machinery's failure, not a result for the model."""

    crashes = 1

    def run(self) -> str:
        """Run a command."""
        if Crashing.crashes > 0:
            Crashing.crashes -= 1
            raise InfrastructureError("the sandbox was killed by the host (SIGKILL)")
        return "ok"


def test_an_outage_ends_episodes_as_errors_with_their_cause_and_retries_recover_them(tiny_tokenizer, tiny_template):
    texts = [call("finish", "{}")]

    def run(failures: int, retries: int):
        engine = RolloutEngine(SPEC, Outage(ReplayText(tiny_tokenizer, texts), failures), tiny_tokenizer,
                               chat_template=tiny_template, parser=get_parser("hermes"), seed=0)
        episodes = [Episode(f"e{i}", {}) for i in range(3)]
        return sorted(asyncio.run(engine.run(episodes, concurrency=1, retries=retries, retry_backoff_s=0.01)),
                      key=lambda t: t.id)

    kept = run(failures=2, retries=0)
    assert [t.status for t in kept] == ["error", "error", "success"]
    assert kept[0].error == "the generator (outage) failed: ConnectionError: connection refused"
    recovered = run(failures=2, retries=2)
    assert [t.status for t in recovered] == ["success"] * 3
    # e0 failed, then e1 took the free slot and failed; each succeeded on its second attempt
    assert [t.metrics.get("attempts", 1.0) for t in recovered] == [2.0, 2.0, 1.0]
    exhausted = run(failures=100, retries=2)  # a server that stays down: three attempts each, then kept as errors
    assert [t.status for t in exhausted] == ["error"] * 3
    assert [t.metrics.get("attempts") for t in exhausted] == [3.0] * 3


def test_an_infrastructure_error_from_a_tool_is_no_observation(tiny_tokenizer, tiny_template):
    Crashing.crashes = 1
    spec = EnvSpec(name="crashing", env_cls=Crashing, system_prompt="Test.")
    engine = RolloutEngine(spec, ReplayText(tiny_tokenizer, [call("run", "{}"), call("finish", "{}")]),
                           tiny_tokenizer, chat_template=tiny_template, parser=get_parser("hermes"), seed=0)
    [broken] = asyncio.run(engine.run([Episode("e", {})], concurrency=8, retries=0, retry_backoff_s=1.0))
    assert broken.status == "error" and broken.error == "the sandbox was killed by the host (SIGKILL)"
    assert not any(m["role"] == "tool" for m in broken.messages), "the model never saw the host's failure"
    [retried] = asyncio.run(engine.run([Episode("e", {})], concurrency=8, retries=0,
                                       retry_backoff_s=1.0))  # the sandbox works again
    assert retried.status == "success" and retried.metrics["tool_errors"] == 0
