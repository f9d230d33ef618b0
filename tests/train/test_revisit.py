"""Revisiting train tasks whose group had mixed outcomes (``rl.revisit_share``): which tasks are queued, how a step's
draw takes them, and a real RL run on the tiny model that draws them again and resumes with the same queue."""

from __future__ import annotations

import json

import pytest

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.models.loading import load_tokenizer
from trajlab.rollout.types import Trajectory
from trajlab.train.revisit import Revisits
from trajlab.train.schedule import failed_share

from ..rollout.length_env import SPEC as LENGTH


def group(name: str, task: dict, statuses: list[str], greedy: bool = False) -> list[Trajectory]:
    """A group's rollouts by hand; with ``greedy`` the first is its greedy member (``rl.greedy_rollout``)."""
    return [Trajectory(id=f"{name}:{i}", env="length", task=task, messages=[], tools=[], reward=0.0, status=status,
                       group=name, metrics={"greedy": 1.0} if greedy and i == 0 else {})
            for i, status in enumerate(statuses)]


def test_mixed_groups_are_queued_and_those_that_failed_most_drawn_in_place_of_fresh_tasks():
    revisits = Revisits(share=0.5, capacity=3)
    a, b, c, d, e = ({"task_id": name} for name in "abcde")
    revisits.observe(0, [*group("g1", a, ["success", "failure", "success", "success"]),
                         *group("g2", b, ["success", "success"]), *group("g3", c, ["failure", "truncated"]),
                         *group("g4", d, ["success", "error", "error"]),
                         *group("g5", e, ["error", "failure", "success"])])
    assert [(r.task, r.failed) for r in revisits.queue] == [(a, 0.25), (e, 0.5)], "mixed groups' valid rollouts"
    revisits.observe(0, group("g6", a, ["failure", "failure", "success", "failure"]))
    assert [(r.task, r.failed) for r in revisits.queue] == [(a, 0.75), (e, 0.5)], "a queued task's share renewed"
    fresh = [{"task_id": f"f{i}"} for i in range(4)]
    revisits.observe(0, group("g7", b, ["failure", "success"]))
    assert revisits.mix(0, fresh) == ([a, e, *fresh[:2]], 2), "the most failed first, the earlier among equals"
    assert revisits.mix(0, fresh) == ([b, *fresh[:3]], 1), "drawn tasks leave the queue"
    assert revisits.mix(0, fresh) == (fresh, 0)
    revisits.observe(1, [*group("h1", b, ["success", "failure"]), *group("h2", c, ["success", "failure"])])
    revisits.observe(0, group("h3", d, ["success", "failure"]))
    assert revisits.mix(0, fresh) == ([d, *fresh[:3]], 1), "a stage draws its own tasks only"
    for name, failed in zip("vwxyz", (1, 2, 3, 3, 1), strict=True):
        revisits.observe(1, group(name, {"task_id": name}, ["failure"] * failed + ["success"] * (4 - failed)))
    assert [(r.task["task_id"], r.failed) for r in revisits.queue] == [("w", 0.5), ("x", 0.75), ("y", 0.75)], (
        "beyond capacity the least failed are dropped (the earliest among equals), the rest keep their order")
    restored = Revisits(share=0.5, capacity=3)
    restored.restore(json.loads(json.dumps(revisits.state())))
    assert restored.queue == revisits.queue


def test_with_a_greedy_member_only_groups_whose_greedy_answer_failed_are_queued():
    """Samples that fail now and then where the greedy answer succeeds leave held-out (greedy) evaluation nothing
    to gain: such a group is not queued, nor one whose every rollout failed."""
    revisits = Revisits(share=0.5, capacity=8)
    a, b, c = ({"task_id": name} for name in "abc")
    revisits.observe(0, [*group("g1", a, ["success", "failure", "failure"], greedy=True),
                         *group("g2", b, ["failure", "success", "success"], greedy=True),
                         *group("g3", c, ["failure", "failure", "failure"], greedy=True)])
    assert [(r.task, r.failed) for r in revisits.queue] == [(b, 1 / 3)]


def run(model_dir, out, steps, resume=False) -> list[Trajectory]:
    settings = RLSettings(steps=steps, tasks_per_step=4, group_size=4, learning_rate=1e-3, rewards={"env": 1.0},
                          revisit_share=0.5, save_steps=1, rate_by_failures=True)
    trajlab.rl(model_dir, LENGTH, out, tokenizer=load_tokenizer(model_dir), device="cpu", resume=resume,
               rollout=RolloutSettings(max_turns=1, max_new_tokens=48, concurrency=16), **settings.model_dump())
    return list(read_trajectories(out / "rollouts.jsonl"))


def tasks_of(rollouts: list[Trajectory], step: int) -> list[str]:
    """A step's tasks in its groups' order."""
    ordered = sorted({(int(t.group.split(":")[2]), t.task["task_id"])
                      for t in rollouts if t.metrics["rl/step"] == step})
    return [task for _, task in ordered]


def test_rl_draws_mixed_tasks_again_and_resumes_with_the_same_queue(terse_model_dir, tmp_path):
    """The terse model's answers vary in length, so the length env's groups are sometimes mixed: each later step
    starts with the tasks the queue then held (up to half of its 4), its rate follows the failed share of its fresh
    tasks alone (the revisited ones were chosen for failing), and a run resumed from its step-2 checkpoint draws step
    3 as the uninterrupted run did."""
    through = run(terse_model_dir, tmp_path / "through", steps=3)
    records = [json.loads(line) for line in (tmp_path / "through" / "metrics.jsonl").read_text().splitlines()]
    revisits = Revisits(share=0.5, capacity=16)
    for record in records:
        step = record["step"]
        expected, count = revisits.mix(0, [{"task_id": "fresh"}] * 4)
        assert record["rollout/revisited_tasks"] == count
        assert tasks_of(through, step)[:count] == [task["task_id"] for task in expected[:count]]
        rollouts = [t for t in through if t.metrics["rl/step"] == step]
        fresh = [t for t in rollouts if int(t.group.split(":")[2]) >= count]
        assert record["optim/lr"] == pytest.approx(1e-3 * failed_share(fresh))
        revisits.observe(0, rollouts)
    assert sum(record["rollout/revisited_tasks"] for record in records) > 0, "no mixed group: the test saw nothing"
    run(terse_model_dir, tmp_path / "resumed", steps=2)
    resumed = run(terse_model_dir, tmp_path / "resumed", steps=3, resume=True)
    assert tasks_of(resumed, 3) == tasks_of(through, 3)
