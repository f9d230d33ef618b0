"""The distribution a turn is sampled from, and how ``model.generate`` is told to sample from exactly that.

A checkpoint's ``generation_config.json`` may set a repetition penalty, an n-gram ban, a minimum length, its own
temperature or top-k; ``model.generate`` fills every option a passed config leaves unset from it. Any of them would
change what is sampled while the recorded logprobs, and the RL ratio built on them, assume trajlab's settings. So
generation runs with :class:`ExplicitGenerationConfig`, which takes nothing from the checkpoint, and the only logits
processors are :func:`sampling_processors`: temperature, then top-k, then top-p, transformers' own warpers in the
order ``generate`` would apply them. The scores they return are the tensor ``generate`` samples from, so a token's
recorded logprob is ``log_softmax`` of those scores: the log-probability under the renormalised, truncated
distribution it was drawn from (with top-k 0 and top-p 1, plain ``log_softmax(logits / temperature)``). Greedy
turns record the model's own ``log_softmax(logits)``.

The draw itself is :class:`SeededDraws`: each row of a batch has its own random stream, seeded per request, so what
an episode samples depends on its seed alone, not on which other episodes shared its batches, in what order
requests arrived, or what ran before in the process. Rollouts are then reproducible run to run (the same seed gives
the same trajectories) and a retried or rescheduled episode samples what it would have sampled the first time.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trajlab.inference.base import SamplingParams


class ExplicitGenerationConfig(GenerationConfig):
    """A generation config that is the whole truth: ``generate`` may not fill its unset options from the model's.

    ``generate`` completes a passed config with ``update(defaults_only=True, ...)`` from the checkpoint's
    generation config and then from transformers' global defaults; this config already holds every global default
    explicitly, so it refuses both.
    """

    def update(self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs: Any) -> dict[str, Any]:
        if defaults_only:
            return kwargs
        return super().update(allow_custom_entries=allow_custom_entries, **kwargs)


def generation_config(
    params: SamplingParams, *, max_new_tokens: int, pad_id: int, **outputs: bool
) -> ExplicitGenerationConfig:
    """How ``generate`` decodes a batch: up to ``max_new_tokens``, stopping at ``params.stop_token_ids`` only; every
    other option is transformers' neutral default, whatever the checkpoint says. ``generate`` itself always takes
    the highest score: sampling is :func:`sampling_processors` shaping the distribution and :class:`SeededDraws`
    perturbing its scores so that the highest is a draw from it, both passed as ``logits_processor``.

    Args:
        outputs: what ``generate`` returns, e.g. ``return_dict_in_generate=True, output_scores=True``.
    """
    explicit = dict(
        do_sample=False,  # SeededDraws makes the argmax a sample
        temperature=1.0,  # applied by sampling_processors, so that scores are what is sampled from
        top_k=0,
        top_p=1.0,
        max_length=None,  # not the global 20: generate would warn that it and max_new_tokens are both set
        max_new_tokens=max_new_tokens,
        eos_token_id=list(params.stop_token_ids) or None,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    return ExplicitGenerationConfig(**(GenerationConfig._get_default_generation_params() | explicit | outputs))


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
    """Log-probabilities (..., V) of the distribution ``generate`` samples from, given its processed scores; tokens
    top-k or top-p cut have -inf."""
    return torch.log_softmax(scores.float(), dim=-1)


class SeededDraws(LogitsProcessor):
    """Samples each row from its own random stream by the Gumbel-max trick: ``argmax(scores + G)`` with G standard
    Gumbel noise is a draw from ``softmax(scores)``, so greedy decoding over the perturbed scores samples exactly the
    distribution the scores define. Row r's noise comes from a generator seeded with ``seeds[r]`` and advanced one
    vocabulary-sized draw per step: a row samples the same tokens whichever rows share its batch.

    Comes after the recorder (``ChosenLogprobs``), which keeps the unperturbed distribution's logprobs.
    """

    def __init__(self, seeds: list[int], device: torch.device | str) -> None:
        self.streams = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=stream, device=scores.device) for stream in self.streams])
        tiny = torch.finfo(uniform.dtype).tiny  # rand may return exactly 0: a very low noise value, not a nan
        gumbel = -torch.log(-torch.log(uniform.clamp_min(tiny)))
        return scores.float() + gumbel
