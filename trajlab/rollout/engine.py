"""The multi-turn rollout engine: generate until a tool call, execute it, append the result, resume.

Token in, token out: the model's tokens are appended exactly as the generator returned them (loss mask 1, with
their logprobs); everything else (tool results, error notes, the next generation prompt) is appended as the chat
template's delta (loss mask 0). Nothing is re-tokenized, so a trajectory trains on what the model produced.

Many episodes run at once on one event loop: while one waits on a tool, others generate, and a batching generator
serves their turns together. Every failure is stored in the trajectory record; one bad episode never stops a batch.
Every episode's env is closed (its ``close()`` hook) when the episode ends, however it ends.

What the model does wrong (a malformed call, a failing tool, a wrong answer) is part of its trajectory. What the
machinery does wrong (a generator or server error, an env that cannot start, an ``InfrastructureError`` from env
code) ends the episode with status ``error`` and its cause; such episodes are run again (``retries``) and are
never scored as the policy's failures.
"""

from __future__ import annotations

import functools
import json
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.chat.context import TemplateContext
from trajlab.chat.parsers import ParsedResponse, ToolCall, ToolCallParser
from trajlab.chat.template import ChatTemplate, stop_token_ids
from trajlab.env.base import EnvHandle
from trajlab.env.content import Content, has_images, tool_content
from trajlab.env.limits import EpisodeLimits
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.errors import InfrastructureError
from trajlab.inference.base import GenerationRequest, Generator, SamplingParams, request_seed
from trajlab.rollout.images import decode_png, encode_png
from trajlab.rollout.runner import Episode, EpisodeRunner
from trajlab.rollout.samples import SequenceTokens, TurnBranches
from trajlab.rollout.tools import ToolThreads, execute_tool
from trajlab.rollout.types import Status, Trajectory

EPISODE_COUNTERS = ("turns", "tool_calls", "tool_errors", "parse_errors", "model_tokens")


class RolloutEngine(EpisodeRunner):
    """Runs episodes of one environment with one generator.

    Args:
        env: the environment spec (a fresh env instance is made per episode, and closed when it ends).
        generator: the policy backend.
        tokenizer: the policy's tokenizer.
        chat_template: a prefix-preserving template (see ``trajlab.chat.template.resolve_chat_template``).
        parser: turns model text into tool calls.
        sampling: sampling settings for every turn (stop tokens default to the template's end-of-turn tokens; the
            per-turn ``max_new_tokens`` is the limits', whatever ``sampling`` says).
        limits: the user's overrides of the env's own limits (``EnvSpec.limits``), as ``EpisodeLimits`` field
            names; None values keep the env's. The result is :attr:`limits`.
        system_prompt: overrides the env's default system prompt; "" means none.
        seed: with the episode id and the turn, seeds each turn's sampling (``GenerationRequest.seed``): the same
            episode samples the same tokens in every run, whatever else runs beside it, and so does a retry.
        processor: a vision-language policy's processor, which turns images (from tools, ``reset`` or the user) into
            tokens; None for a text model, which then cannot take an episode that shows it an image.
        context: the chat template's variables and pinned date (recorded with every trajectory).
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
        limits: Mapping[str, int | float | None] | None = None,
        system_prompt: str | None = None,
        seed: int,
        processor: Any = None,
        context: TemplateContext | None = None,
    ) -> None:
        self.env = env
        self.seed = seed
        self.processor = processor
        self.generator = generator
        self.tokenizer = tokenizer
        self.parser = parser
        self.limit_overrides = dict(limits or {})
        self.limits: EpisodeLimits = env.limits.override(**self.limit_overrides)
        sampling = sampling or SamplingParams()
        if not sampling.stop_token_ids:
            sampling = replace(sampling, stop_token_ids=tuple(stop_token_ids(tokenizer)))
        self.sampling = replace(sampling, max_new_tokens=self.limits.max_new_tokens)
        self.system_prompt = env.system_prompt if system_prompt is None else system_prompt
        self.tools = env.tools
        self.chat_template = chat_template
        self.chat = ChatTemplate(tokenizer, self.tools, chat_template, processor, context=context)
        self._threads = ToolThreads(f"trajlab-{env.name}")
        self._owns_threads = True
        self._described: dict[str, RolloutEngine] = {}

    def with_env(self, env: EnvSpec) -> RolloutEngine:
        """An engine for ``env`` (e.g. the same env with other tool descriptions) with this one's policy, parser,
        sampling, limit overrides and system prompt. It shares this engine's threads: closing this one closes both."""
        engine = RolloutEngine(env, self.generator, self.tokenizer, chat_template=self.chat_template,
                               parser=self.parser, sampling=self.sampling, limits=self.limit_overrides,
                               system_prompt=self.system_prompt, seed=self.seed, processor=self.processor,
                               context=self.chat.context)
        engine._threads, engine._owns_threads = self._threads, False
        return engine

    def with_tool_descriptions(self, descriptions: Mapping[str, str]) -> RolloutEngine:
        """This engine showing the model other descriptions of some tools (a prompt-evolution candidate's): itself
        for none, else one engine per set of descriptions, made by :meth:`with_env` once and kept."""
        if not descriptions:
            return self
        key = json.dumps(dict(descriptions), sort_keys=True)
        if key not in self._described:
            self._described[key] = self.with_env(self.env.with_tool_descriptions(dict(descriptions)))
        return self._described[key]

    def close(self) -> None:
        """Stop the threads of env code (a timed-out tool's thread exits when its call returns)."""
        if self._owns_threads:
            self._threads.close()

    async def run_episode(self, episode: Episode) -> Trajectory:
        """Run one episode to its end and close its env; errors are recorded in the trajectory, never raised."""
        if self._threads.closed:
            raise RuntimeError(f"The engine of '{self.env.name}' is closed; make a new one to run more episodes.")
        started = time.perf_counter()
        state = _EpisodeState(episode=episode)
        with self._threads.episode():  # a thread per episode in flight: none waits for another's tool
            try:
                await self._play(state)
            except Exception as exc:
                state.fail(exc)
            finally:
                await self._close_env(state)
        state.counters["wall_s"] = time.perf_counter() - started
        return self._record(state)

    async def _play(self, state: _EpisodeState) -> None:
        """The episode, top to bottom: start it, then model turns until one ends it or the turns run out."""
        await self._start(state)
        for turn in range(self.limits.max_turns):
            stop = await self._turn(state, turn)
            if stop is not None:
                state.stop_reason = stop
                return
        state.stop_reason = "max_turns"

    async def _start(self, state: _EpisodeState) -> None:
        """Make and reset the env, choose the episode's tools and tokenize the first prompt."""
        state.env = env = EnvHandle(self.env.make())
        observation = await self._threads.call(functools.partial(env.reset, state.episode.task))
        first_user = observation if observation is not None else state.episode.task.get("prompt")
        if first_user is None:
            raise ValueError("reset() returned no observation and the task has no 'prompt' field")
        state.tools = self._episode_tools(env)
        state.chat = (self.chat if state.tools is self.tools else self.chat.with_tools(state.tools)).with_images(
            state.image)
        if self.system_prompt:
            state.messages.append({"role": "system", "content": self.system_prompt})
        state.messages.append({"role": "user", "content": _observation(state, first_user)})
        if not self.chat.preserves_prefixes:
            if state.image_order:
                raise ValueError("this chat template rewrites earlier turns, so episodes train one sample per turn, "
                                 "which does not take images yet: use a prefix-preserving template for image envs")
            state.record = TurnBranches()
        else:
            state.record = SequenceTokens(state.chat.prompt_ids(state.messages))

    async def _turn(self, state: _EpisodeState, turn: int) -> str | None:
        """One model turn: generate, parse, act, observe. Returns the stop reason when the episode ends here."""
        record, env = state.record, state.env
        prompt_ids = record.context(state.chat, state.messages)
        budget = self.limits.max_episode_tokens - len(prompt_ids)
        if budget <= 0:
            return "max_episode_tokens"
        params = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, budget))
        if state.episode.greedy:
            params = replace(params, temperature=0.0)

        # --- generate: the model's tokens go into the record exactly as returned ---
        request = GenerationRequest(prompt_ids=prompt_ids, params=params, messages=[dict(m) for m in state.messages],
                                    tools=state.tools, task=state.episode.task,
                                    seed=request_seed(self.seed, state.episode.id, turn),
                                    images=[state.image(image_id) for image_id in state.image_order])
        try:
            result = await self.generator.generate(request)
        except Exception as exc:
            raise InfrastructureError(f"the generator ({self.generator.name}) failed: {type(exc).__name__}: {exc}") \
                from exc
        record.add_model(result.token_ids, result.logprobs)
        state.counters["turns"] += 1
        state.counters["model_tokens"] += len(result.token_ids)
        if result.text_only:  # re-tokenized reply text: the record is not token-exact, and says so
            state.counters["text_only"] = 1.0
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=False)
        if result.finish_reason == "length":
            state.turn_rewards.append(0.0)
            # The turn was cut mid-way: keep its text, but do not act on a half-written call.
            state.messages.append({"role": "assistant", "content": text})
            return "max_new_tokens" if params.max_new_tokens < budget else "max_episode_tokens"

        # --- parse ---
        parsed = self.parser.parse(text, prefix=self.tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False),
                                   tools=state.tools)
        if parsed.errors:
            # A turn with a malformed call executes none of its calls, and the record keeps what the model
            # wrote (minus the stop token) so the messages still match the tokens.
            raw = self.tokenizer.decode(result.token_ids[:-1], skip_special_tokens=False)
            parsed = ParsedResponse(content=raw, errors=parsed.errors)
        state.messages.append(assistant_message(parsed, turn))

        # --- act: run the calls, let the env speak next, credit the turn's reward ---
        acting = bool(parsed.tool_calls or parsed.errors)
        reward_before, calls_rewarded = env.reward, len(env.turn_rewards or [])
        new_messages = await self._act(state, parsed, turn) if acting else []
        if not parsed.errors and not env.done:
            answer = None if acting else parsed.content
            follow_up = await self._threads.call(functools.partial(env.next_user_message, answer))
            if follow_up is not None:
                new_messages.append({"role": "user", "content": _observation(state, follow_up)})
        turn_rewards = env.turn_rewards
        state.turn_rewards.append(sum(turn_rewards[calls_rewarded:]) if turn_rewards is not None
                                  else env.reward - reward_before)

        # --- observe: the template's delta for the new messages, not trained on ---
        if not new_messages:  # the model answered and nobody speaks next
            record.add_closing(state.chat, state.messages)
            return "env_done" if env.done else "no_tool_call"
        ending = env.done or turn == self.limits.max_turns - 1
        record.add_observation(state.chat, state.messages, new_messages, add_generation_prompt=not ending)
        state.messages.extend(new_messages)
        return "env_done" if env.done else None

    async def _act(self, state: _EpisodeState, parsed: ParsedResponse, turn: int) -> list[dict[str, Any]]:
        """Execute the turn's tool calls in order; the messages carry their results and any parse errors."""
        env = state.env
        new_messages = []
        for index, call in enumerate(parsed.tool_calls):
            state.counters["tool_calls"] += 1
            if env.done:
                content, error = "Error: the episode is over; this call was not executed.", "episode_over"
            else:
                outcome = await execute_tool(env, call.name, call.arguments, self._callable_schemas(state),
                                             timeout_s=self.limits.tool_timeout_s, threads=self._threads)
                content, error = state.admit(outcome.content), outcome.error
            if error is not None:
                state.counters["tool_errors"] += 1
                state.counters[f"tool_errors/{error}"] += 1
            new_messages.append(
                {"role": "tool", "tool_call_id": call_id(call, turn, index), "name": call.name, "content": content}
            )
        if parsed.errors:
            state.counters["parse_errors"] += len(parsed.errors)
            note = "\n".join(parsed.errors)
            new_messages.append({"role": "user", "content": f"Nothing in your last turn was executed. {note}"})
        return new_messages

    async def _close_env(self, state: _EpisodeState) -> None:
        """The env's lifecycle end, however the episode ended; a failing ``close()`` is recorded, never raised."""
        if state.env is None:
            return
        try:
            await self._threads.call(state.env.close, timeout_s=self.limits.tool_timeout_s)
        except TimeoutError:
            state.add_error(f"close() did not finish within {self.limits.tool_timeout_s:g} seconds")
        except Exception as exc:
            state.add_error(f"close() failed: {type(exc).__name__}: {exc}")

    def _episode_tools(self, env: EnvHandle) -> list[dict[str, Any]]:
        """The tools shown to the model this episode: the env's ``episode_tools`` if it set them, else all.

        Either way the schemas shown are the spec's, so a tool it describes differently
        (``EnvSpec.tool_descriptions``) is shown with that description.
        """
        chosen = env.episode_tools
        if chosen is None:
            return self.tools
        offered = {tool["function"]["name"]: tool for tool in self.tools}
        unknown = sorted({schema["function"]["name"] for schema in chosen} - set(offered))
        if unknown:
            raise ValueError(
                f"{type(env.env).__name__}.episode_tools names {unknown}, which are not tools of the class: every "
                "tool offered in an episode must be a public method of the env."
            )
        return [offered[schema["function"]["name"]] for schema in chosen]

    def _callable_schemas(self, state: _EpisodeState) -> dict[str, dict[str, Any]]:
        """Tools the model may call now: the episode's list as the env holds it now (it may have announced more)."""
        tools = state.env.episode_tools or state.tools
        return {schema["function"]["name"]: schema for schema in tools}

    def _record(self, state: _EpisodeState) -> Trajectory:
        env = state.env
        reward = env.reward if env is not None else 0.0
        status: Status
        if state.status == "error":
            status = "error"
        elif env is not None and env.success:
            status = "success"
        elif state.stop_reason in ("max_turns", "max_episode_tokens", "max_new_tokens"):
            status = "truncated"
        else:
            status = "failure"
        metrics = {name: float(value) for name, value in state.counters.items()}
        if state.episode.greedy:
            metrics["greedy"] = 1.0
        if env is not None:
            metrics |= {f"env/{name}": value for name, value in env.metrics.items()}
        trajectory = Trajectory(
            id=state.episode.id,
            env=self.env.name,
            task=state.episode.task,
            messages=state.messages,
            tools=state.tools if state.tools is not None else self.tools,
            reward=reward,
            status=status,
            metrics=metrics,
            tokens=state.record.tokens if isinstance(state.record, SequenceTokens) else None,
            branches=state.record.branches if isinstance(state.record, TurnBranches) else None,
            turn_rewards=state.turn_rewards if state.record is not None else None,
            stop_reason=state.stop_reason,
            error=state.error,
            policy=self.generator.name,
            split=state.episode.split,
            group=state.episode.group,
            images=state.image_order,
            template_context=self.chat.context.record(),
        )
        trajectory.attach_images(state.image_data)
        return trajectory


class MixtureEngine(EpisodeRunner):
    """Runs episodes of several envs with one generator: each episode goes to the engine of its task's env.

    The envs share the generator, so their turns batch together; each keeps its own tools, system prompt, limits
    (the user's overrides applied to each env's own) and tool-call validation, and each trajectory is recorded under
    its own env's name.
    """

    def __init__(self, mixture: EnvMixture, generator: Generator, tokenizer: PreTrainedTokenizerBase,
                 **options: Any) -> None:
        self.mixture = mixture
        self.engines = {name: RolloutEngine(spec, generator, tokenizer, **options)
                        for name, spec in mixture.specs.items()}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

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
    """What one episode has built so far; the engine's steps read and extend it."""

    episode: Episode
    messages: list[dict[str, Any]] = field(default_factory=list)
    env: EnvHandle | None = None
    tools: list[dict[str, Any]] | None = None  # the tools shown this episode
    chat: ChatTemplate | None = None  # the template with those tools
    record: SequenceTokens | TurnBranches | None = None  # the episode's tokens so far
    status: Status | None = None
    stop_reason: str = ""
    error: str | None = None
    turn_rewards: list[float] = field(default_factory=list)  # one per model turn
    counters: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float, dict.fromkeys(EPISODE_COUNTERS, 0.0))
    )
    image_order: list[str] = field(default_factory=list)  # the ids of the images seen, in the tokens' order
    image_data: dict[str, bytes] = field(default_factory=dict)  # their PNG bytes
    _decoded: dict[str, Any] = field(default_factory=dict)

    def admit(self, content: Content) -> Content:
        """Content to record: each image part's PIL image kept as PNG bytes and named by its id, so the sampler
        and every later forward pass decode the same bytes."""
        if not has_images(content):
            return content
        admitted = []
        for part in content:
            if part["type"] == "image":
                image_id, data = encode_png(part["image"])
                self.image_data[image_id] = data
                self.image_order.append(image_id)
                part = {"type": "image", "image": image_id}
            admitted.append(part)
        return admitted

    def image(self, image_id: str) -> Any:
        """An image seen this episode, decoded from its PNG bytes once."""
        if image_id not in self._decoded:
            self._decoded[image_id] = decode_png(self.image_data[image_id])
        return self._decoded[image_id]

    def fail(self, exc: Exception) -> None:
        self.status, self.stop_reason = "error", "exception"
        self.add_error(str(exc) if isinstance(exc, InfrastructureError) else f"{type(exc).__name__}: {exc}")

    def add_error(self, message: str) -> None:
        self.error = message if self.error is None else f"{self.error}; {message}"


def _observation(state: _EpisodeState, value: Any) -> Content:
    """What reset() or next_user_message() returned, as a user message's content: text, or text and images."""
    return state.admit(tool_content(value))


_ID_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def call_id(call: ToolCall, turn: int, index: int) -> str:
    """The id of a turn's ``index``-th call: the one the model wrote, else ``c`` + the turn and the index in four
    base-36 digits each (``c00010002``).

    Nine alphanumeric characters, as Mistral's templates require of every id, and a function of the call's place
    alone, so a trajectory's messages (and the drift guard's replay of them) render the same ids in every run.
    """
    if call.id is not None:
        return call.id
    return "c" + _base36(turn) + _base36(index)


def _base36(number: int, digits: int = 4) -> str:
    if not 0 <= number < len(_ID_DIGITS) ** digits:
        raise ValueError(f"{number} does not fit in {digits} base-36 digits of a tool call id")
    text = ""
    for _ in range(digits):
        number, digit = divmod(number, len(_ID_DIGITS))
        text = _ID_DIGITS[digit] + text
    return text


def assistant_message(parsed: ParsedResponse, turn: int) -> dict[str, Any]:
    """The message the engine records for a parsed model turn (turn numbers from 0 name its calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        message[parsed.reasoning_field] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": call_id(c, turn, i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(parsed.tool_calls)
        ]
    return message

