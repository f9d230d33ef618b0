"""Sliced chosen-token log-probabilities on the real tiny model: equal to the full log-softmax, gradients too."""

import pytest
import torch

from trajlab.config import RLSettings
from trajlab.models.loading import load_model
from trajlab.rollout.types import TokenRecord, Trajectory
from trajlab.train import logprobs as logprob_math
from trajlab.train.batches import padded_batch
from trajlab.train.logprobs import chosen_logprobs, token_logprobs
from trajlab.train.loss import policy_loss


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
    # the same float32 sums in another order: equal to a few units in the last place of values near -11 (one unit:
    # 9.5e-7, so 1e-6 alone held on one host's kernels and not on this AMD EPYC's)
    assert torch.allclose(lp, full_lp, atol=1e-6, rtol=4 * torch.finfo(torch.float32).eps)
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


def test_a_shared_prompt_head_runs_once_with_the_same_logprobs_and_gradients(tiny_model_dir, tiny_tokenizer,
                                                                             monkeypatch):
    system = "<|im_start|>system\nYou solve arithmetic with the calculator tools, one call at a time.<|im_end|>\n"
    questions = ["Compute (1 + 2) * 3.", "Compute (1 + 2) * 3.", "Compute (9 - 4) + 6."]
    completions = ["<tool_call>\n{\"name\": \"add\"", "<tool_call>\n{\"name\": \"multiply\", \"arguments\"", "Hi"]
    model = load_model(tiny_model_dir).train()
    trajectories = []
    for question, completion in zip(questions, completions, strict=True):
        prompt = tiny_tokenizer.encode(f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
        ids = tiny_tokenizer.encode(completion, add_special_tokens=False)
        tokens = TokenRecord(prompt_ids=prompt, completion_ids=ids, loss_mask=[1] * len(ids),
                             logprobs=[-1.0] * len(ids))
        trajectories.append(Trajectory(id="t", env="arithmetic", task={}, messages=[], tools=[], reward=1.0,
                                       status="success", tokens=tokens))
    batch = padded_batch(trajectories, [[0.5] * len(t.tokens.completion_ids) for t in trajectories],
                  tiny_tokenizer.pad_token_id, torch.device("cpu"))
    assert logprob_math.shared_head(batch["input_ids"], batch["completion_start"]) >= logprob_math.MIN_SHARED_HEAD

    results = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(logprob_math, "MIN_SHARED_HEAD", 10**9)
        model.zero_grad()
        logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_start"],
                                      1.0)
        policy_loss(model, None, batch, RLSettings(), normaliser=3.0)["loss_tensor"].backward()
        results.append((logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (shared_lp, shared_grad), (full_lp, full_grad) = results
    mask = batch["attention_mask"][:, batch["completion_start"] :].bool()  # predicting padding means nothing
    assert torch.allclose(shared_lp[mask], full_lp[mask], atol=1e-5)
    assert full_grad.abs().sum() > 0 and torch.allclose(shared_grad, full_grad, atol=1e-6, rtol=1e-4)
