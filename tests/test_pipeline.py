"""`trajlab run` end to end with tiny budgets, and resuming a finished run."""

import json
import re

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
eval: {{num_tasks: 4}}
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
    page = (run / "report.html").read_text()
    assert "eval-2-rl" in page and '"rl/step"' in page and '"reward/mean"' in page, "evals, RL rollouts, curves"
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the report fetches nothing"

    again = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert again.exit_code == 0
    assert "sft: already done" in again.stdout and "rl: already done" in again.stdout


def test_run_refuses_a_misspelled_key(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run").replace("max_steps", "max_stepz"))
    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 1 and "sft.max_stepz: unknown key (did you mean 'max_steps'?)" in result.stdout


def test_an_evolve_stage_hands_its_prompt_to_the_stages_after_it(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"""run_dir: {tmp_path / "run"}
env: arithmetic
stages: [eval, evolve, eval]
rollout: {{max_turns: 2, max_new_tokens: 16}}
evolve: {{max_metric_calls: 6, train_tasks: 3, val_tasks: 2, reflection_max_new_tokens: 16, tools: [submit]}}
eval: {{num_tasks: 3}}
""")
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    run = tmp_path / "run"
    assert [r["label"] for r in json.loads((run / "results.json").read_text())] == ["untrained", "untrained+evolved"]
    best = json.loads((run / "evolve" / "result" / "best_candidate.json").read_text())
    assert set(best) == {"system_prompt", "tool:submit"}
    seed_ids = [json.loads(line)["id"] for line in (run / "eval-0-untrained" / "trajectories.jsonl").open()]
    evolved_ids = [json.loads(line)["id"] for line in (run / "eval-1-untrained+evolved" / "trajectories.jsonl").open()]
    assert all(":prompt-" in i for i in evolved_ids) and not any(":prompt-" in i for i in seed_ids)
    again = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert again.exit_code == 0 and "evolve: already done" in again.stdout


def test_rollout_prompt_file_is_what_every_stage_shows_the_model(tmp_path, tiny_tokenizer):
    prompts = tmp_path / "best_candidate.json"
    prompts.write_text(json.dumps({"system_prompt": "EVOLVED-SYSTEM-XYZ", "tool:submit": "EVOLVED-SUBMIT-ABC"}))
    config = tmp_path / "config.yaml"
    config.write_text(f"""run_dir: {tmp_path / "run"}
env: arithmetic
stages: [eval]
rollout: {{max_turns: 1, max_new_tokens: 4, prompt_file: {prompts}}}
eval: {{num_tasks: 2}}
""")
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    line = (tmp_path / "run" / "eval-0-untrained" / "trajectories.jsonl").open().readline()
    prompt = tiny_tokenizer.decode(json.loads(line)["tokens"]["prompt_ids"])
    assert "EVOLVED-SYSTEM-XYZ" in prompt and "EVOLVED-SUBMIT-ABC" in prompt
    assert "Submit the final" not in prompt  # the docstring's description is replaced, not added to
