"""The collect recipe, :func:`trajlab.collect`: roll a policy out on an env's tasks into a trajectory file.

It wires the collection components (:mod:`trajlab.collection`): the plan of episodes, the demonstrator when the
policy is ``oracle``, the runner built from the rollout and model settings, and the resumable run into the store.
``trajlab eval`` and evolution roll out through :func:`roll_out` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trajlab.collection.demonstrators import demonstrator
from trajlab.collection.engines import build_runner, resolve_prompts
from trajlab.collection.plan import TaskRows, episode_tag, plan_episodes, read_planned
from trajlab.collection.run import RunOutcome, run_missing
from trajlab.config import CollectSettings, ModelSettings, RolloutSettings, VLLMSettings
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.inference.policy import Policy, PolicyLike
from trajlab.recipes.arguments import (
    EnvLike,
    Progress,
    as_env,
    model_settings,
    output_path,
    run_seed,
    settings_of,
)
from trajlab.rollout.types import Trajectory


def collect(
    env: EnvLike,
    policy: PolicyLike | Policy,
    *,
    out: str | Path | None = None,
    tasks: TaskRows | None = None,
    tokenizer: Any = None,
    seed: int | None = None,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    backend: str | None = None,
    vllm: VLLMSettings | dict | None = None,
    on_progress: Progress | None = None,
    device: str | None = None,
    dtype: str | None = None,
    **settings: Any,
) -> list[Trajectory]:
    """Roll ``policy`` out on ``env`` and return the trajectories.

    Args:
        env: see :data:`~trajlab.recipes.arguments.EnvLike`.
        policy: see :func:`trajlab.inference.policy.load_policy`.
        out: a trajectory file to append to; an existing one is resumed (only missing episodes run). None: the
            trajectories are only returned.
        tasks: task dicts (or a JSONL file of them) to roll out instead of the env's own split (``episodes``
            cycles through them).
        tokenizer: the trajectories' tokenizer, for the oracle (default: the tiny model's), a server, a loaded
            model or a Generator.
        seed: task order seed (None: the config's ``seed``).
        rollout: rollout settings (limits, concurrency, parser, prompts); see ``RolloutSettings``.
        backend, device, dtype: what generates for a model directory, where and in what dtype (``ModelSettings``;
            None: its default).
        vllm: the vllm backend's engine arguments (``VLLMSettings``: memory share, context length, eager).
        on_progress: called as episodes finish.
        **settings: ``CollectSettings`` fields: ``episodes``, ``split``, ``samples_per_task``, ``temperature``,
            ``reference`` and ``reference_noise`` (with the ``"oracle"`` policy: imperfect demonstrations, from one
            of the env's named reference policies or with mistakes made on purpose).
    """
    chosen = settings_of(CollectSettings, settings)
    with output_path(out, "trajectories.jsonl") as path:
        trajectories, _ = roll_out(
            as_env(env), policy, path, split=chosen.split, seed=run_seed(seed), episodes=chosen.episodes,
            samples_per_task=chosen.samples_per_task, tasks=tasks, temperature=chosen.temperature,
            tokenizer=tokenizer, rollout=settings_of(RolloutSettings, rollout),
            model=model_settings(device, dtype, backend, vllm), reference=chosen.reference,
            noise=chosen.reference_noise, on_progress=on_progress)
        return trajectories


def roll_out(
    env: EnvSpec | EnvMixture, policy: PolicyLike | Policy, out: Path, *, split: str, seed: int, episodes: int,
    samples_per_task: int, tasks: TaskRows | None, temperature: float, tokenizer: Any, rollout: RolloutSettings,
    model: ModelSettings, reference: str | None, noise: float, on_progress: Progress | None,
) -> tuple[list[Trajectory], RunOutcome]:
    """Run the planned episodes ``out`` lacks; returns every planned episode's trajectory (in the plan's order) and
    what this run did."""
    env, rollout = resolve_prompts(env, rollout)
    chosen = demonstrator(env, policy, reference=reference, noise=noise, seed=seed)
    planned = plan_episodes(env, split=split, seed=seed, episodes=episodes, samples_per_task=samples_per_task,
                            tasks=tasks, tag=episode_tag(env, rollout.system_prompt, reference, noise))
    runner = build_runner(env, policy, rollout=rollout, model=model, temperature=temperature, seed=seed,
                          tokenizer=tokenizer, demonstrator=chosen, run_dir=out.parent)
    outcome = run_missing(runner, planned, out, rollout=rollout, demonstrator=chosen, on_progress=on_progress)
    return read_planned(out, planned), outcome
