"""The report's first screen, which answers "did it learn?": the evaluations side by side (success rate with its
standard error), what each training stage fixed and broke against the evaluation before it, and the headline
training curves (reward, success, loss, KL, entropy) with an exponential moving average over the raw points.

The page only draws what this module computes, so the numbers it shows are the ones tested here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from trajlab.evaluation import EvalReport

HEADLINE = (
    ("reward", ("reward/mean",)),
    ("success", ("rollout/success_rate",)),
    ("loss", ("loss/policy", "loss/sft", "loss/sft_mean")),
    ("KL", ("loss/kl",)),
    ("entropy", ("loss/entropy",)),
)
"""The curves a reader looks at first, by title, each with the metric names that carry it (RL's and SFT's)."""


def success_stderr(report: EvalReport) -> float | None:
    """The standard error of an evaluation's success rate, clustered by task; None with fewer than two tasks.

    Episodes of one task are not independent draws (a task the model cannot solve fails every sample), so the
    error treats each task as one cluster: ``SE² = T/(T-1) · Σ_i (s_i - p·n_i)² / N²`` over the ``T`` tasks with
    ``s_i`` successes in ``n_i`` episodes, ``N = Σ n_i`` and ``p`` the success rate. With one episode per task it
    is the binomial ``√(p(1-p)/(N-1))``.
    """
    tasks = report.tasks
    if len(tasks) < 2:
        return None
    episodes = sum(task.n for task in tasks)
    rate = sum(task.successes for task in tasks) / episodes
    spread = sum((task.successes - rate * task.n) ** 2 for task in tasks)
    return math.sqrt(len(tasks) / (len(tasks) - 1) * spread) / episodes


def eval_bars(names: Sequence[str], reports: Sequence[EvalReport]) -> list[dict[str, Any]]:
    """One bar per evaluation, in run order: its success rate, standard error (None: unknown) and sizes."""
    return [{"name": name, "label": report.label, "success": report.success_rate, "stderr": success_stderr(report),
             "episodes": report.episodes, "tasks": len(report.tasks), "reward": report.mean_reward}
            for name, report in zip(names, reports, strict=True)]


def stages_between(stages: Sequence[str], evals: int) -> list[list[str]]:
    """The configured stages that ran between each evaluation and the next (``evals - 1`` lists); empty lists when
    the config does not say (its eval stages are not the evaluations found)."""
    segments: list[list[str]] = []
    for stage in stages:
        if stage == "eval":
            segments.append([])
        elif segments:
            segments[-1].append(stage)
    if len(segments) != evals:
        return [[] for _ in range(max(evals - 1, 0))]
    return segments[:-1]


def transitions(names: Sequence[str], reports: Sequence[EvalReport],
                stages: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """What changed from each evaluation to the next: the tasks whose success rate rose (fixed) and fell (broke).

    Tasks are matched on (env, task id); a task in only one of the two evaluations is counted apart, not compared.
    ``stages[i]`` names the stages that ran between evaluation ``i`` and ``i + 1``.
    """
    rows = []
    for i in range(1, len(reports)):
        before = {(t.env, t.task_id): t.success_rate for t in reports[i - 1].tasks}
        after = {(t.env, t.task_id): t.success_rate for t in reports[i].tasks}
        common = before.keys() & after.keys()
        changed = [{"task": task, "env": env, "before": before[env, task], "after": after[env, task]}
                   for env, task in sorted(common) if before[env, task] != after[env, task]]
        changed.sort(key=lambda row: (-abs(row["after"] - row["before"]), row["env"], row["task"]))
        rows.append({"before": names[i - 1], "after": names[i], "before_label": reports[i - 1].label,
                     "after_label": reports[i].label, "stages": list(stages[i - 1]), "compared": len(common),
                     "fixed": [row for row in changed if row["after"] > row["before"]],
                     "broke": [row for row in changed if row["after"] < row["before"]],
                     "only_before": len(before.keys() - common), "only_after": len(after.keys() - common)})
    return rows


def smoothing_weight(points: int) -> float:
    """The EMA weight for a curve of ``points`` points: 0.6 (TensorBoard's default) for short runs, rising to 0.95
    so that a long run's line follows about its last ``points / 5`` steps rather than the last two or three."""
    return round(min(0.95, max(0.6, 1.0 - 5.0 / max(points, 1))), 2)


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average (as TensorBoard draws it): ``s_t = w·s_{t-1} + (1-w)·x_t`` from
    ``s_0 = 0``, divided by ``1 - w^t`` so the first points are not pulled towards zero."""
    smoothed, last = [], 0.0
    for t, value in enumerate(values, start=1):
        last = weight * last + (1.0 - weight) * value
        smoothed.append(last / (1.0 - weight**t))
    return smoothed


def headline(curves: dict[str, dict[str, list[list[float]]]], order: Sequence[str]) -> list[dict[str, Any]]:
    """Per training stage (``order`` first, then the rest by name), the headline metrics it logged: a smoothed chart
    for a metric with two or more points, a number for a metric logged once."""
    stages = [s for s in order if s in curves] + sorted(s for s in curves if s not in order)
    rows = []
    for stage in stages:
        charts, numbers = [], []
        for title, metrics in HEADLINE:
            for metric in metrics:
                points = curves[stage].get(metric)
                if not points:
                    continue
                if len(points) == 1:
                    numbers.append({"title": title, "metric": metric, "step": points[0][0], "value": points[0][1]})
                    continue
                weight = smoothing_weight(len(points))
                charts.append({"title": title, "metric": metric, "points": points, "weight": weight,
                               "smooth": [round(v, 6) for v in ema([p[1] for p in points], weight)]})
        if charts or numbers:
            rows.append({"stage": stage, "charts": charts, "numbers": numbers})
    return rows
