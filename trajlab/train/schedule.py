"""RL's learning rate over its optimizer steps: a warm-up that starts above 0, then held or decayed to 0 at the
run's last planned optimizer step (``rl.lr_scheduler``), each step's optionally scaled by its rollouts' failures
(``rl.rate_by_failures``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from trajlab.config import RLSettings
from trajlab.rollout.types import Trajectory


def learning_rate_factor(done: int, settings: RLSettings) -> float:
    """The rate's multiplier after ``done`` optimizer steps: warm-up that starts above 0 (no step is wasted at rate
    0), then held or decayed to 0 at the run's last planned optimizer step."""
    warmup = min(1.0, (done + 1) / (settings.warmup_steps + 1))
    if settings.lr_scheduler == "constant":
        return warmup
    decaying = max(1, settings.steps * optimizer_steps(settings) - settings.warmup_steps)
    progress = min(1.0, max(0, done - settings.warmup_steps) / decaying)
    decay = 1 - progress if settings.lr_scheduler == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return warmup * decay


def optimizer_steps(settings: RLSettings, rollouts: int | None = None) -> int:
    """The optimizer steps one RL step's update of ``rollouts`` makes, one per minibatch of each epoch (None: the
    step's planned ``tasks_per_step`` x ``group_size``, which the schedule's length counts)."""
    rollouts = settings.tasks_per_step * settings.group_size if rollouts is None else rollouts
    return settings.epochs_per_step * math.ceil(rollouts / (settings.minibatch_size or rollouts))


def rl_scheduler(optimizer: torch.optim.Optimizer, settings: RLSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """The scheduler stepping ``optimizer``'s rate by :func:`learning_rate_factor`, once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(learning_rate_factor, settings=settings))


def failed_share(trajectories: Sequence[Trajectory]) -> float:
    """The share of ``trajectories`` that did not succeed: the step's rate multiplier under ``rl.rate_by_failures``
    (1 for no trajectories, which train nothing)."""
    if not trajectories:
        return 1.0
    return sum(t.status != "success" for t in trajectories) / len(trajectories)
