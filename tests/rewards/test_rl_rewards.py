"""RL and evaluation on the real tiny model with reward functions beside the env's: a custom function, a turn-level
one under credit: turn, one that fails on some rollouts (masked), and the LLM judge against the scripted judge
(a FAKE for a judge LLM over real HTTP, tests/rewards/conftest.py)."""

import json

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.env import load_env
from trajlab.models.loading import load_tokenizer

FNS = "tests.rewards.reward_fns"


def rewards(judge_url: str) -> dict:
    return {"env": 1.0,
            "brevity": {"function": f"{FNS}:brevity", "weight": 0.2},
            "first": {"function": f"{FNS}:first_turn", "level": "turn", "weight": 0.5},
            "flaky": {"function": f"{FNS}:flaky", "weight": 0.0},
            "judge": {"function": "trajlab.rewards.judge:LLMJudge", "weight": 1.0,
                      "args": {"url": judge_url, "rubric": "Did it call a tool?", "backoff_s": 0}}}


def test_rl_logs_every_reward_function_and_masks_the_failed_ones(tiny_model_dir, tmp_path, scripted_judge):
    scripted_judge.reply = lambda messages: "SCORE: 1" if "-> calls" in messages[-1]["content"] else "SCORE: 0.5"
    settings = RLSettings(steps=2, tasks_per_step=2, group_size=3, minibatch_size=6, save_steps=2, credit="turn",
                          rewards=rewards(scripted_judge.url))
    trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path, tokenizer=load_tokenizer(tiny_model_dir),
               rollout=RolloutSettings(max_turns=2, max_new_tokens=8, concurrency=8), **settings.model_dump())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["reward/brevity"] > 0 and record["reward/first"] == 1.0 and record["reward/flaky"] == 1.0
        assert 0.5 <= record["reward/judge"] <= 1.0
        # every rollout graded once (a function failing beside it does not stop the judge), or found in its cache
        assert record["judge/calls"] + record["judge/cache_hits"] == 6
        assert record["judge/prompt_tokens"] == 100 * record["judge/calls"]
        assert record["rollout/errors"] == 2.0, "the second rollout of each group: flaky raised"
    assert len(scripted_judge.requests) == sum(r["judge/calls"] for r in records)
    rollouts = list(read_trajectories(tmp_path / "rollouts.jsonl"))
    failed = [t for t in rollouts if t.status == "error"]
    assert len(failed) == 4 and all(t.id.endswith(":1") and t.metrics["rl/trained"] == 0.0 for t in failed)
    assert all("reward 'flaky'" in t.error and "database is locked" in t.error for t in failed)
    assert any(t.metrics["rl/trained"] for t in rollouts if t.status != "error")


def test_evaluate_reports_each_reward_function(tiny_model_dir, tmp_path, scripted_judge):
    scripted_judge.reply = lambda messages: "SCORE: 0.25"
    report = trajlab.evaluate(load_env("arithmetic"), str(tiny_model_dir), out=tmp_path / "eval", num_tasks=3,
                              rollout={"max_turns": 2, "max_new_tokens": 8},
                              rewards={k: v for k, v in rewards(scripted_judge.url).items() if k != "flaky"})
    assert report.reward_components["judge"] == 0.25 and report.reward_components["first"] == 1.0
    assert "brevity" in report.reward_components and report.statuses["error"] == 0
