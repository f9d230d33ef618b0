"""Run comparison: two eval reports matched metric by metric and task by task (deltas are ``b - a``)."""

from __future__ import annotations

from typing import Any

from trajlab.evaluation.metrics import EvalReport, metric_names, metric_value


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
    for name in metric_names([a, b]):
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
