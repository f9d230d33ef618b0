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

from trajlab.config import RLSettings
from trajlab.rewards import weight_of
from trajlab.rollout.types import Trajectory

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


def _loss_mask(trajectory: Trajectory) -> list[int]:
    """The trajectory's model-token mask; for one kept a sample per turn, its samples' masks one after another."""
    if trajectory.branches is not None:
        return [bit for branch in trajectory.branches for bit in branch.loss_mask]
    return trajectory.tokens.loss_mask if trajectory.tokens else []


def _spread(trajectory: Trajectory, mask: list[int], per_turn: Sequence[float]) -> list[float]:
    """Turn advantages onto tokens: by runs of model tokens, or (one sample per turn) sample k gets turn k's."""
    if trajectory.branches is None:
        return spread_over_turns(mask, per_turn)
    return [per_turn[min(k, len(per_turn) - 1)] * bit for k, branch in enumerate(trajectory.branches)
            for bit in branch.loss_mask]


def step_advantages(
    trajectories: list[Trajectory], rewards: list[float], settings: RLSettings,
    turn_rewards: Sequence[Sequence[float]] | None = None,
) -> tuple[list[list[float]], dict[str, float]]:
    """Token advantages per trajectory, and the step's group statistics. A trajectory kept a sample per turn gets
    its samples' advantages one after another (:func:`trajlab.rollout.samples.split_advantages` cuts them apart).

    Rollouts are compared within their ``Trajectory.group``, over the group's valid rollouts only: one that ended
    with status ``error`` (the machinery failed, not the policy) has no reward to compare, gets no advantage and
    counts in no group's statistics; a group left with fewer than two valid rollouts has nothing to compare and is
    skipped. With ``credit: turn``, ``turn_rewards`` are each trajectory's weighted per-turn rewards
    (:class:`trajlab.rewards.Scores`; None: the ``progress`` weight times the env's dense rewards), the rest of its
    total on its last turn. Statistics: the share of groups whose rewards were all equal (no signal), groups
    computed over fewer rollouts than were run, groups skipped.

    Raises:
        ValueError: a trajectory has no group.
    """
    groups: dict[str, list[int]] = {}
    for index, trajectory in enumerate(trajectories):
        if trajectory.group is None:
            raise ValueError(f"trajectory {trajectory.id!r} has no group: RL compares rollouts within a group")
        groups.setdefault(trajectory.group, [])
        if trajectory.status != "error":
            groups[trajectory.group].append(index)
    out: list[list[float]] = [[0.0] * len(_loss_mask(t)) for t in trajectories]
    flat = short = skipped = 0
    if turn_rewards is None:
        dense = weight_of(settings.rewards.get("progress", 0.0))
        turn_rewards = [[dense * r for r in t.turn_rewards or []] for t in trajectories]
    for members in groups.values():
        short += len(members) < settings.group_size
        if len(members) < 2:
            skipped += 1
            continue
        group_rewards = torch.tensor([rewards[i] for i in members])
        flat += bool(torch.all(group_rewards == group_rewards[0]))
        masks = [_loss_mask(trajectories[i]) for i in members]
        if settings.credit == "trajectory":
            values = group_advantages(group_rewards, settings.estimator).tolist()
            for i, mask, value in zip(members, masks, values, strict=True):
                out[i] = [value * bit for bit in mask]
            continue
        per_turn = [
            turn_rewards_with_terminal(turn_rewards[i], rewards[i], 1.0) for i in members
        ]
        for i, mask, turn_values in zip(members, masks, group_turn_advantages(per_turn, settings.estimator),
                                        strict=True):
            out[i] = _spread(trajectories[i], mask, turn_values)
    compared = len(groups) - skipped
    return out, {"zero_variance_groups": flat / max(1, compared), "groups_short": float(short),
                 "groups_skipped": float(skipped)}
