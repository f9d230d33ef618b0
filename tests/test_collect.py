"""collect's episode plan: ids name each task by its task id and content, so re-running a command finds its
episodes; episodes that ended in error are run again."""

import itertools
import json
from dataclasses import replace

from trajlab.data.store import read_trajectories
from trajlab.env.mixture import load_envs
from trajlab.env.registry import load_env
from trajlab.errors import InfrastructureError
from trajlab.recipes.collect import CollectConfig, plan_episodes
from trajlab.rollout.types import task_hash, task_id


def test_episode_ids_name_a_task_by_its_task_id_and_content_else_its_content_hash(tmp_path):
    rows = [{"question": "1 + 2", "answer": 3}, {"task_id": "t7", "question": "2 + 2", "answer": 4}]
    spec = replace(load_env("arithmetic"), name="rows", tasks=lambda split, seed: iter(rows))
    config = CollectConfig(env=spec, policy="oracle", episodes=4, out=tmp_path / "x.jsonl", samples_per_task=2)
    hashed, t7 = task_id(rows[0]), f"t7~{task_hash(rows[1])}"
    assert hashed.startswith("task-") and len(t7) == len("t7~") + 8
    assert [e.id for e in plan_episodes(config)] == [
        f"rows:train:0:{hashed}:0", f"rows:train:0:{hashed}:1", f"rows:train:0:{t7}:0", f"rows:train:0:{t7}:1"
    ]
    # a task fixed under the same task_id is another episode: a re-run does not find the old one "already on disk"
    rows[1]["answer"] = 5
    assert plan_episodes(config)[2].id != f"rows:train:0:{t7}:0"
    # a mixture's task is ENV/task_id: two envs' ids never collide
    mixture = load_envs("wordle,driving")
    config = CollectConfig(env=mixture, policy="oracle", episodes=2, out=tmp_path / "y.jsonl", split="test")
    first = list(itertools.islice(mixture.iter_tasks("test"), 2))
    assert [e.id for e in plan_episodes(config)] == [
        f"wordle,driving:test:0:{task['env']}/{task['task_id']}~{task_hash(task)}:0" for task in first
    ]


def test_collected_trajectories_come_in_plan_order_whatever_order_they_finished_in(tmp_path):
    """Episodes finish in an order that depends on timing; what SFT trains on must not (the quickstart's SFT is
    sensitive to data order)."""
    from trajlab.recipes.collect import collect, collected

    config = CollectConfig(env=load_env("arithmetic"), policy="oracle", episodes=6, out=tmp_path / "d.jsonl",
                           concurrency=6)
    collect(config)
    lines = config.out.read_text().splitlines(keepends=True)
    config.out.write_text("".join(reversed(lines)))  # as if they had finished last to first
    assert [t.id for t in collected(config)] == [e.id for e in plan_episodes(config)]


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
    from trajlab.recipes.collect import collect, collected, errors_file

    marker = tmp_path / "down"
    marker.touch()
    config = CollectConfig(env=flaky_arithmetic(marker), policy="oracle", episodes=6, out=tmp_path / "d.jsonl",
                           retries=0)
    first = collect(config)
    assert first["statuses"]["error"] == 6 and first["errors_run_again"] == 0
    marker.unlink()  # the outage is over
    second = collect(config)
    assert second["errors_run_again"] == 6 and second["statuses"]["success"] == 6
    stored = list(read_trajectories(config.out))
    assert len(stored) == 6 and {t.status for t in stored} == {"success"}
    assert [t.id for t in collected(config)] == [e.id for e in plan_episodes(config)]
    failed = list(read_trajectories(errors_file(config.out)))
    assert len(failed) == 6 and {t.status for t in failed} == {"error"}, "the failed attempts are kept"
    assert "the task service is down" in failed[0].error
    assert collect(config)["errors_run_again"] == 0


def test_an_evaluation_runs_its_error_episodes_again_and_counts_them(tmp_path):
    import trajlab

    marker = tmp_path / "down"
    marker.touch()
    env, out = flaky_arithmetic(marker), tmp_path / "eval"
    first = trajlab.evaluate(env, "oracle", out=out, num_tasks=3, rollout={"retries": 0})
    assert first.statuses["error"] == 3 and first.errors_run_again == 0
    marker.unlink()  # the outage is over
    second = trajlab.evaluate(env, "oracle", out=out, num_tasks=3, rollout={"retries": 0})
    assert second.errors_run_again == 3 and second.success_rate == 1.0
    assert json.loads((out / "eval.json").read_text())["errors_run_again"] == 3
