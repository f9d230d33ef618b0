import itertools

import pytest

from tests.env.oracle import run_oracle
from trajlab.env import load_env

BUILTIN = ["arithmetic", "driving", "guess", "wordle"]


@pytest.mark.parametrize("name", BUILTIN)
def test_splits_are_disjoint_and_seeded(name):
    spec = load_env(name)
    train = {t["task_id"] for t in itertools.islice(spec.iter_tasks("train", seed=0), 300)}
    test = {t["task_id"] for t in itertools.islice(spec.iter_tasks("test", seed=1), 300)}
    assert train and test and not train & test
    again = [t["task_id"] for t in itertools.islice(spec.iter_tasks("train", seed=0), 20)]
    assert again == [t["task_id"] for t in itertools.islice(spec.iter_tasks("train", seed=0), 20)]
    other_seed = [t["task_id"] for t in itertools.islice(spec.iter_tasks("train", seed=5), 20)]
    assert other_seed != again


@pytest.mark.parametrize("name", BUILTIN)
def test_oracle_solves_every_task_through_the_tools(name, tiny_tokenizer, tiny_template):
    spec = load_env(name)
    tasks = list(itertools.islice(spec.iter_tasks("test", seed=0), 40))
    results = run_oracle(spec, tasks, tiny_tokenizer, tiny_template)
    assert len(results) == len(tasks)
    assert all(t.status == "success" for t in results), [(t.id, t.status, t.messages[-1]) for t in results]
    assert all(t.metrics["tool_errors"] == 0 and t.metrics["parse_errors"] == 0 for t in results)


def test_arithmetic_wrong_answer_scores_nothing():
    spec = load_env("arithmetic")
    task = next(spec.iter_tasks("train", seed=0))
    env = spec.make()
    env.reset(**task)
    assert env.submit(task["answer"] + 1) == "Wrong."
    assert env.done and env.reward == 0.0 and env.success is False


def test_arithmetic_dense_rewards_credit_each_correct_step():
    from trajlab.env.builtin.arithmetic import solution

    spec = load_env("arithmetic")
    task = next(spec.iter_tasks("train", seed=0))
    (first, args1), (second, args2), (_, final) = solution(task)
    env = spec.make()
    env.reset(**task)
    getattr(env, first)(**args1)
    getattr(env, second)(args2["a"] + 1, args2["b"])  # wrong intermediate: no credit
    getattr(env, second)(**args2)
    env.submit(**final)
    assert env.turn_rewards == [pytest.approx(1 / 3), 0.0, pytest.approx(1 / 3), pytest.approx(1 / 3)]
    assert env.metrics["progress"] == 1.0 and env.success


def test_arithmetic_credits_each_step_of_a_longer_chain():
    from trajlab.env.builtin.arithmetic import solution

    spec = load_env("arithmetic").with_options(operations=4)
    task = next(spec.iter_tasks("train", seed=0))
    calls = solution(task)
    assert [name for name, _ in calls[:4]] == task["ops"] and calls[-1][1] == {"answer": task["answer"]}
    env = spec.make()
    env.reset(**task)
    for name, arguments in calls:
        getattr(env, name)(**arguments)
    assert env.turn_rewards == [pytest.approx(1 / 5)] * 5 and env.success and env.metrics["progress"] == 1.0
