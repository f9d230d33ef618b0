"""Generation samples exactly the configured distribution and records each token's logprob under it, even when the
checkpoint's generation_config.json asks for other options."""

import asyncio

import pytest
import torch
from transformers import GenerationConfig

from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.models.tiny import init_tiny_model

NEW_TOKENS = 40
# Options a real checkpoint's generation_config.json may carry; none of them is trajlab's to apply.
CHECKPOINT_OPTIONS = dict(do_sample=True, temperature=0.3, top_k=3, top_p=0.5, typical_p=0.6, repetition_penalty=1.8,
                          no_repeat_ngram_size=2, min_new_tokens=8, suppress_tokens=[5, 6, 7])


@pytest.fixture(scope="module")
def opinionated(tmp_path_factory):
    """The tiny model with a generation_config.json that sets other sampling options, loaded with them."""
    path = init_tiny_model(tmp_path_factory.mktemp("opinionated") / "model", seed=3)
    saved = GenerationConfig.from_pretrained(path)
    saved.update(**CHECKPOINT_OPTIONS)
    saved.save_pretrained(path)
    model = load_model(path, device="cpu")
    assert model.generation_config.repetition_penalty == 1.8 and model.generation_config.top_k == 3
    return model, load_tokenizer(path)


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["hello", "what is 12 plus 30? use the tools", "guess a number"]  # three lengths: left padding too
    return [tokenizer.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
            for t in texts]


def _generate(model, tokenizer, params: SamplingParams) -> list:
    generator = HFGenerator(model, tokenizer, max_batch_size=32)

    async def batch():
        return await asyncio.gather(*(generator.generate(GenerationRequest(p, params)) for p in _prompts(tokenizer)))

    torch.manual_seed(0)
    return list(zip(_prompts(tokenizer), asyncio.run(batch()), strict=True))


def _logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(N, V) raw logits before each generated token, from one separate forward pass without padding or cache."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        return model(ids).logits[0, len(prompt) - 1 : -1].float()


def _configured(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """log-probs (N, V) of softmax(logits / T) truncated to top-k, then to the top-p nucleus, renormalised."""
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    if top_p < 1.0:
        probs, order = torch.softmax(scaled, -1).sort(-1, descending=True)
        mass_before = probs.cumsum(-1) - probs  # the nucleus: tokens whose more likely peers hold < top_p
        cut = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        scaled = scaled.masked_fill(cut, -torch.inf)
    return torch.log_softmax(scaled, -1)


def _at(logprobs: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return logprobs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.8, 40)])
def test_recorded_logprobs_are_those_of_the_configured_distribution(opinionated, temperature, top_p, top_k):
    model, tokenizer = opinionated
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p, top_k=top_k)
    outside_checkpoint_top_k = 0
    for prompt, result in _generate(model, tokenizer, params):
        # no stop ids: the checkpoint's eos must not end a turn either, and min_new_tokens is not ours
        assert len(result.token_ids) == NEW_TOKENS and result.finish_reason == "length"
        logits = _logits(model, prompt, result.token_ids)
        expected = _at(_configured(logits, temperature, top_p, top_k), result.token_ids)
        recorded = torch.tensor(result.logprobs)
        assert torch.isfinite(recorded).all(), "every sampled token lies inside the configured truncation"
        assert torch.allclose(recorded, expected, atol=1e-4), (recorded - expected).abs().max()
        # The same check tells the checkpoint's distribution apart: its temperature and top-k give other values.
        leaked = _at(_configured(logits, CHECKPOINT_OPTIONS["temperature"], 1.0, CHECKPOINT_OPTIONS["top_k"]),
                     result.token_ids)
        assert not torch.allclose(recorded, leaked, atol=1e-2)
        ranks = (logits > logits.gather(-1, torch.tensor(result.token_ids)[:, None])).sum(-1)
        outside_checkpoint_top_k += int((ranks >= CHECKPOINT_OPTIONS["top_k"]).sum())
    if top_k == 0 or top_k > CHECKPOINT_OPTIONS["top_k"]:
        assert outside_checkpoint_top_k > 0, "the checkpoint's top_k=3 would never sample these tokens"


def test_the_check_fails_when_the_checkpoints_options_leak_into_generation(opinionated):
    """Control: transformers' generate given only T/top-p as keyword arguments fills the rest from the checkpoint
    (repetition penalty, n-gram ban, suppressed tokens...), and the distribution it samples from is not the
    configured one, so the comparison above would fail for it."""
    model, tokenizer = opinionated
    prompt = _prompts(tokenizer)[1]
    torch.manual_seed(0)
    output = model.generate(torch.tensor([prompt]), do_sample=True, temperature=0.7, top_p=0.9, top_k=0,
                            max_new_tokens=NEW_TOKENS, output_scores=True, return_dict_in_generate=True)
    tokens = output.sequences[0, len(prompt):].tolist()
    sampled_from = _at(torch.log_softmax(torch.stack(output.scores, 1)[0].float(), -1), tokens)
    configured = _at(_configured(_logits(model, prompt, tokens), 0.7, 0.9, 0), tokens)
    assert not torch.allclose(sampled_from, configured, atol=1e-2)


def test_greedy_takes_the_models_argmax_and_records_its_logprob(opinionated):
    model, tokenizer = opinionated
    for prompt, result in _generate(model, tokenizer, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)):
        logits = _logits(model, prompt, result.token_ids)
        # a repetition penalty or n-gram ban from the checkpoint would move the argmax of this repetitive model
        assert result.token_ids == logits.argmax(-1).tolist()
        expected = _at(torch.log_softmax(logits, -1), result.token_ids)
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


def test_seeded_draws_follow_the_distribution_of_the_scores():
    """Gumbel-max over the perturbed scores is a draw from softmax(scores): 20,000 streams, one draw each."""
    from trajlab.inference.sampling import SeededDraws

    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])  # the last token cut (top-k/top-p): -inf score
    scores = torch.log(probs).expand(20_000, -1)
    draws = SeededDraws(list(range(20_000)), "cpu")(torch.zeros(20_000, 1, dtype=torch.long), scores).argmax(-1)
    frequencies = torch.bincount(draws, minlength=6).float() / 20_000
    assert frequencies[-1] == 0
    assert torch.allclose(frequencies, probs, atol=0.012), frequencies  # ~3.4 standard errors at p=0.5


def test_a_seeded_turn_samples_the_same_tokens_alone_or_in_any_batch(opinionated):
    """What a turn samples depends on its seed, not on the rows beside it: generation is reproducible run to run and
    across the timing that decides how the hf backend batches."""
    model, tokenizer = opinionated
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    prompts = _prompts(tokenizer)

    def run(rows: list[tuple[list[int], int]]) -> list:
        generator = HFGenerator(model, tokenizer, max_batch_size=32)  # a fresh generator: no kept states

        async def batch():
            return await asyncio.gather(*(generator.generate(GenerationRequest(p, params, seed=s)) for p, s in rows))

        torch.manual_seed(len(rows))  # the global stream differs between runs: it must not matter
        return asyncio.run(batch())

    [alone] = run([(prompts[1], 11)])
    batched = run([(prompts[0], 5), (prompts[2], 7), (prompts[1], 11), (prompts[1], 12)])
    assert batched[2].token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(batched[2].logprobs), torch.tensor(alone.logprobs), atol=1e-4)
    assert batched[3].token_ids != alone.token_ids, "another seed, the same prompt: another sample"
