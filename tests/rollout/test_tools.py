"""The threads that run env code: sized by episodes in flight, never starved by a stuck call, closed for good."""

import asyncio
import threading
import time

import pytest

from trajlab.rollout.tools import ToolThreads


def alive(prefix):
    return [thread for thread in threading.enumerate() if thread.name.startswith(prefix)]


def wait_until(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_stuck_call_leaves_the_count_and_its_thread_exits_when_it_returns():
    threads, release = ToolThreads("trajlab-unit-stuck"), threading.Event()

    async def main():
        with threads.episode():  # one episode in flight: one thread
            with pytest.raises(TimeoutError):
                await threads.call(release.wait, timeout_s=0.05)
            assert await threads.call(lambda: 7, timeout_s=1.0) == 7, "another thread took the stuck one's place"
            assert await threads.call(threading.current_thread) is await threads.call(threading.current_thread)

    asyncio.run(main())
    assert threads.size == 1 and len(alive("trajlab-unit-stuck")) == 2
    threads.close()
    assert wait_until(lambda: len(alive("trajlab-unit-stuck")) == 1), "the idle thread stops at close"
    release.set()
    assert wait_until(lambda: not alive("trajlab-unit-stuck")), "the stuck one stops when its call returns"
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(threads.call(lambda: None))


def test_calls_beyond_the_size_wait_for_a_thread_and_close_cancels_them():
    threads, gate = ToolThreads("trajlab-unit-size"), threading.Event()

    async def main():
        with threads.episode(), threads.episode():  # two in flight: two threads at most
            calls = [asyncio.ensure_future(threads.call(gate.wait)) for _ in range(3)]
            await asyncio.sleep(0.1)
            assert len(alive("trajlab-unit-size")) == 2 and not any(call.done() for call in calls)
            gate.set()
            assert await asyncio.gather(*calls) == [True] * 3

    asyncio.run(main())
    threads.close()
    assert wait_until(lambda: not alive("trajlab-unit-size"))
