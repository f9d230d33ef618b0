"""The pass@k estimator against brute force, and reports on hand-built trajectories with known numbers."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from tests.evaluation.runs import A1, GUESS, GUESS_REORDERED, run_b
from trajlab.evaluation.metrics import evaluate_trajectories, pass_at_k
from trajlab.rollout.types import task_id

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


def test_task_identity_is_the_task_id_or_an_order_independent_hash():
    assert task_id(A1) == "a1"
    assert task_id(GUESS) == task_id(GUESS_REORDERED)
    assert task_id(GUESS).startswith("task-")
    assert task_id({"secret": 8, "high": 10}) != task_id(GUESS)
    assert task_id(GUESS) == "task-ab12c84cd182"  # the id in eval.json files written before: comparisons still match


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
    guess_id = task_id(GUESS)
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
