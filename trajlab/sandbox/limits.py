"""What every command gets on every machine: rlimits, a shell, and an environment scrubbed of the host's.

Why: these protections need nothing from the host beyond util-linux's ``prlimit``, so they are always applied; the
other modules add what the host allows (a private uid, namespaces, a disk quota).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

SHELL = "/bin/sh"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
#: Files commands create are private to the sandbox's uid.
COMMAND_UMASK = 0o077
#: How long the sandbox's own helper commands (probes, mounts, kills) may take.
HELPER_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits. CPU, memory, file size and open files are per process; processes are per command, or per
    sandbox where Protections.cgroup_limits; disk, inodes and total memory are per sandbox."""

    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # RLIMIT_AS: virtual address space
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE: largest file a process may write
    max_processes: int = 64  # RLIMIT_NPROC: enforced only when commands do not run as uid 0 (see Protections)
    open_files: int = 256
    wall_timeout_s: float = 30.0
    max_output_bytes: int = 1 << 20  # kept of stdout and of stderr each; the command is stopped beyond it
    disk_bytes: int = 256 << 20  # all files of the sandbox together, where Protections.disk_quota (tmpfs: RAM)
    inodes: int = 65_536  # files and directories of the sandbox together, where Protections.inode_quota
    total_memory_bytes: int = 2 << 30  # all processes (and tmpfs pages) together, where Protections.cgroup_limits;
    # also the most SysV shared memory a sandbox's IPC namespace holds, where Protections.ipc_limits

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kinds = (int, float) if field.name == "wall_timeout_s" else (int,)
            valid = isinstance(value, kinds) and not isinstance(value, bool) and 0 < value < math.inf
            if not valid:
                kind = "finite number" if float in kinds else "integer"
                raise ValueError(f"SandboxLimits.{field.name} must be a positive {kind}, got {value!r}")


def rlimit_options(limits: SandboxLimits) -> list[str]:
    """``prlimit`` options applying ``limits`` to a command (and no core dumps)."""
    return [
        f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",  # SIGXCPU, then SIGKILL a second later
        f"--as={limits.memory_bytes}",
        f"--fsize={limits.file_size_bytes}",
        f"--nproc={limits.max_processes}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]


#: SysV message queues and POSIX message queues each get at most this share of ``total_memory_bytes``.
_MESSAGE_SHARE = 8
#: The kernel's defaults, set again so that the number of queues below bounds their bytes.
_MSGMNB, _MQ_MSG_MAX, _MQ_MSGSIZE_MAX = 16_384, 10, 8_192


def ipc_sysctls(limits: SandboxLimits) -> dict[str, int]:
    """The limits of a sandbox's own IPC namespace (``/proc/sys`` names), sized from ``total_memory_bytes``.

    Why: SysV shared memory and message queues are not any process's memory: they stay when their creator exits, so
    rlimits never see them, and without a cgroup nothing else caps them. Each IPC namespace has its own limits: SysV
    shared memory gets at most ``total_memory_bytes`` in all, SysV and POSIX message queues an eighth of it each.
    """
    budget = limits.total_memory_bytes
    queue_bytes = _MQ_MSG_MAX * _MQ_MSGSIZE_MAX
    return {
        "kernel/shmmax": budget,
        "kernel/shmall": max(1, budget // os.sysconf("SC_PAGE_SIZE")),  # in pages
        "kernel/shmmni": 256,
        "kernel/msgmnb": _MSGMNB,
        "kernel/msgmni": max(1, budget // _MESSAGE_SHARE // _MSGMNB),
        "fs/mqueue/msg_max": _MQ_MSG_MAX,
        "fs/mqueue/msgsize_max": _MQ_MSGSIZE_MAX,
        "fs/mqueue/queues_max": max(1, min(256, budget // _MESSAGE_SHARE // queue_bytes)),
    }


def scrubbed_environment(home: Path) -> dict[str, str]:
    """A command's whole environment: nothing of the host's (API keys, tokens) is passed on."""
    return {"PATH": SAFE_PATH, "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8"}
