"""The hf generation loop on the real tiny model: finished rows leave the batch, long prompts are read in chunks, and
neither changes a token."""

import asyncio

import pytest
import torch

from trajlab.inference import hf_decode
from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model

SYSTEM = "You solve arithmetic with the calculator tools, one call at a time, and submit the answer when sure."


def prompt(tokenizer, template, question: str, words: int = 0) -> list[int]:
    """A chat prompt with the shared system head (so the batch reads it once and resumes from kept states)."""
    text = question + " " + " ".join(f"w{i % 50}" for i in range(words))
    return tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                                         chat_template=template, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def generate(generator: HFGenerator, requests: list[GenerationRequest]) -> list:
    async def batch():
        return await asyncio.gather(*(generator.generate(r) for r in requests))

    return asyncio.run(batch())


class Forwards:
    """Every forward of the model: (rows, columns read, columns attended, rows of its key/value states)."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs) -> None:
        ids, states = kwargs["input_ids"], kwargs["past_key_values"]
        rows = states.layers[0].keys.shape[0] if states is not None and states.get_seq_length() else ids.shape[0]
        self.calls.append((ids.shape[0], ids.shape[1], kwargs["attention_mask"].shape[1], rows))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_finished_row_leaves_the_batch_and_samples_what_it_samples_alone(model, tiny_tokenizer, tiny_template,
                                                                          temperature):
    short = GenerationRequest(prompt(tiny_tokenizer, tiny_template, "Compute 3 + 4."),
                              SamplingParams(max_new_tokens=4, temperature=temperature), seed=5)
    long = GenerationRequest(prompt(tiny_tokenizer, tiny_template, "Compute (9 - 1) * 7, step by step."),
                             SamplingParams(max_new_tokens=400, temperature=temperature), seed=6)
    [alone] = generate(HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0), [short])
    generator = HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0)
    forwards = Forwards(model)
    try:
        batched, other = generate(generator, [short, long])
    finally:
        forwards.handle.remove()

    assert generator.batches == 1 and len(other.token_ids) == 400
    assert batched.token_ids == alone.token_ids and batched.finish_reason == alone.finish_reason == "length"
    assert torch.allclose(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=1e-4)
    decoding = [call for call in forwards.calls if call[1] == 1]  # one token per row per step
    assert len(decoding) == 399
    # The short row is in 3 decoding steps (its 4th token is never read); then neither it nor its states are.
    assert [call[0] for call in decoding] == [2] * 3 + [1] * 396, [call[0] for call in decoding][:8]
    assert [call[3] for call in decoding] == [2] * 3 + [1] * 396


def test_a_turn_ends_at_its_first_stop_token_even_when_it_is_the_pad_token(model, tiny_tokenizer, tiny_template):
    ids = prompt(tiny_tokenizer, tiny_template, "Hi.")
    [free] = generate(HFGenerator(model, tiny_tokenizer, max_batch_size=4),
                      [GenerationRequest(ids, SamplingParams(max_new_tokens=12, temperature=0.0))])
    stop = free.token_ids[3]
    generator = HFGenerator(model, tiny_tokenizer, max_batch_size=4)
    generator.pad_id = stop
    [ended, other] = generate(generator, [GenerationRequest(ids, SamplingParams(12, 0.0, stop_token_ids=(stop,))),
                                          GenerationRequest(ids[:-3], SamplingParams(12, 0.0, stop_token_ids=(stop,)))])
    first = free.token_ids.index(stop) + 1
    assert ended.token_ids == free.token_ids[:first] and ended.finish_reason == "stop"
    assert other.token_ids and (other.finish_reason == "stop") == (stop in other.token_ids)
    assert stop not in other.token_ids[:-1] and len(other.token_ids) <= 12


def test_a_long_prompt_is_read_in_chunks_with_the_tokens_of_one_pass(model, tiny_tokenizer, tiny_template,
                                                                      monkeypatch):
    requests = [GenerationRequest(prompt(tiny_tokenizer, tiny_template, "Count the words.", words),
                                  SamplingParams(max_new_tokens=12, temperature=0.0)) for words in (900, 20)]
    one_pass = generate(HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0, reuse_prefixes=False),
                        requests)
    monkeypatch.setattr(hf_decode, "PREFILL_SCORES", 1 << 16)
    for reuse in (False, True):
        forwards = Forwards(model)
        try:
            chunked = generate(HFGenerator(model, tiny_tokenizer, max_batch_size=4, max_wait_s=1.0,
                                           reuse_prefixes=reuse), requests)
        finally:
            forwards.handle.remove()
        reading = [call for call in forwards.calls if call[1] > 1]
        assert len(reading) > 10, reading
        assert all(rows * columns * attended <= 1 << 16 for rows, columns, attended, _ in reading), reading
        for a, b in zip(chunked, one_pass, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
