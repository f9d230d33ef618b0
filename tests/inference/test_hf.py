"""The transformers backend on the real tiny model."""

import asyncio
import itertools

import torch

from trajlab.chat.parsers import get_parser
from trajlab.env import load_env
from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


def test_rollouts_batch_across_episodes_and_logprobs_are_the_models(tiny_model_dir, tiny_tokenizer, tiny_template):
    model = load_model(tiny_model_dir)
    generator = HFGenerator(model, tiny_tokenizer, max_batch_size=32)
    spec = load_env("arithmetic")
    engine = RolloutEngine(spec, generator, tiny_tokenizer, chat_template=tiny_template,
                           parser=get_parser("auto", tiny_tokenizer),
                           sampling=SamplingParams(temperature=1.0),
                           limits=dict(max_turns=2, max_new_tokens=24), seed=0)
    tasks = list(itertools.islice(spec.iter_tasks("test", seed=0), 6))
    results = asyncio.run(engine.run([Episode(t["task_id"], t) for t in tasks], concurrency=6, retries=0,
                                     retry_backoff_s=1.0))
    turns = sum(t.metrics["turns"] for t in results)
    assert len(results) == 6 and generator.batches < turns, "concurrent turns must share generate calls"

    for trajectory in results:
        tokens = trajectory.tokens
        assert len(tokens.completion_ids) == len(tokens.loss_mask) == len(tokens.logprobs)
        ids = torch.tensor([tokens.prompt_ids + tokens.completion_ids])
        with torch.inference_mode():
            logits = model(ids).logits[0, :-1].float()  # (T-1, V): position t predicts token t+1
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        offset = len(tokens.prompt_ids) - 1
        for i, (bit, logprob) in enumerate(zip(tokens.loss_mask, tokens.logprobs, strict=True)):
            if bit:
                assert abs(logprob - expected[offset + i].item()) < 1e-3
            else:
                assert logprob is None


def test_greedy_generation_is_deterministic(tiny_model_dir, tiny_tokenizer):
    generator = HFGenerator(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=32)
    prompt = tiny_tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)

    async def twice():
        return await asyncio.gather(*(generator.generate(GenerationRequest(prompt, params)) for _ in range(2)))

    first, second = asyncio.run(twice())
    assert first.token_ids == second.token_ids and len(first.token_ids) > 0


def test_one_generator_serves_successive_event_loops(tiny_model_dir, tiny_tokenizer):
    generator = HFGenerator(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=32)
    request = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0))
    first = asyncio.run(generator.generate(request))
    second = asyncio.run(generator.generate(request))  # e.g. the next RL step
    assert first.token_ids == second.token_ids


def test_sampled_rollouts_are_reproducible_whatever_the_batching(tiny_model_dir, tiny_tokenizer, tiny_template):
    """The same episodes with the same seed give the same trajectories, token for token, whether 6 run at once or 2
    (other batches, other arrival order, prefix states kept or not); another seed gives others."""
    model = load_model(tiny_model_dir)
    spec = load_env("arithmetic")
    tasks = list(itertools.islice(spec.iter_tasks("test", seed=0), 6))

    def roll(concurrency: int, seed: int) -> list:
        engine = RolloutEngine(spec, HFGenerator(model, tiny_tokenizer, max_batch_size=32), tiny_tokenizer,
                               chat_template=tiny_template,
                               parser=get_parser("auto", tiny_tokenizer), sampling=SamplingParams(temperature=1.0),
                               limits=dict(max_turns=2, max_new_tokens=24), seed=seed)
        with engine:
            done = asyncio.run(engine.run([Episode(t["task_id"], t) for t in tasks], concurrency=concurrency,
                                          retries=0, retry_backoff_s=1.0))
        return sorted(done, key=lambda t: t.id)

    first, second, other = roll(6, seed=3), roll(2, seed=3), roll(6, seed=4)
    assert [t.tokens.completion_ids for t in first] == [t.tokens.completion_ids for t in second]
    for a, b in zip(first, second, strict=True):
        model_tokens = [(x, y) for x, y, bit in zip(a.tokens.logprobs, b.tokens.logprobs, a.tokens.loss_mask,
                                                    strict=True) if bit]
        assert all(abs(x - y) < 1e-4 for x, y in model_tokens)
    assert [t.tokens.completion_ids for t in first] != [t.tokens.completion_ids for t in other]
