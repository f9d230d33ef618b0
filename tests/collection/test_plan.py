"""A collection's episode plan: ids name each task by its task id and content, so re-running a command finds its
episodes; the stored trajectories come back in the plan's order."""

import itertools
from dataclasses import replace

import trajlab
from trajlab.collection.plan import episode_tag, plan_episodes, read_planned
from trajlab.env.mixture import load_envs
from trajlab.env.registry import load_env
from trajlab.rollout.types import task_hash, task_id


def plan(env, episodes, **given):
    options = {"split": "train", "seed": 0, "samples_per_task": 1, "tasks": None, "tag": ""} | given
    return plan_episodes(env, episodes=episodes, **options)


def test_episode_ids_name_a_task_by_its_task_id_and_content_else_its_content_hash():
    rows = [{"question": "1 + 2", "answer": 3}, {"task_id": "t7", "question": "2 + 2", "answer": 4}]
    spec = replace(load_env("arithmetic"), name="rows", tasks=lambda split, seed: iter(rows))
    hashed, t7 = task_id(rows[0]), f"t7~{task_hash(rows[1])}"
    assert hashed.startswith("task-") and len(t7) == len("t7~") + 8
    assert [e.id for e in plan(spec, 4, samples_per_task=2)] == [
        f"rows:train:0:{hashed}:0", f"rows:train:0:{hashed}:1", f"rows:train:0:{t7}:0", f"rows:train:0:{t7}:1"
    ]
    # a task fixed under the same task_id is another episode: a re-run does not find the old one "already on disk"
    rows[1]["answer"] = 5
    assert plan(spec, 4, samples_per_task=2)[2].id != f"rows:train:0:{t7}:0"
    # a mixture's task is ENV/task_id: two envs' ids never collide
    mixture = load_envs("wordle,driving")
    first = list(itertools.islice(mixture.iter_tasks("test", 0), 2))
    assert [e.id for e in plan(mixture, 2, split="test")] == [
        f"wordle,driving:test:0:{task['env']}/{task['task_id']}~{task_hash(task)}:0" for task in first
    ]


def test_another_prompt_or_demonstrator_makes_other_episodes():
    spec = load_env("arithmetic")
    assert episode_tag(spec, None, None, 0.0) == ""
    tags = [episode_tag(spec, "Be brief.", None, 0.0), episode_tag(spec, None, "sign_slip", 0.0),
            episode_tag(spec, None, None, 0.2), episode_tag(spec, "Be brief.", "sign_slip", 0.2)]
    assert tags[0].startswith(":prompt-") and tags[1] == ":reference-sign_slip" and tags[2] == ":noise-0.2"
    assert tags[3] == tags[0] + tags[1] + tags[2] and len(set(tags)) == 4
    own, slipped = plan(spec, 2), plan(spec, 2, tag=tags[1])
    assert [e.id + tags[1] for e in own] == [e.id for e in slipped]


def test_planned_trajectories_come_in_plan_order_whatever_order_they_finished_in(tmp_path):
    """Episodes finish in an order that depends on timing; what SFT trains on must not (the quickstart's SFT is
    sensitive to data order)."""
    out = tmp_path / "d.jsonl"
    trajlab.collect("arithmetic", "oracle", out=out, episodes=6, rollout={"concurrency": 6})
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(reversed(lines)))  # as if they had finished last to first
    planned = plan(load_env("arithmetic"), 6)
    assert [t.id for t in read_planned(out, planned)] == [e.id for e in planned]
