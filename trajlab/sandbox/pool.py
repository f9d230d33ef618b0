"""Sandboxes taken back and handed out again, wiped: a fresh sandbox for each episode without making one each time.

Why: making a sandbox (lease and uid, tmpfs, cgroups, bwrap's seven namespaces and the command server) costs about
20 ms of CPU, which caps fresh sandboxes near 50/s on 2 cores; wiping a released one costs under 1 ms. A released
sandbox is reset (:meth:`Sandbox.reset`: its files, POSIX and SysV IPC objects and keys deleted, its directories'
modes restored; no process outlives a command anyway) and kept for the next :meth:`SandboxPool.acquire`. What a reset
sandbox still shares with its earlier users are counters: process ids, inode numbers and IPC ids go on from where
they were, as on any long-lived machine; nothing they stored is left.

A sandbox that cannot be reset (bubblewrap missing, or commands see no Python for the command server), or whose
reset leaves anything, is cleaned up instead, and the next acquire makes a new one.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading

from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import SandboxLimits
from trajlab.sandbox.sandbox import Sandbox

logger = logging.getLogger(__name__)


class SandboxPool:
    """Hands out sandboxes of one :class:`SandboxLimits`, new or reset; keeps up to ``keep`` released ones.

    Args:
        limits: the limits of every sandbox of the pool; :class:`SandboxLimits`' defaults when None.
        keep: how many released sandboxes to keep for later acquires; more are cleaned up.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, keep: int = 64) -> None:
        if keep < 0:
            raise ValueError(f"SandboxPool keep must be 0 or more, got {keep}")
        self.limits = limits or SandboxLimits()
        self._keep = keep
        self._idle: list[Sandbox] = []
        self._lock = threading.Lock()
        self._closed = False
        self.made = 0
        """How many sandboxes this pool made (each acquire that found none to reuse)."""

    def acquire(self) -> Sandbox:
        """A sandbox as new: one released earlier and reset, or a new one. Give it back with :meth:`release`."""
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox pool was closed")
            if self._idle:
                return self._idle.pop()
            self.made += 1
        return Sandbox(self.limits)

    def release(self, sandbox: Sandbox) -> None:
        """Take ``sandbox`` back: reset it for the next acquire, or clean it up (pool full or closed, or the reset
        failed)."""
        with self._lock:
            kept = not self._closed and len(self._idle) < self._keep and sandbox.resettable
        if kept:
            try:
                sandbox.reset()
            except SandboxError as exc:
                logger.warning("sandbox %s could not be reset (%s): cleaning it up", sandbox.path, exc)
                kept = False
        if kept:
            with self._lock:
                if not self._closed:
                    self._idle.append(sandbox)
                    return
        sandbox.cleanup()

    def close(self) -> None:
        """Clean up the kept sandboxes; sandboxes released later are cleaned up too. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sandbox in idle:
            sandbox.cleanup()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@functools.cache
def shared_pool(limits: SandboxLimits) -> SandboxPool:
    """This process's pool for sandboxes of ``limits`` (what envs acquire from), closed when the process exits."""
    pool = SandboxPool(limits)
    atexit.register(pool.close)
    return pool
