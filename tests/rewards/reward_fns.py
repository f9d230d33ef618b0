"""Reward functions a user would write, importable as ``tests.rewards.reward_fns:<name>`` from a config."""

from __future__ import annotations

import asyncio
import os
import time

from trajlab.rollout.types import Trajectory


def brevity(trajectory: Trajectory, task: dict) -> float:
    """1 for an episode of one model turn, less for longer ones."""
    return 1.0 / max(1.0, trajectory.metrics.get("turns", 1.0))


def scaled(trajectory: Trajectory, task: dict, factor: float = 1.0) -> float:
    """``factor``, to see that ``args`` reach the call."""
    return factor


def paid_turn(trajectory: Trajectory, task: dict) -> list[float]:
    """Turn-level: 1 on the turn the task names, 0 on the others."""
    return [float(t == task["paid"]) for t in range(int(trajectory.metrics.get("turns", 0)))]


def flaky(trajectory: Trajectory, task: dict) -> float:
    """Raises on every trajectory whose id ends in 1 (the second rollout of each group)."""
    if trajectory.id.endswith("1"):
        raise RuntimeError("the grader's database is locked")
    return 1.0


def wrong_shape(trajectory: Trajectory, task: dict) -> list[float]:
    """A bug: a list from a function declared (by default) trajectory-level."""
    return [1.0]


def slow(trajectory: Trajectory, task: dict) -> float:
    """A blocking grader: 0.3 s per call."""
    time.sleep(0.3)
    return 0.5


async def slow_async(trajectory: Trajectory, task: dict) -> float:
    """An async grader: 0.3 s per call."""
    await asyncio.sleep(0.3)
    return 0.25


class Threshold:
    """A class reward: built once with its args, called per trajectory."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.calls = 0

    def __call__(self, trajectory: Trajectory, task: dict) -> float:
        self.calls += 1
        return float(trajectory.reward >= self.at)


NOT_CALLABLE = 3


def first_turn(trajectory: Trajectory, task: dict) -> list[float]:
    """Turn-level: 1 on the first model turn, 0 on the others."""
    return [float(t == 0) for t in range(int(trajectory.metrics.get("turns", 0)))]


def counted(trajectory: Trajectory, task: dict) -> float:
    """Appends the trajectory's id to the file ``$REWARD_CALLS`` (one line per call, from any process)."""
    with open(os.environ["REWARD_CALLS"], "a") as calls:
        calls.write(trajectory.id + "\n")
    return 1.0
