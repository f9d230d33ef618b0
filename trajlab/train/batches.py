"""A micro-batch of rollouts as tensors, and the per-token results of its forward pass cut back per rollout."""

from __future__ import annotations

from typing import Any

import torch

from trajlab.rollout.types import Trajectory


def rollout_lengths(trajectories: list[Trajectory], indices: list[int]) -> dict[int, int]:
    """Each indexed rollout's sequence length (prompt and completion tokens): what its row in a batch spans."""
    return {i: len(trajectories[i].tokens.prompt_ids) + len(trajectories[i].tokens.completion_ids) for i in indices}


def micro_batches(order: list[int], lengths: dict[int, int], rows: int, tokens: int | None, *,
                  packed: bool = False) -> list[list[int]]:
    """``order`` (rollout indices, sorted by length so padding stays small) cut into consecutive micro-batches of at
    most ``rows`` rollouts and, with ``tokens``, at most that many tokens: padded (rows x the longest row's length)
    or, ``packed``, the sum of the lengths. Activation memory follows tokens, not rollouts. A rollout longer than
    ``tokens`` goes alone."""
    batches: list[list[int]] = []
    for index in order:
        current = batches[-1] if batches else []
        if packed:
            size = lengths[index] + sum(lengths[i] for i in current)
        else:
            size = (len(current) + 1) * max([lengths[index], *(lengths[i] for i in current)])
        if current and len(current) < rows and (tokens is None or size <= tokens):
            current.append(index)
        else:
            batches.append([index])
    return batches


def _rows(trajectories: list[Trajectory], advantages: list[list[float]],
          trainer_logprobs: list[list[float]] | None) -> list[tuple[list, ...]]:
    """Each rollout's per-token columns over its whole sequence: token ids, loss mask, sampler logprobs, advantages,
    trainer logprobs (prompt positions 0).

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
    return rows


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
    logits are needed there; ``scored`` marks the completion tokens, the only ones whose logprobs are computed.
    ``sequence`` numbers each token's rollout (its row); ``completions`` says where each
    rollout's completion starts in the (B, T - completion_start) results: (row, column). ``images`` are the rows'
    images in their placeholders' order.

    Raises:
        ValueError: a model token has no sampler logprob (a backend that returned none cannot be trained on).
    """
    rows = _rows(trajectories, advantages, trainer_logprobs)
    width = max(len(row[0]) for row in rows)

    def column(index: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row[index] + [fill] * (width - len(row[index])) for row in rows], dtype=dtype,
                            device=device)

    attention = torch.tensor([[1] * len(row[0]) + [0] * (width - len(row[0])) for row in rows], device=device)
    start = min(len(t.tokens.prompt_ids) for t in trajectories)
    batch = {
        "input_ids": column(0, pad_id, torch.long),
        "attention_mask": attention,
        "loss_mask": column(1, 0, torch.float32),
        "old_logprobs": column(2, 0.0, torch.float32),
        "advantages": column(3, 0.0, torch.float32),
        "completion_start": start,
        "scored": torch.tensor([[len(t.tokens.prompt_ids) <= i < len(row[0]) for i in range(width)]
                                for row, t in zip(rows, trajectories, strict=True)], device=device),
        "sequence": torch.arange(len(rows), device=device).unsqueeze(1).expand(-1, width),
        "completions": [(row, len(t.tokens.prompt_ids) - start) for row, t in enumerate(trajectories)],
        "images": [t.image(image_id) for t in trajectories for image_id in t.images],  # rows' placeholders' order
    }
    if trainer_logprobs is not None:
        batch["trainer_logprobs"] = column(4, 0.0, torch.float32)
    return batch


def packed_batch(
    trajectories: list[Trajectory],
    advantages: list[list[float]],
    device: torch.device,
    trainer_logprobs: list[list[float]] | None = None,
) -> dict[str, Any]:
    """The rollouts one after another in a single (1, T) row, no padding: ``position_ids`` restart at 0 with each
    rollout, from which the model's attention keeps every rollout to itself (a block-diagonal causal mask; varlen
    kernels on a GPU), so each token's logprob is the one it has alone. The columns are :func:`padded_batch`'s;
    ``completion_start`` is 1 (position t - 1 predicts token t; a rollout's first token, a prompt token, is the only
    one predicted across a boundary and carries no loss), ``scored`` marks the completion tokens, the only ones whose
    logprobs are computed.

    Raises:
        ValueError: a rollout with images (their inputs follow rows, not packed segments), or as :func:`_rows`.
    """
    if any(t.images for t in trajectories):
        raise ValueError("rollouts with images train in padded batches (rl.padding_free: false).")
    rows = _rows(trajectories, advantages, trainer_logprobs)
    offsets = [0]
    for row in rows[:-1]:
        offsets.append(offsets[-1] + len(row[0]))

    def column(index: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([[value for row in rows for value in row[index]]], dtype=dtype, device=device)

    prompts = [len(t.tokens.prompt_ids) for t in trajectories]
    batch = {
        "input_ids": column(0, torch.long),
        "attention_mask": None,
        "position_ids": torch.tensor([[p for row in rows for p in range(len(row[0]))]], device=device),
        "loss_mask": column(1, torch.float32),
        "old_logprobs": column(2, torch.float32),
        "advantages": column(3, torch.float32),
        "completion_start": 1,
        "scored": torch.tensor([[i >= prompt for row, prompt in zip(rows, prompts, strict=True)
                                 for i in range(len(row[0]))]], device=device),
        "sequence": torch.tensor([[n for n, row in enumerate(rows) for _ in row[0]]], device=device),
        "completions": [(0, offset + prompt - 1) for offset, prompt in zip(offsets, prompts, strict=True)],
        "images": [],
    }
    if trainer_logprobs is not None:
        batch["trainer_logprobs"] = column(4, torch.float32)
    return batch


def by_rollout(logprobs: torch.Tensor, batch: dict[str, Any], chosen: list[int],
               trajectories: list[Trajectory]) -> dict[int, list[float]]:
    """A batch's per-token results (B, T - completion_start) cut back into each rollout's completion tokens, by the
    rollouts' indexes ``chosen`` (the batch's order)."""
    out = {}
    for (row, column), index in zip(batch["completions"], chosen, strict=True):
        out[index] = logprobs[row, column : column + len(trajectories[index].tokens.completion_ids)].tolist()
    return out
