"""The trajlab adapter for ``gepa``: a candidate's texts are scored by real trajlab rollouts.

GEPA evolves named texts: ``system_prompt`` and, when asked, ``tool:NAME`` descriptions. Evaluating a candidate runs
episodes of the env on a batch of tasks through the same engine, parser, chat template and reward as collection,
evaluation and RL, with the candidate's system prompt and tool descriptions. Each episode's score is its reward;
its trace is a compact transcript (tool calls with arguments, tool and parse errors, the final answer) that the
reflection LM reads with the reward components as feedback.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gepa import EvaluationBatch

from trajlab.collection.workers import RayRolloutRunner
from trajlab.config import RolloutSettings
from trajlab.data.store import TrajectoryStore, read_trajectories
from trajlab.env.prompts import SYSTEM_PROMPT, tool_descriptions
from trajlab.rewards import RewardFunction, RewardSet
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.rewards import REWARDS
from trajlab.rollout.runner import Episode
from trajlab.rollout.types import Trajectory, task_id

MAX_FIELD_CHARS = 300
"""Longer tool results and messages are cut in transcripts: the reflection LM needs the shape, not every byte."""


@dataclass(frozen=True)
class _Scored:
    """What GEPA needs of one finished episode; the full trajectory lives in the store file."""

    output: dict[str, Any]
    score: float
    trace: dict[str, Any]


class TrajlabAdapter:
    """GEPA's adapter protocol over trajlab rollouts; a data instance is one task (a row ``reset`` receives).

    A candidate is scored once per task: asking again (GEPA re-scores parents on minibatches it drew before) reuses
    the episode, and while :meth:`recording` a resumed run reuses every episode it finished before.

    Args:
        engine: rolls out the policy on the env (with its parser, chat template, sampling and limits); a candidate
            sets its system prompt, and its tool descriptions give an engine of their own
            (:meth:`RolloutEngine.with_tool_descriptions`; rollout workers, a :class:`RayRolloutRunner`, switch to
            each candidate's texts instead).
        weights: named rewards as ``rl.rewards`` (:class:`trajlab.rewards.RewardSet`; a failing reward function
            scores its episode 0); None scores by the env reward alone.
        rollout: the episodes run at once (``concurrency``) and the retries of an episode the machinery broke
            (status error; one that still fails scores 0: GEPA needs a score for every task).
    """

    propose_new_texts = None
    """None: GEPA proposes new texts with its own reflection template and the configured reflection LM.

    GEPA checks this attribute; an adapter that wants to write prompts itself sets a ``ProposalFn`` here.
    """

    def __init__(self, engine: RolloutEngine | RayRolloutRunner, *,
                 weights: Mapping[str, float | RewardFunction] | None, rollout: RolloutSettings) -> None:
        self.rewards = RewardSet(weights) if weights is not None else None
        self.weights = self.rewards.config() if self.rewards is not None else None
        """The rewards as plain data (None: the env reward), recorded with the run."""
        self.engine = engine
        self.rollout = rollout
        self.rollouts = 0
        """Episodes this adapter ran (not served from earlier results)."""
        self._results: dict[str, _Scored] = {}
        self._store: TrajectoryStore | None = None

    @contextmanager
    def recording(self, path: str | Path) -> Iterator[TrajectoryStore]:
        """Within the block, every episode is written to the trajectory file ``path`` as it finishes, and the
        episodes already there are reused instead of run again."""
        with TrajectoryStore(path) as store:
            for trajectory in read_trajectories(store.path):
                self._results[trajectory.id] = self._scored(trajectory)
            self._store = store
            try:
                yield store
            finally:
                self._store = None

    def evaluate(
        self, batch: list[dict[str, Any]], candidate: dict[str, str], capture_traces: bool = False
    ) -> EvaluationBatch:
        """Roll out ``candidate`` on every task of ``batch``; a failed episode scores 0 and its trace says why."""
        key = _candidate_key(candidate)
        episodes = [Episode(id=f"evolve:{key}:{task_id(task)}", task=dict(task)) for task in batch]
        todo = list({e.id: e for e in episodes if e.id not in self._results}.values())
        if todo:
            asyncio.run(self._engine(candidate).run(todo, concurrency=self.rollout.concurrency, on_result=self._keep,
                                                        retries=self.rollout.retries,
                                                        retry_backoff_s=self.rollout.retry_backoff_s))
        scored = [self._results[episode.id] for episode in episodes]
        return EvaluationBatch(outputs=[s.output for s in scored], scores=[s.score for s in scored],
                               trajectories=[s.trace for s in scored] if capture_traces else None)

    def _engine(self, candidate: dict[str, str]) -> RolloutEngine | RayRolloutRunner:
        """The engine showing the candidate's tool descriptions (one per set), with its system prompt; rollout
        workers are told to show them."""
        descriptions = tool_descriptions(candidate)
        if isinstance(self.engine, RayRolloutRunner):
            self.engine.present(candidate[SYSTEM_PROMPT], descriptions)
            return self.engine
        engine = self.engine.with_tool_descriptions(descriptions)
        engine.system_prompt = candidate[SYSTEM_PROMPT]  # GEPA evaluates one candidate at a time
        return engine

    def _keep(self, trajectory: Trajectory) -> None:
        if self._store is not None:
            self._store.append(trajectory)  # durable before it counts: a crash loses no finished episode
        self._results[trajectory.id] = self._scored(trajectory)
        self.rollouts += 1

    def _scored(self, trajectory: Trajectory) -> _Scored:
        value = self.episode_score(trajectory)
        return _Scored(_output(trajectory, value), value, trace(trajectory, value))

    def episode_score(self, trajectory: Trajectory) -> float:
        """The episode's score: 0 for an episode that errored, else the env reward (or the weighted reward)."""
        components = {name: fn(trajectory) for name, fn in REWARDS.items()}
        trajectory.metrics.update({f"reward/{name}": value for name, value in components.items()})
        total = self.rewards.score([trajectory]).totals[0] if self.rewards is not None else trajectory.reward
        return 0.0 if trajectory.status == "error" else total

    def make_reflective_dataset(
        self, candidate: dict[str, str], eval_batch: EvaluationBatch, components_to_update: list[str]
    ) -> dict[str, list[dict[str, Any]]]:
        """Per component, one record per episode in GEPA's recommended keys: Inputs, Generated Outputs, Feedback."""
        records = [
            {"Inputs": item["task"], "Generated Outputs": item["transcript"], "Feedback": item["feedback"]}
            for item in eval_batch.trajectories or []
        ]
        return {component: records for component in components_to_update}


def trace(trajectory: Trajectory, value: float) -> dict[str, Any]:
    """What the reflection LM reads about one episode: the task, a compact transcript and feedback text."""
    return {"task": _task_text(trajectory), "transcript": transcript(trajectory),
            "feedback": feedback(trajectory, value)}


def transcript(trajectory: Trajectory) -> str:
    """The episode after its first user message: model text, tool calls with arguments, tool results, notes."""
    lines = []
    for message in trajectory.messages[_first_user(trajectory) + 1:]:
        role, content = message["role"], _cut(str(message.get("content") or ""))
        if role == "assistant":
            if content:
                lines.append(f"assistant: {content}")
            for call in message.get("tool_calls") or []:
                function = call["function"]
                lines.append(f"call {function['name']}({json.dumps(function['arguments'], sort_keys=True)})")
        elif role == "tool":
            lines.append(f"-> {message.get('name', 'tool')}: {content}")
        else:
            lines.append(f"{role}: {content}")
    if trajectory.error:
        lines.append(f"episode error: {trajectory.error}")
    return "\n".join(lines) if lines else "(the model never acted)"


def feedback(trajectory: Trajectory, value: float) -> str:
    """Score, status, stop reason, every reward component and the error counts, as one short text."""
    metrics = trajectory.metrics
    names = [*REWARDS, *sorted({k.removeprefix("reward/") for k in metrics if k.startswith("reward/")} - set(REWARDS))]
    components = ", ".join(f"{name} {metrics.get(f'reward/{name}', 0.0):.2f}" for name in names)
    parts = [f"score {value:.2f} ({trajectory.status}, stopped by {trajectory.stop_reason or 'error'})",
             f"reward components: {components}"]
    kinds = sorted(key.partition("/")[2] for key in metrics if key.startswith("tool_errors/"))
    if metrics.get("tool_errors"):
        parts.append(f"tool errors: {int(metrics['tool_errors'])} ({', '.join(kinds)})")
    if metrics.get("parse_errors"):
        parts.append(f"malformed tool calls: {int(metrics['parse_errors'])}")
    if trajectory.error:
        parts.append(f"error: {trajectory.error}")
    return "; ".join(parts)


def _output(trajectory: Trajectory, value: float) -> dict[str, Any]:
    """The per-episode output GEPA keeps (plain data: it is pickled into the run directory's state)."""
    answers = [m.get("content") for m in trajectory.messages if m["role"] == "assistant" and not m.get("tool_calls")]
    return {"task_id": task_id(trajectory.task), "score": value, "status": trajectory.status,
            "final_answer": answers[-1] if answers else None, "error": trajectory.error}


def _candidate_key(candidate: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(candidate, sort_keys=True).encode()).hexdigest()[:16]


def _first_user(trajectory: Trajectory) -> int:
    return next((i for i, m in enumerate(trajectory.messages) if m["role"] == "user"), len(trajectory.messages))


def _task_text(trajectory: Trajectory) -> str:
    index = _first_user(trajectory)
    if index < len(trajectory.messages):
        return str(trajectory.messages[index]["content"])
    return _cut(json.dumps(trajectory.task, sort_keys=True, default=str))  # reset failed: show the task row


def _cut(text: str) -> str:
    return text if len(text) <= MAX_FIELD_CHARS else text[:MAX_FIELD_CHARS] + " [...]"


__all__ = ["TrajlabAdapter", "feedback", "trace", "transcript"]
