"""Several envs in one run: tasks routed by their ``env`` column, metrics reported per env."""

import json

import pytest
from typer.testing import CliRunner

import trajlab
from trajlab.cli import app
from trajlab.config import RLSettings, RolloutSettings
from trajlab.env.mixture import EnvMixture, load_envs
from trajlab.env.registry import EnvSpec, load_env
from trajlab.evaluation import evaluate_trajectories
from trajlab.models.loading import load_tokenizer

runner = CliRunner()


def said(result) -> str:
    """The command's output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def test_one_name_is_an_env_several_are_a_mixture():
    assert isinstance(load_envs("wordle"), EnvSpec)
    mixture = load_envs("wordle, driving")
    assert isinstance(mixture, EnvMixture) and list(mixture.specs) == ["wordle", "driving"]
    assert load_envs(["wordle", "driving"]).name == "wordle,driving"
    with pytest.raises(ValueError, match="more than once"):
        load_envs("wordle,wordle")
    with pytest.raises(ValueError, match="Unknown environment 'wordel'. Did you mean 'wordle'"):
        load_envs("wordel,driving")


def test_a_mixture_interleaves_the_envs_tasks_and_tags_each_with_its_env():
    mixture = load_envs("wordle,driving,arithmetic")
    tasks = [task for _, task in zip(range(9), mixture.iter_tasks("test", seed=3), strict=False)]
    assert [t["env"] for t in tasks] == ["wordle", "driving", "arithmetic"] * 3
    wordle_tasks = [t for t in tasks if t["env"] == "wordle"]
    expected = [t for _, t in zip(range(3), load_env("wordle").iter_tasks("test", seed=3), strict=False)]
    assert [{k: v for k, v in t.items() if k != "env"} for t in wordle_tasks] == expected
    with pytest.raises(ValueError, match="no 'env' field"):
        mixture.spec_for({"task_id": "x"})
    with pytest.raises(ValueError, match="names env 'guess', which is not in the mixture"):
        mixture.spec_for({"task_id": "x", "env": "guess"})


def test_collect_runs_each_task_in_its_env_and_reports_per_env(tiny_model_dir, tmp_path):
    mixture = load_envs("wordle,driving")
    trajectories = trajlab.collect(mixture, "oracle", out=tmp_path / "mixed.jsonl", episodes=12, split="test",
                                   tokenizer=str(tiny_model_dir))
    assert len(trajectories) == 12 and all(t.status == "success" for t in trajectories)
    by_env = {env: [t for t in trajectories if t.env == env] for env in ("wordle", "driving")}
    assert [len(group) for group in by_env.values()] == [6, 6]
    for env, group in by_env.items():
        spec = mixture.specs[env]
        for t in group:
            assert t.task["env"] == env
            assert [tool["function"]["name"] for tool in t.tools] == [tool["function"]["name"] for tool in spec.tools]
            assert t.messages[0] == {"role": "system", "content": spec.system_prompt}
    report = evaluate_trajectories(trajectories)
    assert set(report.per_env) == {"wordle", "driving"}
    assert report.per_env["wordle"]["episodes"] == 6 and report.per_env["wordle"]["success_rate"] == 1.0
    assert report.per_env["wordle"]["mean_turns"] != report.per_env["driving"]["mean_turns"]


def test_a_task_file_with_an_env_column_runs_mixed_and_bad_rows_are_named(tiny_model_dir, tmp_path):
    mixture = load_envs("wordle,driving")
    rows = [task for _, task in zip(range(4), mixture.iter_tasks("test", seed=0), strict=False)]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "eval"
    result = runner.invoke(app, ["eval", "--env", "wordle,driving", "--policy", "oracle", "--tasks", str(tasks),
                                 "--out", str(out), "--tokenizer", str(tiny_model_dir)])
    assert result.exit_code == 0, result.output
    assert "env wordle" in result.output and "env driving" in result.output
    per_env = json.loads((out / "eval.json").read_text())["per_env"]
    assert {env: row["episodes"] for env, row in per_env.items()} == {"wordle": 2.0, "driving": 2.0}

    result = runner.invoke(app, ["collect", "--env", "wordle", "--policy", "oracle", "--tasks", str(tasks),
                                 "--episodes", "4", "--out", str(tmp_path / "x.jsonl"),
                                 "--tokenizer", str(tiny_model_dir)])
    assert result.exit_code == 1
    assert "tasks.jsonl:2: the task is for env 'driving' but runs in 'wordle'" in said(result)
    assert "pass --env wordle,driving" in said(result)
    tasks.write_text(json.dumps({**rows[0], "env": "guess"}) + "\n")
    result = runner.invoke(app, ["collect", "--env", "wordle,driving", "--policy", "oracle", "--tasks", str(tasks),
                                 "--episodes", "1", "--out", str(tmp_path / "y.jsonl"),
                                 "--tokenizer", str(tiny_model_dir)])
    assert result.exit_code == 1 and "tasks.jsonl:1: " in said(result) and "not in the mixture" in said(result)


def test_rl_on_a_mixture_logs_each_envs_share_of_every_step(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    settings = RLSettings(steps=1, tasks_per_step=2, group_size=2, minibatch_size=4, learning_rate=1e-4)
    rollout = RolloutSettings(max_turns=2, max_new_tokens=8, concurrency=8)
    trajlab.rl(tiny_model_dir, load_envs("arithmetic,guess"), tmp_path, tokenizer=tokenizer, rollout=rollout,
               **settings.model_dump())
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["rollout/per_env/arithmetic/episodes"] == 2 and record["rollout/per_env/guess/episodes"] == 2
    # the per-env shares add up to the step's numbers
    for key, step_key in (("reward", "reward/mean"), ("success_rate", "rollout/success_rate")):
        shares = [record[f"rollout/per_env/{env}/{key}"] for env in ("arithmetic", "guess")]
        assert sum(shares) / 2 == pytest.approx(record[step_key])


def test_a_run_config_mixes_envs_with_a_list(tmp_path):
    from trajlab.config import load_config

    path = tmp_path / "mixed.yaml"
    path.write_text("env: [wordle, driving]\nstages: [collect]\n")
    config = load_config(path)
    assert load_envs(config.env).name == "wordle,driving"
