"""The request batching both in-process generators share, driven by a batch function in plain Python."""

import asyncio

import pytest

from trajlab.inference.base import GenerationRequest, GenerationResult, SamplingParams
from trajlab.inference.batching import BatchingGenerator, PendingRequest


class Reverser(BatchingGenerator):
    """Answers each prompt with its tokens reversed and records the batches it was handed."""

    def __init__(self, *, max_batch_size: int = 8, batch_wait_s: float = 0.5, max_wait_s: float = 5.0) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, max_wait_s=max_wait_s)
        self.served: list[list[list[int]]] = []
        self.failure: Exception | None = None
        self.hold: asyncio.Event | None = None
        self.running: list[PendingRequest] = []

    async def _run_batch(self, batch: list[PendingRequest]) -> list[GenerationResult]:
        self.served.append([p.request.prompt_ids for p in batch])
        self.running = batch
        if self.hold is not None:
            await self.hold.wait()
        if self.failure is not None:
            raise self.failure
        return [GenerationResult(p.request.prompt_ids[::-1], [0.0] * len(p.request.prompt_ids), "stop")
                for p in batch]


def ask(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams())


async def staggered(generator: BatchingGenerator, prompts: list[list[int]], gap_s: float) -> list[GenerationResult]:
    """Requests submitted ``gap_s`` apart, as episodes resuming one after another submit their turns."""
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(generator.generate(ask(prompt))))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


def test_requests_arriving_within_the_wait_share_one_batch():
    generator = Reverser(batch_wait_s=0.5)
    results = asyncio.run(staggered(generator, [[1, 2], [3, 4], [5]], gap_s=0.01))
    assert generator.served == [[[1, 2], [3, 4], [5]]]
    assert [r.token_ids for r in results] == [[2, 1], [4, 3], [5]]


def test_a_quiet_moment_starts_the_batch():
    generator = Reverser(batch_wait_s=0.01, max_wait_s=5.0)
    asyncio.run(staggered(generator, [[1], [2]], gap_s=0.5))
    assert generator.served == [[[1]], [[2]]]


def test_a_full_batch_starts_without_waiting():
    generator = Reverser(max_batch_size=2, batch_wait_s=60.0, max_wait_s=60.0)

    async def two() -> list[GenerationResult]:
        return await asyncio.wait_for(asyncio.gather(*(generator.generate(ask([n])) for n in (1, 2))), timeout=5)

    assert [r.token_ids for r in asyncio.run(two())] == [[1], [2]]
    assert generator.served == [[[1], [2]]]


def test_a_failed_batch_reaches_every_waiter_and_the_next_batch_is_served():
    generator = Reverser()
    generator.failure = RuntimeError("out of memory")

    async def failing_then_fine() -> list[object]:
        failed = await asyncio.gather(*(generator.generate(ask([n])) for n in (1, 2, 3)), return_exceptions=True)
        generator.failure = None
        return [*failed, await generator.generate(ask([4, 5]))]

    *failed, fine = asyncio.run(asyncio.wait_for(failing_then_fine(), timeout=10))
    assert [str(f) for f in failed] == ["out of memory"] * 3
    assert fine.token_ids == [5, 4]


def test_a_request_cancelled_while_queued_is_never_served():
    generator = Reverser(batch_wait_s=0.5)

    async def one_cancelled() -> GenerationResult:
        kept = asyncio.create_task(generator.generate(ask([1])))
        dropped = asyncio.create_task(generator.generate(ask([2])))
        await asyncio.sleep(0.01)
        dropped.cancel()
        return await kept

    assert asyncio.run(one_cancelled()).token_ids == [1]
    assert generator.served == [[[1]]]


def test_a_request_cancelled_mid_batch_is_marked_abandoned():
    generator = Reverser(batch_wait_s=0.01)

    async def cancelled_while_running() -> list[bool]:
        generator.hold = asyncio.Event()
        kept = asyncio.create_task(generator.generate(ask([1])))
        dropped = asyncio.create_task(generator.generate(ask([2])))
        while not generator.running:
            await asyncio.sleep(0.01)
        dropped.cancel()
        await asyncio.sleep(0)
        abandoned = [p.abandoned.is_set() for p in generator.running]
        generator.hold.set()
        await kept
        return abandoned

    assert asyncio.run(cancelled_while_running()) == [False, True]


def test_a_backend_that_keeps_cancelled_requests_still_serves_them():
    generator = Reverser(batch_wait_s=0.5)
    generator.drops_cancelled = False

    async def one_cancelled() -> None:
        kept = asyncio.create_task(generator.generate(ask([1])))
        dropped = asyncio.create_task(generator.generate(ask([2])))
        await asyncio.sleep(0.01)
        dropped.cancel()
        await kept
        with pytest.raises(asyncio.CancelledError):
            await dropped

    asyncio.run(one_cancelled())
    assert generator.served == [[[1], [2]]]


def test_one_generator_serves_successive_event_loops():
    generator = Reverser(batch_wait_s=0.01)
    first = asyncio.run(generator.generate(ask([1, 2])))
    second = asyncio.run(generator.generate(ask([3, 4])))  # e.g. the next RL step
    assert (first.token_ids, second.token_ids) == ([2, 1], [4, 3])
    assert generator.served == [[[1, 2]], [[3, 4]]]
