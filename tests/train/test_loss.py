"""The clipped policy-gradient loss on the real tiny model: its direction, model tokens only, micro-batches adding up
to one batch, the off-policy correction, activation checkpointing."""

import pytest
import torch

from trajlab.config import RLSettings
from trajlab.models.loading import load_model
from trajlab.train.batches import padded_batch
from trajlab.train.logprobs import token_logprobs
from trajlab.train.loss import loss_normaliser, policy_loss

from .rollouts import masked_logprob, sampled_by, trajectory_with_model_logprobs


def test_update_follows_the_advantage_on_model_tokens_only(tiny_model_dir, tiny_tokenizer):
    settings = RLSettings()
    mask = [1, 1, 1, 0, 0, 1, 1]
    for sign in (1.0, -1.0):
        model = load_model(tiny_model_dir)
        trajectory = trajectory_with_model_logprobs(model, tiny_tokenizer, mask)
        batch = padded_batch([trajectory], [[sign * bit for bit in mask]], tiny_tokenizer.pad_token_id,
                             torch.device("cpu"))
        before = masked_logprob(model, batch)
        model.train()
        stats = policy_loss(model, None, batch, settings, normaliser=1.0)
        assert abs(stats["clip_fraction"]) < 1e-6, "rollout logprobs equal the policy's: ratio is 1"
        stats["loss_tensor"].backward()
        torch.optim.SGD(model.parameters(), lr=0.05).step()
        after = masked_logprob(model, batch)
        assert (after - before) * sign > 0

    # Advantages on observation tokens (loss_mask 0) must not change the gradient.
    model = load_model(tiny_model_dir)
    trajectory = trajectory_with_model_logprobs(model, tiny_tokenizer, mask)
    grads = []
    for noise in (0.0, 5.0):
        advantages = [1.0 if bit else noise for bit in mask]
        batch = padded_batch([trajectory], [advantages], tiny_tokenizer.pad_token_id, torch.device("cpu"))
        model.zero_grad()
        policy_loss(model, None, batch, settings, normaliser=1.0)["loss_tensor"].backward()
        grads.append(model.model.embed_tokens.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1])

def test_micro_batches_accumulate_to_the_gradient_of_one_batch(tiny_model_dir, tiny_tokenizer):
    """Micro-batches differ in width and in where completions start; their summed gradients must not."""
    model = load_model(tiny_model_dir)
    masks = [[1, 1], [1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1], [1, 0, 1]]
    trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in masks]
    trajectories[1].tokens.prompt_ids = trajectories[1].tokens.prompt_ids[3:]  # a shorter prompt
    advantages = [[(-1.0) ** i * 0.5 * bit for bit in mask] for i, mask in enumerate(masks)]
    pad = tiny_tokenizer.pad_token_id
    for estimator in ("grpo", "dr_grpo", "rloo"):
        settings = RLSettings(estimator=estimator)
        normaliser = loss_normaliser(trajectories, estimator, token_budget=16)
        grads = []
        for size in (4, 1):
            model.zero_grad()
            for first in range(0, 4, size):
                batch = padded_batch(trajectories[first : first + size], advantages[first : first + size], pad,
                              torch.device("cpu"))
                policy_loss(model, None, batch, settings, normaliser)["loss_tensor"].backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert grads[0].abs().sum() > 0
        assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4), estimator

def test_off_policy_correction_weights_each_token_by_the_truncated_importance_ratio(tiny_model_dir, other_model_dir,
                                                                                     tiny_tokenizer):
    trainer, sampler = load_model(tiny_model_dir).train(), load_model(other_model_dir)
    masks = [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]]
    sampled, trainer_lp = sampled_by(sampler, trainer, tiny_tokenizer, masks)
    advantages = [[0.7 * bit for bit in masks[0]], [-0.4 * bit for bit in masks[1]]]
    settings = RLSettings(importance_cap=1.5)
    pad = tiny_tokenizer.pad_token_id
    batch = padded_batch(sampled, advantages, pad, torch.device("cpu"), trainer_lp)

    trainer.zero_grad()
    policy_loss(trainer, None, batch, settings, normaliser=2.0)["loss_tensor"].backward()
    corrected = torch.cat([p.grad.flatten() for p in trainer.parameters()])

    # By hand: the ratio against the trainer's own logprobs is 1 before any step, so each token's gradient is
    # -A * w * grad(log p) with w = min(p_trainer / p_sampler, cap), a sequence mean per rollout (grpo).
    trainer.zero_grad()
    start = batch["completion_start"]
    logprobs, _ = token_logprobs(trainer, batch["input_ids"], batch["attention_mask"], start, 1.0)
    mask, sampler_lp = batch["loss_mask"][:, start:], batch["old_logprobs"][:, start:]
    weight = torch.exp(batch["trainer_logprobs"][:, start:] - sampler_lp).clamp(max=1.5)
    assert ((weight < 1.5) & (mask > 0)).any() and ((weight == 1.5) & (mask > 0)).any(), "some weights capped"
    per_token = -(weight * batch["advantages"][:, start:] * logprobs)
    ((per_token * mask).sum(-1) / mask.sum(-1)).sum().div(2.0).backward()
    by_hand = torch.cat([p.grad.flatten() for p in trainer.parameters()])
    assert corrected.abs().sum() > 0 and torch.allclose(corrected, by_hand, atol=1e-6, rtol=1e-4)

    trainer.zero_grad()  # uncorrected: the sampler's logprobs as the old policy, a different gradient
    policy_loss(trainer, None, padded_batch(sampled, advantages, pad, torch.device("cpu")), settings, 2.0)[
        "loss_tensor"].backward()
    assert not torch.allclose(torch.cat([p.grad.flatten() for p in trainer.parameters()]), by_hand, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model_dir, tiny_tokenizer):
    trajectories = [trajectory_with_model_logprobs(load_model(tiny_model_dir), tiny_tokenizer, [1] * n) for n in (4, 6)]
    batch = padded_batch(trajectories, [[0.5] * 4, [-0.5] * 6], tiny_tokenizer.pad_token_id, torch.device("cpu"))
    results = []
    for checkpointing in (False, True):
        model = load_model(tiny_model_dir).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = policy_loss(model, None, batch, RLSettings(), normaliser=2.0)["loss_tensor"]
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss, grad), (checkpointed_loss, checkpointed_grad) = results
    assert checkpointed_loss == pytest.approx(loss, abs=1e-6)
    assert grad.abs().sum() > 0 and torch.allclose(checkpointed_grad, grad, atol=1e-6, rtol=1e-4)
