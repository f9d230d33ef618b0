"""Run comparison: deltas metric by metric, tasks matched on (env, task id)."""

from __future__ import annotations

import json

import pytest

from tests.evaluation.runs import GUESS
from trajlab.evaluation.compare import compare_reports
from trajlab.rollout.types import task_id


def test_compare_gives_deltas_and_lists_unmatched_tasks(report_a, report_b):
    comparison = compare_reports(report_a, report_b)
    assert (comparison["a"], comparison["b"]) == ("untrained", "sft")
    metrics = comparison["metrics"]
    assert metrics["success_rate"] == {"a": pytest.approx(1 / 3), "b": pytest.approx(3 / 5),
                                       "delta": pytest.approx(3 / 5 - 1 / 3)}
    assert metrics["episodes"] == {"a": 9, "b": 5, "delta": -4}
    assert metrics["tool_error_rate"]["delta"] == pytest.approx(3 / 11 - 6 / 24)
    assert metrics["pass@1"]["b"] == pytest.approx(2 / 3)
    assert metrics["pass@2"] == {"a": pytest.approx(0.5), "b": None, "delta": None}  # b has no pass@2
    assert metrics["reward/format"] == {"a": pytest.approx(2.5 / 3), "b": None, "delta": None}
    assert metrics["tokens_per_s"] == {"a": None, "b": None, "delta": None}
    assert comparison["tasks"] == [
        {"env": "arithmetic", "task_id": "a1", "success_a": pytest.approx(2 / 3), "success_b": 1.0,
         "delta": pytest.approx(1 / 3)},
        {"env": "arithmetic", "task_id": "a2", "success_a": 0.0, "success_b": 0.0, "delta": 0.0},
    ]
    assert comparison["only_in_a"] == [{"env": "guess", "task_id": task_id(GUESS)}]
    assert comparison["only_in_b"] == [{"env": "arithmetic", "task_id": "a3"}]
    assert json.loads(json.dumps(comparison))["metrics"]["success_rate"]["b"] == pytest.approx(0.6)
