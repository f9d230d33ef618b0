"""`trajlab run` end to end with tiny budgets, and resuming a finished run."""

import json

from typer.testing import CliRunner

from trajlab.cli import app

CONFIG = """# trajlab run config.yaml
run_dir: {run_dir}
env: arithmetic
stages: [eval, collect, sft, eval, rl, eval]
rollout: {{max_turns: 4, max_new_tokens: 32, concurrency: 16}}
collect: {{episodes: 16}}
sft: {{max_steps: 2, batch_size: 4, warmup_steps: 0}}
rl: {{steps: 1, tasks_per_step: 2, group_size: 2, minibatch_size: 4, rewards: {{env: 1.0, progress: 1.0}}}}
eval: {{tasks: 4}}
"""


def test_run_prints_one_row_per_evaluation_and_resumes(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run"))
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    for label in ("untrained", "sft", "rl"):
        assert label in result.stdout
    run = tmp_path / "run"
    reports = json.loads((run / "results.json").read_text())
    assert [r["label"] for r in reports] == ["untrained", "sft", "rl"]
    assert all("progress" in r["reward_components"] and r["episodes"] == 4 for r in reports)
    for path in ("model/config.json", "demos.jsonl", "sft/final/config.json", "rl/final/config.json",
                 "rl/metrics.jsonl", "eval-0-untrained/eval.json", "eval-2-rl/eval.json", "results.json"):
        assert (run / path).exists(), path

    again = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert again.exit_code == 0
    assert "sft: already done" in again.stdout and "rl: already done" in again.stdout


def test_run_refuses_a_misspelled_key(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run").replace("max_steps", "max_stepz"))
    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 2 and "sft.max_stepz: unknown key (did you mean 'max_steps'?)" in result.stdout
