"""Evaluation: success rate, pass@k, per-task rows and run comparison, computed from trajectories.

Evaluation reads trajectories only, never a model or an env, so the same numbers come out of a fresh rollout, a
file collected last week, or the recording proxy. An :class:`EvalReport` is plain JSON saved next to the run; its
metric names (``success_rate``, ``mean_reward``, ...) are stable so scripts and later comparisons can rely on them.

Conventions:

- An episode succeeds when its status is ``success``. ``error`` episodes (the episode itself failed) count as
  failures in every rate, and are reported in ``statuses`` so a crashing harness is never mistaken for a weak model.
- A task is :func:`trajlab.rollout.types.task_id` of its row (its ``task_id``, else a stable hash of the task JSON);
  rows group by (env, task).
- pass@k uses the unbiased estimator of Chen et al. (2021) per task, averaged over tasks.
- Deltas in comparisons are ``b - a``: the second run relative to the first.

One module per job: ``metrics`` (the report and its numbers), ``compare`` (two runs), ``io`` (``eval.json``),
``tables`` (rich tables for the terminal).
"""

from trajlab.evaluation.compare import compare_reports
from trajlab.evaluation.io import ReportError, load_report, save_report
from trajlab.evaluation.metrics import (
    REWARD_PREFIX,
    STATUSES,
    SUMMARY_METRICS,
    EvalReport,
    TaskRow,
    check_metric_name,
    evaluate_trajectories,
    metric_value,
    pass_at_k,
)
from trajlab.evaluation.tables import comparison_table, report_table, results_table, summary_table, task_table

__all__ = [
    "REWARD_PREFIX",
    "STATUSES",
    "SUMMARY_METRICS",
    "EvalReport",
    "ReportError",
    "TaskRow",
    "check_metric_name",
    "compare_reports",
    "comparison_table",
    "evaluate_trajectories",
    "load_report",
    "metric_value",
    "pass_at_k",
    "report_table",
    "results_table",
    "save_report",
    "summary_table",
    "task_table",
]
