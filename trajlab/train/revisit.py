"""Train tasks drawn again while the policy both solves and fails them (``rl.revisit_share``).

Why: RL's fresh draws spend each step on whatever train tasks come next, and once SFT is good most of them are
solved already: a situation the policy still gets wrong sits in one or two groups a step, its gradient diluted by
the rest. A task whose group had mixed outcomes (some rollouts succeeded, some failed) is one the policy can learn
from now, since GRPO's signal exists there (DAPO's dynamic sampling and prioritized level replay select for the same
thing). Drawing such tasks again, until their group stops being mixed, spends more of RL's steps where the failures
are. On driving demonstrated with noise, RL on the situation it kept failing alone repaired 25 of its 30 held-out
failures, where 100 steps of fresh draws had repaired none (BENCHMARKS.md, issue 45).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from trajlab.rollout.types import Trajectory


class Revisits:
    """The train tasks whose last group had mixed outcomes, oldest first; each step's draw takes some of them.

    Args:
        share: the share of each step's tasks taken from the queue (while it has tasks of the step's stage).
        capacity: the most tasks the queue keeps; beyond it the oldest are dropped.
    """

    def __init__(self, share: float, capacity: int) -> None:
        self.share, self.capacity = share, capacity
        self.queue: list[tuple[int, dict[str, Any]]] = []  # (curriculum stage, task)
        self._lock = threading.Lock()  # asynchronous RL draws on the feed's thread while the trainer observes

    def mix(self, stage: int, fresh: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """A step's tasks: the oldest queued tasks of ``stage`` (they leave the queue), then as many of ``fresh`` as
        are left to make up its length; and how many were revisits. The fresh tasks not used are skipped, so the
        fresh stream stays where the step's number puts it (resume draws the same tasks)."""
        wanted = round(self.share * len(fresh))
        with self._lock:
            taken = {i for i, (queued_stage, _) in enumerate(self.queue) if queued_stage == stage}
            taken = set(sorted(taken)[:wanted])
            revisits = [task for i, (_, task) in enumerate(self.queue) if i in taken]
            self.queue = [entry for i, entry in enumerate(self.queue) if i not in taken]
        return revisits + fresh[: len(fresh) - len(revisits)], len(revisits)

    def observe(self, stage: int, trajectories: Sequence[Trajectory]) -> None:
        """Queue the tasks of the step's groups whose valid rollouts both succeeded and failed; a task already
        queued stays where it is."""
        outcomes: dict[str, tuple[dict[str, Any], set[bool]]] = {}
        for trajectory in trajectories:
            if trajectory.status != "error" and trajectory.group is not None:
                outcomes.setdefault(trajectory.group, (trajectory.task, set()))[1].add(trajectory.status == "success")
        with self._lock:
            queued = {_key(queued_stage, task) for queued_stage, task in self.queue}
            for task, seen in outcomes.values():
                if len(seen) == 2 and _key(stage, task) not in queued:
                    self.queue.append((stage, task))
                    queued.add(_key(stage, task))
            self.queue = self.queue[-self.capacity :]

    def state(self) -> list[list[Any]]:
        """What a checkpoint keeps: the queue."""
        return [[stage, task] for stage, task in self.queue]

    def restore(self, state: list[list[Any]]) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        self.queue = [(int(stage), dict(task)) for stage, task in state]


def _key(stage: int, task: dict[str, Any]) -> str:
    """A queued task's identity: its stage and its whole content (two envs of a mixture may share a task id)."""
    return f"{stage}:{json.dumps(task, sort_keys=True, default=str)}"
