"""Aggregate caps per sandbox (as root, cgroup v1): memory of all its processes together, and their number.

Why: rlimits cap one process at a time; 64 processes of 1 GiB each are still 64 GiB. Where the cgroup v1 ``memory``
and ``pids`` controllers are mounted and writable (as root), each sandbox gets a cgroup in both, and each command
joins it before anything else runs: the kernel then caps the memory (tmpfs pages included) and the processes of the
whole sandbox, and cleanup kills every process still in it. cgroup v2 is not handled yet: there the caps are only
per command (rlimits).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from trajlab.sandbox.limits import SHELL

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The parent of every sandbox's cgroup, in each controller.
PARENT = "trajlab-sandboxes"
#: bwrap's own processes in a command's cgroup: itself and its PID namespace's init.
LAUNCHER_PROCESSES = 2
# Joins every cgroup.procs file given before "--", then execs the rest (as root, before dropping privileges).
_JOIN_SCRIPT = 'for f; do shift; [ "$f" = -- ] && exec "$@"; echo $$ > "$f" || exit 125; done'
_KILL_ROUNDS = 50


def available() -> bool:
    """Whether this host lets us make cgroups in the v1 memory and pids controllers."""
    try:
        for controller in ("memory", "pids"):
            parent = CGROUP_ROOT / controller / PARENT
            parent.mkdir(exist_ok=True)
            if not os.access(parent, os.W_OK):
                return False
    except OSError:
        return False
    return True


class SandboxCgroup:
    """One sandbox's cgroups, named after its directory; :meth:`remove` kills what is in them and deletes them."""

    def __init__(self, name: str) -> None:
        self.dirs = [CGROUP_ROOT / "memory" / PARENT / name, CGROUP_ROOT / "pids" / PARENT / name]

    def create(self, *, memory_bytes: int, processes: int) -> None:
        """Make the cgroups with their caps (memory: ``memory_bytes``; processes: ``processes`` plus bwrap's own)."""
        memory, pids = self.dirs
        for directory in self.dirs:
            directory.mkdir()
        (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
        (pids / "pids.max").write_text(str(processes + LAUNCHER_PROCESSES))

    def join_prefix(self) -> list[str]:
        """argv that moves the command into the cgroups, then runs the rest."""
        return [SHELL, "-c", _JOIN_SCRIPT, "sh", *(str(d / "cgroup.procs") for d in self.dirs), "--"]

    def kill(self) -> None:
        """SIGKILL every process in the cgroups, until none is left (pids.max bounds how many can appear)."""
        for _ in range(_KILL_ROUNDS):
            pids = self._pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def remove(self) -> None:
        """Kill what is left and delete the cgroups (idempotent; a dying process may hold one a moment)."""
        self.kill()
        for directory in self.dirs:
            for _ in range(_KILL_ROUNDS):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while killed processes are reaped
                    time.sleep(0.002)

    def exists(self) -> bool:
        return any(directory.exists() for directory in self.dirs)

    def _pids(self) -> set[int]:
        found: set[int] = set()
        for directory in self.dirs:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(line) for line in (directory / "cgroup.procs").read_text().split())
        return found
