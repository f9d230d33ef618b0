"""What `trajlab run` writes when its output is a file: progress for every stage, one line per record, no library
noise; --quiet and --verbose. Each run is a real subprocess with its output in a pipe, as under CI or nohup."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

CONFIG = """run_dir: {run_dir}
env: arithmetic
stages: [eval, collect, sft, rl]
rollout: {{max_turns: 4, max_new_tokens: 32, concurrency: 16}}
collect: {{episodes: 8}}
sft: {{max_steps: 2, batch_size: 4, warmup_steps: 0, logging_steps: 1, save_steps: 1}}
rl: {{steps: 1, tasks_per_step: 2, group_size: 2, minibatch_size: 4, save_steps: 1}}
eval: {{num_tasks: 2}}
"""
STAMP = re.compile(r"^\d\d:\d\d:\d\d ")
TABLE = re.compile(r"^[\s┏┃┡│└━─┳╇┴┩┓┗┛┘┬┼]|^\s+arithmetic: held-out|^\s*\w+ = \w")


def trajlab_run(tmp_path, *flags: str) -> list[str]:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run"))
    result = subprocess.run([sys.executable, "-m", "trajlab.cli", *flags, "run", str(config)], capture_output=True,
                            text=True, timeout=600, env=os.environ | {"COLUMNS": "80"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "\r" not in result.stdout + result.stderr, "no progress bar drawn with carriage returns"
    return (result.stdout + result.stderr).splitlines()


@pytest.mark.slow(28)
def test_a_run_logged_to_a_file_shows_every_stage_one_line_per_record(tmp_path):
    lines = trajlab_run(tmp_path)
    loose = [line for line in lines if not STAMP.match(line) and not TABLE.match(line) and line.strip()
             and not line.startswith("Run saved in")]
    assert not loose, f"every line is a timestamped record or the results table: {loose}"
    text = "\n".join(lines)
    for progress in ("eval (untrained): 2/2 (100%)", "collect: 8/8 (100%)", "sft: 2/2 (100%)"):
        assert progress in text, progress
    step = next(line for line in lines if "rl step" in line)
    assert len(step) > 80 and step.rstrip().endswith("tok/s"), "a long line is not wrapped at 80 columns"
    assert "sft step 2/2: loss/sft" in text, "SFT's logs, one line each under their documented names"
    for noise in ("Removed shared tensor", "FutureWarning", "generation flags are not valid", "Loading weights"):
        assert noise not in text, noise


def test_quiet_prints_the_results_only(tmp_path):
    lines = trajlab_run(tmp_path, "--quiet")
    assert lines[-1].startswith("Run saved in") and any(line.startswith("┃ run") for line in lines)
    assert all(TABLE.match(line) for line in lines[:-1]), lines


def test_verbose_shows_the_libraries_records_each_on_one_line(tmp_path):
    lines = trajlab_run(tmp_path, "--verbose")
    records = [line for line in lines if STAMP.match(line)]
    assert any("INFO transformers" in line for line in records)
    assert any("Removed shared tensor" in line for line in records), "nothing is filtered when verbose"
    config_record = next(line for line in records if "Model config Qwen3Config" in line)
    assert '\\n  "vocab_size"' in config_record, "a multi-line message stays on its record's line"


def test_quiet_and_verbose_together_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "trajlab.cli", "--quiet", "--verbose", "envs"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--quiet and --verbose contradict each other" in result.stdout
