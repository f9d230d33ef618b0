"""Running a collection's missing episodes: episodes that ended in error (the machinery failed) run again on the
next run, their failed attempts kept beside the file."""

import itertools
import json
import logging
from dataclasses import replace

import trajlab
from trajlab.collection.engines import build_runner
from trajlab.collection.plan import plan_episodes, read_planned
from trajlab.collection.run import errors_file, run_missing
from trajlab.config import ModelSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.env.registry import load_env
from trajlab.errors import InfrastructureError


def flaky_arithmetic(marker):
    """The arithmetic env whose service is down (reset raises InfrastructureError) while ``marker`` exists."""
    base = load_env("arithmetic")

    class Flaky(base.env_cls):
        def reset(self, **task):
            if marker.exists():
                raise InfrastructureError("the task service is down")
            return super().reset(**task)

    return replace(base, env_cls=Flaky)


def test_episodes_that_ended_in_error_run_again_on_the_next_run(tmp_path):
    marker, out = tmp_path / "down", tmp_path / "d.jsonl"
    marker.touch()
    env, rollout = flaky_arithmetic(marker), RolloutSettings(retries=0)
    planned = plan_episodes(env, split="train", seed=0, episodes=6, samples_per_task=1, tasks=None, tag="")

    def run():
        runner = build_runner(env, "oracle", rollout=rollout, model=ModelSettings(), temperature=1.0, seed=0,
                              tokenizer=None, demonstrator=None, run_dir=tmp_path)
        return run_missing(runner, planned, out, rollout=rollout, demonstrator=None, on_progress=None)

    first = run()
    assert len(first.new) == 6 and {t.status for t in first.new} == {"error"} and first.errors_run_again == 0
    marker.unlink()  # the outage is over
    second = run()
    assert second.errors_run_again == 6 and {t.status for t in second.new} == {"success"}
    stored = list(read_trajectories(out))
    assert len(stored) == 6 and {t.status for t in stored} == {"success"}
    assert [t.id for t in read_planned(out, planned)] == [e.id for e in planned]
    failed = list(read_trajectories(errors_file(out)))
    assert len(failed) == 6 and {t.status for t in failed} == {"error"}, "the failed attempts are kept"
    assert "the task service is down" in failed[0].error
    third = run()
    assert third.errors_run_again == 0 and third.new == [] and third.tokens_per_s == 0.0


def test_an_evaluation_runs_its_error_episodes_again_and_counts_them(tmp_path):
    marker = tmp_path / "down"
    marker.touch()
    env, out = flaky_arithmetic(marker), tmp_path / "eval"
    first = trajlab.evaluate(env, "oracle", out=out, num_tasks=3, rollout={"retries": 0})
    assert first.statuses["error"] == 3 and first.errors_run_again == 0
    marker.unlink()  # the outage is over
    second = trajlab.evaluate(env, "oracle", out=out, num_tasks=3, rollout={"retries": 0})
    assert second.errors_run_again == 3 and second.success_rate == 1.0
    assert json.loads((out / "eval.json").read_text())["errors_run_again"] == 3


def test_an_evaluation_asked_for_more_tasks_than_there_are_runs_each_once(caplog):
    """A short list is cycled in a collection; in an evaluation a task run twice would count twice in the success
    rate, so each runs once, and the log says how many there were."""
    given = list(itertools.islice(load_env("arithmetic").iter_tasks("test", 0), 3))
    with caplog.at_level(logging.WARNING, logger="trajlab.recipes.evaluate"):
        report = trajlab.evaluate("arithmetic", "oracle", tasks=given, num_tasks=5)
    assert report.episodes == 3 and [t.n for t in report.tasks] == [1, 1, 1]
    assert "eval.num_tasks is 5 but 3 tasks are given: each is evaluated once (3 tasks)" in caplog.text
    split = len(list(load_env("guess").iter_tasks("test", 0)))
    report = trajlab.evaluate("guess", "oracle", num_tasks=split + 7)
    assert report.episodes == split and all(t.n == 1 for t in report.tasks) and report.success_rate == 1.0
    assert f"eval.num_tasks is {split + 7} but {split} tasks are in guess's test split" in caplog.text
