"""One RL step's optimizer steps on the real tiny model: rollouts without advantage skipped with the step unchanged,
the trainer's logprobs recomputed when another engine sampled, the mismatch logged."""

import math

import pytest
import torch
from accelerate import Accelerator

from trajlab.config import RLSettings
from trajlab.models.loading import load_model
from trajlab.train.batches import padded_batch
from trajlab.train.loss import loss_normaliser, policy_loss
from trajlab.train.replay import without_sampler_logprobs
from trajlab.train.update import PolicyUpdate

from .rollouts import sampled_by, trajectory_with_model_logprobs


def test_rollouts_without_advantage_are_skipped_and_the_step_is_unchanged(tiny_model_dir, tiny_tokenizer):
    masks = [[1, 1, 1], [1, 1, 1, 1], [1, 1]]
    advantages = [[0.5] * 3, [0.0] * 4, [-0.5] * 2]  # the middle rollout's group had no signal
    settings = RLSettings(estimator="grpo", max_grad_norm=1e6)
    pad = tiny_tokenizer.pad_token_id
    weights, stats = [], {}
    for skipping in (True, False):
        model = load_model(tiny_model_dir).train()
        trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in masks]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if skipping:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
            update = PolicyUpdate(model, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16, pad)
            stats, _ = update(trajectories, advantages, correct=False, shuffle_seed=0)
        else:  # every rollout through the loss, as one batch
            batch = padded_batch(trajectories, advantages, pad, torch.device("cpu"))
            normaliser = loss_normaliser(trajectories, "grpo", 16)
            policy_loss(model, None, batch, settings, normaliser)["loss_tensor"].backward()
            optimizer.step()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert stats["trained_sequences"] == 2
    assert not torch.equal(weights[0], torch.cat([p.flatten() for p in load_model(tiny_model_dir).parameters()]))
    assert torch.allclose(weights[0], weights[1], atol=1e-6)

def test_update_recomputes_the_trainers_logprobs_and_logs_the_mismatch(tiny_model_dir, other_model_dir,
                                                                        tiny_tokenizer):
    masks = [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1], [1, 1]]
    advantages = [[0.5] * 5, [-0.5] * 6, [0.0] * 2]
    settings = RLSettings(importance_cap=1.5)
    pad = tiny_tokenizer.pad_token_id
    for sampler_dir in (other_model_dir, tiny_model_dir):
        trainer = load_model(tiny_model_dir).train()
        sampled, trainer_lp = sampled_by(load_model(sampler_dir), trainer, tiny_tokenizer, masks)
        delta = torch.tensor([t - s.tokens.logprobs[i] for s, lps in zip(sampled, trainer_lp, strict=True)
                              for i, t in enumerate(lps) if s.tokens.loss_mask[i]])
        optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        stats, logprobs = {}, {}
        for correct in (True, False):
            update = PolicyUpdate(trainer, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16, pad)
            stats[correct], logprobs[correct] = update(sampled, advantages, correct=correct, shuffle_seed=0)
            trainer.load_state_dict(load_model(tiny_model_dir).state_dict())
        # The rollout without advantage trains on nothing: neither measured nor recomputed, with or without correction.
        trained = torch.tensor([bool(any(a)) for a, s in zip(advantages, sampled, strict=True)
                                for bit in s.tokens.loss_mask if bit])
        delta = delta[trained]
        measured = stats[True]
        assert measured["mismatch/abs_logprob"] == pytest.approx(delta.abs().mean().item(), abs=1e-5)
        assert measured["mismatch/kl"] == pytest.approx((delta.exp() - delta - 1).mean().item(), abs=1e-5)
        assert measured["mismatch/clipped_share"] == pytest.approx((delta.exp() > 1.5).float().mean().item())
        if sampler_dir == tiny_model_dir:  # on-policy: nothing to correct
            assert measured["mismatch/abs_logprob"] < 1e-5 and measured["mismatch/clipped_share"] == 0.0
        else:
            assert measured["mismatch/abs_logprob"] > 0.1 and measured["mismatch/clipped_share"] > 0.0
        assert sorted(logprobs[True]) == sorted(logprobs[False]) == [0, 1], "recomputed only for what trains"
        # Without the correction the mismatch is still measured, on the rollouts trained before the first step.
        assert stats[False]["mismatch/abs_logprob"] == pytest.approx(delta.abs().mean().item(), abs=1e-5)


def test_a_rate_scale_moves_the_weights_as_that_fraction_of_the_rate_and_does_not_stick(tiny_model_dir,
                                                                                       tiny_tokenizer):
    """Plain SGD moves the weights in proportion to the rate: a step scaled by 0.25 at rate 0.1 lands where an
    unscaled step at 0.025 does, and the optimizer's rate is the scheduler's again after it (a scale never
    compounds from one RL step to the next)."""
    masks, advantages = [[1, 1, 1], [1, 1]], [[0.5] * 3, [-0.5] * 2]
    settings, pad, moved = RLSettings(max_grad_norm=1e6), tiny_tokenizer.pad_token_id, []
    start = torch.cat([p.detach().flatten() for p in load_model(tiny_model_dir).parameters()])
    for rate, scale in ((0.1, 0.25), (0.025, 1.0)):
        model = load_model(tiny_model_dir).train()
        trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in masks]
        optimizer = torch.optim.SGD(model.parameters(), lr=rate)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        update = PolicyUpdate(model, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16, pad)
        update(trajectories, advantages, correct=False, shuffle_seed=0, rate_scale=scale)
        assert optimizer.param_groups[0]["lr"] == rate
        moved.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - start)
    assert moved[0].abs().max() > 1e-6
    assert torch.allclose(moved[0], moved[1], rtol=1e-4, atol=1e-8)


def test_a_step_at_rate_zero_skips_its_passes_and_keeps_the_schedule(tiny_model_dir, tiny_tokenizer):
    """A rate scale of 0 (``rl.rate_by_failures`` on a step whose rollouts all succeeded) moves no weight: the update
    runs no pass and no optimizer step, so the weights and Adam's moments stay as they were, while the schedule
    advances by the optimizer steps the update would have taken (2 epochs x 2 minibatches here), so the next step
    trains at the rate it would have had."""
    masks, advantages = [[1, 1, 1], [1, 1], [1, 1, 1, 1], [1, 1]], [[0.5] * 3, [-0.5] * 2, [0.5] * 4, [-0.5] * 2]
    settings = RLSettings(minibatch_size=2, epochs_per_step=2)
    model = load_model(tiny_model_dir).train()
    trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in masks]
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0 / (1 + done))
    update = PolicyUpdate(model, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16,
                          tiny_tokenizer.pad_token_id)
    stats, logprobs = update(trajectories, advantages, correct=True, shuffle_seed=0, rate_scale=0.0)
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), start)
    assert not optimizer.state, "no optimizer step: Adam's moments untouched"
    assert stats["trained_sequences"] == 0 and logprobs == {}
    assert scheduler.last_epoch == 4 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 5)
    update(trajectories, advantages, correct=False, shuffle_seed=1, rate_scale=1.0)
    assert scheduler.last_epoch == 8 and optimizer.state
    assert not torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), start)


def test_a_step_with_no_usable_rollout_keeps_the_schedule_as_a_step_at_rate_zero_does(tiny_model_dir,
                                                                                     tiny_tokenizer):
    """A step whose rollouts have no token to train (every one dropped: errors, drift) makes no optimizer step, and
    the schedule still passes the steps the run planned for it (2 epochs x 2 minibatches of the 2 x 2 rollouts), so
    the next step's rate is the one the plan gives it and a decaying rate still reaches 0 at the last step."""
    settings = RLSettings(tasks_per_step=2, group_size=2, minibatch_size=2, epochs_per_step=2)
    model = load_model(tiny_model_dir).train()
    trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, [0, 0, 0]) for _ in range(4)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0 / (1 + done))
    update = PolicyUpdate(model, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16,
                          tiny_tokenizer.pad_token_id)
    stats, logprobs = update(trajectories, [[0.0] * 3] * 4, correct=False, shuffle_seed=0)
    assert stats["trained_sequences"] == 0 and logprobs == {} and not optimizer.state
    assert scheduler.last_epoch == 4 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 5)

@pytest.mark.parametrize(("settings", "correct"), [
    (RLSettings(max_grad_norm=1e6), False),
    (RLSettings(max_grad_norm=1e6, minibatch_size=2, epochs_per_step=2), False),
    (RLSettings(max_grad_norm=1e6, minibatch_size=2, epochs_per_step=2), True),
], ids=["one optimizer step", "four optimizer steps", "four steps, another engine sampled"])
def test_tokens_no_sampler_made_take_the_models_own_logprobs_before_the_update(tiny_model_dir, tiny_tokenizer,
                                                                              settings, correct):
    """Replayed demonstrations carry NaN sampler logprobs (``without_sampler_logprobs``): the update trains them as if
    their sampler logprobs were the model's own before its first optimizer step (taken from the first pass with one
    step, computed first with several, whose later ratios are clipped against them; with the off-policy correction,
    an importance weight of 1), and leaves them out of the sampler-trainer mismatch."""
    masks, advantages = [[1, 1, 1], [1, 1], [1, 1, 1, 1], [1, 1]], [[0.5] * 3, [-0.5] * 2, [0.5] * 4, [-0.5] * 2]
    weights, stats = [], []
    for replayed in (False, True):
        model = load_model(tiny_model_dir).train()
        trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in masks]
        if replayed:
            without_sampler_logprobs(trajectories[1:3])
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # large: the later ratios leave the clip range
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        update = PolicyUpdate(model, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16,
                              tiny_tokenizer.pad_token_id)
        stats.append(update(trajectories, advantages, correct=correct, shuffle_seed=0)[0])
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # the same up to the two ways' float rounding of the logprobs (2e-6), grown by four steps at this rate
    assert torch.allclose(weights[0], weights[1], atol=1e-3)
    assert stats[1]["clip_fraction"] == pytest.approx(stats[0]["clip_fraction"])
    assert all(math.isfinite(value) for value in stats[1].values())
    if settings.minibatch_size:
        assert stats[0]["clip_fraction"] > 0, "the later steps' ratios left the clip range: their 'old' policy counts"
