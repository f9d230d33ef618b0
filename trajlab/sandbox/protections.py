"""Which protections this machine gives sandboxed commands, probed once per process; network isolation among them.

Why: a private uid, a network namespace and a disk quota each depend on the host (root or not, user namespaces
allowed or not, util-linux tools present). Each is probed by running a no-op command under it; the sandbox then
applies what works and still runs, with fewer protections, where some are missing.

Network isolation is a fresh network namespace holding only a down loopback interface: ``unshare --net``, or, where
the host cannot create one directly (not root), the same inside a user namespace (``--map-current-user``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from trajlab.sandbox.disk_quota import fstab, mount_namespace_prefix, mount_tmpfs, unmount
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import HELPER_TIMEOUT_S, SAFE_PATH, SHELL
from trajlab.sandbox.uids import SANDBOX_UID_RANGE, identity_prefix


@dataclasses.dataclass(frozen=True)
class Protections:
    """Which protections commands get on this machine, beyond those always applied.

    Always applied: private directory, scrubbed environment, rlimits on CPU, memory, file size and open files, wall
    timeout, output cap, and killing the command's process group when it ends.
    """

    #: Each sandbox runs as its own unprivileged uid (the host is root): sandboxes cannot read each other's files or
    #: signal each other, and processes that leave the process group (setsid) are still killed at cleanup.
    private_uid: bool
    #: RLIMIT_NPROC is enforced (the kernel ignores it for uid 0); without private_uid it counts every process of the
    #: host's user, not only the sandbox's.
    process_cap: bool
    #: setuid binaries cannot raise privileges (setpriv --no-new-privs).
    no_new_privs: bool
    #: Commands see only a down loopback interface: no network at all.
    network_namespace: bool
    #: The network namespace sits in a user namespace, because the host cannot create one directly.
    user_namespace: bool
    #: The sandbox directory is a tmpfs of ``disk_bytes``, and commands see it in place of /tmp, /var/tmp, /dev/shm
    #: and /run/lock: their files cannot fill the host's disk or memory, nor meet another sandbox's in /tmp.
    disk_quota: bool = False


@dataclasses.dataclass(frozen=True)
class Platform:
    """The host's tools that apply the protections, and the protections they give."""

    prlimit: str
    setpriv: str | None
    net_prefix: tuple[str, ...]
    protections: Protections
    unshare: str | None = None


def probe_protections() -> Protections:
    """Which protections sandboxed commands get on this machine (probed once per process)."""
    return host_platform().protections


@functools.cache
def host_platform() -> Platform:
    """Probe the host once: which tools exist and which protections work with them."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxError("the sandbox needs util-linux's prlimit to apply resource limits")
    setpriv = shutil.which("setpriv")
    probe_uid = SANDBOX_UID_RANGE[0]
    private_uid = os.geteuid() == 0 and setpriv is not None and _works(identity_prefix(setpriv, probe_uid))
    identity = identity_prefix(setpriv, probe_uid if private_uid else None)
    net_prefix = next((prefix for prefix in _net_prefixes() if _works([*prefix, *identity])), ())
    unshare = shutil.which("unshare")
    protections = Protections(
        private_uid=private_uid,
        process_cap=private_uid or os.geteuid() != 0,
        no_new_privs=setpriv is not None,
        network_namespace=bool(net_prefix),
        user_namespace="--map-current-user" in net_prefix,
        disk_quota=private_uid and unshare is not None and _can_mount_private_tmp(unshare),
    )
    return Platform(prlimit, setpriv, net_prefix, protections, unshare)


def _can_mount_private_tmp(unshare: str) -> bool:
    """Whether this host can give a sandbox a tmpfs and bind it over /tmp in a command's own mount namespace."""
    try:
        with tempfile.TemporaryDirectory() as directory:
            if not mount_tmpfs(directory, size=1 << 20):
                return False
            try:
                fstab_file = Path(directory, "fstab")
                fstab_file.write_text(fstab(Path(directory), ["/tmp"]))
                return _works(mount_namespace_prefix(unshare, fstab_file, network=False))
            finally:
                unmount(directory)
    except OSError:
        return False


def _net_prefixes() -> list[tuple[str, ...]]:
    """Ways to run a command without network, best first: a plain network namespace, then one in a user namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    return [(unshare, "--net", "--"), (unshare, "--net", "--map-current-user", "--")]


def _works(prefix: Sequence[str]) -> bool:
    """Whether a no-op command runs under ``prefix`` on this host."""
    try:
        done = subprocess.run([*prefix, SHELL, "-c", ":"], env={"PATH": SAFE_PATH}, cwd="/",
                              capture_output=True, timeout=HELPER_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
