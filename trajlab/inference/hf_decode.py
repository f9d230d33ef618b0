"""The hf backend's generation loop, written out instead of ``model.generate`` to bound a batch's memory.

- **Prompts are read in chunks** (:func:`prefill`). One pass over a left-padded batch scores every row's queries
  against all its keys, memory growing with the square of the longest prompt per row: three chat calls of 28,000
  tokens took ``trajlab serve`` past 12 GB. Chunks of columns keep one forward's query-key pairs near
  ``PREFILL_SCORES``, whatever the prompts' lengths.
- **A row leaves the batch when it is done** (:func:`decode`): at its first stop token, at its own
  ``max_new_tokens``, or when nobody waits for it any more. ``generate`` runs every row to the batch's largest
  ``max_new_tokens``: one call asking for 32,000 tokens held the calls batched with it and grew their key/value
  states to its length. Here a finished row's result and states are handed over at once and its rows of the cache
  dropped.

Each step samples exactly as ``sampling`` describes: the configured warpers, the recorded logprob of the token under
the distribution it was drawn from, the draw from the row's own seeded stream, so what a row samples does not depend
on the rows beside it or on when they leave.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import Cache, PreTrainedModel

from trajlab.inference.base import GenerationRequest, GenerationResult
from trajlab.inference.sampling import SeededDraws, sampling_logprobs, sampling_processors
from trajlab.models.devices import release_freed_memory

PREFILL_SCORES = 1 << 22
"""Query-key pairs one prefill forward may score over the whole batch (about 4 million: 100 MB of float32 scores for
6 heads). A batch of ``B`` rows ``W`` columns wide is read ``PREFILL_SCORES // (B x W)`` columns at a time."""

TRIM_EVERY_STEPS = 16
"""Decoding steps between two trims of the C heap (:func:`release_freed_memory`): each step frees (B, V) logits
buffers between the key/value states it grows, and without trimming a 256-token turn of 16 rows on Qwen3's
vocabulary kept about 1 GB resident."""

Leaving = Callable[[int, int, Cache, GenerationResult], None]
"""Called as a row leaves: (request index, its row in the cache now, the cache, its result)."""


def prefill(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int,
            cache: Cache | None, **inputs: Any) -> tuple[torch.Tensor, Cache, torch.Tensor]:
    """Read columns ``start:`` of ``input_ids`` (B, W) after the states ``cache`` holds for the columns before.

    Image inputs (``inputs``) go with the first forward, which then reads everything: a model puts an image's
    embeddings at its placeholders in the ids it is given, so they cannot be split. Returns the last column's (B, V)
    float32 logits, the cache, and the (..., B, W) position ids (the model's own: 3-D for multimodal rotary ones).
    """
    rows, width = input_ids.shape
    device = model.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    positions = model._prepare_position_ids_for_generation(input_ids, {"attention_mask": attention_mask, **inputs})
    step = width - start if inputs else max(1, PREFILL_SCORES // (rows * width))
    # the last column's logits only: a real vocabulary makes full logits the largest tensor by far
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    for begin in range(start, width, step):
        end = min(begin + step, width)
        output = model(input_ids=input_ids[:, begin:end], attention_mask=attention_mask[:, :end],
                       position_ids=positions[..., begin:end], past_key_values=cache, use_cache=True,
                       **last_only, **(inputs if begin == start else {}))
        cache = output.past_key_values
        logits = output.logits[:, -1].float()  # (B, V)
        del output
    return logits, cache, positions


def decode(model: PreTrainedModel, logits: torch.Tensor, cache: Cache, attention_mask: torch.Tensor,
           positions: torch.Tensor, requests: list[GenerationRequest], abandoned: list[threading.Event],
           leaving: Leaving) -> list[GenerationResult]:
    """Generate from the prompts ``prefill`` read: one token per step for the rows still going.

    ``requests`` share their sampling settings but ``max_new_tokens``. A row is done at its first stop token
    ("stop"), at its own ``max_new_tokens`` or once ``abandoned`` ("length"); ``leaving`` then sees it while its
    states are still in ``cache``, the tokens it generated but the last one included, and its rows are dropped.
    """
    params = requests[0].params
    warpers, stops = sampling_processors(params), set(params.stop_token_ids)
    draws = None
    if params.temperature > 0:  # each row draws from its own stream: the same tokens whatever shares the batch
        seeds = [r.seed if r.seed is not None else int(torch.randint(1 << 62, ())) for r in requests]
        draws = SeededDraws(seeds, model.device)
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[float]] = [[] for _ in requests]
    results: list[GenerationResult | None] = [None] * len(requests)
    going = list(range(len(requests)))  # the request of each row of the cache
    attention_mask = attention_mask.to(model.device)
    positions = positions[..., -1:]  # (..., B, 1): the last token read
    step = 0
    while True:
        scores = warpers(None, logits)  # (b, V): the distribution sampled from
        chosen = (scores if draws is None else draws(None, scores)).argmax(-1)  # (b,)
        chosen_logprobs = sampling_logprobs(scores).gather(-1, chosen[:, None]).squeeze(-1)
        for row, (token, logprob) in enumerate(zip(chosen.tolist(), chosen_logprobs.tolist(), strict=True)):
            tokens[going[row]].append(token)
            logprobs[going[row]].append(logprob)
        done = [row for row, index in enumerate(going) if tokens[index][-1] in stops
                or len(tokens[index]) >= requests[index].params.max_new_tokens or abandoned[index].is_set()]
        for row in done:
            index = going[row]
            reason = "stop" if tokens[index][-1] in stops else "length"
            results[index] = GenerationResult(tokens[index], logprobs[index], reason)
            leaving(index, row, cache, results[index])
        if len(done) == len(going):
            return results
        if done:  # the finished rows leave: their states are freed, the batch narrows
            kept = [row for row in range(len(going)) if row not in done]
            select = torch.tensor(kept, device=model.device)
            for layer in cache.layers:
                layer.batch_select_indices(select)
            attention_mask, positions, chosen = attention_mask[select], positions[..., select, :], chosen[select]
            going = [going[row] for row in kept]
            if draws is not None:
                draws.select(select)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(going), 1))], dim=-1)
        positions = positions + 1
        output = model(input_ids=chosen[:, None], attention_mask=attention_mask, position_ids=positions,
                       past_key_values=cache, use_cache=True)
        cache, logits = output.past_key_values, output.logits[:, -1].float()
        del output
        step += 1
        if step % TRIM_EVERY_STEPS == 0:
            release_freed_memory()

