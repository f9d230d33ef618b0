"""The evaluate recipe, :func:`trajlab.evaluate`: roll a policy out on held-out tasks and score it (success rate,
pass@k, mean reward and turns, error rates, per task); ``trajlab eval`` and every ``eval`` stage of a run."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trajlab.collection.plan import TaskRows
from trajlab.config import EvalSettings, RolloutSettings, VLLMSettings
from trajlab.env.registry import read_tasks_file
from trajlab.errors import UserError
from trajlab.evaluation import EvalReport, evaluate_trajectories, save_report
from trajlab.evaluation.metrics import eval_metrics
from trajlab.inference.policy import Policy, PolicyLike
from trajlab.recipes.arguments import EnvLike, Progress, as_env, model_settings, output_path, policy_label, settings_of
from trajlab.recipes.collect import roll_out
from trajlab.rewards import RewardFunction, RewardSet
from trajlab.tracking import Trackers, require_trackers

logger = logging.getLogger(__name__)


def evaluate(
    env: EnvLike,
    policy: PolicyLike | Policy,
    *,
    out: str | Path | None = None,
    tasks: TaskRows | None = None,
    tokenizer: Any = None,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    rewards: Mapping[str, float | RewardFunction | dict[str, Any]] | None = None,
    label: str | None = None,
    backend: str | None = None,
    vllm: VLLMSettings | dict | None = None,
    on_progress: Progress | None = None,
    device: str | None = None,
    dtype: str | None = None,
    report_to: Sequence[str] = (),
    **settings: Any,
) -> EvalReport:
    """Evaluate ``policy`` on held-out tasks: success rate, pass@k, mean reward and turns, error rates, per task.

    Args:
        out: a run directory for ``trajectories.jsonl`` and ``eval.json`` (resumed if it exists); None: nothing
            is written.
        tasks: task dicts to evaluate on instead of the env's split (all of them unless ``num_tasks`` is given).
        rewards: named rewards to report (``reward/<name>``), as ``eval.rewards``: built-in weights or reward
            functions (a failing function marks its episode error); None: the env reward only.
        label: the run's name in tables (default: the policy's).
        report_to: experiment trackers that also get the results, as ``eval/...`` (:mod:`trajlab.tracking`; the
            tracker run is named after ``out``).
        **settings: ``EvalSettings`` fields: ``num_tasks``, ``samples_per_task``, ``ks``, ``temperature``,
            ``split``, ``seed``.
        Other arguments: as for :func:`trajlab.collect`.
    """
    require_trackers(report_to)
    if report_to and out is None:
        raise UserError("report_to needs out=: the tracker run is named after the evaluation's directory.")
    spec = as_env(env)
    chosen = _each_task_once(spec, tasks, settings)
    with output_path(out, "") as run_dir:
        trajectories, outcome = roll_out(
            spec, policy, run_dir / "trajectories.jsonl", split=chosen.split, seed=chosen.seed,
            episodes=chosen.num_tasks * chosen.samples_per_task, samples_per_task=chosen.samples_per_task,
            tasks=tasks, temperature=chosen.temperature, tokenizer=tokenizer,
            rollout=settings_of(RolloutSettings, rollout), model=model_settings(device, dtype, backend, vllm),
            reference=None, noise=0.0, on_progress=on_progress)
        if rewards is not None:  # every reward logged alongside success, the functions' calls batched
            RewardSet(settings_of(EvalSettings, {"rewards": dict(rewards)}).rewards).score(trajectories)
        report = evaluate_trajectories(trajectories, ks=chosen.pass_at(), label=label or policy_label(policy),
                                       tokens_per_s=outcome.tokens_per_s or None)
        report.errors_run_again = outcome.errors_run_again
        if out is not None:
            save_report(report, run_dir / "eval.json")
            with Trackers(report_to, run_dir.parent, run_dir.name, config={"eval": chosen.model_dump(mode="json"),
                                                                           "label": report.label}) as trackers:
                trackers.log(eval_metrics(report), step=0)
    return report


def _each_task_once(env: Any, tasks: TaskRows | None, settings: Mapping[str, Any]) -> EvalSettings:
    """The evaluation's settings, ``num_tasks`` cut to the tasks there are (all the given ones by default), saying
    so: a short list would otherwise be cycled (as a collection does), and a task evaluated twice counts twice in the
    success rate (``samples_per_task`` is how to roll each task out several times)."""
    if tasks is not None:
        available = len(read_tasks_file(tasks)) if isinstance(tasks, str | Path) else len(tasks)
        chosen, where = settings_of(EvalSettings, {"num_tasks": max(available, 1), **settings}), "given"
    else:
        chosen = settings_of(EvalSettings, settings)
        available = sum(1 for _ in itertools.islice(env.iter_tasks(chosen.split, chosen.seed), chosen.num_tasks))
        where = f"in {env.name}'s {chosen.split} split"
    if 0 < available < chosen.num_tasks:
        logger.warning("eval.num_tasks is %d but %d tasks are %s: each is evaluated once (%d tasks).",
                       chosen.num_tasks, available, where, available)
        return chosen.model_copy(update={"num_tasks": available})
    return chosen
