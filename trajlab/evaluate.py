"""Evaluation: success rate, pass@k, per-task rows and run comparison, computed from trajectories.

Evaluation reads trajectories only, never a model or an env, so the same numbers come out of a fresh rollout, a
file collected last week, or the recording proxy. An :class:`EvalReport` is plain JSON saved next to the run; its
metric names (``success_rate``, ``mean_reward``, ...) are stable so scripts and later comparisons can rely on them.

Conventions:

- An episode succeeds when its status is ``success``. ``error`` episodes (the episode itself failed) count as
  failures in every rate, and are reported in ``statuses`` so a crashing harness is never mistaken for a weak model.
- A task is ``task["task_id"]`` when present, else a stable hash of the task JSON; rows group by (env, task).
- pass@k uses the unbiased estimator of Chen et al. (2021) per task, averaged over tasks.
- Deltas in comparisons are ``b - a``: the second run relative to the first.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from rich.markup import escape
from rich.table import Column, Table

from trajlab.rollout.types import Trajectory

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
STATUSES = ("success", "failure", "truncated", "error")
#: Which way is good, for colouring deltas; pass@K and reward components are higher-is-better too.
HIGHER_IS_BETTER = frozenset({"success_rate", "mean_reward", "tokens_per_s"})
LOWER_IS_BETTER = frozenset({"tool_error_rate", "parse_error_rate"})


class ReportError(ValueError):
    """An eval report file is missing or not a valid report; the message names the file."""


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
    tasks: list[TaskRow]


def task_key(task: dict[str, Any]) -> str:
    """A task's identity: its ``task_id``, else a hash of its content that does not depend on key order."""
    if "task_id" in task:
        return str(task["task_id"])
    blob = json.dumps(task, sort_keys=True, ensure_ascii=False, default=str)
    return "task-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


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
        groups[(t.env, task_key(t.task))].append(t)
    tasks = [_task_row(env, task_id, group, ks) for (env, task_id), group in sorted(groups.items())]
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


def _reward_components(episodes: list[Trajectory]) -> dict[str, float]:
    """Each reward component averaged over the episodes that logged it: an env without that reward says nothing."""
    components: defaultdict[str, list[float]] = defaultdict(list)
    for t in episodes:
        for key, value in t.metrics.items():
            if key.startswith(REWARD_PREFIX):
                components[key.removeprefix(REWARD_PREFIX)].append(value)
    return {name: sum(values) / len(values) for name, values in sorted(components.items())}


def _task_row(env: str, task_id: str, group: list[Trajectory], ks: Sequence[int]) -> TaskRow:
    n = len(group)
    successes = sum(t.status == "success" for t in group)
    return TaskRow(
        task_id=task_id,
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


def _metric_names(reports: Sequence[EvalReport]) -> list[str]:
    """Every metric any of ``reports`` has, in display order."""
    names = list(SUMMARY_METRICS)
    names += [f"pass@{k}" for k in sorted({k for r in reports for k in r.pass_at})]
    names += [REWARD_PREFIX + c for c in sorted({c for r in reports for c in r.reward_components})]
    return names


def compare_reports(a: EvalReport, b: EvalReport) -> dict[str, Any]:
    """Compare two runs metric by metric and task by task (deltas are ``b - a``).

    Returns a JSON-serialisable dict::

        {"a": label, "b": label,
         "metrics": {name: {"a": x, "b": y, "delta": y - x}},   # None where a side lacks the metric
         "tasks": [{"env", "task_id", "success_a", "success_b", "delta"}],   # tasks evaluated in both runs
         "only_in_a": [{"env", "task_id"}], "only_in_b": [{"env", "task_id"}]}

    Tasks are matched on (env, task id); per-task success is that task's success rate in each run.
    """
    metrics: dict[str, dict[str, float | None]] = {}
    for name in _metric_names([a, b]):
        x, y = metric_value(a, name), metric_value(b, name)
        metrics[name] = {"a": x, "b": y, "delta": None if x is None or y is None else y - x}
    rows_a = {(row.env, row.task_id): row for row in a.tasks}
    rows_b = {(row.env, row.task_id): row for row in b.tasks}
    tasks = []
    for env, task_id in sorted(rows_a.keys() & rows_b.keys()):
        x, y = rows_a[env, task_id].success_rate, rows_b[env, task_id].success_rate
        tasks.append({"env": env, "task_id": task_id, "success_a": x, "success_b": y, "delta": y - x})
    return {
        "a": a.label,
        "b": b.label,
        "metrics": metrics,
        "tasks": tasks,
        "only_in_a": [{"env": env, "task_id": task_id} for env, task_id in sorted(rows_a.keys() - rows_b.keys())],
        "only_in_b": [{"env": env, "task_id": task_id} for env, task_id in sorted(rows_b.keys() - rows_a.keys())],
    }


def save_report(report: EvalReport, path: str | Path) -> Path:
    """Write ``report`` as indented JSON, atomically, so a crash never leaves a half-written ``eval.json``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path


def load_report(path: str | Path) -> EvalReport:
    """Read a report written by :func:`save_report`.

    Raises:
        ReportError: the file is missing, not JSON, or not an eval report; the message names the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ReportError(f"{path}: no such eval report (write one with `trajlab eval`)") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read eval report: {exc}") from exc
    try:
        return EvalReport.model_validate_json(text)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")  # misspelled keys first
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in errors[:4])
        more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
        raise ReportError(f"{path}: not a valid eval report: {problems}{more}") from exc


# ---------------------------------------------------------------------------------------------------------- tables


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name == "episodes":
        return str(int(value))
    if name == "mean_turns":
        return f"{value:.2f}"
    if name == "tokens_per_s":
        return f"{value:.1f}"
    return f"{value:.3f}"


def _fmt_delta(name: str, delta: float | None) -> str:
    """A signed delta, green when it is an improvement and red when it is a regression (uncoloured if neither)."""
    if delta is None:
        return "-"
    text = ("+" if delta > 0 else "-" if delta < 0 else "") + _fmt(name, abs(delta))
    better = name in HIGHER_IS_BETTER or name.startswith(("pass@", REWARD_PREFIX))
    worse = name in LOWER_IS_BETTER
    if delta == 0 or not (better or worse):
        return text
    return f"[green]{text}[/]" if (delta > 0) == better else f"[red]{text}[/]"


def summary_table(report: EvalReport) -> Table:
    """The report's headline numbers, one metric per row, under their plain names."""
    table = Table("metric", "value", title=f"eval: {escape(report.label)}" if report.label else "eval")
    for name in _metric_names([report]):
        value = metric_value(report, name)
        if value is not None:
            table.add_row(name, _fmt(name, value))
    table.add_row("statuses", ", ".join(f"{s} {c}" for s, c in report.statuses.items() if c) or "-")
    if len(report.per_env) > 1:
        for env, row in report.per_env.items():
            components = "".join(f", {escape(key)} {value:.3f}" for key, value in row.items()
                                 if key.startswith(REWARD_PREFIX))
            table.add_row(
                f"env {escape(env)}",
                f"{int(row['episodes'])} episodes, success {row['success_rate']:.3f}, "
                f"reward {row['mean_reward']:.3f}, turns {row.get('mean_turns', 0.0):.2f}, "
                f"tool errors {row.get('tool_error_rate', 0.0):.3f}{components}",
            )
    return table


def task_table(report: EvalReport, *, max_tasks: int = 20) -> Table:
    """Per-task rows, weakest first, so that the tasks worth looking at survive the ``max_tasks`` cut."""
    ks = sorted({k for row in report.tasks for k in row.pass_at})
    table = Table("env", "task", "n", "successes", "success", "reward", "turns", *(f"pass@{k}" for k in ks),
                  title="tasks")
    rows = sorted(report.tasks, key=lambda r: (r.success_rate, r.mean_reward, r.env, r.task_id))
    for row in rows[:max_tasks]:
        table.add_row(
            escape(row.env), escape(row.task_id), str(row.n), str(row.successes), f"{row.success_rate:.3f}",
            f"{row.mean_reward:.3f}", f"{row.mean_turns:.2f}",
            *(f"{row.pass_at[k]:.3f}" if k in row.pass_at else "-" for k in ks),
        )
    if len(rows) > max_tasks:
        table.caption = f"{max_tasks} of {len(rows)} tasks shown (lowest success first)"
    return table


def report_table(report: EvalReport, *, max_tasks: int = 20) -> Table:
    """The summary above the per-task table (``max_tasks=0`` leaves tasks out), printable in one call."""
    grid = Table.grid(padding=(1, 0))
    grid.add_row(summary_table(report))
    if max_tasks > 0 and report.tasks:
        grid.add_row(task_table(report, max_tasks=max_tasks))
    return grid


def comparison_table(comparison: dict[str, Any], *, max_tasks: int = 20) -> Table:
    """A :func:`compare_reports` result: every metric, then the tasks whose success changed most."""
    a, b = escape(comparison["a"] or "a"), escape(comparison["b"] or "b")  # labels and task ids are not markup
    table = Table("metric / task", a, b, "delta", title=f"{a} -> {b}")
    for name, row in comparison["metrics"].items():
        if row["a"] is None and row["b"] is None:
            continue
        table.add_row(name, _fmt(name, row["a"]), _fmt(name, row["b"]), _fmt_delta(name, row["delta"]))
    changed = sorted((t for t in comparison["tasks"] if t["delta"]), key=lambda t: (-abs(t["delta"]), t["task_id"]))
    if changed:
        table.add_section()
        for task in changed[:max_tasks]:
            table.add_row(escape(f"{task['env']}/{task['task_id']}"), f"{task['success_a']:.3f}",
                          f"{task['success_b']:.3f}", _fmt_delta("success_rate", task["delta"]))
    notes = [f"{len(comparison['tasks'])} tasks in both, {len(changed)} changed"]
    if len(changed) > max_tasks:
        notes.append(f"{max_tasks} largest changes shown")
    if comparison["only_in_a"]:
        notes.append(f"{len(comparison['only_in_a'])} only in {a}")
    if comparison["only_in_b"]:
        notes.append(f"{len(comparison['only_in_b'])} only in {b}")
    table.caption = "; ".join(notes)
    return table


SHORT_HEADERS = {
    "success_rate": "success",
    "mean_reward": "reward",
    "mean_turns": "turns",
    "tool_error_rate": "tool err",
    "parse_error_rate": "parse err",
    "tokens_per_s": "tok/s",
}


def results_table(
    reports: Sequence[EvalReport],
    metrics: Sequence[str] = ("success_rate", "mean_reward", "mean_turns", "tool_error_rate", "parse_error_rate"),
    *,
    title: str = "results",
) -> Table:
    """One row per run (e.g. untrained, after SFT, after RL): the pipeline's final table.

    ``metrics`` take the names of :func:`metric_value` (``pass@K`` and ``reward/<component>`` included); a run
    that lacks one shows ``-``. The episode count is always shown, since rates over few episodes mean little.
    """
    for name in metrics:
        check_metric_name(name)
    columns = [name for name in metrics if name != "episodes"]
    # Short headers keep the table readable in an 80-column terminal; the caption maps them to metric names.
    headers = [SHORT_HEADERS.get(name, name.removeprefix(REWARD_PREFIX)) for name in columns]
    caption = ", ".join(f"{h} = {n}" for h, n in zip(headers, columns, strict=True) if h != n)
    # fold: a long label like "untrained+evolved" goes on two lines instead of being cut
    table = Table(Column("run", overflow="fold"), "n", *headers, title=title, caption=caption or None)
    for report in reports:
        table.add_row(escape(report.label or "-"), str(report.episodes),
                      *(_fmt(name, metric_value(report, name)) for name in columns))
    return table
