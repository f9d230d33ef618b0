"""The multi-turn rollout engine: generate until a tool call, execute it, append the result, resume.

Token in, token out: the model's tokens are appended exactly as the generator returned them (loss mask 1, with
their logprobs); everything else (tool results, error notes, the next generation prompt) is appended as the chat
template's delta (loss mask 0). Nothing is re-tokenized, so a trajectory trains on what the model produced.

Many episodes run at once on one event loop: while one waits on a tool, others generate, and a batching generator
serves their turns together. Every failure is stored in the trajectory record; one bad episode never stops a batch.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.chat.parsers import ParsedResponse, ToolCallParser
from trajlab.chat.template import ChatTemplate, stop_token_ids
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.inference.base import GenerationRequest, Generator, SamplingParams
from trajlab.rollout.tools import execute_tool
from trajlab.rollout.types import Status, TokenRecord, Trajectory

EPISODE_COUNTERS = ("turns", "tool_calls", "tool_errors", "parse_errors", "model_tokens")


@dataclass(frozen=True)
class RolloutLimits:
    """Limits applied the same way to every env, and recorded with each trajectory as its stop reason."""

    max_turns: int = 8
    max_episode_tokens: int = 2048
    tool_timeout_s: float = 10.0


@dataclass(frozen=True)
class Episode:
    """A unit of rollout work: serialisable in (id + task), a Trajectory out."""

    id: str
    task: dict[str, Any]
    split: str | None = None
    group: str | None = None


class EpisodeRunner:
    """Runs many episodes at once on one event loop; subclasses say how one episode runs."""

    async def run_episode(self, episode: Episode) -> Trajectory:
        raise NotImplementedError

    async def run(
        self,
        episodes: Iterable[Episode],
        *,
        concurrency: int = 8,
        on_result: Callable[[Trajectory], Awaitable[None] | None] | None = None,
    ) -> list[Trajectory]:
        """Run episodes, at most ``concurrency`` at once; ``on_result`` sees each trajectory as it finishes."""
        episodes = list(episodes)
        self._check(episodes)
        gate = asyncio.Semaphore(concurrency)
        results: list[Trajectory] = []

        async def one(episode: Episode) -> None:
            async with gate:
                trajectory = await self.run_episode(episode)
            results.append(trajectory)
            if on_result is not None:
                maybe = on_result(trajectory)
                if maybe is not None:
                    await maybe

        await asyncio.gather(*(one(episode) for episode in episodes))
        return results

    def _check(self, episodes: list[Episode]) -> None:
        """Refuse episodes this runner cannot run, before any of them starts."""


class RolloutEngine(EpisodeRunner):
    """Runs episodes of one environment with one generator.

    Args:
        env: the environment spec (a fresh env instance is made per episode).
        generator: the policy backend.
        tokenizer: the policy's tokenizer.
        chat_template: a prefix-preserving template (see ``trajlab.chat.template.resolve_chat_template``).
        parser: turns model text into tool calls.
        sampling: sampling settings for every turn (stop tokens default to the template's end-of-turn tokens).
        limits: turn, token and tool-time limits.
        system_prompt: overrides the env's default system prompt; "" means none.
    """

    def __init__(
        self,
        env: EnvSpec,
        generator: Generator,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str,
        parser: ToolCallParser,
        sampling: SamplingParams | None = None,
        limits: RolloutLimits | None = None,
        system_prompt: str | None = None,
    ) -> None:
        self.env = env
        self.generator = generator
        self.tokenizer = tokenizer
        self.parser = parser
        self.limits = limits or RolloutLimits()
        sampling = sampling or SamplingParams()
        if not sampling.stop_token_ids:
            sampling = replace(sampling, stop_token_ids=tuple(stop_token_ids(tokenizer)))
        self.sampling = sampling
        self.system_prompt = env.system_prompt if system_prompt is None else system_prompt
        self.tools = env.tools
        self.chat_template = chat_template
        self.chat = ChatTemplate(tokenizer, self.tools, chat_template)
        self._tool_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="trajlab-tool")

    def with_env(self, env: EnvSpec) -> RolloutEngine:
        """An engine for ``env`` (e.g. the same env with other tool descriptions) with this one's policy, parser,
        sampling, limits and system prompt."""
        return RolloutEngine(env, self.generator, self.tokenizer, chat_template=self.chat_template,
                             parser=self.parser, sampling=self.sampling, limits=self.limits,
                             system_prompt=self.system_prompt)

    async def run_episode(self, episode: Episode) -> Trajectory:
        """Run one episode to its end; errors are recorded in the trajectory, never raised."""
        started = time.perf_counter()
        state = _EpisodeState(episode=episode, messages=[])
        try:
            await self._play(state)
        except Exception as exc:
            state.status, state.stop_reason = "error", "exception"
            state.error = f"{type(exc).__name__}: {exc}"
        state.counters["wall_s"] = time.perf_counter() - started
        return self._record(state)

    async def _play(self, state: _EpisodeState) -> None:
        env = state.env_instance = self.env.make()
        observation = await asyncio.get_running_loop().run_in_executor(
            self._tool_pool, lambda: env.reset(**state.episode.task)
        )
        first_user = observation if observation is not None else state.episode.task.get("prompt")
        if first_user is None:
            raise ValueError("reset() returned no observation and the task has no 'prompt' field")
        state.tools = self._episode_tools(env)
        chat = self.chat if state.tools is self.tools else ChatTemplate(self.tokenizer, state.tools, self.chat_template)
        if self.system_prompt:
            state.messages.append({"role": "system", "content": self.system_prompt})
        state.messages.append({"role": "user", "content": str(first_user)})
        state.tokens = TokenRecord(prompt_ids=chat.prompt_ids(state.messages), completion_ids=[], loss_mask=[],
                                   logprobs=[])

        for turn in range(self.limits.max_turns):
            budget = self.limits.max_episode_tokens - len(state.tokens.prompt_ids) - len(state.tokens.completion_ids)
            if budget <= 0:
                state.stop_reason = "max_episode_tokens"
                return
            params = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, budget))
            request = GenerationRequest(
                prompt_ids=state.tokens.prompt_ids + state.tokens.completion_ids,
                params=params,
                messages=[dict(m) for m in state.messages],
                tools=state.tools,
                task=state.episode.task,
            )
            result = await self.generator.generate(request)
            state.tokens.extend(result.token_ids, trained=True, logprobs=result.logprobs)
            state.counters["turns"] += 1
            state.counters["model_tokens"] += len(result.token_ids)
            if result.text_only:  # re-tokenized reply text: the record is not token-exact, and says so
                state.counters["text_only"] = 1.0

            text = self.tokenizer.decode(result.token_ids, skip_special_tokens=False)
            if result.finish_reason == "length":
                state.turn_rewards.append(0.0)
                # The turn was cut mid-way: keep its text, but do not act on a half-written call.
                state.messages.append({"role": "assistant", "content": text})
                state.stop_reason = "max_new_tokens" if params.max_new_tokens < budget else "max_episode_tokens"
                return
            prefix = self.tokenizer.decode(request.prompt_ids[-64:], skip_special_tokens=False)
            parsed = self.parser.parse(text, prefix=prefix)
            if parsed.errors:
                # A turn with a malformed call executes none of its calls, and the record keeps what the model
                # wrote (minus the stop token) so the messages still match the tokens.
                raw = self.tokenizer.decode(result.token_ids[:-1], skip_special_tokens=False)
                parsed = ParsedResponse(content=raw, errors=parsed.errors)
            state.messages.append(_assistant_message(parsed, turn))
            acting = bool(parsed.tool_calls or parsed.errors)
            reward_before = float(env.reward or 0.0)
            calls_rewarded = len(env.turn_rewards or [])
            new_messages = await self._observe(state, env, parsed, turn) if acting else []
            if not parsed.errors and not env.done:
                follow_up = await self._next_user_message(env, None if acting else parsed.content)
                if follow_up is not None:
                    new_messages.append({"role": "user", "content": str(follow_up)})
            state.turn_rewards.append(
                sum(env.turn_rewards[calls_rewarded:]) if env.turn_rewards is not None
                else float(env.reward or 0.0) - reward_before
            )
            if not new_messages:  # the model answered and nobody speaks next
                state.tokens.extend(chat.closing_ids(state.messages), trained=False)
                state.stop_reason = "env_done" if env.done else "no_tool_call"
                return
            ending = bool(env.done) or turn == self.limits.max_turns - 1
            obs_ids = chat.observation_ids(state.messages, new_messages, add_generation_prompt=not ending)
            state.messages.extend(new_messages)
            state.tokens.extend(obs_ids, trained=False)
            if env.done:
                state.stop_reason = "env_done"
                return
        state.stop_reason = "max_turns"

    async def _observe(
        self, state: _EpisodeState, env: Any, parsed: ParsedResponse, turn: int
    ) -> list[dict[str, Any]]:
        """Execute the turn's tool calls in order and build the observation messages."""
        new_messages = []
        for index, call in enumerate(parsed.tool_calls):
            state.counters["tool_calls"] += 1
            if env.done:
                content, error = "Error: the episode is over; this call was not executed.", "episode_over"
            else:
                outcome = await execute_tool(env, call.name, call.arguments, self._callable_schemas(env, state),
                                             timeout_s=self.limits.tool_timeout_s, executor=self._tool_pool)
                content, error = outcome.content, outcome.error
            if error is not None:
                state.counters["tool_errors"] += 1
                state.counters[f"tool_errors/{error}"] += 1
            new_messages.append(
                {"role": "tool", "tool_call_id": _call_id(turn, index), "name": call.name, "content": content}
            )
        if parsed.errors:
            state.counters["parse_errors"] += len(parsed.errors)
            note = "\n".join(parsed.errors)
            new_messages.append({"role": "user", "content": f"Nothing in your last turn was executed. {note}"})
        return new_messages

    def _episode_tools(self, env: Any) -> list[dict[str, Any]]:
        """The tools shown to the model this episode: the env's ``episode_tools`` if it set them, else all.

        Either way the schemas shown are the spec's, so a tool it describes differently
        (``EnvSpec.tool_descriptions``) is shown with that description.
        """
        chosen = getattr(env, "episode_tools", None)
        if chosen is None:
            return self.tools
        offered = {tool["function"]["name"]: tool for tool in self.tools}
        unknown = sorted({schema["function"]["name"] for schema in chosen} - set(offered))
        if unknown:
            raise ValueError(
                f"{type(env).__name__}.episode_tools names {unknown}, which are not tools of the class: every tool "
                "offered in an episode must be a public method of the env."
            )
        return [offered[schema["function"]["name"]] for schema in chosen]

    def _callable_schemas(self, env: Any, state: _EpisodeState) -> dict[str, dict[str, Any]]:
        """Tools the model may call now: the episode's list as the env holds it now (it may have announced more)."""
        tools = getattr(env, "episode_tools", None) or state.tools
        return {schema["function"]["name"]: schema for schema in tools}

    async def _next_user_message(self, env: Any, answer: str | None) -> str | None:
        hook = getattr(env, "_next_user_message", None)
        if hook is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._tool_pool, hook, answer)

    def _record(self, state: _EpisodeState) -> Trajectory:
        env = state.env_instance
        reward = float(getattr(env, "reward", 0.0) or 0.0) if env is not None else 0.0
        status: Status
        if state.status == "error":
            status = "error"
        elif env is not None and _succeeded(env, reward):
            status = "success"
        elif state.stop_reason in ("max_turns", "max_episode_tokens", "max_new_tokens"):
            status = "truncated"
        else:
            status = "failure"
        metrics = {name: float(value) for name, value in state.counters.items()}
        if env is not None:
            for name, value in (getattr(env, "metrics", None) or {}).items():
                if isinstance(value, int | float):
                    metrics[f"env/{name}"] = float(value)
        return Trajectory(
            id=state.episode.id,
            env=self.env.name,
            task=state.episode.task,
            messages=state.messages,
            tools=state.tools if state.tools is not None else self.tools,
            reward=reward,
            status=status,
            metrics=metrics,
            tokens=state.tokens,
            turn_rewards=state.turn_rewards if state.tokens is not None else None,
            stop_reason=state.stop_reason,
            error=state.error,
            policy=self.generator.name,
            split=state.episode.split,
            group=state.episode.group,
        )


class MixtureEngine(EpisodeRunner):
    """Runs episodes of several envs with one generator: each episode goes to the engine of its task's env.

    The envs share the generator, so their turns batch together; each keeps its own tools, system prompt and
    tool-call validation, and each trajectory is recorded under its own env's name.
    """

    def __init__(self, mixture: EnvMixture, generator: Generator, tokenizer: PreTrainedTokenizerBase,
                 **options: Any) -> None:
        self.mixture = mixture
        self.engines = {name: RolloutEngine(spec, generator, tokenizer, **options)
                        for name, spec in mixture.specs.items()}

    def _check(self, episodes: list[Episode]) -> None:
        for episode in episodes:  # a task for no env of the mixture is a caller's error: say so before any work
            self.mixture.spec_for(episode.task)

    async def run_episode(self, episode: Episode) -> Trajectory:
        return await self.engines[self.mixture.spec_for(episode.task).name].run_episode(episode)


def make_engine(
    env: EnvSpec | EnvMixture, generator: Generator, tokenizer: PreTrainedTokenizerBase, **options: Any
) -> RolloutEngine | MixtureEngine:
    """The engine for one env or a mixture; ``options`` are :class:`RolloutEngine`'s keyword arguments."""
    if isinstance(env, EnvMixture):
        return MixtureEngine(env, generator, tokenizer, **options)
    return RolloutEngine(env, generator, tokenizer, **options)


@dataclass
class _EpisodeState:
    episode: Episode
    messages: list[dict[str, Any]]
    tokens: TokenRecord | None = None
    tools: list[dict[str, Any]] | None = None  # the tools shown this episode
    env_instance: Any = None
    status: Status | None = None
    stop_reason: str = ""
    error: str | None = None
    turn_rewards: list[float] = field(default_factory=list)  # one per model turn
    counters: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float, dict.fromkeys(EPISODE_COUNTERS, 0.0))
    )


def _succeeded(env: Any, reward: float) -> bool:
    verdict = getattr(env, "success", None)
    return bool(verdict) if verdict is not None else reward >= 1.0


def _call_id(turn: int, index: int) -> str:
    return f"call_{turn}_{index}"


def _assistant_message(parsed: ParsedResponse, turn: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": _call_id(turn, i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(parsed.tool_calls)
        ]
    return message

