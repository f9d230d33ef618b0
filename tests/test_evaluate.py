"""Evaluation: the pass@k estimator against brute force, and reports on hand-built trajectories with known numbers."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest
from rich.console import Console

from trajlab.evaluate import (
    EvalReport,
    ReportError,
    compare_reports,
    comparison_table,
    evaluate_trajectories,
    load_report,
    pass_at_k,
    report_table,
    results_table,
    save_report,
    task_key,
    task_table,
)
from trajlab.rollout.types import Trajectory

# ------------------------------------------------------------------------------------------------------- pass@k


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of all k-subsets of n samples (c of them correct) that hold at least one correct sample."""
    correct = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(subset) for subset in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_exhaustive_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            expected = brute_force_pass_at_k(n, c, k)
            assert expected == 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # the closed form itself
            assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12), (n, c, k)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.77, 1.0])
def test_pass_at_k_is_unbiased(p):
    # With n samples of a task solved with probability p, E[pass_at_k(n, C, k)] over C ~ Binomial(n, p) must equal
    # the true pass@k, 1 - (1 - p)^k, for every k <= n.
    for n in range(1, 9):
        for k in range(1, n + 1):
            expectation = sum(
                math.comb(n, c) * p**c * (1 - p) ** (n - c) * pass_at_k(n, c, k) for c in range(n + 1)
            )
            assert expectation == pytest.approx(1 - (1 - p) ** k, abs=1e-12), (n, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # nothing correct
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 3) == 1.0  # everything correct
    assert pass_at_k(5, 1, 5) == 1.0 and pass_at_k(5, 0, 5) == 0.0  # k = n: any correct sample is drawn
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain success rate
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    n, c, k = 2000, 37, 500
    with pytest.raises(OverflowError):
        float(math.comb(n, k))  # the naive formula cannot even be evaluated in floats
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k", "message"), [
    (3, 1, 4, "at least 4 samples"),
    (3, 1, 0, "k >= 1"),
    (3, 4, 1, "must lie in"),
    (3, -1, 1, "must lie in"),
])
def test_pass_at_k_refuses_impossible_arguments(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


# ------------------------------------------------------------------------------------------------------- reports


def episode(env, task, status, reward, *, turns, calls=0, tool_errors=0, parse_errors=0, **extra) -> Trajectory:
    episode.count += 1
    metrics = {"turns": turns, "tool_calls": calls, "tool_errors": tool_errors, "parse_errors": parse_errors,
               "model_tokens": 10.0 * turns, **extra}
    return Trajectory(id=f"ep{episode.count}", env=env, task=task, messages=[], tools=[], reward=reward,
                      status=status, metrics=metrics, error="boom" if status == "error" else None)


episode.count = 0
A1, A2, A3 = {"task_id": "a1", "x": 1}, {"task_id": "a2", "x": 2}, {"task_id": "a3", "x": 3}
GUESS = {"secret": 7, "high": 10}  # no task_id: identified by a hash of its content
GUESS_REORDERED = {"high": 10, "secret": 7}


def run_a() -> list[Trajectory]:
    """9 episodes, 3 tasks with unequal sample counts (3, 2, 4), every status, two envs."""
    return [
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2, **{"reward/format": 1.0, "env/steps": 9.0}),
        episode("arithmetic", A1, "failure", 0.0, turns=3, calls=3, tool_errors=1, parse_errors=1,
                **{"reward/format": 0.5}),
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2, **{"reward/format": 1.0}),
        episode("arithmetic", A2, "error", 0.0, turns=1),
        episode("arithmetic", A2, "truncated", 0.5, turns=4, calls=4, tool_errors=2, parse_errors=1),
        episode("guess", GUESS, "success", 1.0, turns=1, calls=1),
        *(episode("guess", GUESS_REORDERED if i else GUESS, "failure", 0.0, turns=5, calls=4, tool_errors=1,
                  parse_errors=1) for i in range(3)),
    ]


def run_b() -> list[Trajectory]:
    """5 episodes: a1 now always solved, a2 still never, a3 new, the guess task gone."""
    return [
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2),
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2),
        episode("arithmetic", A2, "failure", 0.0, turns=3, calls=3),
        episode("arithmetic", A2, "failure", 0.0, turns=3, calls=3, tool_errors=3),
        episode("arithmetic", A3, "success", 1.0, turns=1, calls=1),
    ]


@pytest.fixture
def report_a() -> EvalReport:
    return evaluate_trajectories(run_a(), ks=(1, 2, 3), label="untrained")


@pytest.fixture
def report_b() -> EvalReport:
    return evaluate_trajectories(iter(run_b()), ks=(1,), label="sft")


def test_task_identity_is_the_task_id_or_an_order_independent_hash():
    assert task_key(A1) == "a1"
    assert task_key(GUESS) == task_key(GUESS_REORDERED)
    assert task_key(GUESS).startswith("task-")
    assert task_key({"secret": 8, "high": 10}) != task_key(GUESS)


def test_report_headline_numbers(report_a):
    r = report_a
    assert r.label == "untrained" and r.episodes == 9
    assert r.success_rate == pytest.approx(3 / 9)  # the error episode counts as a failure
    assert r.mean_reward == pytest.approx(3.5 / 9)
    assert r.mean_turns == pytest.approx(28 / 9)
    assert r.tool_error_rate == pytest.approx(6 / 24)  # per tool call
    assert r.parse_error_rate == pytest.approx(5 / 28)  # per model turn
    assert r.statuses == {"success": 3, "failure": 4, "truncated": 1, "error": 1}
    assert r.per_env == {  # every headline rate again, per env, with the reward components that env logged
        "arithmetic": {"episodes": 5.0, "success_rate": pytest.approx(2 / 5), "mean_reward": pytest.approx(0.5),
                       "mean_turns": pytest.approx(12 / 5), "tool_error_rate": pytest.approx(3 / 11),
                       "parse_error_rate": pytest.approx(2 / 12), "reward/format": pytest.approx(2.5 / 3)},
        "guess": {"episodes": 4.0, "success_rate": pytest.approx(1 / 4), "mean_reward": pytest.approx(1 / 4),
                  "mean_turns": pytest.approx(16 / 4), "tool_error_rate": pytest.approx(3 / 13),
                  "parse_error_rate": pytest.approx(3 / 16)},
    }
    # Averaged over the three episodes that logged it; env/ metrics are not reward components.
    assert r.reward_components == {"format": pytest.approx(2.5 / 3)}
    assert r.tokens_per_s is None


def test_report_task_rows_and_pass_at_k_with_unequal_samples(report_a):
    rows = {row.task_id: row for row in report_a.tasks}
    guess_id = task_key(GUESS)
    assert [row.task_id for row in report_a.tasks] == ["a1", "a2", guess_id]  # sorted by (env, task)
    a1, a2, guess = rows["a1"], rows["a2"], rows[guess_id]
    assert (a1.env, a1.n, a1.successes) == ("arithmetic", 3, 2)
    assert (a2.env, a2.n, a2.successes) == ("arithmetic", 2, 0)
    assert (guess.env, guess.n, guess.successes) == ("guess", 4, 1)  # key order in the task JSON does not matter
    assert a1.mean_reward == pytest.approx(2 / 3) and a1.mean_turns == pytest.approx(7 / 3)
    assert a2.mean_reward == pytest.approx(0.25) and a2.mean_turns == pytest.approx(2.5)
    assert guess.mean_reward == pytest.approx(0.25) and guess.mean_turns == pytest.approx(4.0)
    # Each row keeps the ks its own n supports.
    assert a1.pass_at == {1: pytest.approx(2 / 3), 2: 1.0, 3: 1.0}
    assert a2.pass_at == {1: 0.0, 2: 0.0}
    assert guess.pass_at == {1: pytest.approx(1 / 4), 2: pytest.approx(1 / 2), 3: pytest.approx(3 / 4)}
    # The report keeps only ks every task supports (min n = 2), each the mean over tasks.
    assert report_a.pass_at == {1: pytest.approx((2 / 3 + 0 + 1 / 4) / 3), 2: pytest.approx((1 + 0 + 1 / 2) / 3)}


def test_tokens_per_s_is_recorded_when_given():
    assert evaluate_trajectories(run_b(), tokens_per_s=123.5).tokens_per_s == 123.5


def test_evaluate_refuses_nothing_and_bad_ks():
    with pytest.raises(ValueError, match="no trajectories"):
        evaluate_trajectories([])
    with pytest.raises(ValueError, match=">= 1"):
        evaluate_trajectories(run_b(), ks=(0, 1))


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
    assert comparison["only_in_a"] == [{"env": "guess", "task_id": task_key(GUESS)}]
    assert comparison["only_in_b"] == [{"env": "arithmetic", "task_id": "a3"}]
    assert json.loads(json.dumps(comparison))["metrics"]["success_rate"]["b"] == pytest.approx(0.6)


def test_save_load_round_trip_keeps_plain_metric_names(report_a, tmp_path):
    path = save_report(report_a, tmp_path / "run" / "eval.json")
    loaded = load_report(path)
    assert loaded == report_a
    assert loaded.pass_at.keys() == {1, 2} and loaded.tasks[0].pass_at.keys() == {1, 2, 3}  # int keys come back
    raw = json.loads(path.read_text())
    assert {"label", "episodes", "success_rate", "mean_reward", "tool_error_rate", "parse_error_rate", "pass_at",
            "statuses", "per_env", "reward_components", "tasks"} <= raw.keys()
    assert raw["pass_at"]["1"] == pytest.approx(report_a.pass_at[1])
    assert list(tmp_path.glob("run/*")) == [path]  # no partial file left behind


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such eval report"),
    ("{not json", "not a valid eval report"),
    ('{"label": "x"}', "not a valid eval report"),
    ('{"id": "ep1", "env": "arithmetic"}', "not a valid eval report: id: Extra inputs are not permitted"),
])
def test_a_bad_report_file_is_a_clear_error_naming_it(content, message, tmp_path):
    path = tmp_path / "eval.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReportError, match=message) as info:
        load_report(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)  # the CLI turns ValueErrors into clean messages


def test_a_report_with_an_unknown_key_is_refused(report_a, tmp_path):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({**json.loads(report_a.model_dump_json()), "succes_rate": 1.0}))
    with pytest.raises(ReportError, match="succes_rate"):
        load_report(path)


# ------------------------------------------------------------------------------------------------------- tables


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
    assert text.index("a2") < text.index(task_key(GUESS)) < text.index("a1")


def test_task_table_cuts_to_the_weakest_tasks(report_a):
    text = render(task_table(report_a, max_tasks=1))
    assert "a2" in text and "a1" not in text and task_key(GUESS) not in text
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
