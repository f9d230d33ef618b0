"""Continuous batching on the real CPU build of vLLM: requests join and leave the engine one by one.

Runs in the vLLM lane only. Two engines of the tiny model serve the module: continuous (the default) and lockstep.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from trajlab.chat.parsers import get_parser
from trajlab.env import load_env
from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.vllm import VLLMGenerator
from trajlab.rollout.drift import check_token_drift
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode

pytest.importorskip("vllm", reason="the vLLM lane: `scripts/test.sh --vllm` runs tests/vllm in .venv-vllm")


@pytest.fixture(scope="module")
def continuous(tiny_model_dir):
    return VLLMGenerator(tiny_model_dir, max_batch_size=8)


@pytest.fixture(scope="module")
def lockstep(tiny_model_dir):
    return VLLMGenerator(tiny_model_dir, max_batch_size=8, batching="lockstep")


def _prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _finish_times(generator, requests: list[GenerationRequest]) -> list[float]:
    """Seconds from the start until each request's result arrived."""
    async def run():
        start = time.perf_counter()

        async def one(request):
            await generator.generate(request)
            return time.perf_counter() - start

        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(run())


def test_a_short_request_comes_back_while_a_long_one_still_generates(continuous, lockstep, tiny_tokenizer):
    prompt = _prompt(tiny_tokenizer, "hi")
    short = GenerationRequest(prompt, SamplingParams(max_new_tokens=2, temperature=0.0, stop_token_ids=(0,)))
    long = GenerationRequest(prompt, SamplingParams(max_new_tokens=400, temperature=0.0, stop_token_ids=(0,)))
    _finish_times(continuous, [short]), _finish_times(lockstep, [short])  # warm-up: the first steps compile
    steps = continuous._engine_loop.steps
    quick, slow = _finish_times(continuous, [short, long])
    assert quick < slow / 4, "the short request waited for the long one"
    assert continuous._engine_loop.steps - steps <= 400 + 2, "the two requests were stepped together"
    together = _finish_times(lockstep, [short, long])
    assert abs(together[0] - together[1]) < together[1] / 10, "lockstep hands back the whole batch at once"


def test_the_next_turn_of_an_episode_reuses_its_prefix_from_the_cache(continuous, tiny_tokenizer):
    prompt = _prompt(tiny_tokenizer, "what is 2 + 3? " * 40)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(0,))
    first = asyncio.run(continuous.generate(GenerationRequest(prompt, params)))
    cached, total = continuous.cached_prompt_tokens, continuous.prompt_tokens
    following = prompt + first.token_ids + _prompt(tiny_tokenizer, "and 4 + 5?")
    asyncio.run(continuous.generate(GenerationRequest(following, params)))
    reused = continuous.cached_prompt_tokens - cached
    assert continuous.prompt_tokens - total == len(following)
    block = continuous.llm.llm_engine.vllm_config.cache_config.block_size  # vLLM caches whole blocks of tokens
    assert reused >= len(prompt) // block * block >= block, (
        f"only {reused} of the earlier turn's {len(prompt)} tokens were cached (blocks of {block})")


def test_a_cancelled_request_leaves_the_engine(continuous, tiny_tokenizer):
    request = GenerationRequest(_prompt(tiny_tokenizer, "hi"), SamplingParams(max_new_tokens=2000, temperature=0.0,
                                                                              stop_token_ids=(0,)))

    async def run():
        task = asyncio.create_task(continuous.generate(request))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while continuous.llm.llm_engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(run())
    assert not continuous.llm.llm_engine.has_unfinished_requests()


def test_continuous_and_lockstep_give_the_same_greedy_trajectories(continuous, lockstep, tiny_tokenizer,
                                                                    tiny_template):
    spec = load_env("arithmetic")
    episodes = [Episode(f"e{i}", task) for i, task in zip(range(6), spec.iter_tasks("test", 0), strict=False)]
    parser = get_parser("auto", tiny_tokenizer)

    def roll(generator):
        engine = RolloutEngine(spec, generator, tiny_tokenizer, chat_template=tiny_template, parser=parser,
                               sampling=SamplingParams(temperature=0.0), limits={"max_turns": 3, "max_new_tokens": 24},
                               seed=0)

        async def run():
            return await asyncio.gather(*(engine.run_episode(e) for e in episodes))

        try:
            return asyncio.run(run())
        finally:
            engine.close()

    for generator in (continuous, lockstep):  # both compute every prompt afresh, as the other tests left them
        assert generator.llm.reset_prefix_cache()
    ours, theirs = roll(continuous), roll(lockstep)
    for a, b in zip(ours, theirs, strict=True):  # logprobs as near as two batch shapes compute them
        assert a.tokens.prompt_ids + a.tokens.completion_ids == b.tokens.prompt_ids + b.tokens.completion_ids
        assert a.tokens.loss_mask == b.tokens.loss_mask
        gaps = [abs(x - y) for x, y in zip(a.tokens.logprobs, b.tokens.logprobs, strict=True) if x is not None]
        assert gaps and max(gaps) < 1e-4
    assert [t.messages for t in ours] == [t.messages for t in theirs]
    kept, drifted = check_token_drift(ours, tiny_tokenizer, tiny_template, parser, max_drift=0.0)
    assert kept == ours and not drifted

