"""transformers backend: batches the turns of concurrent episodes into one ``model.generate`` call.

Episodes submit requests independently; a single worker drains the queue, groups requests with the same sampling
settings into a left-padded batch, and runs generation in a thread so tools of other episodes keep running.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trajlab.inference.base import GenerationRequest, GenerationResult, SamplingParams


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]


class HFGenerator:
    """Generator over a transformers causal LM.

    Args:
        model: the policy, in eval mode.
        tokenizer: its tokenizer (used for the pad id only; generation works on ids).
        max_batch_size: the most turns generated together.
        batch_wait_s: a batch that is not full starts once no new request has arrived for this long...
        max_wait_s: ...or once this long has passed since its first request. Episodes resume one after another
            after a batch (parse, run tools, render the observation), so their next turns trickle in; waiting for
            a quiet moment gathers them into one ``generate`` call instead of several small ones.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.01,
        max_wait_s: float = 0.1,
        name: str = "hf",
    ) -> None:
        self.model = model
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_wait_s = max_wait_s
        self.name = name
        self._queue: list[_Pending] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self.generated_tokens = 0
        self.batches = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (e.g. one asyncio.run per RL step): start a worker on it
            self._loop, self._wakeup, self._queue = loop, asyncio.Event(), []
            self._worker = None
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._serve())
        future: asyncio.Future[GenerationResult] = loop.create_future()
        self._queue.append(_Pending(request, future))
        self._wakeup.set()
        return await future

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            await self._gather_stragglers()
            while self._queue:
                batch = self._take_batch()
                try:
                    results = await asyncio.to_thread(self._generate_batch, [p.request for p in batch])
                except Exception as exc:  # hand the failure to every waiting episode instead of hanging them
                    for pending in batch:
                        if not pending.future.done():
                            pending.future.set_exception(exc)
                    continue
                for pending, result in zip(batch, results, strict=True):
                    if not pending.future.done():
                        pending.future.set_result(result)

    async def _gather_stragglers(self) -> None:
        """Wait until the batch is full, no request came for ``batch_wait_s``, or ``max_wait_s`` has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(self._queue) < self.max_batch_size and loop.time() < deadline:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), min(self.batch_wait_s, deadline - loop.time()))
            except TimeoutError:
                break
        self._wakeup.clear()

    def _take_batch(self) -> list[_Pending]:
        key = _batch_key(self._queue[0].request.params)
        batch = [p for p in self._queue if _batch_key(p.request.params) == key][: self.max_batch_size]
        self._queue = [p for p in self._queue if p not in batch]
        return batch

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        params = requests[0].params
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)  # (B, T), left-padded
        attention_mask = torch.zeros_like(input_ids)
        for row, request in enumerate(requests):
            input_ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            attention_mask[row, width - len(request.prompt_ids):] = 1
        sample = params.temperature > 0
        output = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention_mask.to(self.model.device),
            max_new_tokens=max(r.params.max_new_tokens for r in requests),
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=params.top_k if sample else None,
            eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = output.sequences[:, width:].cpu()  # (B, N)
        logits = torch.stack(output.logits, dim=1).float()  # (B, N, V)
        scale = params.temperature if sample else 1.0
        logprobs = torch.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1).cpu()
        self.batches += 1
        return [
            self._cut(new_tokens[row].tolist(), logprobs[row].tolist(), request.params)
            for row, request in enumerate(requests)
        ]

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


def _batch_key(params: SamplingParams) -> tuple[float, float, int, tuple[int, ...]]:
    return (params.temperature, params.top_p, params.top_k, params.stop_token_ids)
