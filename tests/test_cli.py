"""Each CLI command end to end, with tiny budgets."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trajlab.cli import app
from trajlab.data.store import read_trajectories, task_keys
from trajlab.env.registry import load_env, registered_names
from trajlab.models.loading import load_processor

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_envs_json_lists_every_env_with_its_tools():
    result = invoke("envs", "--json")
    assert result.exit_code == 0
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert {"arithmetic", "guess"} <= set(rows)
    assert {t["function"]["name"] for t in rows["arithmetic"]["tools"]} == {"add", "subtract", "multiply", "submit"}
    assert rows["guess"]["description"]
    assert rows["driving"]["references"] == ["overconfident"]
    assert rows["arithmetic"]["references"] == ["sign_slip"]
    assert rows["guess"]["references"] == ["impatient"]


def test_model_init_refuses_to_overwrite(tmp_path):
    assert invoke("model", "init", tmp_path / "m").exit_code == 0
    result = invoke("model", "init", tmp_path / "m")
    assert result.exit_code == 1 and "overwrite" in result.stdout


def test_model_init_vision_builds_a_model_with_a_processor(tmp_path):
    result = invoke("model", "init", "--vision", tmp_path / "vl")
    assert result.exit_code == 0, result.stdout
    assert "Wrote tiny vision-language model" in result.stdout
    assert type(load_processor(tmp_path / "vl")).__name__ == "Gemma3Processor"
    again = invoke("model", "init", "--vision", tmp_path / "vl")
    assert again.exit_code == 1 and "overwrite" in again.stdout


@pytest.mark.parametrize("env", ["arithmetic", "guess"])
def test_collect_with_the_oracle_solves_everything(env, tmp_path, tiny_model_dir):
    out = tmp_path / "demos.jsonl"
    result = invoke("collect", "--env", env, "--policy", "oracle", "--tokenizer", tiny_model_dir, "--episodes", 24,
                    "--split", "test", "--out", out)
    assert result.exit_code == 0, result.stdout
    assert "success rate" in result.stdout and "1.000" in result.stdout
    trajectories = list(read_trajectories(out))
    assert len(trajectories) == 24 and all(t.status == "success" for t in trajectories)
    assert all(t.split == "test" and t.policy == "oracle" for t in trajectories)


def test_collect_with_the_untrained_model_records_failures_honestly(tmp_path, tiny_model_dir):
    out = tmp_path / "untrained.jsonl"
    result = invoke("collect", "--env", "arithmetic", "--policy", tiny_model_dir, "--episodes", 4,
                    "--max-new-tokens", 24, "--max-turns", 2, "--out", out)
    assert result.exit_code == 0, result.stdout
    trajectories = list(read_trajectories(out))
    assert len(trajectories) == 4
    assert all(t.status in ("failure", "truncated") and t.reward == 0.0 for t in trajectories)
    for t in trajectories:
        assert sum(t.tokens.loss_mask) == t.metrics["model_tokens"] > 0
        assert all(lp is not None for lp, bit in zip(t.tokens.logprobs, t.tokens.loss_mask, strict=True) if bit)
    again = invoke("collect", "--env", "arithmetic", "--policy", tiny_model_dir, "--episodes", 4,
                   "--max-new-tokens", 24, "--max-turns", 2, "--out", out)
    assert "already on disk" in again.stdout and len(list(read_trajectories(out))) == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env", "arithmetik", "--policy", "oracle"], "Did you mean 'arithmetic'"),
        (["--env", "arithmetic", "--policy", "/no/such/model"], "'/no/such/model' does not exist"),
        (["--env", "arithmetic", "--policy", "oracle", "--split", "dev"], "splits ['train', 'test']"),
    ],
)
def test_collect_bad_input_is_a_clear_error(args, message, tmp_path, tiny_model_dir):
    result = invoke("collect", *args, "--tokenizer", tiny_model_dir, "--episodes", 2, "--out", tmp_path / "x.jsonl")
    assert result.exit_code == 1 and message in result.stdout


def test_evolve_writes_the_result_folder_and_resumes(tmp_path, tiny_model_dir):
    args = ("evolve", "--env", "arithmetic", "--policy", tiny_model_dir, "--reflection", tiny_model_dir,
            "--out", tmp_path, "--train-tasks", 3, "--val-tasks", 2, "--set", "rollout.max_turns=2",
            "--set", "rollout.max_new_tokens=16", "--set", "evolve.reflection_max_new_tokens=16")
    result = invoke(*args, "--max-metric-calls", 2)
    assert result.exit_code == 0, result.stdout
    assert "1 candidates, 2 rollouts (2 this run) for 2 metric calls" in " ".join(result.stdout.split())
    result = invoke(*args, "--max-metric-calls", 8)
    assert result.exit_code == 0, result.stdout
    summary = json.loads((tmp_path / "result" / "summary.json").read_text())
    assert summary["resumed"] and summary["metric_calls"] >= 8 and (tmp_path / "result" / "best_prompt.txt").exists()
    assert summary["rollouts"] == summary["rollouts_this_run"] + 2


def test_evolve_says_what_is_wrong(tmp_path, tiny_model_dir):
    def error(*args, code=1):  # 1: a mistake in what was given; 2: a wrong combination of options
        result = invoke("evolve", *args)
        assert result.exit_code == code
        return " ".join((result.stdout + result.stderr).split())

    assert "cannot load the policy: 'nowhere' does not exist" in error("--env", "arithmetic", "--policy", "nowhere",
                                                                       "--out", tmp_path)
    assert "give --env, or a --config" in error("--policy", tiny_model_dir)
    assert "runs one env" in error("--env", "arithmetic,wordle", "--policy", tiny_model_dir, code=2)
    assert "evolve.max_metric_cals: unknown key (did you mean 'max_metric_calls'?)" in error(
        "--env", "arithmetic", "--set", "evolve.max_metric_cals=3")
    assert "The oracle cannot reflect" in error("--env", "arithmetic", "--policy", "oracle", "--out", tmp_path)
    assert "no tool(s) ['divide']" in error("--env", "arithmetic", "--policy", "oracle", "--tool", "divide",
                                              "--reflection", tiny_model_dir, "--out", tmp_path / "t")


def test_envs_lists_an_env_that_cannot_load_with_what_it_needs():
    from tests.env.test_bfcl import INSTALL_LINE, WITHOUT_BFCL_EVAL

    def envs(*args):
        code = WITHOUT_BFCL_EVAL + f"from trajlab.cli import app\napp({['envs', *args]!r})"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "COLUMNS": "1000"})
        assert result.returncode == 0, result.stderr
        return result.stdout

    rows = {row["name"]: row for row in json.loads(envs("--json"))}
    assert rows["bfcl"] == {"name": "bfcl", "unavailable": INSTALL_LINE}
    assert all("unavailable" not in row and row["tools"] for name, row in rows.items() if name != "bfcl")
    table = envs()
    assert INSTALL_LINE in table and "submit(answer)" in table


@pytest.mark.parametrize("env", sorted(registered_names()))
def test_collect_uses_the_envs_own_limits_by_default(env, tmp_path, tiny_model_dir, tiny_vision_dir):
    out = tmp_path / "demos.jsonl"
    tokenizer = tiny_vision_dir if load_env(env).shows_images else tiny_model_dir
    result = invoke("collect", "--env", env, "--policy", "oracle", "--tokenizer", tokenizer, "--episodes", 4,
                    "--split", "test", "--out", out)
    assert result.exit_code == 0, result.stdout
    trajectories = list(read_trajectories(out))
    assert len(trajectories) == 4 and all(t.status == "success" for t in trajectories), [
        (t.status, t.stop_reason) for t in trajectories]


def test_collect_refuses_a_text_model_for_an_env_that_shows_images(tmp_path, tiny_model_dir):
    result = invoke("collect", "--env", "odd_one_out", "--policy", "oracle", "--tokenizer", tiny_model_dir,
                    "--episodes", 1, "--out", tmp_path / "t.jsonl")
    assert result.exit_code != 0 and "return images" in result.stdout and "--vision" in result.stdout
    assert not (tmp_path / "t.jsonl").exists() or not (tmp_path / "t.jsonl").read_text()


def test_dtype_bfloat16_on_the_cpu_loads_bfloat16_and_collect_and_eval_run(tmp_path, tiny_model_dir, monkeypatch):
    import torch

    from trajlab.models import loading

    loaded, real = [], loading.load_model

    def spy(*args, **kwargs):  # the real loader, watched: which device and dtype each command loaded
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(loading, "load_model", spy)
    out = tmp_path / "bf16.jsonl"
    result = invoke("collect", "--env", "arithmetic", "--policy", tiny_model_dir, "--episodes", 2, "--max-new-tokens",
                    12, "--max-turns", 1, "--device", "cpu", "--dtype", "bfloat16", "--out", out)
    assert result.exit_code == 0, result.stdout
    trajectories = list(read_trajectories(out))
    assert len(trajectories) == 2 and all(t.tokens.logprobs[-1] is not None for t in trajectories)
    result = invoke("eval", "--env", "arithmetic", "--policy", tiny_model_dir, "--num-tasks", 2, "--max-new-tokens",
                    12, "--max-turns", 1, "--dtype", "bfloat16", "--out", tmp_path / "eval")
    assert result.exit_code == 0, result.stdout
    assert [(m.device.type, m.dtype) for m in loaded] == [("cpu", torch.bfloat16)] * 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machines without a GPU")
@pytest.mark.parametrize("command", [
    ["collect", "--env", "arithmetic", "--episodes", 1, "--out", "x.jsonl", "--policy"],
    ["eval", "--env", "arithmetic", "--num-tasks", 1, "--out", "e", "--policy"],
    ["evolve", "--env", "arithmetic", "--out", "v", "--policy"],
    ["rl", "--env", "arithmetic", "--out", "r", "--model"],
    ["serve", "--model"],
])
def test_device_cuda_without_a_gpu_is_one_clear_line(command, tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(*command, tiny_model_dir, "--device", "cuda")
    assert result.exit_code == 1
    assert "error: device 'cuda': torch" in result.stdout and "sees no CUDA GPU on this machine" in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1
    result = invoke(*command, tiny_model_dir, "--device", "gpu")
    assert result.exit_code == 1
    assert "model.device: 'gpu' is not a device: use auto, cpu, cuda or cuda:N" in result.stdout


def test_rl_draws_none_of_the_tasks_of_the_file_it_skips(tmp_path, tiny_model_dir):
    """The demonstrations are drawn in the order RL draws its tasks (the same seed): without --skip-tasks-of, RL's
    two tasks would be the first two demonstrated."""
    demos = tmp_path / "demos.jsonl"
    result = invoke("collect", "--env", "arithmetic", "--policy", "oracle", "--tokenizer", tiny_model_dir,
                    "--episodes", 4, "--out", demos)
    assert result.exit_code == 0, result.stdout
    result = invoke("rl", "--env", "arithmetic", "--model", tiny_model_dir, "--out", tmp_path / "rl", "--steps", 1,
                    "--tasks-per-step", 2, "--group-size", 2, "--skip-tasks-of", demos,
                    "--set", "rollout.max_turns=1", "--set", "rollout.max_new_tokens=8")
    assert result.exit_code == 0, result.stdout
    trained = task_keys(tmp_path / "rl" / "rollouts.jsonl")
    assert len(trained) == 2 and trained.isdisjoint(task_keys(demos))


def test_float16_weights_are_not_trained(tmp_path, tiny_model_dir):
    result = invoke("rl", "--env", "arithmetic", "--model", tiny_model_dir, "--out", tmp_path, "--dtype", "float16")
    assert result.exit_code == 1 and "float16 weights cannot be trained" in result.stdout


def test_dataset_takes_the_dataset_section_of_a_config_and_set(tmp_path, tiny_model_dir):
    """`trajlab dataset --config RUN.yaml --kind sft` builds what that run's sft stage trains on; --set and the options
    override the file, as for every command."""
    demos = tmp_path / "demos.jsonl"
    result = invoke("collect", "--env", "arithmetic", "--policy", "oracle", "--tokenizer", tiny_model_dir,
                    "--episodes", 12, "--reference-noise", 0.2, "--out", demos)
    assert result.exit_code == 0, result.stdout
    trajectories = list(read_trajectories(demos))
    succeeded = [t for t in trajectories if t.status == "success"]
    assert 0 < len(succeeded) < len(trajectories)  # the noisy reference fails some tasks
    config = tmp_path / "run.yaml"
    config.write_text("env: arithmetic\ndataset:\n  include_failures: true\n")

    def rows(*args) -> list[dict]:
        out = tmp_path / "sft.jsonl"
        result = invoke("dataset", "--kind", "sft", "--from", demos, "--out", out, *args)
        assert result.exit_code == 0, result.stdout
        return [json.loads(line) for line in out.read_text().splitlines()]

    assert len(rows()) == len(succeeded)
    assert len(rows("--config", config)) == len(trajectories)
    assert len(rows("--config", config, "--set", "dataset.include_failures=false")) == len(succeeded)
    assert len(rows("--config", config, "--no-include-failures")) == len(succeeded)
    lengths = sorted(len(t.tokens.prompt_ids) + len(t.tokens.completion_ids) for t in trajectories)
    limit = lengths[len(lengths) // 2]
    kept = rows("--config", config, "--set", f"dataset.max_tokens={limit}")
    assert 0 < len(kept) == sum(length <= limit for length in lengths) < len(trajectories)
    assert all(len(row["input_ids"]) <= limit for row in kept)
    # the section is about SFT data: another kind built from the same run's config ignores it
    result = invoke("dataset", "--kind", "rl", "--from", demos, "--out", tmp_path / "rl.jsonl", "--config", config)
    assert result.exit_code == 0, result.stdout
