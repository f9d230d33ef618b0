"""The episodes a collection stands for, with ids that follow from the command.

Episode ids are derived from the command (env, split, seed, task id and a hash of the task's content, sample, and a
tag for a replaced system prompt or tool descriptions and for the demonstrator), so running the same command again
after a crash runs only the episodes that are missing, and those that ended in ``error``, and ends with exactly the
requested number.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trajlab.data.store import read_trajectories
from trajlab.env.mixture import ENV_COLUMN, EnvMixture
from trajlab.env.prompts import prompt_tag
from trajlab.env.registry import EnvSpec, read_tasks_file
from trajlab.rollout.runner import Episode
from trajlab.rollout.types import Trajectory, task_hash, task_id

TaskRows = Sequence[dict[str, Any]] | str | Path
"""Tasks given instead of the env's own split: dicts, or a JSONL file of them."""


def plan_episodes(env: EnvSpec | EnvMixture, *, split: str, seed: int, episodes: int, samples_per_task: int,
                  tasks: TaskRows | None, tag: str) -> list[Episode]:
    """The exact episodes a collection stands for, in order: ``samples_per_task`` consecutive episodes of each task
    (``tasks``, else the env's ``split`` in ``seed``'s order), a short task list cycled with new sample numbers.

    Raises:
        ValueError: a task row the env cannot run (named by its line), or no task at all.
    """
    rows = _given_tasks(env, tasks) if tasks is not None else list(
        itertools.islice(env.iter_tasks(split, seed), -(-episodes // samples_per_task)))
    if not rows:
        raise ValueError(f"Environment '{env.name}' has no tasks in split '{split}'.")
    planned = []
    for index in range(episodes):
        task_index, sample = divmod(index, samples_per_task)
        cycle, task_index = divmod(task_index, len(rows))
        task = rows[task_index]
        sample += cycle * samples_per_task
        task_key = f"{task[ENV_COLUMN]}/{task_id(task)}" if ENV_COLUMN in task else task_id(task)
        if "task_id" in task:  # an id given by hand says nothing of the content: an edited task is another one
            task_key += f"~{task_hash(task)}"
        planned.append(Episode(id=f"{env.name}:{split}:{seed}:{task_key}:{sample}{tag}", task=task, split=split))
    return planned


def episode_tag(env: EnvSpec | EnvMixture, system_prompt: str | None, reference: str | None, noise: float) -> str:
    """What sets a collection's episodes apart from the same tasks' other episodes: another system prompt or tool
    descriptions, another demonstrator, or the noisy reference's mistakes ("" for none)."""
    tag = prompt_tag(system_prompt, env)
    tag = f":prompt-{tag}" if tag else ""
    if reference:
        tag += f":reference-{reference}"
    if noise:
        tag += f":noise-{noise:g}"
    return tag


def _given_tasks(env: EnvSpec | EnvMixture, tasks: TaskRows) -> list[dict[str, Any]]:
    """Task rows checked against the env's own tasks before anything runs, each with a ``task_id``."""
    source = tasks if isinstance(tasks, str | Path) else None
    rows = read_tasks_file(source) if source is not None else [dict(task) for task in tasks]
    where = source or "tasks"
    checked = [{"task_id": str(row.get("task_id", f"line{i + 1}")), **row} for i, row in enumerate(rows)]
    checks: dict[str, Callable[[dict[str, Any]], list[str]]] = {}
    for number, task in enumerate(checked, start=1):
        _check_env_column(env, task, f"{where}:{number}")
        spec = env.spec_for(task) if isinstance(env, EnvMixture) else env
        check = checks.setdefault(spec.name, spec.task_check())
        if problems := check(task):
            raise ValueError(f"{where}:{number}: not a valid {spec.name} task: {'; '.join(problems)}. Fix the row "
                             "(or remove it) and run again; nothing was run.")
    return checked


def _check_env_column(env: EnvSpec | EnvMixture, task: dict[str, Any], where: str) -> None:
    """A task's ``env`` column must name the env it is run in (or one of the mixture's)."""
    if isinstance(env, EnvMixture):
        try:
            env.spec_for(task)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    elif ENV_COLUMN in task and task[ENV_COLUMN] != env.name:
        raise ValueError(f"{where}: the task is for env {task[ENV_COLUMN]!r} but runs in '{env.name}'; pass "
                         f"--env {env.name},{task[ENV_COLUMN]} to run a mixed task file.")


def read_planned(out: str | Path, episodes: Sequence[Episode]) -> list[Trajectory]:
    """The stored trajectories of exactly ``episodes`` (the file may hold others too), in the plan's order: the file
    is in the order episodes finished, which depends on timing, and what is trained on must not."""
    order = {episode.id: i for i, episode in enumerate(episodes)}
    return sorted((t for t in read_trajectories(out) if t.id in order), key=lambda t: order[t.id])
