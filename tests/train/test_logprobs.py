"""Sliced chosen-token log-probabilities on the real tiny model: equal to the full log-softmax, gradients too."""

import pytest
import torch

from trajlab.models.loading import load_model
from trajlab.train.logprobs import chosen_logprobs


def hidden_and_targets(model, rows=3, length=40):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (rows, length + 1), generator=generator)
    hidden = model(input_ids=input_ids[:, :-1], output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    return hidden, input_ids[:, 1:]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_slices_equal_the_full_log_softmax_with_the_same_gradients(tiny_model_dir, temperature):
    model = load_model(tiny_model_dir).train()
    head = model.get_output_embeddings()
    results = []
    for sliced in (True, False):
        model.zero_grad()
        hidden, targets = hidden_and_targets(model)
        if sliced:  # 3 rows x 5 positions per slice: 8 slices for 40 positions, the last one short
            logprobs, entropy = chosen_logprobs(hidden, head, targets, temperature, chunk_tokens=15)
        else:
            full = torch.log_softmax(head(hidden).float() / temperature, dim=-1)  # (B, L, V): what slicing avoids
            logprobs = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            entropy = -(full.exp() * full).sum(-1)
        (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logprobs.detach(), entropy, grads))
    (lp, ent, grad), (full_lp, full_ent, full_grad) = results
    assert lp.shape == (3, 40) and not ent.requires_grad
    assert torch.allclose(lp, full_lp, atol=1e-6, rtol=0)
    assert torch.allclose(ent, full_ent, atol=1e-5, rtol=0)
    # float32 sums in another order: they differ by about 1e-6 of the largest gradient (up to ~20 here: 1.7e-5)
    largest = full_grad.abs().max()
    assert largest > 0 and torch.allclose(grad, full_grad, atol=2e-6 * largest, rtol=1e-5)


def test_without_gradients_no_slice_is_kept_for_backward(tiny_model_dir):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        hidden, targets = hidden_and_targets(model, rows=2, length=9)
        logprobs, entropy = chosen_logprobs(hidden, model.get_output_embeddings(), targets, 1.0, chunk_tokens=4)
        full = torch.log_softmax(model.get_output_embeddings()(hidden), dim=-1)
    assert not logprobs.requires_grad
    # the same float32 numbers summed in another order: equal up to a few units in the last place (values near -9
    # differ by up to 1.9e-6 on an AVX-512 CPU, where 1e-6 absolute held on others)
    assert torch.allclose(logprobs, full.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-6,
                          rtol=4 * torch.finfo(torch.float32).eps)
    assert bool((entropy > 0).all()) and bool((entropy <= torch.log(torch.tensor(float(full.shape[-1])))).all())
