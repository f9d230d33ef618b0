"""Rich tables: the numbers shown, weakest tasks first, coloured deltas, labels shown literally."""

from __future__ import annotations

import pytest
from rich.console import Console

from tests.evaluation.runs import GUESS, episode
from trajlab.evaluation.compare import compare_reports
from trajlab.evaluation.metrics import evaluate_trajectories
from trajlab.evaluation.tables import comparison_table, report_table, results_table, task_table
from trajlab.rollout.types import task_id


def render(table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_report_table_shows_the_numbers(report_a):
    text = render(report_table(report_a))
    for expected in ("untrained", "success_rate", "0.333", "mean_reward", "0.389", "mean_turns", "3.11",
                     "tool_error_rate", "0.250", "parse_error_rate", "0.179", "pass@1", "0.306", "pass@2", "0.500",
                     "reward/format", "0.833", "error 1", "truncated 1", "env guess", "a1", "a2", "0.667"):
        assert expected in text, expected
    assert "tokens_per_s" not in text  # unknown throughput is left out, not shown as 0
    # Weakest tasks come first.
    assert text.index("a2") < text.index(task_id(GUESS)) < text.index("a1")


def test_task_table_cuts_to_the_weakest_tasks(report_a):
    text = render(task_table(report_a, max_tasks=1))
    assert "a2" in text and "a1" not in text and task_id(GUESS) not in text
    assert "1 of 3 tasks shown" in text
    summary_only = render(report_table(report_a, max_tasks=0))
    assert "success_rate" in summary_only and "a1" not in summary_only and "pass@3" not in summary_only


def test_comparison_table_shows_deltas_and_unmatched_counts(report_a, report_b):
    text = render(comparison_table(compare_reports(report_a, report_b)))
    for expected in ("untrained", "sft", "success_rate", "0.333", "0.600", "+0.267", "episodes", "-4",
                     "arithmetic/a1", "+0.333", "2 tasks in both, 1 changed", "1 only in untrained", "1 only in sft"):
        assert expected in text, expected


def test_comparison_colours_improvements_green_and_regressions_red(report_a, report_b):
    console = Console(record=True, width=200, force_terminal=True, color_system="standard")
    console.print(comparison_table(compare_reports(report_a, report_b)))
    lines = {line.split()[1]: line for line in console.export_text(styles=True).splitlines() if "_" in line}
    green, red = "\x1b[32m", "\x1b[31m"
    assert green in lines["success_rate"] and red not in lines["success_rate"]  # up is better
    assert red in lines["tool_error_rate"] and green not in lines["tool_error_rate"]  # up is worse
    assert green in lines["parse_error_rate"]  # down is better
    assert green not in lines["mean_turns"] and red not in lines["mean_turns"]  # no direction


def test_results_table_has_one_row_per_run(report_a, report_b):
    text = render(results_table([report_a, report_b], metrics=("success_rate", "pass@2", "reward/format")))
    lines = {line.split()[1]: line for line in text.splitlines() if "untrained" in line or "sft" in line}
    assert "9" in lines["untrained"] and "0.333" in lines["untrained"] and "0.500" in lines["untrained"]
    assert "0.833" in lines["untrained"]
    assert "5" in lines["sft"] and "0.600" in lines["sft"] and "-" in lines["sft"]
    with pytest.raises(ValueError, match="unknown metric 'succes_rate'"):
        results_table([report_a], metrics=("succes_rate",))


def test_labels_and_task_ids_are_shown_literally_not_as_markup():
    trajectories = [episode("arith[/]", {"task_id": "t[/bold]"}, "success", 1.0, turns=1)]
    report = evaluate_trajectories(trajectories, label="[red]run[/red]")
    for table in (report_table(report), comparison_table(compare_reports(report, report)), results_table([report])):
        text = render(table)
        assert "[red]run[/red]" in text
    assert "t[/bold]" in render(report_table(report)) and "arith[/]" in render(report_table(report))
