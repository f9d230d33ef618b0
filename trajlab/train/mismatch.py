"""How far the sampler's log-probabilities are from the trainer's on the tokens it sampled.

Another engine (vLLM), older weights (asynchronous RL) or merely other kernels sample tokens whose log-probabilities
the trainer computes differently; the step's metrics say how much (``mismatch/...``), and the truncated importance
weight of the update corrects for it (:mod:`trajlab.train.loss`).
"""

from __future__ import annotations

from typing import Any

import torch


class MismatchSums:
    """Token sums of the sampler-trainer mismatch over a step's model tokens.

    With the sampler's logprob s and the trainer's t of each sampled token: mean |t - s|; the KL from sampler to
    trainer by the k3 estimator (exp(t - s) - (t - s) - 1, unbiased under the sampler's samples, never negative);
    and the share of tokens whose importance weight exp(t - s) exceeds the cap. Sums, so several processes' add up.
    """

    def __init__(self, abs_logprob: float = 0.0, kl: float = 0.0, clipped: float = 0.0, tokens: float = 0.0) -> None:
        self.abs_logprob, self.kl, self.clipped, self.tokens = abs_logprob, kl, clipped, tokens

    def sums(self) -> list[float]:
        return [self.abs_logprob, self.kl, self.clipped, self.tokens]

    def add(self, trainer: torch.Tensor, batch: dict[str, Any], cap: float) -> None:
        """Count a batch's model tokens, with the trainer's logprobs (B, T - completion_start) of them."""
        start = batch["completion_start"]
        sampler = batch["old_logprobs"][:, start:]
        own = sampler.isnan()  # a token no sampler made (a replayed demonstration's): no mismatch to measure
        mask = batch["loss_mask"][:, start:] * ~own
        delta = torch.where(own, 0.0, trainer.detach() - sampler)
        self.abs_logprob += (delta.abs() * mask).sum().item()
        self.kl += ((torch.exp(delta) - delta - 1) * mask).sum().item()
        self.clipped += ((torch.exp(delta) > cap).float() * mask).sum().item()
        self.tokens += mask.sum().item()

    def means(self) -> dict[str, float]:
        """The step's ``mismatch/...`` metrics (none when no token was counted)."""
        if not self.tokens:
            return {}
        return {"mismatch/abs_logprob": self.abs_logprob / self.tokens, "mismatch/kl": self.kl / self.tokens,
                "mismatch/clipped_share": self.clipped / self.tokens}
