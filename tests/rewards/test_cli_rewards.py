"""``trajlab eval`` as a real subprocess with reward functions in ``eval.rewards``; a bad one refused in a line."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def trajlab(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "trajlab.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_eval_reports_the_configured_reward_functions(tiny_model_dir, tmp_path, scripted_judge):
    scripted_judge.reply = lambda messages: "SCORE: 0.75"
    rewards = ("{env: 1.0, brevity: {function: 'tests.rewards.reward_fns:brevity', weight: 0.2}, "
               f"judge: {{function: 'trajlab.rewards.judge:LLMJudge', args: {{url: '{scripted_judge.url}'}}}}}}")
    result = trajlab("eval", "--env", "arithmetic", "--policy", str(tiny_model_dir), "--out", str(tmp_path / "e"),
                     "--set", "eval.num_tasks=2", "--set", "rollout.max_new_tokens=8", "--set", "rollout.max_turns=1",
                     "--set", f"eval.rewards={rewards}")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "e" / "eval.json").read_text())
    components = report["reward_components"]
    assert components["judge"] == 0.75 and 0 < components["brevity"] <= 1 and "env" in components
    assert len(scripted_judge.requests) == 2
    # what grading cost, summed over the episodes: the scripted judge answers each request with 100 + 7 tokens
    assert report["judge_usage"] == {"cache_hits": 0, "calls": 2, "completion_tokens": 14, "prompt_tokens": 200}
    assert "judge usage" in result.stdout


def test_a_reward_function_that_does_not_import_is_one_line_and_exit_1(tiny_model_dir, tmp_path):
    result = trajlab("eval", "--env", "arithmetic", "--policy", str(tiny_model_dir), "--out", str(tmp_path / "e"),
                     "--set", "eval.rewards={env: 1.0, mine: {function: 'my_pkg.rewardz:score'}}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ("error: " in result.stderr + result.stdout and "eval.rewards.mine.function: cannot import 'my_pkg.rewardz'"
            in result.stderr + result.stdout)
