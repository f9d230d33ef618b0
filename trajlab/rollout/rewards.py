"""The built-in reward components, weighted in the config beside reward functions (:mod:`trajlab.rewards`) and
logged one by one.

A component reads the trajectory's record (the env's reward and metrics, the engine's counters), never text the
model or a tool printed: a reward that can be earned by printing "Correct!" is a bug. Weight 0 makes a component a
logged metric only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from trajlab.rollout.types import Trajectory

RewardFn = Callable[[Trajectory], float]


def env_reward(trajectory: Trajectory) -> float:
    """The environment's own reward (its verifier)."""
    return trajectory.reward


def progress(trajectory: Trajectory) -> float:
    """Share of the task solved, from the env's dense per-call rewards (e.g. correct steps, solved user turns)."""
    return float(sum(trajectory.turn_rewards or []))


def valid_format(trajectory: Trajectory) -> float:
    """1 when every model turn parsed, down to 0 when none did."""
    turns = trajectory.metrics.get("turns", 0.0)
    return 1.0 - trajectory.metrics.get("parse_errors", 0.0) / turns if turns else 0.0


def tool_success(trajectory: Trajectory) -> float:
    """Share of tool calls that ran without error (unknown tool, bad arguments, exception, timeout)."""
    calls = trajectory.metrics.get("tool_calls", 0.0)
    return 1.0 - trajectory.metrics.get("tool_errors", 0.0) / calls if calls else 0.0


REWARDS: dict[str, RewardFn] = {
    "env": env_reward,
    "progress": progress,
    "format": valid_format,
    "tool_success": tool_success,
}


def check_weights(weights: Mapping[str, float]) -> None:
    """Every name is a built-in component.

    Raises:
        ValueError: one is not, with the known names.
    """
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise ValueError(f"Unknown reward component(s) {unknown}; known: {sorted(REWARDS)}.")

