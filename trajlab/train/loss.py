"""The clipped policy-gradient loss of a micro-batch of rollouts, with the optional KL to the starting policy.

Per model token: the PPO-clipped ratio of the trainer's logprob to the old policy's, times the token's advantage;
when another engine sampled (``trainer_logprobs`` in the batch), the ratio is taken against the trainer's own
logprobs before the update and the token is weighted by the truncated importance weight min(p_trainer / p_sampler,
cap). The token losses are reduced so that summing micro-batches equals the loss of their whole minibatch.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from trajlab.config import RLSettings
from trajlab.rollout.types import Trajectory
from trajlab.train.logprobs import batch_logprobs

OWN_LOGPROB = float("nan")
"""The sampler logprob of a token no sampler made (a replayed demonstration's): the trained model's own before the
update's first optimizer step stands in, taken in that step's pass when the update makes one, else computed before it
(:meth:`~trajlab.train.update.PolicyUpdate.__call__`), so the ratio starts at 1 and the importance weight is 1."""


def loss_normaliser(trajectories: list[Trajectory], estimator: str, token_budget: int) -> float:
    """What a minibatch's summed loss is divided by, so accumulating micro-batches equals one big batch.

    grpo sums per-sequence token means (divide by sequences); dr_grpo divides the token sum by a constant budget per
    sequence (no length bias); rloo averages over every model token of the minibatch.
    """
    if estimator == "grpo":
        return float(len(trajectories))
    if estimator == "dr_grpo":
        return float(len(trajectories) * token_budget)
    return float(max(1, sum(sum(t.tokens.loss_mask) for t in trajectories)))


def policy_loss(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    batch: dict[str, Any],
    settings: RLSettings,
    normaliser: float,
    processor: Any = None,
) -> dict[str, Any]:
    """The micro-batch's loss (``loss_tensor``, to backpropagate), its statistics (``loss``, ``kl``, ``entropy``,
    ``clip_fraction``) and the trainer's logprobs of its completion tokens (``trainer_logprobs``, detached).

    ``reference``: the frozen starting policy of the KL term; None with a KL term means the policy is a PEFT model
    whose disabled adapter is the starting policy. ``processor``: a vision-language model's, for the batch's images.
    """
    start = batch["completion_start"]
    mask = batch["loss_mask"][:, start:]  # (B, L): model tokens only
    sampler = batch["old_logprobs"][:, start:]
    advantages = batch["advantages"][:, start:]
    corrected = "trainer_logprobs" in batch
    old = batch["trainer_logprobs"][:, start:] if corrected else sampler

    logprobs, entropy = batch_logprobs(policy, batch, settings.temperature, processor)  # (B, L) each
    own = sampler.isnan()  # OWN_LOGPROB: no sampler; the trainer's own before the update stands in (weight 1)
    if own.any():
        old = old if corrected else torch.where(own, logprobs.detach(), old)
        sampler = torch.where(own, old, sampler)

    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 1 - settings.clip_eps, 1 + settings.clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if corrected:  # truncated importance sampling: the tokens came from the sampler, not from `old`
        per_token = per_token * torch.exp(old - sampler).clamp(max=settings.importance_cap)

    kl = torch.zeros_like(per_token)
    if settings.kl_coef > 0:
        with torch.no_grad(), (policy.disable_adapter() if reference is None else nullcontext()):
            ref_model = policy if reference is None else reference
            ref_logprobs, _ = batch_logprobs(ref_model, batch, settings.temperature, processor)
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3 estimator: unbiased, always >= 0
        per_token = per_token + settings.kl_coef * kl

    if settings.estimator == "grpo":  # each sequence's token mean; the normaliser counts sequences
        sequence = batch["sequence"][:, start:].reshape(-1)  # a packed row holds several
        count = len(batch["completions"])
        sums = per_token.new_zeros(count).index_add(0, sequence, (per_token * mask).reshape(-1))
        tokens = mask.new_zeros(count).index_add(0, sequence, mask.reshape(-1))
        loss = (sums / tokens.clamp(min=1)).sum() / normaliser
    else:  # dr_grpo and rloo: a token sum over a constant (dr_grpo) or the minibatch's token count (rloo)
        loss = (per_token * mask).sum() / normaliser

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clip_fraction = (((ratio - 1).abs() > settings.clip_eps).float() * mask).sum() / n
        stats = {
            "loss": loss.item(),
            "kl": ((kl * mask).sum() / n).item(),
            "entropy": ((entropy * mask).sum() / n).item(),
            "clip_fraction": clip_fraction.item(),
        }
    return stats | {"loss_tensor": loss, "trainer_logprobs": logprobs.detach()}
