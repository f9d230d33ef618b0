"""Envs whose episode kills its own process once (test only): a rollout worker dying mid-run, for real.

``arm(monkeypatch, marker, task_id)`` sets environment variables that a Ray cluster started afterwards passes to its
workers. From then on, the first ``reset`` (of the task ``task_id``, or of any task) in a process other than the
test's own creates ``marker`` and SIGKILLs its process; every later one, retries included, runs normally.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

from trajlab.env.builtin.arithmetic import SPEC as ARITHMETIC_SPEC
from trajlab.env.builtin.arithmetic import Arithmetic

from .length_env import SPEC as LENGTH_SPEC
from .length_env import LengthReward

MARKER, DRIVER, TASK = "TRAJLAB_TEST_DIE_MARKER", "TRAJLAB_TEST_DIE_DRIVER", "TRAJLAB_TEST_DIE_TASK"


def arm(monkeypatch: Any, marker: Path, task_id: str | None = None) -> None:
    """Make the first matching ``reset`` outside this process kill its process (see the module doc)."""
    monkeypatch.setenv(MARKER, str(marker))
    monkeypatch.setenv(DRIVER, str(os.getpid()))
    if task_id is not None:
        monkeypatch.setenv(TASK, task_id)


def _die_once(task: dict[str, Any]) -> None:
    marker = os.environ.get(MARKER)
    if not marker or str(os.getpid()) == os.environ.get(DRIVER):
        return
    if os.environ.get(TASK, task["task_id"]) != task["task_id"]:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


class DyingArithmetic(Arithmetic):
    __doc__ = Arithmetic.__doc__

    def reset(self, **task: Any) -> Any:
        _die_once(task)
        return super().reset(**task)


class DyingLengthReward(LengthReward):
    __doc__ = LengthReward.__doc__

    def reset(self, **task: Any) -> Any:
        _die_once(task)
        return super().reset(**task)


ARITHMETIC = dataclasses.replace(ARITHMETIC_SPEC, env_cls=DyingArithmetic)
LENGTH = dataclasses.replace(LENGTH_SPEC, env_cls=DyingLengthReward)
