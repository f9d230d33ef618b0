"""The distribution a turn is sampled from, exactly as configured.

A checkpoint's ``generation_config.json`` may set a repetition penalty, an n-gram ban, a minimum length, its own
temperature or top-k; ``model.generate`` would fill every option a passed config leaves unset from it, changing what
is sampled while the recorded logprobs, and the RL ratio built on them, assume trajlab's settings. The hf backend's
own loop (``hf_decode``) reads none of it: the only logits processors are :func:`sampling_processors`: temperature,
then top-k, then top-p, transformers' own warpers in the order ``generate`` would apply them. The scores they return
are the tensor sampled from, so a token's recorded logprob is ``log_softmax`` of those scores: the log-probability
under the renormalised, truncated distribution it was drawn from (with top-k 0 and top-p 1, plain
``log_softmax(logits / temperature)``). Greedy turns record the model's own ``log_softmax(logits)``.

The draw itself is :class:`SeededDraws`: each row of a batch has its own random stream, seeded per request, so what
an episode samples depends on its seed alone, not on which other episodes shared its batches, in what order
requests arrived, or what ran before in the process. Rollouts are then reproducible run to run (the same seed gives
the same trajectories) and a retried or rescheduled episode samples what it would have sampled the first time.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trajlab.inference.base import SamplingParams


def sampling_processors(params: SamplingParams) -> LogitsProcessorList:
    """The warpers that turn a step's logits (B, V) into the scores sampled from: none when greedy."""
    if params.temperature <= 0:
        return LogitsProcessorList()
    processors: list[Any] = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    return LogitsProcessorList(processors)


def sampling_logprobs(scores: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (..., V) of the distribution sampled from, given its processed scores; tokens
    top-k or top-p cut have -inf."""
    return torch.log_softmax(scores.float(), dim=-1)


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), one per (seed, counter) pair: splitmix64's output function over ``seed + counter x
    golden`` (int64 arithmetic wraps), vectorised, so every value depends on its seed and counter only."""
    z = seeds + counters * _GOLDEN
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    z = z ^ _shift(z, 31)
    return (_shift(z, 11).double() + 0.5) / float(1 << 53)


class SeededDraws(LogitsProcessor):
    """Samples each row from its own random stream: row r's token at step t is drawn by inverting the cumulative
    distribution of ``softmax(scores[r])`` at a counter-based uniform of (``seeds[r]``, t) (:func:`counter_uniforms`).
    The returned scores keep only the drawn token (the rest -inf), so their argmax is the draw, and a
    row samples the same tokens whichever rows share its batch. One uniform per row per step: the draw costs a
    softmax and a cumulative sum, not vocabulary-sized noise.

    Its input is the warped scores (whose logprobs are recorded); :meth:`select` follows rows leaving the batch.
    """

    def __init__(self, seeds: list[int], device: torch.device | str) -> None:
        self.seeds = torch.tensor(seeds, dtype=torch.int64, device=device)[:, None]
        self.step = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        uniform = counter_uniforms(self.seeds.to(scores.device), torch.tensor([[self.step]], device=scores.device))
        self.step += 1
        cdf = torch.softmax(scores.float(), dim=-1).cumsum(-1)
        # the first token whose cumulative mass reaches u (> 0): never one the scores gave no probability
        drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1:]).float()).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -torch.inf).scatter_(-1, drawn, 0.0)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the streams of ``rows`` only, in that order: the other rows left the batch."""
        self.seeds = self.seeds[rows.to(self.seeds.device)]
