"""The collect recipe: roll out a policy on an env's tasks and append the trajectories to a store.

Episode ids are derived from the command (env, split, seed, task id and a hash of the task's content, sample, and a
hash of a replaced system prompt or tool descriptions, and the reference noise), so running the same command again
after a crash runs only the episodes that are missing, and those that ended in ``error``, and ends with exactly the
requested number.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajlab.chat.parsers import get_parser
from trajlab.data.store import StoreError, TrajectoryStore, read_trajectories
from trajlab.env.mixture import ENV_COLUMN, EnvMixture
from trajlab.env.noisy import NoisyReference
from trajlab.env.prompts import prompt_tag
from trajlab.env.registry import EnvSpec, Oracle, read_tasks_file
from trajlab.errors import UserError
from trajlab.evaluation import evaluate_trajectories
from trajlab.inference.base import SamplingParams
from trajlab.inference.policy import Policy, PolicyLike, load_policy
from trajlab.inference.scripted import draws
from trajlab.rollout.engine import Episode, MixtureEngine, RolloutEngine, make_engine
from trajlab.rollout.types import Trajectory, task_hash, task_id
from trajlab.rollout.workers import RayRolloutRunner, WorkerSpec

logger = logging.getLogger(__name__)


@dataclass
class CollectConfig:
    """What to roll out, with which policy, into which file; episode ids follow from it (see the module doc)."""

    env: EnvSpec | EnvMixture
    policy: PolicyLike | Policy  # see trajlab.inference.policy.load_policy
    episodes: int
    out: Path
    split: str = "train"
    seed: int = 0
    samples_per_task: int = 1
    tasks_file: Path | None = None
    tasks: list[dict[str, Any]] | None = None  # instead of a tasks file or the env's generator
    tokenizer: Any = None  # for the oracle, a server, a model or a Generator: the trajectories' tokens
    parser: str = "auto"
    concurrency: int = 8
    retries: int = 2  # RolloutSettings.retries and retry_backoff_s
    retry_backoff_s: float = 1.0
    workers: int = 0  # RolloutSettings.workers and ray_address: Ray actors run the episodes
    ray_address: str = "local"
    worker_gpus: float = 0.0
    sampling: SamplingParams = SamplingParams()
    limits: dict[str, int | float] = field(default_factory=dict)  # the user's; the rest are each env's own
    system_prompt: str | None = None
    device: str = "auto"  # model.device and model.dtype, for a model-directory policy
    dtype: str = "auto"
    backend: str = "hf"  # what generates for a model-directory policy: hf or vllm (ModelSettings.backend)
    reference: str | None = None  # CollectSettings.reference: one of the env's imperfect reference policies
    reference_noise: float = 0.0  # CollectSettings.reference_noise: the oracle errs in this share of situations


def plan_episodes(config: CollectConfig) -> list[Episode]:
    """The exact episodes a collect command stands for, in order."""
    if config.tasks_file is not None or config.tasks is not None:
        rows = read_tasks_file(config.tasks_file) if config.tasks is None else config.tasks
        where = config.tasks_file or "tasks"
        tasks = [{"task_id": str(row.get("task_id", f"line{i + 1}")), **row} for i, row in enumerate(rows)]
        checks: dict[str, Callable[[dict[str, Any]], list[str]]] = {}
        for number, task in enumerate(tasks, start=1):
            _check_env_column(config.env, task, f"{where}:{number}")
            spec = config.env.spec_for(task) if isinstance(config.env, EnvMixture) else config.env
            check = checks.setdefault(spec.name, spec.task_check())
            if problems := check(task):
                raise ValueError(f"{where}:{number}: not a {spec.name} task: {'; '.join(problems)}. Fix the row "
                                 "(or remove it) and run again; nothing was run.")
    else:
        needed = -(-config.episodes // config.samples_per_task)
        tasks = list(itertools.islice(config.env.iter_tasks(config.split, config.seed), needed))
    if not tasks:
        raise ValueError(f"Environment '{config.env.name}' has no tasks in split '{config.split}'.")
    tag = prompt_tag(config.system_prompt, config.env)
    tag = f":prompt-{tag}" if tag else ""  # another system prompt or tool descriptions make other episodes
    if config.reference:
        tag += f":reference-{config.reference}"  # another demonstrator's episodes are other episodes
    if config.reference_noise:
        tag += f":noise-{config.reference_noise:g}"  # so do the noisy reference's demonstrations
    episodes = []
    for index in range(config.episodes):
        # Each task gets samples_per_task consecutive episodes; a short task list is cycled with new sample numbers.
        task_index, sample = divmod(index, config.samples_per_task)
        cycle, task_index = divmod(task_index, len(tasks))
        task = tasks[task_index]
        sample += cycle * config.samples_per_task
        task_key = f"{task[ENV_COLUMN]}/{task_id(task)}" if ENV_COLUMN in task else task_id(task)
        if "task_id" in task:  # an id given by hand says nothing of the content: an edited task is another one
            task_key += f"~{task_hash(task)}"
        episode_id = f"{config.env.name}:{config.split}:{config.seed}:{task_key}:{sample}{tag}"
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
    """The stored trajectories of exactly the episodes ``config`` stands for (the file may hold others too), in the
    plan's order: the file is in the order episodes finished, which depends on timing, and what is trained on must not.
    """
    order = {episode.id: i for i, episode in enumerate(episodes if episodes is not None else plan_episodes(config))}
    return sorted((t for t in read_trajectories(config.out) if t.id in order), key=lambda t: order[t.id])


def build_policy(config: CollectConfig, reference: NoisyReference | None = None) -> Policy:
    """The generator, tokenizer and chat template of ``config.policy``; for the oracle, the reference policy
    ``config.reference`` names, and with ``reference_noise``, ``reference`` (default: :func:`noisy_reference`)."""
    reference = reference or noisy_reference(config)
    oracle, name = chosen_reference(config)
    policy = load_policy(config.policy, tokenizer=config.tokenizer, oracle=reference or oracle,
                         device=config.device, dtype=config.dtype, backend=config.backend,
                         vision=config.env.shows_images)
    if reference is not None or config.reference:
        policy.generator.name = reference.name if reference is not None else name  # each trajectory's policy
    return policy


def chosen_reference(config: CollectConfig) -> tuple[Oracle | None, str]:
    """The reference policy that demonstrates: the env's own, or the imperfect one ``config.reference`` names; and
    the name each of its trajectories records as its policy (``oracle``, ``oracle:NAME``).

    Raises:
        UserError: a named reference for a policy other than the oracle, or one the env does not have
            (:func:`named_reference`).
    """
    if not config.reference:
        return config.env.oracle, "oracle"
    if not _is_oracle(config.policy):
        raise UserError(f"collect.reference names a reference policy that demonstrates: it needs --policy oracle, "
                        f"not {config.policy!r}.")
    return named_reference(config.env, config.reference), f"oracle:{config.reference}"


def _is_oracle(policy: PolicyLike | Policy) -> bool:
    return isinstance(policy, str | Path) and str(policy) == "oracle"


def named_reference(env: EnvSpec | EnvMixture, name: str) -> Oracle:
    """The env's imperfect reference policy ``name``.

    Raises:
        UserError: a mixture of envs, or a name the env does not have (the message lists those it has).
    """
    if isinstance(env, EnvMixture):
        raise UserError(f"collect.reference {name!r} is one env's: collect each env of the mixture {env.name!r} on "
                        "its own to use it.")
    if name not in env.references:
        listed = ", ".join(sorted(env.references)) or "none besides its own"
        raise UserError(f"{env.name} has no reference policy {name!r}; it has: {listed}. Leave collect.reference "
                        "unset for the env's own.")
    return env.references[name]


def noisy_reference(config: CollectConfig) -> NoisyReference | None:
    """The env's reference policy erring in ``config.reference_noise`` of its situations (None at 0), seeded by the
    collection's seed.

    Raises:
        UserError: noise for a policy other than the oracle, or for an env without one.
    """
    if not config.reference_noise:
        return None
    oracle, name = chosen_reference(config)
    if not _is_oracle(config.policy) or oracle is None:
        raise UserError(f"reference_noise makes the env's reference policy err: it needs --policy oracle (and an env "
                        f"with one), not {config.policy!r}.")
    if draws(oracle):
        raise UserError(f"reference_noise replays each conversation to find the turns its reference erred on, and the "
                        f"reference {config.reference!r} draws anew in every episode, so they do not compose: leave "
                        f"collect.reference_noise at 0 with it.")
    env = config.env

    def tools_of(task: dict[str, Any]) -> list[dict[str, Any]]:
        return (env.spec_for(task) if isinstance(env, EnvMixture) else env).tools

    return NoisyReference(oracle, tools_of, config.reference_noise, seed=config.seed, name=name)


def build_engine(config: CollectConfig, reference: NoisyReference | None = None
                 ) -> RolloutEngine | MixtureEngine | RayRolloutRunner:
    """The engine rolling out ``config``'s policy on its env, with its parser, sampling, limits and system prompt:
    in this process, or on ``config.workers`` Ray actors (each building the policy from its name). ``reference``: see
    :func:`build_policy`."""
    if config.workers:
        return _workers(config)
    policy = build_policy(config, reference)
    if config.env.shows_images and policy.processor is None:
        raise UserError(f"{config.env.name}'s tools return images, and the policy's model is a text model (no image "
                        "processor): use a vision-language model directory (e.g. `trajlab model init --vision DIR`) "
                        "as --policy, or as --tokenizer for the oracle.")
    return make_engine(config.env, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                       parser=get_parser(config.parser, policy.tokenizer), sampling=config.sampling,
                       limits=config.limits, system_prompt=config.system_prompt, seed=config.seed,
                       processor=policy.processor)


def _workers(config: CollectConfig) -> RayRolloutRunner:
    if not isinstance(config.policy, str | Path) or not isinstance(config.tokenizer, str | Path | None):
        raise UserError("rollout.workers build their policies from names: pass the policy as 'oracle', a model "
                        "directory or a server URL, and the tokenizer as a directory.")
    if config.reference_noise or config.reference:
        raise UserError("collect.reference and reference_noise run in this process only: set rollout.workers to 0 "
                        "to collect their demonstrations.")
    spec = WorkerSpec(env=config.env, policy=str(config.policy),
                      tokenizer=None if config.tokenizer is None else str(config.tokenizer), backend=config.backend,
                      device=config.device, dtype=config.dtype, parser=config.parser, sampling=config.sampling,
                      limits=config.limits, system_prompt=config.system_prompt, seed=config.seed,
                      max_batch_size=config.concurrency)
    return RayRolloutRunner(spec, config.workers, address=config.ray_address, run_dir=config.out.parent,
                            worker_gpus=config.worker_gpus,
                            concurrency=config.concurrency)


def collect(
    config: CollectConfig, *, on_progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Run the missing episodes of ``config`` into ``config.out`` and summarise the whole file's episodes."""
    episodes = plan_episodes(config)
    reference = None if config.workers else noisy_reference(config)
    with build_engine(config, reference) as engine, TrajectoryStore(config.out) as store:
        failed = {episode.id for episode in episodes} & store.errors
        if failed:  # the machinery broke them last time (a server away, a bug since fixed): run them again
            kept_in = errors_file(config.out)
            store.remove(failed, keep_in=kept_in)
            logger.info("running again %d episodes that ended in error (their records are kept in %s)",
                        len(failed), kept_in)
        todo = [episode for episode in episodes if episode.id not in store.ids]
        done = len(episodes) - len(todo)
        if on_progress:
            on_progress(done, len(episodes))

        refused = False  # the store refused a write (disk full): raised once, later results are not stored

        def save(trajectory: Trajectory) -> None:
            nonlocal done, refused
            if refused:
                return  # not stored: the same command runs it again once there is room
            if reference is not None:
                _record_noise(trajectory, reference)
            try:
                store.append(trajectory)
            except StoreError:
                refused = True
                raise
            done += 1
            if on_progress:
                on_progress(done, len(episodes))

        started = time.perf_counter()
        new = asyncio.run(engine.run(todo, concurrency=config.concurrency, on_result=save, retries=config.retries,
                                     retry_backoff_s=config.retry_backoff_s))
        elapsed = time.perf_counter() - started
    report = evaluate_trajectories(collected(config, episodes))
    summary: dict[str, Any] = report.model_dump(include={"episodes", "success_rate", "mean_reward", "mean_turns",
                                                         "tool_error_rate", "parse_error_rate", "statuses"})
    summary["tokens_per_s"] = sum(t.metrics.get("model_tokens", 0.0) for t in new) / elapsed if new else 0.0
    summary["errors_run_again"] = len(failed)
    return summary


def _record_noise(trajectory: Trajectory, reference: NoisyReference) -> None:
    """Mark a noisy reference's trajectory: ``metrics["reference_noise"]`` (the share of situations it errs in) and
    ``metrics["reference_noise/turns"]`` (its turns that were mistakes; 0: this demonstration is the oracle's own)."""
    trajectory.metrics["reference_noise"] = reference.noise
    erred = reference.erred_turns(trajectory.task, trajectory.messages)
    trajectory.metrics["reference_noise/turns"] = float(len(erred))


def errors_file(out: Path) -> Path:
    """Where a collection keeps the records of episodes that ended in ``error`` and were run again (one line per
    failed attempt, so an episode may appear once per run it failed in)."""
    return out.with_name(out.stem + ".errors.jsonl")
