"""Train tasks drawn again while the policy both solves and fails them (``rl.revisit_share``).

Why: RL's fresh draws spend each step on whatever train tasks come next, and once SFT is good most of them are
solved already: a situation the policy still gets wrong sits in one or two groups a step, its gradient diluted by
the rest. A task whose group had mixed outcomes (some rollouts succeeded, some failed) is one the policy can learn
from now, since GRPO's signal exists there (DAPO's dynamic sampling and prioritized level replay select for the same
thing). Drawing such tasks again, those whose groups failed most first, until their group stops being mixed, spends
more of RL's steps where the failures are. With a greedy rollout in each group (``rl.greedy_rollout``) only the
groups whose greedy answer failed are queued: where the samples fail now and then but the greedy answer succeeds
(most mixed groups once SFT is good), held-out greedy evaluation has nothing to gain, and such tasks otherwise fill
the queue. On driving demonstrated with noise, the held-out failures sit on one kind of road, one or two groups of
a step; RL on that kind alone repaired 25 of its 30 (and broke 95 roads of the other kinds, seen no more), where 100
steps of fresh draws had repaired none: revisits bring such tasks up more often beside the fresh ones
(BENCHMARKS.md, issue 45).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trajlab.rollout.types import Trajectory


class Revisits:
    """The train tasks whose last group had mixed outcomes, by how much of it failed; each step's draw takes some.

    Args:
        share: the share of each step's tasks taken from the queue (while it has tasks of the step's stage).
        capacity: the most tasks the queue keeps; beyond it those whose groups failed least are dropped (the
            earliest queued among equals: their share is the oldest news).
    """

    def __init__(self, share: float, capacity: int) -> None:
        self.share, self.capacity = share, capacity
        self.queue: list[Revisit] = []  # in the order queued
        self._lock = threading.Lock()  # asynchronous RL draws on the feed's thread while the trainer observes

    def mix(self, stage: int, fresh: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """A step's tasks: the queued tasks of ``stage`` whose groups failed most (the earlier queued first among
        equals; they leave the queue), then as many of ``fresh`` as are left to make up its length; and how many were
        revisits. The fresh tasks not used are skipped, so the fresh stream stays where the step's number puts it
        (resume draws the same tasks)."""
        wanted = round(self.share * len(fresh))
        with self._lock:
            mine = sorted((r for r in self.queue if r.stage == stage), key=lambda r: -r.failed)[:wanted]
            self.queue = [r for r in self.queue if all(r is not taken for taken in mine)]
        return [r.task for r in mine] + fresh[: len(fresh) - len(mine)], len(mine)

    def observe(self, stage: int, trajectories: Sequence[Trajectory]) -> None:
        """Queue the tasks of the step's groups whose valid rollouts both succeeded and failed, and whose greedy
        rollout (``rl.greedy_rollout``), if they have one, failed; with the share that failed (a task queued already
        takes its new share and keeps its place)."""
        outcomes: dict[str, tuple[dict[str, Any], list[bool]]] = {}
        greedy_succeeded: dict[str, bool] = {}
        for trajectory in trajectories:
            if trajectory.status != "error" and trajectory.group is not None:
                outcomes.setdefault(trajectory.group, (trajectory.task, []))[1].append(trajectory.status == "success")
                if trajectory.metrics.get("greedy"):
                    greedy_succeeded[trajectory.group] = trajectory.status == "success"
        with self._lock:
            queued = {_key(r.stage, r.task): r for r in self.queue}
            for group, (task, succeeded) in outcomes.items():
                if len(set(succeeded)) < 2 or greedy_succeeded.get(group, False):
                    continue
                failed = succeeded.count(False) / len(succeeded)
                if _key(stage, task) in queued:
                    queued[_key(stage, task)].failed = failed
                else:
                    queued[_key(stage, task)] = Revisit(stage, task, failed)
                    self.queue.append(queued[_key(stage, task)])
            kept = sorted(range(len(self.queue)), key=lambda i: (-self.queue[i].failed, -i))[: self.capacity]
            self.queue = [self.queue[i] for i in sorted(kept)]

    def state(self) -> list[list[Any]]:
        """What a checkpoint keeps: the queue."""
        return [[r.stage, r.task, r.failed] for r in self.queue]

    def restore(self, state: list[list[Any]]) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        self.queue = [Revisit(int(stage), dict(task), float(failed)) for stage, task, failed in state]


@dataclass
class Revisit:
    """A queued task: its curriculum stage, and the share of its last group's valid rollouts that failed."""

    stage: int
    task: dict[str, Any]
    failed: float


def _key(stage: int, task: dict[str, Any]) -> str:
    """A queued task's identity: its stage and its whole content (two envs of a mixture may share a task id)."""
    return f"{stage}:{json.dumps(task, sort_keys=True, default=str)}"
