"""Request batching shared by the in-process generators: concurrent episodes' turns queued and served in batches.

Episodes submit requests independently; one worker task per event loop drains the queue, waits briefly for
stragglers, and hands each batch to the backend's batch function. Backends differ only in how they pick a batch
from the queue and how they run it (which thread, which call), so those are the two methods a subclass provides.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from trajlab.inference.base import GenerationRequest, GenerationResult


@dataclass
class PendingRequest:
    """A queued request and the future its episode awaits."""

    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    abandoned: threading.Event = field(default_factory=threading.Event)
    """Set when the awaiting task is cancelled (a client that went away): a batch function may stop its row."""


class BatchingGenerator:
    """A generator whose requests are gathered into batches by one worker task.

    Args:
        max_batch_size: the most requests served together.
        batch_wait_s: a batch that is not full starts once no new request has arrived for this long...
        max_wait_s: ...or once this long has passed since its first request. Episodes resume one after another
            after a batch (parse, run tools, render the observation), so their next turns trickle in; waiting for
            a quiet moment gathers them into one batch instead of several small ones.

    Subclasses implement :meth:`_run_batch` and may override :meth:`_take_batch` (the first ``max_batch_size``
    requests in arrival order). A failure of a batch reaches every request in it, never hangs them.
    """

    drops_cancelled: bool = True
    """Whether a request whose awaiting task is cancelled leaves the queue (and is marked abandoned) rather than
    being generated for nobody."""

    def __init__(self, *, max_batch_size: int, batch_wait_s: float, max_wait_s: float) -> None:
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_wait_s = max_wait_s
        self._queue: list[PendingRequest] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Queue ``request`` and wait for the batch that serves it."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (e.g. one asyncio.run per RL step): start a worker on it
            self._loop, self._wakeup, self._queue, self._worker = loop, asyncio.Event(), [], None
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._serve())
        pending = PendingRequest(request, loop.create_future())
        self._queue.append(pending)
        self._wakeup.set()
        try:
            return await pending.future
        except asyncio.CancelledError:  # nobody wants the result: do not generate it (any further)
            if self.drops_cancelled:
                pending.abandoned.set()
                if pending in self._queue:
                    self._queue.remove(pending)
            raise

    async def _run_batch(self, batch: list[PendingRequest]) -> list[GenerationResult]:
        """One result per request of ``batch``, in order, computed off the event loop."""
        raise NotImplementedError

    def _take_batch(self) -> list[PendingRequest]:
        """Remove the next batch from the queue: the first ``max_batch_size`` requests in arrival order."""
        batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size:]
        return batch

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            await self._gather_stragglers()
            while self._queue:
                batch = self._take_batch()
                try:
                    results = await self._run_batch(batch)
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
