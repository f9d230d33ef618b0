"""Logged demonstrations trained beside each RL step's rollouts, weighted by how their reward compares with the log's.

Why: demonstrations trained on as logged (a weaker model's runs, a noisy trace, failures included) teach SFT their
mistakes as well as their successes, and the SFT model then samples few successes of its own: on inventory with 30%
noise, 0.09 of its first RL rollouts succeed, so its groups mostly compare failures, and RL's greedy answers hardly
move (BENCHMARKS.md, issue 45). The log itself holds what RL is missing: every demonstration's reward. Replayed with
an advantage against the whole log's rewards (one group of every demonstration, as GRPO compares a task's rollouts),
a successful demonstration is pulled up and a failed one pushed down, on its own turns when credit is per turn. This
is RL from off-policy demonstrations as LUFFY and advantage-weighted regression do it, not SFT: the failures'
tokens get negative weight.

A demonstration's "old" logprobs (the ratio's denominator) are the trained model's own before the step's update, so
its first pass is a plain policy gradient and later passes are clipped like any rollout's, and an importance
correction weighs it 1: the demonstrator's own probabilities are not known. With one optimizer step a step they are
the update's own pass's, not a pass of their own (:data:`~trajlab.train.loss.OWN_LOGPROB`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trajlab.config import RLSettings
from trajlab.rewards import RewardSet
from trajlab.rollout.types import Trajectory
from trajlab.train.advantages import step_advantages
from trajlab.train.loss import OWN_LOGPROB

GROUP = "demonstrations"
"""The group every replayed demonstration is compared within: the whole log."""
MIN_REPLAYABLE = 2
"""A replay compares its demonstrations with each other: one alone has no baseline."""


class DemonstrationReplay:
    """The log's demonstrations with their token advantages; ``draw`` gives a step's share.

    Args:
        demonstrations: the logged episodes (their token ids kept; drift-checked by the caller); only the
            :func:`replayable` ones are trained on.
        rewards: the run's rewards, applied to the demonstrations as to rollouts.
        settings: ``replay_demonstrations`` (how many a step), ``replay_weighting``, ``replay_below_baseline``,
            ``estimator`` and ``credit``.
        seed: which demonstrations each step draws (the same on every process and on resume).

    Raises:
        ValueError: fewer than two usable demonstrations, or none with model tokens.
    """

    def __init__(self, demonstrations: Sequence[Trajectory], rewards: RewardSet, settings: RLSettings,
                 seed: int) -> None:
        usable = [t.model_copy(update={"group": GROUP}) for t in replayable(demonstrations)]
        if len(usable) < MIN_REPLAYABLE:
            raise ValueError(f"rl.replay_demonstrations needs at least {MIN_REPLAYABLE} demonstrations with model "
                             f"tokens to compare; {len(usable)} of the {len(demonstrations)} given have them "
                             f"(rl.replay_demonstrations: 0 trains without them)")
        scores = rewards.score(usable)
        self.advantages, _ = step_advantages(usable, scores.totals, settings, turn_rewards=scores.turns)
        if settings.replay_weighting == "sign":
            self.advantages = [[float((a > 0) - (a < 0)) for a in row] for row in self.advantages]
        if not settings.replay_below_baseline:  # self-imitation: only what did better than the log's average
            self.advantages = [[max(a, 0.0) for a in row] for row in self.advantages]
        self.demonstrations, self.rewards = usable, scores.totals
        self.per_step, self.seed = settings.replay_demonstrations, seed

    def draw(self, step: int) -> tuple[list[Trajectory], list[list[float]]]:
        """The step's demonstrations (copies, without their logprobs yet) and their token advantages."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        chosen = torch.randperm(len(self.demonstrations), generator=generator)[: self.per_step].tolist()
        return [self.demonstrations[i].model_copy(deep=True) for i in chosen], [self.advantages[i] for i in chosen]

    def metrics(self, advantages: Sequence[Sequence[float]]) -> dict[str, float]:
        """The log's mean reward and the drawn demonstrations' mean token advantage (negative: mostly failures)."""
        tokens = [a for row in advantages for a in row if a]
        return {"replay/demonstrations": float(len(advantages)), "replay/log_reward_mean":
                sum(self.rewards) / len(self.rewards), "replay/advantage_mean": sum(tokens) / max(1, len(tokens))}


def replayable(demonstrations: Sequence[Trajectory]) -> list[Trajectory]:
    """The demonstrations a replay can train on: not errored (their reward says nothing of their actions), with
    model tokens."""
    return [t for t in demonstrations if t.status != "error" and t.tokens is not None and any(t.tokens.loss_mask)]


def without_sampler_logprobs(demonstrations: list[Trajectory]) -> list[Trajectory]:
    """The demonstrations with NaN as their model tokens' sampler logprobs: no sampler made them (the demonstrator's
    own probabilities are not known), so the update takes the trained model's own before its first optimizer step as
    the ratio's denominator (:class:`~trajlab.train.update.PolicyUpdate`)."""
    for trajectory in demonstrations:
        trajectory.tokens.logprobs = [OWN_LOGPROB] * len(trajectory.tokens.completion_ids)
    return demonstrations
