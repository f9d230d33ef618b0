"""Run untrusted commands (model tool calls) in a throwaway sandbox.

Commands written by a model in training are untrusted: they must not read the host process's secrets, reach the
network, exhaust the machine, touch another episode's files, or outlive their episode. Each :class:`Sandbox` owns a
private 0700 directory. Every command runs in a new session under rlimits (CPU seconds, address space, file size,
processes, open files), a wall-clock timeout, an output cap and a scrubbed environment and, where bubblewrap works,
in its own user, PID, IPC, network, UTS, cgroup and mount namespaces with a read-only view of the system and private
/tmp, /var/tmp and /dev/shm. As root a sandbox also gets its own uid and a tmpfs capped in bytes and inodes (its
directory and its commands' tmp directories); without root, its working and tmp directories are each capped in bytes
and inodes (mounted in its namespaces, which then drop every capability). Where a cgroup can be had (v1 as root; v2
as root or delegated), the memory and processes of all its processes together are capped; under bubblewrap its IPC
namespace's own limits cap SysV and POSIX IPC. Without bubblewrap, util-linux's ``unshare`` and ``setpriv``
give what they can.
:func:`probe_protections` reports what this machine gives; :func:`require_strong_isolation` is how an env refuses
less. What a killed process's sandboxes left is removed by the next process's :func:`sweep`. A :class:`SandboxPool`
hands out sandboxes as new without making one each time: a released one is wiped (files, IPC objects, keys) and
handed out again.

One module per job: ``sandbox`` (the :class:`Sandbox`), ``limits`` (rlimits and the scrubbed environment),
``process`` (running one command to its end), ``files`` (the host's file access inside a sandbox), ``bwrap`` (the
bubblewrap argv), ``uids`` (switching to and killing a uid), ``leases`` (what each sandbox made, held by its owner),
``sweep`` (removing it), ``cgroups`` (aggregate caps), ``disk_quota`` (the tmpfs and the fallback's mount namespace),
``protections`` (what the host allows), ``session`` and ``command_server`` (one long-lived bwrap per sandbox), ``pool``
(wiped sandboxes handed out again).
"""

from trajlab.sandbox.disk_quota import MOUNT_BASE_DIR
from trajlab.sandbox.errors import MissingProtection, SandboxError, SandboxPathError
from trajlab.sandbox.limits import SandboxLimits
from trajlab.sandbox.pool import SandboxPool
from trajlab.sandbox.process import SandboxResult
from trajlab.sandbox.protections import ALLOW_WEAK_ENV, Protections, probe_protections, require_strong_isolation
from trajlab.sandbox.sandbox import Sandbox
from trajlab.sandbox.sweep import sweep
from trajlab.sandbox.uids import SANDBOX_UID_RANGE

__all__ = [
    "ALLOW_WEAK_ENV",
    "MOUNT_BASE_DIR",
    "SANDBOX_UID_RANGE",
    "MissingProtection",
    "Protections",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPathError",
    "SandboxPool",
    "SandboxResult",
    "probe_protections",
    "require_strong_isolation",
    "sweep",
]
