"""Chosen-token log-probabilities and entropies without a (batch, length, vocab) tensor.

With a real vocabulary (Qwen3: 151,936 tokens) the float32 log-softmax of one 8k-token sequence is 5 GB, and autograd
would keep it for the backward pass. Here the output head runs on a bounded slice of positions at a time: a slice's
logits live only while they are reduced to one log-probability and one entropy per position, and the backward pass
recomputes them slice by slice (activation checkpointing) instead of keeping them. Memory grows with the sequence
length (hidden states, one number per position), never with length x vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 128
"""Positions (over the whole batch) whose logits exist at once: 128 x 151,936 x 4 bytes = 78 MB in float32, a few
such buffers at the peak of a slice's backward pass (BENCHMARKS.md, "Memory": 256 cost 0.3-0.4 GB more at the peak)."""

Head = Callable[[torch.Tensor], torch.Tensor]
"""Maps hidden states (B, l, H) to logits (B, l, V): the model's output layer."""


def chosen_logprobs(
    hidden: torch.Tensor,
    head: Head,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (B, L) of ``targets`` (B, L) under ``head(hidden) / temperature``, and the entropies (B, L)
    of those distributions.

    ``hidden`` (B, L, H) holds the final hidden states of the positions that predict ``targets``. The result equals
    ``log_softmax(head(hidden).float() / temperature).gather(targets)``, with the same gradients; the entropy is a
    statistic and carries none. ``chunk_tokens`` defaults to ``CHUNK_TOKENS``.
    """
    width = max(1, (chunk_tokens or CHUNK_TOKENS) // max(1, hidden.shape[0]))  # positions per slice
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    pieces = []
    for begin in range(0, hidden.shape[1], width):
        piece = (hidden[:, begin : begin + width], targets[:, begin : begin + width])
        if recompute:  # keep only the slice's hidden states for backward; its logits are computed again there
            pieces.append(checkpoint(_slice, head, *piece, temperature, use_reentrant=False))
        else:
            pieces.append(_slice(head, *piece, temperature))
    if not pieces:
        empty = hidden.new_zeros(targets.shape, dtype=torch.float32)
        return empty, empty
    logprobs, entropy = zip(*pieces, strict=True)
    return torch.cat(logprobs, dim=1), torch.cat(entropy, dim=1)


def _slice(head: Head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    logits = head(hidden).float()  # (B, l, V): the only vocabulary-wide tensor, one slice at a time
    if temperature != 1.0:
        logits = logits / temperature
    norm = logits.logsumexp(-1)  # (B, l)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    with torch.no_grad():  # H = log Z - sum p * logits, in place: one more (B, l, V) buffer at most
        probs = (logits - norm.unsqueeze(-1)).exp_()
        entropy = norm - probs.mul_(logits).sum(-1)
    return chosen, entropy
