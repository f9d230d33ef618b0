"""Chosen-token log-probabilities and entropies without a (batch, length, vocab) tensor, and the forward pass that
gives them for a batch of rollouts, padded (:func:`token_logprobs`) or packed into one row (:func:`packed_logprobs`).

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
    only its hidden states and is recomputed in the backward pass. Only the log-probabilities carry gradients. A
    plain linear head (:func:`_plain_linear`) accumulates its weight's gradient in one buffer (:class:`_LinearHead`);
    any other (soft-capped, adapted, sharded) is checkpointed slice by slice, each slice's weight gradient a buffer
    of its own until it is added up: one more (V, H) tensor at the peak.
    """
    width = chunk_tokens or CHUNK_TOKENS
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    if recompute and hidden.shape[0] and _plain_linear(head):
        return _LinearHead.apply(hidden, head.weight, head.bias, targets, temperature, width)
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
    logprobs, entropy, top1, _ = (torch.cat(column) for column in zip(*pieces, strict=True))
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
    return chosen, entropy, top1, norm.detach()


def _plain_linear(head: Head) -> bool:
    """A plain ``nn.Linear`` whose whole weight is here (not sharded away, not a tensor subclass)."""
    return (type(head) is torch.nn.Linear and type(head.weight) is torch.nn.Parameter
            and head.weight.shape == (head.out_features, head.in_features))


class _LinearHead(torch.autograd.Function):
    """:func:`head_statistics` of a linear head, slice by slice, keeping only the hidden states and each token's
    log-normaliser for the backward pass, which recomputes each slice's logits and adds its weight gradient into one
    float32 (V, H) buffer."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, width: int) -> tuple[torch.Tensor, ...]:
        pieces = [_slice(lambda h: torch.nn.functional.linear(h, weight, bias), hidden[begin : begin + width],
                         targets[begin : begin + width], temperature) for begin in range(0, hidden.shape[0], width)]
        chosen, entropy, top1, norm = (torch.cat(column) for column in zip(*pieces, strict=True))
        ctx.save_for_backward(hidden, weight, bias, targets, norm)
        ctx.temperature, ctx.width = temperature, width
        ctx.device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.dtype = torch.get_autocast_dtype(ctx.device_type) if autocast else None
        ctx.mark_non_differentiable(entropy, top1)
        return chosen, entropy, top1

    @staticmethod
    def backward(ctx: Any, grad_chosen: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, norm = ctx.saved_tensors
        wanted = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wanted[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if wanted[2] else None
        for begin in range(0, hidden.shape[0], ctx.width):
            rows = slice(begin, begin + ctx.width)
            with torch.autocast(ctx.device_type, dtype=ctx.dtype, enabled=ctx.dtype is not None):  # as forward ran
                logits = torch.nn.functional.linear(hidden[rows], weight, bias).float() / ctx.temperature  # (l, V)
            # d log p(target) / d logits = (onehot(target) - softmax) / temperature, times the incoming gradient
            grad = logits.sub_(norm[rows].unsqueeze(-1)).exp_().mul_(-grad_chosen[rows].unsqueeze(-1))
            grad.scatter_add_(-1, targets[rows].unsqueeze(-1), grad_chosen[rows].unsqueeze(-1))
            grad.div_(ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad @ weight.float()).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), hidden[rows].float())
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


MIN_SHARED_HEAD = 16
"""Rows sharing fewer leading tokens than this are run in full: one extra forward pass would cost more."""


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, start: int, temperature: float,
    images: Sequence[Any] = (), processor: Any = None, scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (B, T - start) of the tokens from ``start`` on at the sampling temperature, and the entropy
    of each position's distribution.

    The model returns final hidden states, and the output head turns them into log-probabilities a slice at a time
    (:func:`chosen_logprobs`): logits over the full vocabulary never exist for the whole batch. Only positions from
    ``start`` on are read: the prompt needs none. The head all rows share (system prompt, tool schemas: often half
    of every sequence) is run once and its key/value states broadcast to every row; gradients flow back through the
    broadcast, so the result equals running each row in full. ``images`` (those whose placeholders the rows hold, in
    order) reach the model as they reached the sampler; rows with images are run in full. ``scored`` (B, T): the
    tokens whose results are wanted (the completions); the others' are 0 and cost no output-head work.
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
    if scored is None:
        return chosen_logprobs(hidden, output_head(model), input_ids[:, start:], temperature)
    return _scored_only(hidden, output_head(model), input_ids[:, start:], scored[:, start:], temperature)


def _scored_only(hidden: torch.Tensor, head: Head, targets: torch.Tensor, scored: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chosen_logprobs` of the ``scored`` targets (B, L) only, 0 elsewhere: the output head, the costliest
    layer with a real vocabulary, never runs on padding or prompt tokens."""
    rows, columns = scored.nonzero(as_tuple=True)
    logprobs, entropy, _ = head_statistics(hidden[rows, columns], head, targets[rows, columns], temperature)
    empty = torch.zeros(targets.shape, dtype=logprobs.dtype, device=logprobs.device)
    return empty.index_put((rows, columns), logprobs), empty.index_put((rows, columns), entropy)


def batch_logprobs(model: torch.nn.Module, batch: dict[str, Any], temperature: float,
                   processor: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` of a padded batch, or :func:`packed_logprobs` of a packed one
    (:mod:`trajlab.train.batches`): (B, T - completion_start) log-probabilities and entropies either way."""
    if batch.get("position_ids") is None:
        return token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_start"],
                              temperature, batch["images"], processor, batch.get("scored"))
    return packed_logprobs(model, batch["input_ids"], batch["position_ids"], batch["scored"], temperature)


def packed_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    scored: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities and entropies (1, T - 1) of the tokens of a packed row (1, T) (position t - 1 predicts
    token t), computed for the ``scored`` tokens only (the completions; 0 elsewhere).

    No attention mask: the model derives one from ``position_ids``, which restart at 0 with each sequence, so every
    sequence attends to itself alone (transformers builds a block-diagonal causal mask for sdpa and eager attention;
    flash attention runs the sequences as variable-length ones).
    """
    hidden = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1,
                   output_hidden_states=True).hidden_states[-1]  # (1, T, H)
    return _scored_only(hidden[:, :-1], output_head(model), input_ids[:, 1:], scored[:, 1:], temperature)


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
