"""The report's numbers: pass@k, per-task rows, per-env rates, and metric names (see the package docstring)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict

from trajlab.rollout.types import Trajectory, task_key

#: Top-level report fields that are single numbers, in display order. Comparisons and results tables use these names.
SUMMARY_METRICS = (
    "episodes",
    "success_rate",
    "mean_reward",
    "mean_turns",
    "tool_error_rate",
    "parse_error_rate",
    "tokens_per_s",
)
#: Prefix of per-component reward metrics written into ``Trajectory.metrics`` by reward functions.
REWARD_PREFIX = "reward/"
JUDGE_PREFIX = "judge/"  # an LLM judge's usage on a trajectory's metrics (trajlab.rewards.judge)
STATUSES = ("success", "failure", "truncated", "error")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` is correct.

    This is the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` of Chen et al. (2021), "Evaluating Large Language
    Models Trained on Code". Computing the binomials directly overflows floats for realistic ``n``; the equivalent
    product ``1 - prod_{i=n-c+1..n} (1 - k/i)`` stays in [0, 1] throughout.

    Args:
        n: samples drawn for the task.
        c: how many of them were correct.
        k: the budget being estimated; must not exceed ``n``, since ``n`` samples cannot say anything about more.

    Raises:
        ValueError: ``k < 1``, ``k > n`` or ``c`` outside ``[0, n]``.
    """
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct samples c={c} must lie in [0, n={n}]")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class TaskRow(BaseModel):
    """One task's results over its ``n`` sampled episodes."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    env: str
    n: int
    successes: int
    mean_reward: float
    mean_turns: float
    pass_at: dict[int, float]

    @property
    def success_rate(self) -> float:
        return self.successes / self.n


class EvalReport(BaseModel):
    """Everything one evaluation measured; saved as ``eval.json`` with the run.

    Rates are per episode except ``tool_error_rate`` (per tool call) and ``parse_error_rate`` (per model turn), so
    that an agent that makes many calls is not flattered or punished by its episode count.
    """

    model_config = ConfigDict(extra="forbid")

    label: str
    episodes: int
    success_rate: float
    mean_reward: float
    mean_turns: float
    tool_error_rate: float
    parse_error_rate: float
    pass_at: dict[int, float]
    statuses: dict[str, int]
    per_env: dict[str, dict[str, float]]
    reward_components: dict[str, float]
    tokens_per_s: float | None = None
    errors_run_again: int = 0
    """Episodes that had ended in ``error`` on an earlier run of this evaluation and were run again by this one."""
    judge_usage: dict[str, float] = {}
    """An LLM judge's usage summed over the episodes (``calls``, ``prompt_tokens``, ``completion_tokens``,
    ``cache_hits``: their ``judge/...`` metrics); empty where no judge scored them."""
    tasks: list[TaskRow]


def evaluate_trajectories(
    trajectories: Iterable[Trajectory],
    *,
    ks: Sequence[int] = (1,),
    label: str = "",
    tokens_per_s: float | None = None,
) -> EvalReport:
    """Summarise episodes into an :class:`EvalReport`.

    Args:
        trajectories: the episodes to evaluate, e.g. ``read_trajectories(path)``.
        ks: pass@k budgets. The report-level ``pass_at`` keeps each ``k`` that every task can support (``k`` at most
            the smallest per-task sample count), so that every task contributes to the average; a task row keeps
            each ``k`` up to its own sample count.
        label: the run's name in tables and comparisons (e.g. ``untrained``, ``sft``).
        tokens_per_s: generation throughput measured by whoever ran the rollouts; trajectories alone cannot know
            it because episodes overlap in time.

    Raises:
        ValueError: no trajectories, or a ``k`` below 1.
    """
    episodes = list(trajectories)
    if not episodes:
        raise ValueError("no trajectories to evaluate")
    if any(k < 1 for k in ks):
        raise ValueError(f"pass@k budgets must be >= 1, got {list(ks)}")
    ks = sorted(set(ks))
    n = len(episodes)

    groups: defaultdict[tuple[str, str], list[Trajectory]] = defaultdict(list)
    for t in episodes:
        groups[task_key(t.env, t.task)].append(t)
    tasks = [_task_row(env, task, group, ks) for (env, task), group in sorted(groups.items())]
    min_n = min(row.n for row in tasks)
    pass_at = {k: sum(row.pass_at[k] for row in tasks) / len(tasks) for k in ks if k <= min_n}

    # Each env of a mixed run gets the headline rates and reward components of its own episodes.
    per_env: dict[str, dict[str, float]] = {}
    for env in sorted({t.env for t in episodes}):
        mine = [t for t in episodes if t.env == env]
        components = _reward_components(mine)
        per_env[env] = {"episodes": float(len(mine)), **_rates(mine)}
        per_env[env].update({f"{REWARD_PREFIX}{name}": value for name, value in components.items()})

    return EvalReport(
        label=label,
        episodes=n,
        **_rates(episodes),
        pass_at=pass_at,
        statuses={status: sum(t.status == status for t in episodes) for status in STATUSES},
        per_env=per_env,
        reward_components=_reward_components(episodes),
        tokens_per_s=tokens_per_s,
        judge_usage=_judge_usage(episodes),
        tasks=tasks,
    )


def _rates(episodes: list[Trajectory]) -> dict[str, float]:
    """The per-episode headline rates (tool errors per call, parse errors per model turn)."""
    n = len(episodes)

    def total(key: str) -> float:
        return sum(t.metrics.get(key, 0.0) for t in episodes)

    tool_calls, turns = total("tool_calls"), total("turns")
    return {
        "success_rate": sum(t.status == "success" for t in episodes) / n,
        "mean_reward": sum(t.reward for t in episodes) / n,
        "mean_turns": turns / n,
        "tool_error_rate": total("tool_errors") / tool_calls if tool_calls else 0.0,
        "parse_error_rate": total("parse_errors") / turns if turns else 0.0,
    }


def _judge_usage(episodes: list[Trajectory]) -> dict[str, float]:
    """The ``judge/...`` metrics the judges left on the episodes, summed, under their names without the prefix."""
    usage: defaultdict[str, float] = defaultdict(float)
    for t in episodes:
        for key, value in t.metrics.items():
            if key.startswith(JUDGE_PREFIX):
                usage[key.removeprefix(JUDGE_PREFIX)] += value
    return dict(sorted(usage.items()))


def _reward_components(episodes: list[Trajectory]) -> dict[str, float]:
    """Each reward component averaged over the episodes that logged it: an env without that reward says nothing."""
    components: defaultdict[str, list[float]] = defaultdict(list)
    for t in episodes:
        for key, value in t.metrics.items():
            if key.startswith(REWARD_PREFIX):
                components[key.removeprefix(REWARD_PREFIX)].append(value)
    return {name: sum(values) / len(values) for name, values in sorted(components.items())}


def _task_row(env: str, task: str, group: list[Trajectory], ks: Sequence[int]) -> TaskRow:
    n = len(group)
    successes = sum(t.status == "success" for t in group)
    return TaskRow(
        task_id=task,
        env=env,
        n=n,
        successes=successes,
        mean_reward=sum(t.reward for t in group) / n,
        mean_turns=sum(t.metrics.get("turns", 0.0) for t in group) / n,
        pass_at={k: pass_at_k(n, successes, k) for k in ks if k <= n},
    )


def check_metric_name(name: str) -> None:
    """Refuse a metric name :func:`metric_value` cannot resolve, saying which names exist.

    Raises:
        ValueError: the name is not a summary field, ``pass@K`` or ``reward/<component>``.
    """
    if name in SUMMARY_METRICS or (name.startswith("pass@") and name[5:].isdigit()):
        return
    if name.startswith(REWARD_PREFIX) and len(name) > len(REWARD_PREFIX):
        return
    raise ValueError(
        f"unknown metric {name!r}; use one of {list(SUMMARY_METRICS)}, 'pass@K' or '{REWARD_PREFIX}<component>'"
    )


def metric_value(report: EvalReport, name: str) -> float | None:
    """A report's number by plain name: a summary field, ``pass@K``, or ``reward/<component>``; None if absent."""
    check_metric_name(name)
    if name.startswith("pass@"):
        return report.pass_at.get(int(name[5:]))
    if name.startswith(REWARD_PREFIX):
        return report.reward_components.get(name.removeprefix(REWARD_PREFIX))
    return getattr(report, name)


def metric_names(reports: Sequence[EvalReport]) -> list[str]:
    """Every metric any of ``reports`` has, in display order."""
    names = list(SUMMARY_METRICS)
    names += [f"pass@{k}" for k in sorted({k for r in reports for k in r.pass_at})]
    names += [REWARD_PREFIX + c for c in sorted({c for r in reports for c in r.reward_components})]
    return names


def eval_metrics(report: EvalReport) -> dict[str, float]:
    """An evaluation's numbers under ``eval/`` (pass@k as ``eval/pass@K``, reward components as
    ``eval/reward/NAME``)."""
    return {f"eval/{name}": float(value) for name in metric_names([report])
            if (value := metric_value(report, name)) is not None}
