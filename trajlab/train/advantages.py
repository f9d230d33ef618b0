"""Advantage estimators over groups of rollouts of the same task.

Trajectory-level: one number per rollout, compared with the other rollouts of its group.
- ``grpo``: (r - mean) / (std + eps)                      (Shao et al. 2024)
- ``dr_grpo``: r - mean, no std scaling                    (Liu et al. 2025, "Dr. GRPO")
- ``rloo``: r - mean of the *other* rollouts               (Ahmadian et al. 2024)

Turn-level: each model turn gets the return-to-go of the per-turn rewards from that turn on, baselined against the
same turn index of the other rollouts in the group, and that advantage is credited to that turn's tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Estimator = Literal["grpo", "dr_grpo", "rloo"]
EPS = 1e-4


def group_advantages(rewards: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """Advantages of one group of rewards, shape (G,) -> (G,)."""
    if rewards.numel() < 2:
        raise ValueError("a group needs at least 2 rollouts to have a baseline")
    if torch.all(rewards == rewards[0]):  # no signal; the rounded mean would leave noise (std + eps scales it up)
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean()
    if estimator == "grpo":
        return centered / (rewards.std() + EPS)
    if estimator == "dr_grpo":
        return centered
    if estimator == "rloo":
        n = rewards.numel()
        return centered * n / (n - 1)  # r_i - mean_{j != i} r_j
    raise ValueError(f"unknown estimator {estimator!r}; use grpo, dr_grpo or rloo")


def turn_rewards_with_terminal(turn_rewards: Sequence[float], total: float, dense_weight: float) -> list[float]:
    """Per-turn rewards for credit: weighted dense rewards per turn, the rest of the total on the last turn."""
    rewards = [dense_weight * r for r in turn_rewards] or [0.0]
    rewards[-1] += total - sum(rewards)
    return rewards


def returns_to_go(rewards: Sequence[float]) -> list[float]:
    out, running = [], 0.0
    for reward in reversed(rewards):
        running += reward
        out.append(running)
    return out[::-1]


def group_turn_advantages(turn_rewards: Sequence[Sequence[float]], estimator: Estimator) -> list[list[float]]:
    """Per-turn advantages for one group: return-to-go at turn t against the group's returns at turn t.

    Rollouts that ended before turn t do not enter turn t's baseline; a turn index that only one rollout reached
    is compared with the whole group's returns at that rollout's last shared turn instead of with itself.
    """
    returns = [returns_to_go(r) for r in turn_rewards]
    longest = max(len(r) for r in returns)
    advantages: list[list[float]] = [[0.0] * len(r) for r in returns]
    for t in range(longest):
        members = [i for i, r in enumerate(returns) if len(r) > t]
        if len(members) < 2:
            for i in members:  # nothing to compare with at this depth: reuse the advantage of the turn before
                advantages[i][t] = advantages[i][t - 1] if t > 0 else 0.0
            continue
        values = group_advantages(torch.tensor([returns[i][t] for i in members]), estimator)
        for i, value in zip(members, values.tolist(), strict=True):
            advantages[i][t] = value
    return advantages


def turn_starts(loss_mask: Sequence[int]) -> list[int]:
    """Where each model turn starts in the completion: the turns of :func:`spread_over_turns`, runs of loss-mask
    1s."""
    return [i for i, bit in enumerate(loss_mask) if bit and (i == 0 or not loss_mask[i - 1])]


def spread_over_turns(loss_mask: Sequence[int], per_turn: Sequence[float]) -> list[float]:
    """Token advantages: the t-th contiguous run of model tokens gets ``per_turn[t]``; other tokens get 0."""
    out, turn, previous = [], -1, 0
    for bit in loss_mask:
        if bit and not previous:
            turn += 1
        out.append(per_turn[min(turn, len(per_turn) - 1)] if bit else 0.0)
        previous = bit
    return out
