"""RL driving an external ``vllm serve`` process (``model.vllm.server``): rollouts over its API, after each update the
trained LoRA adapter loaded into it, or every weight broadcast to it in buckets (the ``trajlab_gloo`` backend that
trajlab's vLLM plugin registers in the server). Runs in the vLLM lane only; the server is the CPU build's, started by
the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.vllm import _saved_dtype
from trajlab.inference.vllm_server import VLLMServerGenerator
from trajlab.models.loading import load_model

from .noisy_env import SPEC as NOISY
from .test_vllm_backend import forward_logprobs, lora_rl, max_gap

pytest.importorskip("vllm", reason="the vLLM lane: `scripts/test.sh --vllm` runs tests/vllm in .venv-vllm")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """``vllm serve`` of the tiny model taking LoRA adapters and full weights at run time, on a free loopback port;
    yields its API root."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    env = os.environ | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1",
                        "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
               "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1",
               "--dtype", _saved_dtype(tiny_model_dir), "--enforce-eager", "--enable-lora", "--max-lora-rank", "8",
               "--logprobs-mode", "processed_logprobs", "--weight-transfer-config", '{"backend": "trajlab_gloo"}']
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, f"vllm serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"vllm serve did not start: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_rl_rolls_out_on_a_vllm_server_and_loads_the_trained_adapter_into_it(server, prompts, tiny_model_dir,
                                                                            tiny_tokenizer, tmp_path):
    final = lora_rl(tiny_model_dir, tiny_tokenizer, tmp_path, backend="vllm", vllm={"server": server})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    # The server sampled what the trainer computes: after each sync the logged mismatch stays near zero.
    assert all(r["mismatch/abs_logprob"] < 1e-3 for r in records), records
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["trajlab-policy-v2"], "the older unloaded"
    served = VLLMServerGenerator(server, "trajlab-policy-v2", tiny_tokenizer, adapter_dir=tmp_path / "adapters")
    params = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def run():
        return await asyncio.gather(*(served.generate(GenerationRequest(p, params)) for p in prompts))

    merged, base = load_model(final), load_model(tiny_model_dir)
    results = asyncio.run(run())
    for prompt, result in zip(prompts, results, strict=True):
        assert max_gap(result.logprobs, forward_logprobs(merged, prompt, result.token_ids)) < 1e-4
    moved = max(max_gap(r.logprobs, forward_logprobs(base, p, r.token_ids)) for p, r in zip(prompts, results,
                                                                                           strict=True))
    assert moved > 1e-3, "the adapter's training reached the server"


def served(server, model, tokenizer, prompts):
    """Greedy turns of ``prompts`` on the server's ``model``."""
    generator = VLLMServerGenerator(server, model, tokenizer, adapter_dir="unused")
    params = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def run():
        return await asyncio.gather(*(generator.generate(GenerationRequest(p, params)) for p in prompts))

    return asyncio.run(run())


def test_rl_without_lora_broadcasts_every_weight_to_the_server_after_each_step(server, prompts, tiny_model_dir,
                                                                              tiny_tokenizer, tmp_path):
    """Full weights reach the server in buckets over gloo; it then samples what the trainer computes. Runs last:
    the server's base weights are put back afterwards."""
    settings = RLSettings(steps=2, tasks_per_step=2, group_size=2, learning_rate=3e-3, save_steps=2)
    rollout = RolloutSettings(concurrency=4, max_turns=1, max_new_tokens=8)
    base = load_model(tiny_model_dir)
    before = served(server, "tiny", tiny_tokenizer, prompts)
    try:
        final = trajlab.rl(tiny_model_dir, NOISY, tmp_path, tokenizer=tiny_tokenizer, rollout=rollout,
                           backend="vllm", vllm={"server": server}, **settings.model_dump())
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == 2
        assert all(r["mismatch/abs_logprob"] < 1e-3 for r in records), records
        assert not (tmp_path / "adapters").exists(), "no adapter: the weights themselves moved"
        trained = load_model(final)
        after = served(server, "tiny", tiny_tokenizer, prompts)
        for prompt, result in zip(prompts, after, strict=True):
            assert max_gap(result.logprobs, forward_logprobs(trained, prompt, result.token_ids)) < 1e-4
        changed = [a.token_ids != b.token_ids or max_gap(a.logprobs, b.logprobs) > 1e-3
                   for a, b in zip(after, before, strict=True)]
        assert all(changed), "RL changed what the server generates"
    finally:
        restore = VLLMServerGenerator(server, "tiny", tiny_tokenizer, adapter_dir="unused")
        restore.load_weights(base)
        assert restore.sent_bytes == sum(t.numel() * t.element_size() for t in base.state_dict().values())
    for prompt, result in zip(prompts, served(server, "tiny", tiny_tokenizer, prompts), strict=True):
        assert max_gap(result.logprobs, forward_logprobs(base, prompt, result.token_ids)) < 1e-4, "put back"
