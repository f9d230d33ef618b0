"""The collect recipe: roll out a policy on an env's tasks and append the trajectories to a store.

Episode ids are derived from the command (env, split, seed, task, sample, and a hash of a replaced system prompt or
tool descriptions), so running the same command again after a crash runs only the episodes that are missing and
ends with exactly the requested number.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template
from trajlab.data.store import TrajectoryStore, read_trajectories
from trajlab.env.mixture import ENV_COLUMN, EnvMixture
from trajlab.env.registry import EnvSpec, read_tasks_file
from trajlab.evaluation import evaluate_trajectories
from trajlab.evolve.candidate import prompt_tag
from trajlab.inference.base import Generator, SamplingParams, is_server_url
from trajlab.inference.hf import HFGenerator
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models import init_tiny_model, load_model, load_tokenizer
from trajlab.rollout.engine import Episode, MixtureEngine, RolloutEngine, RolloutLimits, make_engine
from trajlab.rollout.types import Trajectory, task_id


@dataclass
class CollectConfig:
    env: EnvSpec | EnvMixture
    policy: str  # "oracle", a model directory, or an OpenAI-compatible server's URL (http://host:port/v1[#model])
    episodes: int
    out: Path
    split: str = "train"
    seed: int = 0
    samples_per_task: int = 1
    tasks_file: Path | None = None
    tokenizer: str | None = None  # for the oracle or a server: whose tokens the trajectories are written in
    parser: str = "auto"
    concurrency: int = 8
    sampling: SamplingParams = SamplingParams()
    limits: RolloutLimits = RolloutLimits()
    system_prompt: str | None = None


def default_model_dir() -> Path:
    """Where the tiny offline default model lives; built on first use."""
    return Path(os.environ.get("TRAJLAB_HOME", Path.home() / ".cache" / "trajlab")) / "tiny-model"


def ensure_default_model() -> Path:
    path = default_model_dir()
    if not (path / "config.json").exists():
        init_tiny_model(path, overwrite=True)
    return path


def plan_episodes(config: CollectConfig) -> list[Episode]:
    """The exact episodes a collect command stands for, in order."""
    if config.tasks_file is not None:
        rows = read_tasks_file(config.tasks_file)
        tasks = [{"task_id": str(row.get("task_id", f"line{i + 1}")), **row} for i, row in enumerate(rows)]
        for number, task in enumerate(tasks, start=1):
            _check_env_column(config.env, task, f"{config.tasks_file}:{number}")
    else:
        needed = -(-config.episodes // config.samples_per_task)
        tasks = list(itertools.islice(config.env.iter_tasks(config.split, config.seed), needed))
    if not tasks:
        raise ValueError(f"Environment '{config.env.name}' has no tasks in split '{config.split}'.")
    tag = prompt_tag(config.system_prompt, config.env)
    tag = f":prompt-{tag}" if tag else ""  # another system prompt or tool descriptions make other episodes
    episodes = []
    for index in range(config.episodes):
        # Each task gets samples_per_task consecutive episodes; a short task list is cycled with new sample numbers.
        task_index, sample = divmod(index, config.samples_per_task)
        cycle, task_index = divmod(task_index, len(tasks))
        task = tasks[task_index]
        sample += cycle * config.samples_per_task
        key = f"{task[ENV_COLUMN]}/{task_id(task)}" if ENV_COLUMN in task else task_id(task)
        episode_id = f"{config.env.name}:{config.split}:{config.seed}:{key}:{sample}{tag}"
        episodes.append(Episode(id=episode_id, task=task, split=config.split))
    return episodes


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


def collected(config: CollectConfig, episodes: list[Episode] | None = None) -> list[Trajectory]:
    """The stored trajectories of exactly the episodes ``config`` stands for (the file may hold others too)."""
    wanted = {episode.id for episode in (episodes if episodes is not None else plan_episodes(config))}
    return [t for t in read_trajectories(config.out) if t.id in wanted]


def build_policy(config: CollectConfig) -> tuple[Generator, Any, str]:
    """The generator, its tokenizer and its (prefix-preserving) chat template for a ``--policy`` value."""
    if config.policy == "oracle":
        if config.env.oracle is None:
            raise ValueError(f"Environment '{config.env.name}' has no reference policy; pass a model directory.")
        tokenizer = load_tokenizer(config.tokenizer or ensure_default_model())
        template = resolve_chat_template(tokenizer)
        return ScriptedGenerator(config.env.oracle, tokenizer, template, name="oracle"), tokenizer, template
    if is_server_url(config.policy):
        return _server_policy(config)
    tokenizer = load_tokenizer(config.policy)
    template = resolve_chat_template(tokenizer)
    model = load_model(config.policy)
    return HFGenerator(model, tokenizer, name=str(config.policy)), tokenizer, template


def _server_policy(config: CollectConfig) -> tuple[Generator, Any, str]:
    """``--policy http://host:port/v1[#model]``: an OpenAI-compatible server, read with the local ``--tokenizer``."""
    from trajlab.inference.openai_server import OpenAIGenerator, served_model, split_policy_url

    if config.tokenizer is None:
        raise ValueError(f"--policy {config.policy} is a server: pass --tokenizer with the served model's "
                         "directory (prompts are rendered and tool calls read locally, in its tokens).")
    base_url, model = split_policy_url(config.policy)
    model = served_model(base_url, model)
    tokenizer = load_tokenizer(config.tokenizer)
    template = resolve_chat_template(tokenizer)
    return OpenAIGenerator(base_url, model, tokenizer), tokenizer, template


def build_engine(config: CollectConfig) -> RolloutEngine | MixtureEngine:
    """The engine rolling out ``config``'s policy on its env, with its parser, sampling, limits and system prompt."""
    generator, tokenizer, template = build_policy(config)
    return make_engine(config.env, generator, tokenizer, chat_template=template,
                       parser=get_parser(config.parser, tokenizer), sampling=config.sampling, limits=config.limits,
                       system_prompt=config.system_prompt)


def collect(
    config: CollectConfig, *, on_progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Run the missing episodes of ``config`` into ``config.out`` and summarise the whole file's episodes."""
    episodes = plan_episodes(config)
    engine = build_engine(config)
    with TrajectoryStore(config.out) as store:
        todo = [episode for episode in episodes if episode.id not in store.ids]
        done = len(episodes) - len(todo)
        if on_progress:
            on_progress(done, len(episodes))

        def save(trajectory: Trajectory) -> None:
            nonlocal done
            store.append(trajectory)
            done += 1
            if on_progress:
                on_progress(done, len(episodes))

        started = time.perf_counter()
        new = asyncio.run(engine.run(todo, concurrency=config.concurrency, on_result=save))
        elapsed = time.perf_counter() - started
    report = evaluate_trajectories(collected(config, episodes))
    summary: dict[str, Any] = report.model_dump(include={"episodes", "success_rate", "mean_reward", "mean_turns",
                                                         "tool_error_rate", "parse_error_rate", "statuses"})
    summary["resumed_from"] = len(episodes) - len(todo)
    summary["tokens_per_s"] = sum(t.metrics.get("model_tokens", 0.0) for t in new) / elapsed if new else 0.0
    return summary
