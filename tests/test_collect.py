"""collect's episode plan: ids name each task by its task id, so re-running a command finds its episodes."""

import itertools
from dataclasses import replace

from trajlab.env.mixture import load_envs
from trajlab.env.registry import load_env
from trajlab.recipes.collect import CollectConfig, plan_episodes
from trajlab.rollout.types import task_id


def test_episode_ids_name_a_task_by_its_task_id_else_its_content_hash(tmp_path):
    rows = [{"question": "1 + 2", "answer": 3}, {"task_id": "t7", "question": "2 + 2", "answer": 4}]
    spec = replace(load_env("arithmetic"), name="rows", tasks=lambda split, seed: iter(rows))
    config = CollectConfig(env=spec, policy="oracle", episodes=4, out=tmp_path / "x.jsonl", samples_per_task=2)
    hashed = task_id(rows[0])
    assert hashed.startswith("task-")
    assert [e.id for e in plan_episodes(config)] == [
        f"rows:train:0:{hashed}:0", f"rows:train:0:{hashed}:1", "rows:train:0:t7:0", "rows:train:0:t7:1"
    ]
    # a mixture's task is ENV/task_id: two envs' ids never collide
    mixture = load_envs("wordle,driving")
    config = CollectConfig(env=mixture, policy="oracle", episodes=2, out=tmp_path / "y.jsonl", split="test")
    first = list(itertools.islice(mixture.iter_tasks("test"), 2))
    assert [e.id for e in plan_episodes(config)] == [
        f"wordle,driving:test:0:{task['env']}/{task['task_id']}:0" for task in first
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
