"""Continuous batching for the in-process vLLM engine: one thread steps the engine, requests join and leave it one by
one.

``LLM.generate`` takes a batch and returns when its slowest request is done, so an episode whose turn finished early
waits for the batch before it can run its tool and send its next turn. Here each request is added to vLLM's engine
as its episode sends it and handed back the moment the engine reports it finished; vLLM's scheduler batches whatever
is running at each step, and its prefix cache keeps an episode's earlier turns from being computed again.

The engine is stepped under a lock that weight loads also take, so weights never change in the middle of a step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IDLE_EXIT_S = 1.0
"""The stepping thread ends after this long without requests; the next request starts it again."""


@dataclass
class _Waiting:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EngineLoop:
    """Steps ``engine`` (vLLM's ``LLMEngine``) in a thread of its own while it has requests.

    Args:
        engine: the ``LLM``'s engine (``llm.llm_engine``), run in this process.
        lock: held while the engine steps; hold it to change the engine's weights between two steps.
        to_result: turns a finished ``RequestOutput`` into what the request's caller gets.
    """

    def __init__(self, engine: Any, lock: threading.Lock, to_result: Callable[[Any], Any]) -> None:
        self.engine, self.lock, self.to_result = engine, lock, to_result
        self._inbox: queue.SimpleQueue[tuple[str, Any, tuple[Any, Any] | None, _Waiting | None]] = \
            queue.SimpleQueue()
        self._waiting: dict[str, _Waiting] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self.steps = 0

    def submit(self, prompt: Any, params: Any, lora: Any = None) -> tuple[str, asyncio.Future]:
        """Queue one request for the engine (served with the LoRA adapter ``lora`` if any); its id and the future
        its result arrives in (on the calling loop)."""
        loop = asyncio.get_running_loop()
        request_id = f"trajlab-{next(self._ids)}"
        future = loop.create_future()
        self._inbox.put((request_id, prompt, (params, lora), _Waiting(loop, future)))
        self._ensure_running()
        return request_id, future

    def abort(self, request_id: str) -> None:
        """Stop a request nobody waits for any more; its rows leave the engine at its next step."""
        self._inbox.put((request_id, None, None, None))
        self._ensure_running()

    def _ensure_running(self) -> None:
        self._wake.set()
        with self._start:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="trajlab-vllm-loop", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._admit()
            if not self._waiting:
                self._wake.clear()
                if self._inbox.empty() and not self._wake.wait(IDLE_EXIT_S):
                    with self._start:  # no request came: end, unless one is being queued right now
                        if self._inbox.empty():
                            self._thread = None
                            return
                continue
            try:
                with self.lock:
                    outputs = self.engine.step()
            except Exception as exc:  # hand the failure to every waiting episode instead of hanging them
                self._fail_all(exc)
                continue
            self.steps += 1
            for output in outputs:
                if output.finished and (waiting := self._waiting.pop(output.request_id, None)):
                    self._settle(waiting, self.to_result, output)

    def _admit(self) -> None:
        """Add queued requests to the engine and abort the abandoned ones, between two steps."""
        while not self._inbox.empty():
            request_id, prompt, settings, waiting = self._inbox.get()
            if waiting is None:
                if self._waiting.pop(request_id, None) is not None:
                    with self.lock:
                        self.engine.abort_request([request_id])
                continue
            try:
                with self.lock:
                    params, lora = settings
                    self.engine.add_request(request_id, prompt, params, lora_request=lora)
            except Exception as exc:  # a request vLLM refuses fails alone
                self._settle(waiting, _raise, exc)
                continue
            self._waiting[request_id] = waiting

    def _fail_all(self, exc: Exception) -> None:
        waiting, self._waiting = self._waiting, {}
        if waiting:
            with self.lock:
                self.engine.abort_request(list(waiting))
        for each in waiting.values():
            self._settle(each, _raise, exc)

    @staticmethod
    def _settle(waiting: _Waiting, make: Callable[[Any], Any], value: Any) -> None:
        """Set the future on its own event loop: with ``make(value)``, or the exception it raises."""
        def done() -> None:
            if waiting.future.done():
                return
            try:
                waiting.future.set_result(make(value))
            except Exception as exc:  # noqa: BLE001 - the caller's await raises it
                waiting.future.set_exception(exc)

        if not waiting.loop.is_closed():
            waiting.loop.call_soon_threadsafe(done)


def _raise(exc: Exception) -> Any:
    raise exc
