"""A micro-batch of rollouts as tensors: padding marked by the attention mask, results cut back per rollout."""

import pytest
import torch

from trajlab.models.loading import load_model
from trajlab.train.batches import by_rollout, padded_batch

from .rollouts import trajectory_with_model_logprobs


def test_padding_is_marked_by_attention_mask_even_when_pad_is_a_real_token(tiny_model_dir, tiny_tokenizer):
    model = load_model(tiny_model_dir)
    short = trajectory_with_model_logprobs(model, tiny_tokenizer, [1, 1])
    long = trajectory_with_model_logprobs(model, tiny_tokenizer, [1, 1, 1, 1, 1])
    pad = short.tokens.completion_ids[-1]  # pad id equal to a token the model generated
    batch = padded_batch([short, long], [[1.0, 1.0], [1.0] * 5], pad, torch.device("cpu"))
    lengths = [len(t.tokens.prompt_ids) + len(t.tokens.completion_ids) for t in (short, long)]
    assert batch["attention_mask"].sum(-1).tolist() == lengths
    assert batch["loss_mask"].sum(-1).tolist() == [2, 5]


def test_results_are_cut_back_into_each_rollouts_completion(tiny_model_dir, tiny_tokenizer):
    """Rows whose prompts differ in length: a (B, T - completion_start) tensor goes back to each rollout's own
    completion tokens, whatever its row and its prompt's length."""
    model = load_model(tiny_model_dir)
    rollouts = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in ([1, 1], [1, 0, 1, 1])]
    rollouts[0].tokens.prompt_ids = rollouts[0].tokens.prompt_ids[2:]  # a shorter prompt: completion starts earlier
    batch = padded_batch(rollouts, [[0.0] * 2, [0.0] * 4], tiny_tokenizer.pad_token_id, torch.device("cpu"))
    start = batch["completion_start"]
    positions = torch.arange(start, batch["input_ids"].shape[1], dtype=torch.float32).expand(2, -1)
    cut = by_rollout(positions, batch, [7, 3], {7: rollouts[0], 3: rollouts[1]})
    for index, rollout in ((7, rollouts[0]), (3, rollouts[1])):
        first = len(rollout.tokens.prompt_ids)
        assert cut[index] == [float(p) for p in range(first, first + len(rollout.tokens.completion_ids))]


def test_a_model_token_without_the_samplers_logprob_is_refused(tiny_model_dir, tiny_tokenizer):
    rollout = trajectory_with_model_logprobs(load_model(tiny_model_dir), tiny_tokenizer, [1, 1, 1])
    rollout.tokens.logprobs[1] = None  # as from a backend that returned no logprobs
    with pytest.raises(ValueError, match="without the sampler's logprob"):
        padded_batch([rollout], [[1.0] * 3], tiny_tokenizer.pad_token_id, torch.device("cpu"))
