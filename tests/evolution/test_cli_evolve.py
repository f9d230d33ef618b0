"""``trajlab evolve`` -> ``trajlab eval --prompt-file`` -> ``trajlab eval compare``, as the docs walk through it.

The policy (``--env tests.evolution.scripted:INSTRUCTED --policy oracle``) and the reflection LM (the deterministic
proposer behind ``trajlab serve``'s real app, on a loopback port) are the TEST-ONLY scripted parts of
``tests/evolution/scripted.py``; everything between them is trajlab's command line as shipped. The docs' own config
(``configs/evolve.yaml``, the tiny model) runs too, and is killed mid-run and resumed.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.evolution.scripted import HINT, SEED_PROMPT, proposer_as_chat_policy
from tests.proxy.conftest import running
from trajlab.chat.parsers import get_parser
from trajlab.cli import app
from trajlab.config import ServeSettings
from trajlab.data.store import read_trajectories
from trajlab.inference.hf import HFGenerator
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.loading import load_model
from trajlab.proxy import SessionRecorder, create_app

ROOT = Path(__file__).resolve().parents[2]
ENV = "tests.evolution.scripted:INSTRUCTED"
runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    return result


def test_evolve_then_compare_seed_and_evolved_prompts_on_held_out_tasks(tiny_tokenizer, tiny_template, tmp_path):
    proposer = ScriptedGenerator(proposer_as_chat_policy, tiny_tokenizer, tiny_template, name="proposer")
    server = create_app(proposer, tiny_tokenizer, tiny_template, get_parser("auto", tiny_tokenizer), "proposer",
                        SessionRecorder(tmp_path / "sessions"), ServeSettings(),
                        tiny_tokenizer.model_max_length)
    with running(server) as url:
        evolved = invoke("evolve", "--env", ENV, "--policy", "oracle", "--reflection", f"{url}/v1#proposer",
                         "--out", tmp_path / "evolve", "--train-tasks", 4, "--val-tasks", 4,
                         "--max-metric-calls", 30)
    assert "validation score 0.000 (seed) -> 1.000 (best" in " ".join(evolved.stdout.split())
    result = tmp_path / "evolve" / "result"
    assert json.loads((result / "best_candidate.json").read_text()) == {"system_prompt": f"{SEED_PROMPT} {HINT}"}

    common = ("--env", ENV, "--policy", "oracle", "--num-tasks", 16)  # the test split: held out from evolution
    invoke("eval", *common, "--out", tmp_path / "seed", "--label", "seed")
    invoke("eval", *common, "--out", tmp_path / "evolved", "--label", "evolved",
           "--prompt-file", result / "best_candidate.json")
    compared = invoke("eval", "compare", tmp_path / "seed" / "eval.json", tmp_path / "evolved" / "eval.json",
                      "--json")
    metrics = json.loads(compared.stdout)["metrics"]
    assert (metrics["success_rate"]["a"], metrics["success_rate"]["b"]) == (0.0, 1.0)

    # One eval file, two prompts: the evolved prompt's episodes are new ones, not the seed prompt's reused.
    invoke("eval", *common, "--out", tmp_path / "seed", "--prompt-file", result / "best_prompt.txt")
    ids = [json.loads(line)["id"] for line in (tmp_path / "seed" / "trajectories.jsonl").open()]
    assert len(ids) == len(set(ids)) == 32


@pytest.mark.slow(36)
def test_the_docs_config_runs_and_resumes_after_being_killed(tmp_path):
    """``trajlab evolve --config configs/evolve.yaml`` (tiny model, offline), SIGKILLed mid-run, then run again."""
    out = tmp_path / "evolve"
    command = [sys.executable, "-m", "trajlab.cli", "evolve", "--config", str(ROOT / "configs" / "evolve.yaml"),
               "--out", str(out), "--set", f"run_dir={tmp_path}", "--max-metric-calls", "40"]
    rollouts = out / "gepa" / "rollouts.jsonl"
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while not (rollouts.exists() and len(rollouts.read_bytes().splitlines()) >= 12):
        assert process.poll() is None and time.monotonic() < deadline, "evolve ended before it could be killed"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "result").exists()
    before = len(rollouts.read_bytes().splitlines())

    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    summary = json.loads((out / "result" / "summary.json").read_text())
    ids = [json.loads(line)["id"] for line in rollouts.open()]
    assert len(ids) == len(set(ids)) == summary["rollouts"]  # no episode ran twice
    assert summary["rollouts_this_run"] == summary["rollouts"] - before  # the killed run's episodes were reused
    assert summary["metric_calls"] >= 40 and (out / "result" / "best_candidate.json").exists()


def test_policy_and_reflection_both_behind_trajlab_serve(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    """The docs' server recipe with ``trajlab serve`` standing in for vLLM: token-in/token-out policy turns over
    ``/v1/completions`` and reflection over ``/v1/chat/completions``, both recorded by the server."""
    server = create_app(HFGenerator(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=32), tiny_tokenizer,
                        tiny_template,
                        get_parser("auto", tiny_tokenizer), "tiny", SessionRecorder(tmp_path / "sessions"),
                        ServeSettings(), tiny_tokenizer.model_max_length)
    with running(server) as url:
        invoke("evolve", "--env", "arithmetic", "--policy", f"{url}/v1", "--tokenizer", tiny_model_dir,
               "--reflection", f"{url}/v1#tiny", "--out", tmp_path / "evolve", "--train-tasks", 3, "--val-tasks", 2,
               "--max-metric-calls", 8, "--set", "rollout.max_turns=2", "--set", "rollout.max_new_tokens=8",
               "--set", "evolve.reflection_max_new_tokens=8")
    summary = json.loads((tmp_path / "evolve" / "result" / "summary.json").read_text())
    assert summary["rollouts"] >= 2 and summary["metric_calls"] >= 8
    (first,) = itertools.islice(read_trajectories(tmp_path / "evolve" / "gepa" / "rollouts.jsonl"), 1)
    assert first.policy == f"{url}/v1#tiny" and "text_only" not in first.metrics  # the server's own token ids
    endpoints = {json.loads(line)["endpoint"] for path in (tmp_path / "sessions").glob("*.jsonl") for line in
                 path.open()}
    assert endpoints == {"/v1/completions", "/v1/chat/completions"}
