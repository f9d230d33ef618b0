"""Env code off the event loop: the threads that run blocking env calls, and one tool call with its errors.

A tool that raises, times out, or gets bad arguments never ends the episode: the model receives an error
observation that says what went wrong, and the error kind is counted in the trajectory's metrics. The exception is
:class:`~trajlab.errors.InfrastructureError`: the machinery failed, not the model, so the episode ends as ``error``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import pydantic

from trajlab.env.base import EnvHandle, ToolResult, describe_validation_error
from trajlab.env.content import tool_content
from trajlab.errors import InfrastructureError

T = TypeVar("T")


_Job = tuple[Future[Any], Callable[[], Any]]


class ToolThreads:
    """Threads for envs' blocking calls (``reset``, synchronous tools, hooks), one per call in progress.

    An episode makes one blocking call at a time, so :attr:`size` follows the number of episodes in flight (the
    engine's ``concurrency``; engines sharing the threads count together) and no episode ever waits for a thread.
    Threads start when first needed and then wait for the next call.

    Python cannot stop a thread. A synchronous call that runs past its timeout goes on in its thread until it
    returns; its result is discarded, and it may still change the env it was called on, which by then has moved on to
    its next turn or been closed. That thread stops counting toward :attr:`size` at the timeout, so other calls get
    another thread and a stuck tool never starves other episodes; it exits when the call returns. Threads are
    daemons, so a call that never returns does not keep the process alive either. A tool that may hang (a shell
    command, a network call) belongs in the sandbox, whose commands are killed at their timeout.
    """

    def __init__(self, name: str = "trajlab-tool") -> None:
        self.name = name
        self.size = 1
        self._episodes = 0  # in flight now
        self._lock = threading.Lock()  # guards everything below; every hand-over of a call happens under it
        self._idle: list[queue.SimpleQueue[_Job | None]] = []  # the inboxes of threads waiting for a call
        self._backlog: deque[_Job] = deque()  # calls waiting for a thread (only while size is too small)
        self._counted = 0  # threads counting toward size: waiting ones, and ones whose call has not timed out
        self._abandoned: set[Future[Any]] = set()  # calls past their timeout, whose thread left the count
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def episode(self) -> Iterator[None]:
        """Count an episode in flight while the block runs; :attr:`size` follows the most in flight at once."""
        with self._lock:
            self._episodes += 1
            self.size = max(self.size, self._episodes)
            self._start_for_backlog()
        try:
            yield
        finally:
            with self._lock:
                self._episodes -= 1

    async def call(self, fn: Callable[[], T], *, timeout_s: float | None = None) -> T:
        """Run ``fn()`` in a thread and wait for it; raises :class:`TimeoutError` after ``timeout_s`` seconds."""
        future = self._submit(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            self._abandon(future)
            raise

    def close(self) -> None:
        """Stop the threads once their calls return; calls not yet started are cancelled. Idempotent."""
        with self._lock:
            self._closed = True
            for future, _ in self._backlog:
                future.cancel()
            self._backlog.clear()
            for inbox in self._idle:
                inbox.put(None)
            self._idle.clear()

    def _submit(self, fn: Callable[[], Any]) -> Future[Any]:
        job: _Job = (Future(), fn)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} threads are closed: the engine was closed.")
            if self._idle:
                self._idle.pop().put(job)
            else:
                self._backlog.append(job)
                self._start_for_backlog()
        return job[0]

    def _start_for_backlog(self) -> None:
        while self._backlog and self._counted < self.size and not self._closed:
            self._counted += 1
            threading.Thread(target=self._work, args=(self._backlog.popleft(),), name=f"{self.name}-{self._counted}",
                             daemon=True).start()

    def _abandon(self, future: Future[Any]) -> None:
        with self._lock:
            if future.cancel() or future.done():
                return  # it never started, or it finished just now: its thread is free
            self._abandoned.add(future)
            self._counted -= 1
            self._start_for_backlog()

    def _work(self, job: _Job | None) -> None:
        inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        while job is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:  # handed to the waiting episode, which records it
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                if future in self._abandoned:  # another thread took this one's place at the timeout
                    self._abandoned.discard(future)
                    return
                if self._closed:
                    return
                if self._backlog:
                    job = self._backlog.popleft()
                    continue
                self._idle.append(inbox)
            job = inbox.get()


async def execute_tool(
    env: EnvHandle,
    name: str,
    arguments: dict[str, Any],
    schemas: dict[str, dict[str, Any]],
    *,
    timeout_s: float,
    threads: ToolThreads,
) -> ToolResult:
    """Run ``env.<name>(**arguments)`` with argument validation and a wall-clock limit.

    Synchronous tools run in ``threads`` so a slow tool does not block other episodes (see :class:`ToolThreads`
    for what happens to one that times out); coroutine tools run on the event loop and are cancelled at the timeout.
    """
    tool = env.tool(name) if name in schemas else None
    if tool is None:
        available = ", ".join(sorted(schemas)) or "none"
        return ToolResult(f"Error: unknown tool '{name}'. Available tools: {available}.", "unknown_tool")
    try:
        if inspect.iscoroutinefunction(tool):
            value = await asyncio.wait_for(tool(**arguments), timeout_s)
        else:
            value = await threads.call(functools.partial(tool, **arguments), timeout_s=timeout_s)
    except pydantic.ValidationError as exc:
        return ToolResult(describe_validation_error(name, exc, schemas[name]), "bad_arguments")
    except TimeoutError:
        return ToolResult(f"Error: tool '{name}' did not finish within {timeout_s:g} seconds.", "timeout")
    except InfrastructureError:  # the machinery failed, not the model: the episode errors (and is retried)
        raise
    except Exception as exc:  # a tool's own bug is an observation for the model, not a crash of the rollout
        return ToolResult(f"Error: tool '{name}' failed: {type(exc).__name__}: {exc}", "exception")
    return ToolResult(tool_content(value))
