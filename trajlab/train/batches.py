"""A micro-batch of rollouts as tensors, and the per-token results of its forward pass cut back per rollout."""

from __future__ import annotations

from typing import Any

import torch

from trajlab.rollout.types import Trajectory


def rollout_lengths(trajectories: list[Trajectory], indices: list[int]) -> dict[int, int]:
    """Each indexed rollout's sequence length (prompt and completion tokens): what its row in a batch spans."""
    return {i: len(trajectories[i].tokens.prompt_ids) + len(trajectories[i].tokens.completion_ids) for i in indices}


def micro_batches(order: list[int], lengths: dict[int, int], rows: int, tokens: int | None) -> list[list[int]]:
    """``order`` (rollout indices, sorted by length so padding stays small) cut into consecutive micro-batches of at
    most ``rows`` rollouts and, with ``tokens``, at most that many padded tokens (rows x the longest row's length):
    activation memory follows tokens, not rollouts. A rollout longer than ``tokens`` goes alone."""
    batches: list[list[int]] = []
    for index in order:
        current = batches[-1] if batches else []
        width = max([lengths[index], *(lengths[i] for i in current)])
        if current and len(current) < rows and (tokens is None or (len(current) + 1) * width <= tokens):
            current.append(index)
        else:
            batches.append([index])
    return batches


def padded_batch(
    trajectories: list[Trajectory],
    advantages: list[list[float]],
    pad_id: int,
    device: torch.device,
    trainer_logprobs: list[list[float]] | None = None,
) -> dict[str, Any]:
    """Right-padded (B, T) tensors; padding is marked in attention_mask, never inferred from token ids.

    ``old_logprobs`` are the sampler's; ``trainer_logprobs`` (when given) the trainer's own, recomputed for the
    off-policy correction. ``completion_start`` is the shortest prompt: no position before it carries loss, so no
    logits are needed there. ``images`` are the rows' images in their placeholders' order.

    Raises:
        ValueError: a model token has no sampler logprob (a backend that returned none cannot be trained on).
    """
    rows = []
    for index, (trajectory, advantage) in enumerate(zip(trajectories, advantages, strict=True)):
        tokens = trajectory.tokens
        if any(lp is None for lp, bit in zip(tokens.logprobs, tokens.loss_mask, strict=True) if bit):
            raise ValueError(f"trajectory {trajectory.id!r} has model tokens without the sampler's logprob: RL needs "
                             "them for its ratio; roll out with a backend that returns logprobs (hf, vllm).")
        prompt = len(tokens.prompt_ids)
        trainer = trainer_logprobs[index] if trainer_logprobs is not None else []
        rows.append((
            tokens.prompt_ids + tokens.completion_ids,
            [0] * prompt + tokens.loss_mask,
            [0.0] * prompt + [lp if lp is not None else 0.0 for lp in tokens.logprobs],
            [0.0] * prompt + advantage,
            [0.0] * prompt + trainer,
        ))
    width = max(len(row[0]) for row in rows)

    def column(index: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row[index] + [fill] * (width - len(row[index])) for row in rows], dtype=dtype,
                            device=device)

    attention = torch.tensor([[1] * len(row[0]) + [0] * (width - len(row[0])) for row in rows], device=device)
    batch = {
        "input_ids": column(0, pad_id, torch.long),
        "attention_mask": attention,
        "loss_mask": column(1, 0, torch.float32),
        "old_logprobs": column(2, 0.0, torch.float32),
        "advantages": column(3, 0.0, torch.float32),
        "completion_start": min(len(t.tokens.prompt_ids) for t in trajectories),
        "images": [t.image(image_id) for t in trajectories for image_id in t.images],  # rows' placeholders' order
    }
    if trainer_logprobs is not None:
        batch["trainer_logprobs"] = column(4, 0.0, torch.float32)
    return batch


def by_rollout(logprobs: torch.Tensor, batch: dict[str, Any], chosen: list[int],
               trajectories: list[Trajectory]) -> dict[int, list[float]]:
    """A batch's (B, T - completion_start) logprobs cut back into each rollout's completion tokens, by the rollouts'
    indexes ``chosen`` (row order)."""
    out = {}
    for row, index in enumerate(chosen):
        tokens = trajectories[index].tokens
        offset = len(tokens.prompt_ids) - batch["completion_start"]
        out[index] = logprobs[row, offset : offset + len(tokens.completion_ids)].tolist()
    return out
