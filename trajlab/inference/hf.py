"""transformers backend: batches the turns of concurrent episodes into one generation loop (``hf_decode``).

Episodes submit requests independently; a single worker drains the queue, groups requests with the same sampling
settings into a left-padded batch, and runs generation on one long-lived thread so tools of other episodes keep
running. A row leaves its batch as soon as it is done, and long prompts are read in chunks, so a batch's memory
follows what its rows still need. Each row samples from its own stream, seeded by its request
(``sampling.SeededDraws``), so batching never changes what an episode samples. Each turn feeds only the tokens the
model has not read yet: the key/value states of every episode's history, and of the head all prompts of a batch
share, are kept between calls (see ``prefix_cache``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import statistics
import threading
from typing import Any

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from trajlab.inference.base import GenerationRequest, GenerationResult, SamplingParams
from trajlab.inference.batching import BatchingGenerator, PendingRequest
from trajlab.inference.hf_decode import decode, prefill
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

MIN_SHARED_PREFIX = 16
"""A batch's common head shorter than this is fed per row: reading it once would save less than it costs."""

DECODE_ROOM = 256
"""Generated tokens a batch's key/value states have room for at first; rows that go on grow them by doubling. Room
for every row's ``max_new_tokens`` up front held 32,000 columns for each row batched with a 32,000-token call."""


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
        self._states_version: tuple[int, ...] = ()
        self.generated_tokens = 0
        self.fed_tokens = 0
        self.batches = 0

    async def _run_batch(self, batch: list[PendingRequest]) -> list[GenerationResult]:
        """On the generator's own thread; the rows of abandoned requests stop generating early."""
        return await asyncio.get_running_loop().run_in_executor(
            self._compute, self._generate_batch, [p.request for p in batch], [p.abandoned for p in batch])

    def _take_batch(self) -> list[PendingRequest]:
        """The oldest request and those queued with the same sampling settings: one batch samples all its
        rows alike."""
        key = _batch_key(self._queue[0].request.params)
        batch = [p for p in self._queue if _batch_key(p.request.params) == key][: self.max_batch_size]
        self._queue = [p for p in self._queue if p not in batch]
        return batch

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest],
                        abandoned: list[threading.Event]) -> list[GenerationResult]:
        prompts = [r.prompt_ids for r in requests]
        images = [image for request in requests for image in request.images]
        prefixes = [None] * len(prompts) if images else self._reusable_prefixes(prompts)
        layout = BatchLayout.of(prompts, prefixes)
        input_ids, attention_mask = layout.inputs(prompts, self.pad_id)
        # room for the tokens to feed and the first generated ones; the rest is grown into only if rows get there
        longest = min(max(r.params.max_new_tokens for r in requests), DECODE_ROOM)
        states = batch_cache(self.model, prefixes, layout, room=layout.width - layout.cached_width + longest)
        logits, states, positions = prefill(self.model, input_ids, attention_mask, layout.cached_width, states,
                                            **image_inputs(self.model, self.processor, images, input_ids))
        self.fed_tokens += int(attention_mask[:, layout.cached_width:].sum())
        keep = self.reuse_prefixes and not images

        def leaving(index: int, row: int, cache: Cache, result: GenerationResult) -> None:
            self.generated_tokens += len(result.token_ids)
            if keep:  # the row's prompt and generated tokens but the last (unread)
                prompt, kept = prompts[index], result.token_ids[:-1]
                layers = row_states(cache, row, layout.columns(index, len(prompt), len(kept)))
                self.prefix_cache.add(CachedPrefix((*prompt, *kept), layers))

        results = decode(self.model, logits, states, attention_mask, positions, requests, abandoned, leaving)
        self.batches += 1
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
        states = batch_cache(self.model, prefixes, layout, room=layout.width - layout.cached_width)
        _, states, _ = prefill(self.model, input_ids, attention_mask, layout.cached_width, states)
        self.fed_tokens += int(attention_mask[:, layout.cached_width:].sum())
        entries = [CachedPrefix(tuple(sequence), row_states(states, row,
                                                             layout.columns(row, len(sequence))))
                   for row, sequence in enumerate(sequences)]
        for entry in entries:
            self.prefix_cache.add(entry)
        return entries


def _batch_key(params: SamplingParams) -> tuple[float, float, int, tuple[int, ...]]:
    return (params.temperature, params.top_p, params.top_k, params.stop_token_ids)
