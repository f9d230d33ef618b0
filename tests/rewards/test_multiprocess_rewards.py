"""RL under ``accelerate launch`` with two CPU processes: each process holds every trajectory of a step, yet a reward
function is called once per trajectory (by the main process), so a judge is not asked twice."""

import json

from tests.train.test_multiprocess import LAUNCH, ROOT, run


def test_two_processes_call_a_reward_function_once_per_trajectory(terse_model_dir, tmp_path):
    calls = tmp_path / "calls.txt"
    run([*LAUNCH, "rl", "--model", str(terse_model_dir), "--env", "tests.rollout.length_env:SPEC", "--steps", "1",
         "--tasks-per-step", "2", "--group-size", "2", "--device", "cpu", "--out", str(tmp_path / "two"),
         "--set", "rollout.max_turns=1", "--set", "rollout.max_new_tokens=16",
         "--set", "rl.rewards={env: 1.0, counted: {function: 'tests.rewards.reward_fns:counted', weight: 0}}"],
        ROOT, REWARD_CALLS=str(calls))
    ids = calls.read_text().splitlines()
    assert len(ids) == len(set(ids)) == 4, ids
    record = json.loads((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["reward/counted"] == 1.0 and record["perf/processes"] == 2
