"""Key/value reuse across turns on the real tiny model: the same tokens and logprobs as reading the whole history."""

import asyncio
import os

import pytest
import torch

from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.inference.prefix_cache import CachedPrefix, PrefixCache
from trajlab.models.loading import load_model

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


def first_prompts(tokenizer, template) -> list[list[int]]:
    system = {"role": "system", "content": "You solve arithmetic with the calculator tools, one call at a time."}
    questions = ["Compute (3 + 4) * 2.", "Compute (9 - 1) + 7.", "Compute (2 * 6) - 5, then submit it.", "Hi."]
    return [
        tokenizer.apply_chat_template([system, {"role": "user", "content": q}], chat_template=template,
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        for q in questions
    ]


def run_turns(generator: HFGenerator, prompts: list[list[int]], observations: list[list[int]], turns: int = 3):
    """Episodes that append what the model said and an observation each turn, as the rollout engine does."""
    histories = [list(p) for p in prompts]
    outputs = []

    async def turn():
        return await asyncio.gather(*(generator.generate(GenerationRequest(h, GREEDY)) for h in histories))

    for _ in range(turns):
        results = asyncio.run(turn())
        outputs.append(results)
        for history, result, observation in zip(histories, results, observations, strict=True):
            history += result.token_ids + observation
    return outputs


@pytest.fixture(scope="module")
def observations(tiny_tokenizer):
    long_result = "<tool_response>\n" + " ".join(str(n) for n in range(40)) + "\n</tool_response>"
    texts = ["<tool_response>\n14\n</tool_response>", "8", long_result, ""]  # one far longer: read ahead
    return [tiny_tokenizer.encode(f"\n<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False) for t in texts]


def test_reused_states_give_the_tokens_and_logprobs_of_full_prefill(tiny_model_dir, tiny_tokenizer, tiny_template,
                                                                  observations):
    model = load_model(tiny_model_dir)
    prompts = first_prompts(tiny_tokenizer, tiny_template)
    reusing = HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0)
    plain = HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0, reuse_prefixes=False)
    read, read_ahead = reusing._read, []
    reusing._read = lambda sequences, prefixes: read_ahead.append(len(sequences)) or read(sequences, prefixes)

    with_reuse, without = run_turns(reusing, prompts, observations), run_turns(plain, prompts, observations)

    for turn_a, turn_b in zip(with_reuse, without, strict=True):
        for a, b in zip(turn_a, turn_b, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert reusing.reuse_prefixes and reusing.prefix_cache.hits >= 8  # turns 2 and 3 of all four episodes
    assert read_ahead[0] == 1 and 1 in read_ahead[1:], read_ahead  # the shared head; the long tool result alone
    # Every token is read exactly once: the shared head, each question, then per turn the last generated token
    # (not read while generating) and the observation.
    head = len(os.path.commonprefix(prompts))
    expected = head + sum(len(p) - head for p in prompts) + 2 * sum(1 + len(o) for o in observations)
    assert reusing.fed_tokens == expected and plain.fed_tokens > 2 * expected, (reusing.fed_tokens, expected)


def test_a_weight_change_drops_the_kept_states(tiny_model_dir, tiny_tokenizer, tiny_template, observations):
    model = load_model(tiny_model_dir)
    prompts = first_prompts(tiny_tokenizer, tiny_template)
    generator = HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0)
    run_turns(generator, prompts, observations, turns=2)
    assert len(generator.prefix_cache) > 0

    with torch.no_grad():  # what an optimizer step does: an in-place update of the weights
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    after = run_turns(generator, prompts, observations, turns=2)
    fresh = run_turns(HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0, reuse_prefixes=False),
                      prompts, observations, turns=2)
    for turn_a, turn_b in zip(after, fresh, strict=True):
        for a, b in zip(turn_a, turn_b, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_prefix_cache_finds_the_longest_prefix_and_stays_within_its_budget():
    def entry(ids):
        return CachedPrefix(tuple(ids), [(torch.zeros(1, len(ids), 2), torch.zeros(1, len(ids), 2))])

    cache = PrefixCache(max_bytes=entry(range(10)).nbytes * 2)
    cache.add(entry([1, 2, 3]))
    cache.add(entry([1, 2, 3, 4, 5]))
    assert cache.longest([1, 2, 3, 4, 5, 6]).token_ids == (1, 2, 3, 4, 5)
    assert cache.longest([1, 2, 3, 4, 5]).token_ids == (1, 2, 3)  # at least one token must be left to feed
    assert cache.longest([1, 2, 9]) is None
    cache.add(entry(range(10, 24)))  # over budget: the least recently used entries go first
    assert cache.nbytes <= cache.max_bytes and cache.longest([1, 2, 3, 4, 5, 6]).token_ids == (1, 2, 3)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.longest([1, 2, 3, 4]) is None


def test_the_default_budget_is_a_quarter_of_the_weights_and_at_least_64_mib(tiny_model_dir):
    from trajlab.config import ModelSettings, ServeSettings
    from trajlab.inference.prefix_cache import default_budget
    from trajlab.models.loading import load_tokenizer
    from trajlab.proxy.server import _generator

    with torch.device("meta"):  # shapes only: 1.2 GB of float32 weights cost nothing here
        big = torch.nn.Linear(1 << 14, (1 << 14) + (1 << 10))
    weights = 4 * sum(p.numel() for p in big.parameters())
    assert weights > 1 << 30 and default_budget(big) == weights // 4
    tiny = load_model(tiny_model_dir)
    assert default_budget(tiny) == 64 << 20  # the tiny model's 12 MB of weights: the floor
    tokenizer, model = load_tokenizer(tiny_model_dir), ModelSettings(path=str(tiny_model_dir), device="cpu")
    served, _ = _generator(ServeSettings(), model, tokenizer, "tiny", None)
    assert served.prefix_cache.max_bytes == 64 << 20
    served, _ = _generator(ServeSettings(prefix_cache_mb=300), model, tokenizer, "tiny", None)
    assert served.prefix_cache.max_bytes == 300 << 20
