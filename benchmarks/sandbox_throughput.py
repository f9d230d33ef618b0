"""Isolated tool executions per second through the sandbox, against plain ``subprocess.run`` in the same run.

Short shell tool calls run on a thread pool, as concurrent episodes would issue them: once through plain
``subprocess.run`` (no isolation: the baseline), once through one reused sandbox per worker (an episode's later turns:
one long-lived bwrap per sandbox, each command spawned inside it), once through a fresh :class:`Sandbox` per execution
(directory, uid, tmpfs, cgroups and namespaces set up and torn down each time), once through a fresh sandbox per
execution from a :class:`SandboxPool` (a released sandbox wiped and handed out again, as the ctf env gets one per
episode), and, reused again, with bwrap started for each command and with bubblewrap turned off (the fallback chain),
to show what each design costs.

    .venv/bin/python benchmarks/sandbox_throughput.py --executions 200 --workers 8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from trajlab.sandbox import Sandbox, SandboxLimits, probe_protections
from trajlab.sandbox.pool import SandboxPool

COMMANDS = ("echo hello", "printf '%s\\n' c a b | sort | head -n 1 && echo $((6 * 7))")
LIMITS = SandboxLimits(cpu_seconds=5, wall_timeout_s=10)


def plain(command: str) -> str:
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=True).stdout


def fresh_sandbox(command: str) -> str:
    with Sandbox(LIMITS) as box:
        return box.run(command).stdout


class PooledSandboxes:
    """A sandbox from the pool per execution, given back (wiped) after it."""

    def __init__(self) -> None:
        self.pool = SandboxPool(LIMITS)

    def __call__(self, command: str) -> str:
        box = self.pool.acquire()
        try:
            return box.run(command).stdout
        finally:
            self.pool.release(box)


class ReusedSandboxes:
    """One sandbox per worker thread, kept for every execution that thread runs."""

    def __init__(self, **options: bool) -> None:
        self._options = options
        self._local = threading.local()
        self._all: list[Sandbox] = []

    def __call__(self, command: str) -> str:
        if not hasattr(self._local, "box"):
            self._local.box = Sandbox(LIMITS, **self._options)
            self._all.append(self._local.box)
        return self._local.box.run(command).stdout

    def cleanup(self) -> None:
        for box in self._all:
            box.cleanup()


def throughput(execute: Callable[[str], str], executions: int, workers: int) -> float:
    """Executions per second, checking every execution printed what the plain shell prints."""
    expected = {command: plain(command) for command in COMMANDS}
    commands = [COMMANDS[i % len(COMMANDS)] for i in range(executions)]
    with ThreadPoolExecutor(workers) as pool:
        started = time.perf_counter()
        outputs = list(pool.map(execute, commands))
        elapsed = time.perf_counter() - started
    wrong = sum(output != expected[command] for command, output in zip(commands, outputs, strict=True))
    if wrong:
        raise RuntimeError(f"{wrong} of {executions} executions printed something unexpected")
    return executions / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=200)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    print(f"machine: {cores} cores usable, {platform.platform()}, Python {platform.python_version()}")
    print(f"protections: {dataclasses.asdict(probe_protections())}")
    print(f"{args.executions} executions, {args.workers} workers, commands: {COMMANDS}")

    reused = ReusedSandboxes()
    per_command = ReusedSandboxes(reuse_namespaces=False)
    chain = ReusedSandboxes(use_bubblewrap=False)
    pooled = PooledSandboxes()
    try:
        results = {
            "plain subprocess.run": throughput(plain, args.executions, args.workers),
            "sandbox, reused per worker": throughput(reused, args.executions, args.workers),
            "sandbox, fresh per execution": throughput(fresh_sandbox, args.executions, args.workers),
            "sandbox, fresh from the pool": throughput(pooled, args.executions, args.workers),
            "reused, bwrap per command": throughput(per_command, args.executions, args.workers),
            "reused, fallback chain": throughput(chain, args.executions, args.workers),
        }
    finally:
        for sandboxes in (reused, per_command, chain):
            sandboxes.cleanup()
        print(f"the pool made {pooled.pool.made} sandboxes for {args.executions} executions")
        pooled.pool.close()
    baseline = results["plain subprocess.run"]
    for name, rate in results.items():
        print(f"{name:30s} {rate:8.1f} executions/s  ({rate / baseline:.2f}x plain)")


if __name__ == "__main__":
    main()
