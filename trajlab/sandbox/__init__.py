"""Run untrusted commands (model tool calls) in a throwaway sandbox.

Commands written by a model in training are untrusted: they must not read the host process's secrets, reach the
network, exhaust the machine, or touch another episode's files. Each :class:`Sandbox` owns a private 0700 directory
and, when the host runs as root, its own unprivileged uid, leased for its lifetime so that concurrent sandboxes (in
this or any other process) never share one. Every command runs in a new session under rlimits (CPU seconds, address
space, file size, processes, open files), a wall-clock timeout, an output cap, a scrubbed environment and, where the
OS allows it, a fresh network namespace holding only a down loopback interface. :func:`probe_protections` reports
which of these this machine provides; the sandbox still runs, with fewer protections, where some are missing.

As root, the sandbox directory is also a size-capped tmpfs, and each command runs in its own mount namespace where
that tmpfs stands in for /tmp, /var/tmp, /dev/shm and /run/lock: everything a command can write lives inside the cap,
so no loop of files can fill the host's disk or memory.

Not isolated: commands can read world-readable host files. Without root they can write into world-writable
directories such as /tmp (their files there are private by default: umask 077), up to the file size limit per file.

One module per job: ``sandbox`` (the :class:`Sandbox`), ``limits`` (rlimits and the scrubbed environment),
``process`` (running one command to its end), ``files`` (the host's file access inside a sandbox), ``uids`` (uid
leasing), ``disk_quota`` (the tmpfs and mount namespace), ``protections`` (what the host allows, network included).
"""

from trajlab.sandbox.disk_quota import MOUNT_BASE_DIR
from trajlab.sandbox.errors import SandboxError, SandboxPathError
from trajlab.sandbox.limits import SandboxLimits
from trajlab.sandbox.process import SandboxResult
from trajlab.sandbox.protections import Protections, probe_protections
from trajlab.sandbox.sandbox import Sandbox
from trajlab.sandbox.uids import SANDBOX_UID_RANGE

__all__ = [
    "MOUNT_BASE_DIR",
    "SANDBOX_UID_RANGE",
    "Protections",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPathError",
    "SandboxResult",
    "probe_protections",
]
