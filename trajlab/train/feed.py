"""Each RL step's rollouts, produced on a background thread at most ``max_staleness`` policy versions ahead.

The policy version is the number of RL steps trained so far. Rollouts for step ``s`` start once at least
``s - max_staleness`` steps are trained, from the sampler's weights of that moment, and every trajectory records that
version (``metrics["policy_version"]``). With ``max_staleness`` 0 the thread waits for each update before rolling out
the next step: the synchronous loop, every step sampled by the weights just trained. With K > 0 the rollouts of the
next K steps run while the trainer updates, from weights up to K versions old.

The sampler's weights change only between two steps' rollouts: ``publish`` takes the lock the producer holds while
it rolls out, so no batch mixes two versions.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from trajlab.rollout.types import Trajectory


@dataclass
class StepRollouts:
    """One step's trajectories and when they were made (``time.perf_counter`` seconds)."""

    step: int
    trajectories: list[Trajectory]
    version: int
    began: float
    ended: float
    generate_calls: int = 0


@dataclass
class _Timeline:
    """The rollout intervals, so each update can say how much of it ran alongside rollouts."""

    intervals: list[tuple[float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, began: float, ended: float) -> None:
        with self.lock:
            self.intervals.append((began, ended))

    def overlap(self, began: float, ended: float, now: float) -> float:
        """Seconds of [began, ended] during which rollouts ran (one still running counts up to ``now``)."""
        with self.lock:
            spans = list(self.intervals)
        return sum(max(0.0, min(ended, e if e else now) - max(began, b)) for b, e in spans)


class RolloutFeed:
    """Produce ``steps`` steps of rollouts from ``start`` on, at most ``max_staleness`` versions ahead.

    Args:
        rollouts: the coroutine that rolls out one step (its index) and returns its trajectories.
        start: the first step (a resumed run's), also the sampler's version at start.
        steps: one past the last step.
        max_staleness: how many versions the sampler may be behind the trainer when a step's rollouts begin.
        calls: the sampler's count of generate calls, read around each step.
    """

    def __init__(self, rollouts: Callable[[int], Coroutine[Any, Any, list[Trajectory]]], *, start: int, steps: int,
                 max_staleness: int, calls: Callable[[], int] = lambda: 0) -> None:
        self.max_staleness = max_staleness
        self._rollouts, self._calls = rollouts, calls
        self._steps = range(start, steps)
        self._trained = start
        self.version = start
        self._ready: queue.Queue[StepRollouts | BaseException] = queue.Queue()
        self._turn = threading.Condition()
        self.sampler_lock = threading.Lock()
        self._stop = False
        self.timeline = _Timeline()
        self._thread = threading.Thread(target=self._produce, name="trajlab-rollouts", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for step in self._steps:
                with self._turn:
                    self._turn.wait_for(lambda s=step: self._stop or s - self._trained <= self.max_staleness)
                if self._stop:
                    return
                with self.sampler_lock:
                    version, calls, began = self.version, self._calls(), time.perf_counter()
                    self.timeline.add(began, 0.0)
                    trajectories = asyncio.run(self._rollouts(step))
                    ended = time.perf_counter()
                    with self.timeline.lock:
                        self.timeline.intervals[-1] = (began, ended)
                for trajectory in trajectories:
                    trajectory.metrics["policy_version"] = float(version)
                self._ready.put(StepRollouts(step, trajectories, version, began, ended, self._calls() - calls))
        except BaseException as exc:  # the trainer re-raises it: a failed rollout must not hang the run
            self._ready.put(exc)

    def next(self) -> StepRollouts:
        """The next step's rollouts, waiting for them if need be."""
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def trained(self, steps: int, publish: Callable[[], None]) -> None:
        """``steps`` steps are trained: hand the sampler the new weights (``publish``, between two steps' rollouts)
        and let the producer run ahead again."""
        with self.sampler_lock:
            publish()
            self.version = steps
        with self._turn:
            self._trained = steps
            self._turn.notify_all()

    def close(self) -> None:
        """Stop producing after the step in flight (the thread is a daemon: a hung sampler cannot block exit)."""
        with self._turn:
            self._stop = True
            self._turn.notify_all()
        self._thread.join(timeout=1.0)
