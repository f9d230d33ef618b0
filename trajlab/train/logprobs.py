"""Chosen-token log-probabilities and entropies without a (batch, length, vocab) tensor, and the forward pass that
gives them for a batch of rollouts (:func:`token_logprobs`).

With a real vocabulary (Qwen3: 151,936 tokens) the float32 log-softmax of one 8k-token sequence is 5 GB, and autograd
would keep it for the backward pass. Here the output head runs on a bounded slice of positions at a time: a slice's
logits live only while they are reduced to one log-probability and one entropy per position, and the backward pass
recomputes them slice by slice (activation checkpointing) instead of keeping them. Memory grows with the sequence
length (hidden states, one number per position), never with length x vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from trajlab.inference.pixels import image_inputs

CHUNK_TOKENS = 128
"""Tokens (over the whole micro-batch, however many rows it has) whose logits exist at once: 128 x 151,936 x 4 bytes
= 78 MB in float32, a few such buffers at the peak of a slice's backward pass (BENCHMARKS.md, "Memory": 256 cost
0.3-0.4 GB more at the peak)."""

Head = Callable[[torch.Tensor], torch.Tensor]
"""Maps hidden states (..., H) to logits (..., V): the model's output layer."""


def chosen_logprobs(
    hidden: torch.Tensor,
    head: Head,
    targets: torch.Tensor,
    temperature: float,
    *,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (B, L) of ``targets`` (B, L) under ``head(hidden) / temperature``, and the entropies (B, L)
    of those distributions.

    ``hidden`` (B, L, H) holds the final hidden states of the positions that predict ``targets``. The result equals
    ``log_softmax(head(hidden).float() / temperature).gather(targets)``, with the same gradients; the entropy is a
    statistic and carries none. The rows are sliced as one sequence of B x L tokens (:func:`head_statistics`).
    """
    rows, length = targets.shape
    logprobs, entropy, _ = head_statistics(hidden.reshape(rows * length, hidden.shape[-1]), head,
                                           targets.reshape(-1), temperature, chunk_tokens=chunk_tokens)
    return logprobs.view(rows, length), entropy.view(rows, length)


def head_statistics(
    hidden: torch.Tensor,
    head: Head,
    targets: torch.Tensor,
    temperature: float,
    *,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of ``hidden`` (N, H) and ``targets`` (N,): the target's log-probability under ``head(hidden) /
    temperature`` (N,), the distribution's entropy (N,) and whether the target is its first most likely token (N,).

    The head runs on ``chunk_tokens`` tokens at a time (default ``CHUNK_TOKENS``); under autograd each slice keeps
    only its hidden states and is recomputed in the backward pass. Only the log-probabilities carry gradients.
    """
    width = chunk_tokens or CHUNK_TOKENS
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    pieces = []
    for begin in range(0, hidden.shape[0], width):
        piece = (hidden[begin : begin + width], targets[begin : begin + width])
        if recompute:  # keep only the slice's hidden states for backward; its logits are computed again there
            pieces.append(checkpoint(_slice, head, *piece, temperature, use_reentrant=False))
        else:
            pieces.append(_slice(head, *piece, temperature))
    if not pieces:  # no tokens: empty results, still in the graph, so a loss over none of them backpropagates
        empty = hidden.sum(-1, dtype=torch.float32)  # (0,)
        return empty, empty.detach(), torch.zeros_like(targets, dtype=torch.bool)
    logprobs, entropy, top1 = (torch.cat(column) for column in zip(*pieces, strict=True))
    return logprobs, entropy, top1


def _slice(head: Head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    logits = head(hidden).float()  # (l, V): the only vocabulary-wide tensor, one slice at a time
    if temperature != 1.0:
        logits = logits / temperature
    norm = logits.logsumexp(-1)  # (l,)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    with torch.no_grad():  # H = log Z - sum p * logits, in place: one more (l, V) buffer at most
        top1 = logits.argmax(-1) == targets
        probs = (logits - norm.unsqueeze(-1)).exp_()
        entropy = norm - probs.mul_(logits).sum(-1)
    return chosen, entropy, top1


MIN_SHARED_HEAD = 16
"""Rows sharing fewer leading tokens than this are run in full: one extra forward pass would cost more."""


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, start: int, temperature: float,
    images: Sequence[Any] = (), processor: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (B, T - start) of the tokens from ``start`` on at the sampling temperature, and the entropy
    of each position's distribution.

    The model returns final hidden states, and the output head turns them into log-probabilities a slice at a time
    (:func:`chosen_logprobs`): logits over the full vocabulary never exist for the whole batch. Only positions from
    ``start`` on are read: the prompt needs none. The head all rows share (system prompt, tool schemas: often half
    of every sequence) is run once and its key/value states broadcast to every row; gradients flow back through the
    broadcast, so the result equals running each row in full. ``images`` (those whose placeholders the rows hold, in
    order) reach the model as they reached the sampler; rows with images are run in full.
    """
    checkpointing = model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    # checkpointed layers keep no key/value states; image inputs go with the whole sequence
    head = 0 if checkpointing or images else shared_head(input_ids, start)
    last = {"logits_to_keep": 1, "output_hidden_states": True}  # one position of logits: the head is applied below
    if not head:
        pixels = image_inputs(unwrap(model), processor, images, input_ids)
        hidden = model(input_ids=input_ids, attention_mask=attention, use_cache=False, **last, **pixels
                       ).hidden_states[-1]
    else:
        rows, width = input_ids.shape
        states = model(input_ids=input_ids[:1, :head], use_cache=True, logits_to_keep=1).past_key_values
        broadcast = [(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
                     for layer in states.layers]
        positions = torch.arange(head, width, device=input_ids.device).expand(rows, -1)
        hidden = model(input_ids=input_ids[:, head:], attention_mask=attention, position_ids=positions,
                       past_key_values=DynamicCache(ddp_cache_data=broadcast, config=model.config), **last
                       ).hidden_states[-1]
    hidden = hidden[:, start - 1 - head : input_ids.shape[1] - 1 - head]  # (B, L, H): position t predicts t + 1
    return chosen_logprobs(hidden, output_head(model), input_ids[:, start:], temperature)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model a DistributedDataParallel wrapper holds (itself otherwise)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def output_head(model: torch.nn.Module) -> Head:
    """The model's hidden-states-to-logits layer, with the logit soft-capping some families (Gemma 2) apply."""
    inner = unwrap(model)
    linear = inner.get_output_embeddings()
    cap = getattr(inner.config.get_text_config(), "final_logit_softcapping", None)
    if not cap:
        return linear
    return lambda hidden: torch.tanh(linear(hidden) / cap) * cap


def shared_head(input_ids: torch.Tensor, start: int) -> int:
    """How many leading tokens every row shares, up to the first position whose logits are needed (0: not worth
    sharing, or several processes: DDP, FSDP and DeepSpeed expect one forward pass per backward pass)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if input_ids.shape[0] < 2 or (distributed and torch.distributed.get_world_size() > 1):
        return 0
    differs = (input_ids[:, : start - 1] != input_ids[:1, : start - 1]).any(0).nonzero()
    head = int(differs[0]) if len(differs) else start - 1
    return head if head >= MIN_SHARED_HEAD else 0
