"""transformers backend: batches the turns of concurrent episodes into one ``model.generate`` call.

Episodes submit requests independently; a single worker drains the queue, groups requests with the same sampling
settings into a left-padded batch, and runs generation on one long-lived thread so tools of other episodes keep
running. Each row samples from its own stream, seeded by its request (``sampling.SeededDraws``), so batching never
changes what an episode samples. Each turn feeds only the tokens the model has not read yet: the key/value states of
every episode's history, and of the head all prompts of a batch share, are kept between calls (see ``prefix_cache``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import statistics
import threading
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from trajlab.inference.base import GenerationRequest, GenerationResult, SamplingParams
from trajlab.inference.batching import BatchingGenerator, PendingRequest
from trajlab.inference.hf_states import (
    BatchLayout,
    batch_cache,
    prefix_length,
    row_states,
    supports_prefix_reuse,
    weights_version,
)
from trajlab.inference.pixels import image_inputs
from trajlab.inference.prefix_cache import CachedPrefix, PrefixCache
from trajlab.inference.sampling import SeededDraws, generation_config, sampling_logprobs, sampling_processors
from trajlab.models.devices import release_freed_memory

MIN_SHARED_PREFIX = 16
"""A batch's common head shorter than this is fed per row: reading it once would save less than it costs."""


class _StopAbandoned(StoppingCriteria):
    """Ends the rows whose request nobody waits for any more; generate stops when every row has ended."""

    def __init__(self, abandoned: list[threading.Event]) -> None:
        self.abandoned = abandoned

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.tensor([event.is_set() for event in self.abandoned], device=input_ids.device)


class HFGenerator(BatchingGenerator):
    """Generator over a transformers causal LM.

    Args:
        model: the policy, in eval mode.
        tokenizer: its tokenizer (used for the pad id only; generation works on ids).
        max_batch_size: the most turns generated together.
        batch_wait_s: a batch that is not full starts once no new request has arrived for this long...
        max_wait_s: ...or once this long has passed since its first request (see ``BatchingGenerator``).
        reuse_prefixes: keep key/value states between calls so a turn feeds only its new tokens. States are dropped
            whenever a parameter changes in place (an optimizer step), so a generator can serve RL across updates.
            Off for models whose cache cannot be cut per row (sliding-window or recurrent layers).
        prefix_cache_bytes: memory for kept states; the least recently used are dropped first.
        processor: a vision-language model's processor: requests with images get its image inputs (and read their
            whole prompt: no kept states).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int,
        batch_wait_s: float = 0.01,
        max_wait_s: float = 0.1,
        reuse_prefixes: bool = True,
        prefix_cache_bytes: int = 1 << 30,
        name: str = "hf",
        processor: Any = None,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, max_wait_s=max_wait_s)
        self.model = model
        self.processor = processor
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.name = name
        # One long-lived thread for every batch: a fresh thread per event loop (asyncio.to_thread's executor ends
        # with each asyncio.run, e.g. each RL step) pays for a new malloc arena and OpenMP team on every batch.
        self._compute = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajlab-hf")
        self.reuse_prefixes = reuse_prefixes and supports_prefix_reuse(model)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        # Reading ahead needs states, not logits: a real vocabulary makes full logits the largest tensor by far.
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._last_logit_only = {"logits_to_keep": 1} if keeps else {}
        self._states_version: tuple[int, ...] = ()
        self.generated_tokens = 0
        self.fed_tokens = 0
        self.batches = 0

    async def _run_batch(self, batch: list[PendingRequest]) -> list[GenerationResult]:
        """On the generator's own thread; the rows of abandoned requests stop generating early."""
        return await asyncio.get_running_loop().run_in_executor(
            self._compute, self._generate_batch, [p.request for p in batch], [p.abandoned for p in batch])

    def _take_batch(self) -> list[PendingRequest]:
        """The oldest request and those queued with the same sampling settings: one ``generate`` call samples
        all its rows alike."""
        key = _batch_key(self._queue[0].request.params)
        batch = [p for p in self._queue if _batch_key(p.request.params) == key][: self.max_batch_size]
        self._queue = [p for p in self._queue if p not in batch]
        return batch

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest],
                        abandoned: list[threading.Event]) -> list[GenerationResult]:
        params = requests[0].params
        max_new_tokens = max(r.params.max_new_tokens for r in requests)
        prompts = [r.prompt_ids for r in requests]
        images = [image for request in requests for image in request.images]
        prefixes = [None] * len(prompts) if images else self._reusable_prefixes(prompts)
        layout = BatchLayout.of(prompts, prefixes)
        input_ids, attention_mask = layout.inputs(prompts, self.pad_id)
        recorder = ChosenLogprobs()
        # the recorder sees the distribution sampled from; the heap is trimmed as generation goes
        processors = [*sampling_processors(params), recorder, _ReleaseFreedMemory()]
        if params.temperature > 0:  # each row draws from its own stream: the same tokens whatever shares the batch
            seeds = [r.seed if r.seed is not None else int(torch.randint(1 << 62, ())) for r in requests]
            processors.append(SeededDraws(seeds, self.model.device))
        states = batch_cache(self.model, prefixes, layout, room=layout.width - layout.cached_width + max_new_tokens)
        output = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention_mask.to(self.model.device),
            past_key_values=states,
            generation_config=generation_config(params, max_new_tokens=max_new_tokens, pad_id=self.pad_id,
                                                return_dict_in_generate=True),
            logits_processor=LogitsProcessorList(processors),
            stopping_criteria=StoppingCriteriaList([_StopAbandoned(abandoned)]),
            **image_inputs(self.model, self.processor, images, input_ids),
        )
        new_tokens = output.sequences[:, layout.width:].cpu()  # (B, N)
        logprobs = recorder.logprobs(output.sequences[:, layout.width:]).cpu()  # (B, N)
        self.batches += 1
        self.fed_tokens += int(attention_mask[:, layout.cached_width:].sum())
        results = [self._cut(new_tokens[row].tolist(), logprobs[row].tolist(), request.params)
                   for row, request in enumerate(requests)]
        if self.reuse_prefixes and not images:  # each row's prompt and generated tokens but the last (unread)
            for row, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
                kept = result.token_ids[:-1]
                layers = row_states(output.past_key_values, row, layout.columns(row, len(prompt), len(kept)))
                self.prefix_cache.add(CachedPrefix((*prompt, *kept), layers))
        return results

    def _reusable_prefixes(self, prompts: list[list[int]]) -> list[CachedPrefix | None]:
        """Per prompt, the longest prefix whose states are known: its own earlier turn, or the batch's shared head;
        prompts with far more new tokens than the rest are read ahead so they do not pad every row of the batch."""
        if not self.reuse_prefixes:
            return [None] * len(prompts)
        version = weights_version(self.model)
        if version != self._states_version:  # states computed by other weights are wrong, not just stale
            self.prefix_cache.clear()
            self._states_version = version
        prefixes = [self.prefix_cache.longest(p) for p in prompts]
        shared = self._shared_prefix(prompts, prefixes)
        prefixes = [shared if shared and prefix_length(p) < len(shared.token_ids) else p for p in prefixes]
        new = [len(p) - prefix_length(prefix) for p, prefix in zip(prompts, prefixes, strict=True)]
        limit = max(MIN_SHARED_PREFIX, 2 * statistics.median(new))
        behind = [row for row, n in enumerate(new) if n > limit]
        if behind:
            caught_up = self._read([prompts[row][:-1] for row in behind], [prefixes[row] for row in behind])
            for row, prefix in zip(behind, caught_up, strict=True):
                prefixes[row] = prefix
        return prefixes

    def _shared_prefix(self, prompts: list[list[int]], found: list[CachedPrefix | None]) -> CachedPrefix | None:
        """The head every prompt of the batch shares (system prompt, tool schemas), read once for all of them."""
        head = os.path.commonprefix(prompts)
        length = min(len(head), *(len(p) - 1 for p in prompts))
        if length < MIN_SHARED_PREFIX or sum(prefix_length(f) < length for f in found) < 2:
            return None
        return self.prefix_cache.get(tuple(head[:length])) or self._read([head[:length]], [None])[0]

    def _read(self, sequences: list[list[int]], prefixes: list[CachedPrefix | None]) -> list[CachedPrefix]:
        """Run sequences through the model after their known prefixes, without generating; keep their states."""
        layout = BatchLayout.of(sequences, prefixes)
        input_ids, attention_mask = layout.inputs(sequences, self.pad_id)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, layout.cached_width:]
        device = self.model.device
        output = self.model(
            input_ids=input_ids[:, layout.cached_width:].to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            past_key_values=batch_cache(self.model, prefixes, layout, room=layout.width - layout.cached_width),
            use_cache=True,
            **self._last_logit_only,
        )
        self.fed_tokens += int(attention_mask[:, layout.cached_width:].sum())
        entries = [CachedPrefix(tuple(sequence), row_states(output.past_key_values, row,
                                                             layout.columns(row, len(sequence))))
                   for row, sequence in enumerate(sequences)]
        for entry in entries:
            self.prefix_cache.add(entry)
        return entries

    def _cut(self, tokens: list[int], logprobs: list[float], params: SamplingParams) -> GenerationResult:
        """One row's tokens up to and including its first stop token; padding is never guessed from token ids."""
        stops = set(params.stop_token_ids)
        end = next((i + 1 for i, token in enumerate(tokens) if token in stops), None)
        if end is not None and end <= params.max_new_tokens:
            result = GenerationResult(tokens[:end], logprobs[:end], "stop")
        else:
            limit = min(len(tokens), params.max_new_tokens)
            result = GenerationResult(tokens[:limit], logprobs[:limit], "length")
        self.generated_tokens += len(result.token_ids)
        return result


TRIM_EVERY_STEPS = 16
"""Generation steps between two trims of the C heap (:class:`_ReleaseFreedMemory`)."""


class _ReleaseFreedMemory(LogitsProcessor):
    """Every ``TRIM_EVERY_STEPS`` steps, the heap's freed pages back to the system (:func:`release_freed_memory`):
    each step frees (B, V) logits buffers between the key/value states it grows, and without trimming a 256-token turn
    of 16 rows on Qwen3's vocabulary kept about 1 GB resident."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps += 1
        if self.steps % TRIM_EVERY_STEPS == 0:
            release_freed_memory()
        return scores


class ChosenLogprobs(LogitsProcessor):
    """Keeps each generated token's log-probability under the distribution it was sampled from, not the step's logits.

    ``output_scores`` would keep a (B, V) float32 tensor per step, gigabytes for long turns with a real vocabulary.
    This processor comes after trajlab's sampling warpers (``sampling_processors``: temperature, top-k, top-p) and
    before the draw's noise (``SeededDraws``), so it sees the very distribution sampled from; it reduces the previous
    step's distribution to the token that was sampled from it (now the last of ``input_ids``) and holds one step's
    log-softmax: memory O(B x N), not O(B x N x V).
    """

    def __init__(self) -> None:
        self.chosen: list[torch.Tensor] = []  # (B,) per step already decided
        self.pending: torch.Tensor | None = None  # (B, V): the newest step's log-softmax, its token not yet known

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:
            self.chosen.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = sampling_logprobs(scores)
        return scores

    def logprobs(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, N) log-probabilities of the ``new_tokens`` (B, N) that generate returned."""
        steps = new_tokens.shape[1]
        if len(self.chosen) < steps and self.pending is not None:  # the last step's token never came back as input
            self.chosen.append(self.pending.gather(-1, new_tokens[:, len(self.chosen), None]).squeeze(-1))
        self.pending = None
        if not steps:
            return torch.zeros(new_tokens.shape)
        return torch.stack(self.chosen[:steps], dim=1)


def _batch_key(params: SamplingParams) -> tuple[float, float, int, tuple[int, ...]]:
    return (params.temperature, params.top_p, params.top_k, params.stop_token_ids)
