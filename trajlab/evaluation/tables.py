"""Rich tables of eval reports for the terminal: a run's summary and tasks, a comparison, one row per run.

Labels, env names and task ids are escaped: they are data, never rich markup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from trajlab.evaluation.metrics import REWARD_PREFIX, EvalReport, check_metric_name, metric_names, metric_value

#: Which way is good, for colouring deltas; pass@K and reward components are higher-is-better too.
HIGHER_IS_BETTER = frozenset({"success_rate", "mean_reward", "tokens_per_s"})
LOWER_IS_BETTER = frozenset({"tool_error_rate", "parse_error_rate"})


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
    for name in metric_names([report]):
        value = metric_value(report, name)
        if value is not None:
            table.add_row(name, _fmt(name, value))
    table.add_row("statuses", ", ".join(f"{s} {c}" for s, c in report.statuses.items() if c) or "-")
    if report.judge_usage:  # what grading cost, in the judge's own units
        table.add_row("judge usage", ", ".join(f"{key} {value:g}" for key, value in report.judge_usage.items()))
    if report.errors_run_again:
        table.add_row("errors run again", f"{report.errors_run_again} (ended in error on an earlier run)")
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
    # the caption is one line however narrow the table: wrapped, it would break a metric name in two
    table = Table(Column("run", overflow="fold"), "n", *headers, title=title,
                  caption=Text(caption, no_wrap=True, overflow="ignore") if caption else None, caption_justify="left")
    for report in reports:
        table.add_row(escape(report.label or "-"), str(report.episodes),
                      *(_fmt(name, metric_value(report, name)) for name in columns))
    return table
