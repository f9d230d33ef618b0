"""The Python API as the README and docs/python-api.md show it, and its settings validated by the config models."""

import re
from pathlib import Path

import pytest

import trajlab
from trajlab.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("page", "heading"), [("README.md", "## Python API"), ("docs/python-api.md", "# Python API")])
def test_the_documented_python_example_runs(monkeypatch, tmp_path, tiny_model_dir, capsys, page, heading):
    monkeypatch.setenv("TRAJLAB_HOME", str(tmp_path))  # the oracle's default tokenizer is built there
    section = (ROOT / page).read_text().split(heading + "\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, page, "exec"), {})
    rate, count, status = capsys.readouterr().out.split()
    assert float(rate) == 1.0 and int(count) == 4 and status == "success"


def test_settings_are_validated_by_the_config_models(tiny_model_dir):
    with pytest.raises(UserError, match="num_taks.*did you mean 'num_tasks'"):
        trajlab.evaluate("arithmetic", "oracle", tokenizer=tiny_model_dir, num_taks=3)
    with pytest.raises(UserError, match="max_turns"):
        trajlab.collect("arithmetic", "oracle", tokenizer=tiny_model_dir, episodes=1, rollout={"max_turns": 0})


def test_in_memory_tasks_and_a_built_policy(tiny_model_dir):
    from trajlab.env.registry import load_env
    from trajlab.inference.policy import load_policy

    spec = load_env("arithmetic")
    tasks = [task for _, task in zip(range(3), spec.iter_tasks("test", seed=0), strict=False)]
    policy = load_policy("oracle", oracle=spec.oracle, tokenizer=tiny_model_dir, device="auto", dtype="auto",
                         backend="hf", max_batch_size=32)
    report = trajlab.evaluate(spec, policy, tasks=tasks)
    assert report.episodes == 3 and report.success_rate == 1.0
    assert {row.task_id for row in report.tasks} == {str(t["task_id"]) for t in tasks}
