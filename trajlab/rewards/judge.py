"""An LLM judge: a reward function that asks any OpenAI-compatible chat endpoint to grade a trajectory against a
rubric.

The prompt is the rubric, the task as the env received it, and the conversation rendered as plain text (tool calls
and results included). The judge must end its answer with a line ``SCORE: <number from 0 to 1>``; the last such
line is the score, and an answer without one (or out of range) is asked again. After ``max_retries`` more tries, a
judge that is down, times out or keeps answering garbage raises :class:`JudgeError`, which the reward machinery
records on the trajectory (status ``error``, masked from advantages): an infrastructure failure, never a crash.

Each trajectory's judge usage lands in its metrics (``judge/prompt_tokens``, ``judge/completion_tokens``,
``judge/calls``, ``judge/cache_hits``), which RL sums per step. Grades are cached by the content they were asked
about (model, rubric, prompt): in memory for the judge's life, and in a JSON-lines file when ``cache`` names one,
so a resumed run or a re-run of the same trajectory does not pay twice.

:class:`RelativeJudge` (as RULER does) asks once per group of rollouts of one task, showing every attempt side by
side, and reads one ``ATTEMPT n: x`` line per attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from trajlab.errors import InfrastructureError
from trajlab.rollout.types import Trajectory

if TYPE_CHECKING:  # imported where used: every command reads the config, whose reward settings import this module
    import openai

T = TypeVar("T")
DEFAULT_RUBRIC = ("Did the assistant accomplish the user's task correctly, using its tools sensibly? 1 for a "
                  "correct, complete result; 0 for a wrong or missing one; in between for partial progress.")
INSTRUCTIONS = ("You grade an AI assistant's episode against a rubric. Read the task and the conversation, reason "
                "briefly, then end your answer with exactly one line of the form\nSCORE: <number from 0 to 1>")
RELATIVE_INSTRUCTIONS = ("You compare several attempts at the same task against a rubric. Read the task and every "
                         "attempt, reason briefly about how they compare, then score each from 0 to 1 relative to "
                         "the others (a better attempt scores higher). End your answer with one line per attempt, "
                         "in order, of the form\nATTEMPT <n>: <number from 0 to 1>")
ATTEMPT_LINE = re.compile(r"^\W*attempt\s*#?(\d+)\W*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)\s*\**\s*$",
                          re.IGNORECASE | re.MULTILINE)
SCORE_LINE = re.compile(r"^\W*score\W*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)\s*\**\s*$", re.IGNORECASE | re.MULTILINE)


class JudgeError(InfrastructureError):
    """The judge gave no score: unreachable, timed out, refused, or answered without a valid score line. The
    machinery's failure, not the policy's: its trajectory ends in ``error`` and is not trained on."""


def parse_score(text: str) -> float:
    """The score of a judge's answer: the number on its last ``SCORE: x`` line, 0 <= x <= 1.

    Raises:
        ValueError: no such line, or the number is out of range.
    """
    found = SCORE_LINE.findall(text or "")
    if not found:
        raise ValueError(f"the judge's answer has no 'SCORE: <0..1>' line: {_clip(text)!r}")
    score = float(found[-1])
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"the judge's score {score} is outside 0..1")
    return score


def parse_attempt_scores(text: str, attempts: int) -> list[float]:
    """The scores of a relative judge's answer: ``ATTEMPT n: x`` for every n in 1..attempts (the last line of each
    n counts), 0 <= x <= 1.

    Raises:
        ValueError: an attempt has no score, a number is out of range, or an attempt that does not exist is scored.
    """
    found = {int(n): float(x) for n, x in ATTEMPT_LINE.findall(text or "")}
    if missing := sorted(set(range(1, attempts + 1)) - set(found)):
        raise ValueError(f"the judge's answer has no 'ATTEMPT <n>: <0..1>' line for attempt(s) {missing}: "
                         f"{_clip(text)!r}")
    if extra := sorted(set(found) - set(range(1, attempts + 1))):
        raise ValueError(f"the judge scored attempt(s) {extra}, but there are {attempts}")
    if bad := [x for x in found.values() if not 0.0 <= x <= 1.0]:
        raise ValueError(f"the judge's score(s) {bad} are outside 0..1")
    return [found[n] for n in range(1, attempts + 1)]


def render_conversation(trajectory: Trajectory, max_chars: int = 2000) -> str:
    """The conversation as readable text: one block per message, tool calls as ``name(arguments)``, each message's
    text cut to ``max_chars``."""
    blocks = []
    for message in trajectory.messages:
        role = message.get("role", "?")
        if role == "tool" and message.get("name"):
            role = f"tool {message['name']}"
        text = _text(message.get("content"))
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            text += f"\n-> calls {function.get('name')}({arguments})"
        blocks.append(f"[{role}]\n{_clip(text.strip(), max_chars)}")
    return "\n\n".join(blocks)


class LLMJudge:
    """Grades each trajectory with an OpenAI-compatible chat model against a rubric; the reward is its score.

    Args:
        url: the endpoint, ``http://host:port/v1`` or ``http://host:port/v1#model`` (no model: the first the server
            lists).
        rubric: what a good episode is; the task (as the env received it) and the conversation follow it.
        api_key: bearer key; default ``$OPENAI_API_KEY``, else none.
        max_retries: tries after the first, for a failed request and for an answer without a valid score.
        timeout_s: seconds per request.
        max_concurrency: requests in flight at once (per event loop).
        cache: a JSON-lines file of grades, read at start and appended to; None keeps them in memory only.
        temperature, max_tokens: the judge's sampling.
        backoff_s: the wait before the n-th retry is ``backoff_s * 2 ** (n - 1)``.
    """

    def __init__(self, url: str, rubric: str = DEFAULT_RUBRIC, *, api_key: str | None = None, max_retries: int = 2,
                 timeout_s: float = 60.0, max_concurrency: int = 8, cache: str | Path | None = None,
                 temperature: float = 0.0, max_tokens: int = 1024, backoff_s: float = 1.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the judge's url is http(s)://host:port/v1[#model], got {url!r}")
        if max_retries < 0 or max_concurrency < 1 or timeout_s <= 0:
            raise ValueError("the judge needs max_retries >= 0, max_concurrency >= 1 and timeout_s > 0")
        if not rubric.strip():
            raise ValueError("the judge's rubric is empty: say what a good episode is")
        from trajlab.inference.openai_client import split_policy_url  # with openai: only a judge needs it

        self.base_url, self.model = split_policy_url(url)
        self.rubric, self.api_key, self.max_retries, self.timeout_s = rubric, api_key, max_retries, timeout_s
        self.max_concurrency, self.temperature, self.max_tokens = max_concurrency, temperature, max_tokens
        self.backoff_s = backoff_s
        self.cache_path = Path(cache) if cache is not None else None
        self.grades: dict[str, Any] = {}
        """Parsed answers by the hash of what was asked (a score, or a relative judge's list of scores)."""
        if self.cache_path is not None and self.cache_path.exists():
            for line in self.cache_path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    self.grades[record["key"]] = record["score"]
        self._loop: Any = None
        self._client: openai.AsyncOpenAI | None = None
        self._slots: asyncio.Semaphore | None = None
        self._asking: dict[str, asyncio.Future] = {}  # this loop's questions in flight, by key

    async def __call__(self, trajectory: Trajectory, task: dict[str, Any]) -> float:
        """The trajectory's score, from the cache or the judge; its usage added to the trajectory's metrics."""
        prompt = self.prompt(trajectory, task)
        usage = trajectory.metrics
        for key in ("judge/prompt_tokens", "judge/completion_tokens", "judge/calls", "judge/cache_hits"):
            usage.setdefault(key, 0.0)
        return await self.grade(prompt, usage, parse_score)

    def prompt(self, trajectory: Trajectory, task: dict[str, Any]) -> list[dict[str, str]]:
        """The chat messages asking for the grade."""
        body = (f"# Rubric\n{self.rubric}\n\n# Task (as the environment received it)\n"
                f"{json.dumps(task, ensure_ascii=False, default=str)}\n\n# Conversation\n"
                f"{render_conversation(trajectory)}")
        return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": body}]

    async def grade(self, messages: list[dict[str, str]], usage: dict[str, float], parse: Callable[[str], T]) -> T:
        """Ask the judge (or the cache) and parse its answer with ``parse``; tries again on any failure.

        Raises:
            JudgeError: still no valid answer after the retries.
        """
        client, slots = await self._connection()
        key = hashlib.sha256(json.dumps([self.model, messages], sort_keys=True).encode()).hexdigest()
        if key in self.grades or key in self._asking:  # graded before, or being graded for a twin in this batch
            usage["judge/cache_hits"] = usage.get("judge/cache_hits", 0.0) + 1
            return self.grades[key] if key in self.grades else await asyncio.shield(self._asking[key])
        self._asking[key] = asking = asyncio.get_running_loop().create_future()
        try:
            value = await self._ask(client, slots, messages, usage, parse)
        except JudgeError as exc:
            asking.set_exception(exc)
            asking.exception()  # retrieved: a twin waiting on it gets it, and none waiting is no warning
            raise
        except BaseException:
            asking.cancel()
            raise
        finally:
            del self._asking[key]
        asking.set_result(value)
        self._remember(key, value)
        return value

    async def _ask(self, client: openai.AsyncOpenAI, slots: asyncio.Semaphore, messages: list[dict[str, str]],
                   usage: dict[str, float], parse: Callable[[str], T]) -> T:
        """The tries of one question: the first valid parsed answer.

        Raises:
            JudgeError: none after the retries.
        """
        import openai

        problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with slots:
                    response = await client.chat.completions.create(
                        model=self.model, messages=messages, temperature=self.temperature,
                        max_tokens=self.max_tokens)
            except openai.OpenAIError as exc:
                problem = f"{type(exc).__name__}: {_clip(str(exc))}"
                continue
            finally:
                usage["judge/calls"] = usage.get("judge/calls", 0.0) + 1
            if response.usage is not None:
                usage["judge/prompt_tokens"] = usage.get("judge/prompt_tokens", 0.0) + response.usage.prompt_tokens
                usage["judge/completion_tokens"] = (usage.get("judge/completion_tokens", 0.0)
                                                    + response.usage.completion_tokens)
            try:
                value = parse(response.choices[0].message.content or "")
            except (ValueError, IndexError) as exc:
                problem = str(exc)
                continue
            return value
        raise JudgeError(f"the judge at {self.base_url} gave no score after {self.max_retries + 1} tries: {problem}")

    async def aclose(self) -> None:
        """Close this loop's connections (the next call opens new ones); the cache stays."""
        if self._client is not None:
            await self._client.close()
        self._loop = self._client = self._slots = None
        self._asking = {}

    def _remember(self, key: str, value: Any) -> None:
        self.grades[key] = value
        if self.cache_path is not None:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            with self.cache_path.open("a") as file:
                file.write(json.dumps({"key": key, "score": value}) + "\n")

    async def _connection(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        """This event loop's client and concurrency slots (a client's connections belong to one loop); the model
        is asked of the server once, when the url named none.

        Raises:
            JudgeError: no model named and the server lists none (or cannot be reached).
        """
        import openai

        from trajlab.inference.openai_client import api_key_or_placeholder

        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._slots, self._asking = loop, asyncio.Semaphore(self.max_concurrency), {}
            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key_or_placeholder(self.api_key),
                                              timeout=self.timeout_s, max_retries=0)
        assert self._client is not None and self._slots is not None
        if self.model is None:
            try:
                models = [model.id async for model in self._client.models.list()]
            except openai.OpenAIError as exc:
                raise JudgeError(f"the judge at {self.base_url} could not list its models: {exc}") from exc
            if not models:
                raise JudgeError(f"the judge at {self.base_url} lists no model; name one as url#model")
            self.model = models[0]
        return self._client, self._slots


class RelativeJudge(LLMJudge):
    """Ranks a group's rollouts of one task in one call, as RULER does: the judge sees every attempt side by side and
    scores each relative to the others, which needs no absolute scale in the rubric. Arguments as
    :class:`LLMJudge`; its answer ends with ``ATTEMPT n: <0..1>`` per attempt. A group's usage is shared out evenly
    over its trajectories' metrics; an answer missing an attempt is asked again, then fails the whole group."""

    async def __call__(self, trajectory: Trajectory, task: dict[str, Any]) -> float:
        """One trajectory alone: a group of one."""
        return (await self.score_group([trajectory], [task]))[0]

    async def score_group(self, trajectories: list[Trajectory], tasks: list[dict[str, Any]]) -> list[float]:
        """Every trajectory's score, from one request for the group (the task is the first's: they share it)."""
        usage: dict[str, float] = {}
        try:
            return await self.grade(self.group_prompt(trajectories, tasks[0]), usage,
                                    lambda text: parse_attempt_scores(text, len(trajectories)))
        finally:
            for trajectory in trajectories:
                for key in ("judge/prompt_tokens", "judge/completion_tokens", "judge/calls", "judge/cache_hits"):
                    trajectory.metrics[key] = trajectory.metrics.get(key, 0.0) + usage.get(key, 0.0) / len(trajectories)

    def group_prompt(self, trajectories: list[Trajectory], task: dict[str, Any]) -> list[dict[str, str]]:
        """The chat messages asking for the group's scores."""
        attempts = "\n\n".join(f"## Attempt {n}\n{render_conversation(t)}" for n, t in enumerate(trajectories, 1))
        body = (f"# Rubric\n{self.rubric}\n\n# Task (as the environment received it)\n"
                f"{json.dumps(task, ensure_ascii=False, default=str)}\n\n# Attempts\n{attempts}")
        return [{"role": "system", "content": RELATIVE_INSTRUCTIONS}, {"role": "user", "content": body}]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part.get("text", "") if part.get("type") == "text" else f"[{part.get('type', 'part')}]"
                         for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"
