"""`--backend vllm` on the commands, each run as a real subprocess on the CPU build of vLLM, with tiny budgets.

Runs in the vLLM lane only (`scripts/test.sh --vllm`); each command starts its own engine (~20 s on 2 cores).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from trajlab.data.store import read_trajectories
from trajlab.models.loading import load_model

pytest.importorskip("vllm", reason="the vLLM lane: `scripts/test.sh --vllm` runs tests/vllm in .venv-vllm")
ROOT = Path(__file__).resolve().parents[2]
TINY_ROLLOUT = ["--max-turns", 1, "--max-new-tokens", 8]


def trajlab(*args) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "trajlab.cli", *map(str, args)], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_collect_and_eval_with_the_vllm_backend(tiny_model_dir, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    trajlab("collect", "--env", "arithmetic", "--policy", tiny_model_dir, "--backend", "vllm", "--episodes", 3,
            "--out", out, *TINY_ROLLOUT)
    trajectories = list(read_trajectories(out))
    assert len(trajectories) == 3
    for trajectory in trajectories:
        tokens = trajectory.tokens
        assert sum(tokens.loss_mask) == trajectory.metrics["model_tokens"] > 0
        assert all(lp is not None and lp <= 0 for lp, bit in zip(tokens.logprobs, tokens.loss_mask, strict=True)
                   if bit)
    trajlab("eval", "--env", "arithmetic", "--policy", tiny_model_dir, "--backend", "vllm", "--num-tasks", 2,
            "--out", tmp_path / "eval", *TINY_ROLLOUT)
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["episodes"] == 2


def test_a_run_config_with_the_vllm_backend(tiny_model_dir, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nenv: arithmetic\nstages: [eval]\n"
                      f"model: {{path: {tiny_model_dir}, backend: vllm}}\n"
                      "rollout: {max_turns: 1, max_new_tokens: 8}\neval: {num_tasks: 2}\n")
    trajlab("run", config)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["episodes"] for r in results] == [2]


def test_three_rl_steps_with_the_vllm_backend(tiny_model_dir, tmp_path):
    trajlab("rl", "--model", tiny_model_dir, "--env", "tests.vllm.noisy_env:SPEC", "--backend", "vllm",
            "--steps", 3, "--tasks-per-step", 2, "--group-size", 2, "--learning-rate", 3e-3, "--out", tmp_path,
            "--set", "rollout.max_turns=1", "--set", "rollout.max_new_tokens=8", "--set", "rollout.concurrency=4")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["optim/trained_sequences"] > 0 for r in records), "noisy rewards: every step took a gradient step"
    assert all(r["mismatch/abs_logprob"] < 1e-3 for r in records), "the engine samples the synced weights"
    start, final = load_model(tiny_model_dir).state_dict(), load_model(tmp_path / "final").state_dict()
    assert any(not torch.equal(start[name], final[name]) for name in start)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_with_the_vllm_backend(tiny_model_dir, tmp_path):
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "trajlab.cli", "serve", "--model", str(tiny_model_dir),
                               "--backend", "vllm", "--port", str(port), "--record-dir", str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(1)
        body = {"model": Path(tiny_model_dir).name, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0,
                "logprobs": 0, "return_token_ids": True}
        request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokens = reply["choices"][0]["token_ids"]
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert tokens == greedy[: len(tokens)] and len(tokens) >= 1
