"""What an RL step logs: its rollouts' statistics, under the names users see (docs/metrics.md), and the step's
trajectories with what the update made of them (``rollouts.jsonl``, for ``trajlab report``)."""

from __future__ import annotations

import math
from typing import Any

from trajlab.data.store import TrajectoryStore
from trajlab.rollout.types import Trajectory
from trajlab.train.advantages import turn_starts

METRIC_NAMES = {
    "step": "step",
    "reward": "reward/mean",
    **{name: f"rollout/{name}" for name in (
        "success_rate", "greedy_success_rate", "tool_error_rate", "parse_error_rate", "mean_turns", "episodes",
        "errors", "retries", "zero_variance_groups", "groups_short", "groups_skipped", "staleness_mean",
        "dropped_stale", "workers_replaced")},
    "drift/trajectories": "rollout/drifted",
    "loss": "loss/policy", "kl": "loss/kl", "entropy": "loss/entropy", "clip_fraction": "loss/clip_fraction",
    "grad_norm": "optim/grad_norm", "lr": "optim/lr", "trained_sequences": "optim/trained_sequences",
    **{name: f"perf/{name}" for name in (
        "tokens_per_s", "rollout_s", "update_s", "rollout_wait_s", "overlap_s", "generate_calls", "drift_check_s",
        "processes")},
}
"""An RL step's metrics by their names in ``metrics.jsonl`` and the trackers (docs/metrics.md)."""
METRIC_PREFIXES = {"reward/": "reward/", "judge/": "judge/", "mismatch/": "mismatch/",
                   "staleness/": "rollout/staleness/", "per_env/": "rollout/per_env/", "curriculum/": "curriculum/",
                   "replay/": "replay/"}


def namespaced(record: dict[str, float]) -> dict[str, float]:
    """``record`` under the names users see (``METRIC_NAMES``); a metric without one is a bug, not a new name."""
    named = {}
    for key, value in record.items():
        prefix = next((p for p in METRIC_PREFIXES if key.startswith(p)), None)
        named[METRIC_PREFIXES[prefix] + key.removeprefix(prefix) if prefix else METRIC_NAMES[key]] = value
    return named


def step_metrics(step: int, trajectories: list[Trajectory], rewards: list[float], rollout_s: float,
                 update_s: float) -> dict[str, float]:
    """The step's rollout statistics. Episodes that ended in ``error`` (the machinery's failure) are counted
    (in ``episodes`` and ``errors``; ``retries``: attempts beyond the first over all episodes) but left out of the
    policy's statistics: they say nothing about it.

    Raises:
        FloatingPointError: the mean reward is not finite.
    """
    episodes, every = len(trajectories), trajectories
    retries = sum(t.metrics.get("attempts", 1.0) - 1 for t in trajectories)
    errors = sum(t.status == "error" for t in trajectories)
    rewards = [r for r, t in zip(rewards, trajectories, strict=True) if t.status != "error"]
    trajectories = [t for t in trajectories if t.status != "error"]
    n = max(1, len(trajectories))
    calls = sum(t.metrics.get("tool_calls", 0.0) for t in trajectories)
    turns = sum(t.metrics.get("turns", 0.0) for t in trajectories)
    generated = sum(t.metrics.get("model_tokens", 0.0) for t in trajectories)
    record = {
        "step": step + 1,
        "reward": sum(rewards) / n,
        "success_rate": sum(t.status == "success" for t in trajectories) / n,
        "tool_error_rate": sum(t.metrics.get("tool_errors", 0.0) for t in trajectories) / calls if calls else 0.0,
        "parse_error_rate": sum(t.metrics.get("parse_errors", 0.0) for t in trajectories) / turns if turns else 0.0,
        "mean_turns": turns / n,
        "episodes": float(episodes),
        "errors": float(errors),
        "retries": retries,
        "tokens_per_s": generated / rollout_s if rollout_s else 0.0,
        "rollout_s": rollout_s,
        "update_s": update_s,
    }
    for key in sorted({k for t in trajectories for k in t.metrics if k.startswith("reward/")}):
        record[key] = sum(t.metrics.get(key, 0.0) for t in trajectories) / n
    for key in sorted({k for t in every for k in t.metrics if k.startswith("judge/")}):  # what the judge cost
        record[key] = sum(t.metrics.get(key, 0.0) for t in every)
    greedy = [t for t in trajectories if t.metrics.get("greedy")]
    if greedy:  # rl.greedy_rollout: the train tasks' greedy success, the quantity held-out evaluation measures
        record["greedy_success_rate"] = sum(t.status == "success" for t in greedy) / len(greedy)
    record |= _per_env(trajectories, rewards)
    if not math.isfinite(record["reward"]):
        raise FloatingPointError(f"non-finite reward at step {step + 1}")
    return record


def _per_env(trajectories: list[Trajectory], rewards: list[float]) -> dict[str, float]:
    """In a mixture, each env's share of the step, so one env's progress cannot hide another's (none for one env)."""
    envs = sorted({t.env for t in trajectories})
    if len(envs) < 2:
        return {}
    record = {}
    for env in envs:
        mine = [i for i, t in enumerate(trajectories) if t.env == env]
        record[f"per_env/{env}/episodes"] = float(len(mine))
        record[f"per_env/{env}/reward"] = sum(rewards[i] for i in mine) / len(mine)
        record[f"per_env/{env}/success_rate"] = sum(trajectories[i].status == "success" for i in mine) / len(mine)
    return record


def staleness_metrics(staleness: list[int], max_staleness: int) -> dict[str, float]:
    """How many policy versions behind the trained weights each rollout was sampled, and how many were dropped."""
    counts = {f"staleness/{age}": float(staleness.count(age)) for age in sorted(set(staleness))}
    return counts | {"dropped_stale": float(sum(age > max_staleness for age in staleness)),
                     "staleness_mean": sum(staleness) / max(1, len(staleness))}


def record_rollouts(store: TrajectoryStore, step: int, trajectories: list[Trajectory], rewards: list[float],
                    token_advantages: list[list[float]], trained: set[int],
                    trainer_logprobs: dict[int, list[float]]) -> None:
    """Append the step's trajectories with what RL made of them: ``rl/step``, ``rl/reward`` (weighted),
    ``rl/trained`` (1 if the update used it), ``advantage/<turn>`` (each model turn's advantage) and, where the
    update computed them, the trainer's logprobs of the model tokens (none for a rollout whose advantage was zero
    throughout and went through no forward pass; with several processes, those of the main process's passes). A
    resumed run skips the ones already there."""
    for index, trajectory in enumerate(trajectories):
        if trajectory.id in store.ids:
            continue
        update: dict[str, Any] = {}
        extra = {"rl/step": float(step + 1), "rl/reward": rewards[index], "rl/trained": float(index in trained)}
        if trajectory.tokens is not None:
            turns = turn_starts(trajectory.tokens.loss_mask)
            extra |= {f"advantage/{turn}": token_advantages[index][start] for turn, start in enumerate(turns)}
            if index in trainer_logprobs:
                update["tokens"] = trajectory.tokens.model_copy(update={"trainer_logprobs": [
                    lp if bit else None
                    for lp, bit in zip(trainer_logprobs[index], trajectory.tokens.loss_mask, strict=True)]})
        store.append(trajectory.model_copy(update=update | {"metrics": trajectory.metrics | extra}))
