"""Which protections this machine gives sandboxed commands, probed once per process, and the check envs make.

Why: bubblewrap, a private uid, cgroups and a disk quota each depend on the host (root or not, user namespaces
allowed or not, tools installed). Each is probed by running a no-op command under it; the sandbox applies what works.
Where bubblewrap is missing, the fallback is util-linux's chain: ``unshare --net`` for a network namespace (inside a
user namespace, ``--map-current-user``, where the host cannot create one directly) and, as root, a mount namespace
for the private /tmp. Envs that run model-written code call :func:`require_strong_isolation`, which refuses to go on
with a weaker sandbox (no bubblewrap, no aggregate memory cap, as root no private uid or disk quota) unless the
user opted out: ``TRAJLAB_SANDBOX_ALLOW_WEAK=memory_cap`` (names, separated by commas) or ``=1`` (all).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path

from trajlab.sandbox.bwrap import bwrap_argv
from trajlab.sandbox.cgroups import CgroupHost, host_cgroups
from trajlab.sandbox.disk_quota import WorkTmpfs, fstab, mount_namespace_prefix, mount_tmpfs, unmount
from trajlab.sandbox.errors import MissingProtection, SandboxError
from trajlab.sandbox.limits import HELPER_TIMEOUT_S, SAFE_PATH, SHELL, SandboxLimits, ipc_sysctls
from trajlab.sandbox.seccomp import filter_program
from trajlab.sandbox.session import confined_exec_argv, confinement
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
    #: Commands see only a loopback interface of their own: no network at all. They also get their own IPC
    #: namespace, so SysV and POSIX IPC objects die with the command.
    network_namespace: bool
    #: The network namespace sits in a user namespace, because the host cannot create one directly.
    user_namespace: bool
    #: The sandbox directory is a tmpfs of ``disk_bytes``, and commands see it in place of /tmp, /var/tmp, /dev/shm
    #: (and /run/lock): their files cannot fill the host's disk or memory, nor meet another sandbox's in /tmp.
    disk_quota: bool = False
    #: That tmpfs also caps the number of files and directories (``inodes``).
    inode_quota: bool = False
    #: Commands run under bubblewrap: their own user, PID, IPC, network, UTS, cgroup and mount namespaces, no nested
    #: user namespaces, a read-only system, the host's processes, files and unix sockets out of sight, and nothing
    #: they start outlives them. Without root, /tmp, /var/tmp and /dev/shm are each a tmpfs of ``disk_bytes``, made
    #: with the sandbox's namespaces.
    bubblewrap: bool = False
    #: /tmp, /var/tmp and /dev/shm cap the number of files and directories (``inodes``): on the sandbox's tmpfs
    #: (inode_quota), or, without it, each a tmpfs mounted with that cap by the command server under bubblewrap.
    tmp_inode_quota: bool = False
    #: The working directory is capped in bytes (``disk_bytes``) and inodes (``inodes``): the sandbox's tmpfs
    #: (disk_quota), or, without it, a tmpfs the command server mounts in its namespace, which the host reaches through
    #: ``/proc/<server>/root`` (not with one bwrap per command: :meth:`Sandbox.protections` says which a sandbox has).
    work_dir_quota: bool = False
    #: Each sandbox is a cgroup: its processes together get ``total_memory_bytes`` and ``max_processes``.
    cgroup_limits: bool = False
    #: Which cgroups cap the memory of a sandbox's processes together: ``"cgroup v1"``, ``"cgroup v2"``, or ``""``
    #: where no cgroup can be had (then only each process is capped, by ``memory_bytes``).
    memory_cap: str = ""
    #: The IPC namespace of a sandbox's commands has its own limits (``kernel.shm*``, ``kernel.msg*``,
    #: ``fs.mqueue.*``), sized from ``total_memory_bytes``: SysV shared memory and message queues, which outlive
    #: the processes that made them, cannot take more (:func:`~trajlab.sandbox.limits.ipc_sysctls`).
    ipc_limits: bool = False
    #: Commands under bubblewrap run with a seccomp filter refusing io_uring, keyrings, ptrace, bpf, perf events,
    #: userfaultfd, mounts, namespaces and the other calls container runtimes refuse (:mod:`trajlab.sandbox.seccomp`).
    seccomp_filter: bool = False

    def missing_for_strong_isolation(self) -> list[str]:
        """The protections an env running model-written code needs that this machine lacks, each with its fix."""
        return [f"{name}: {fix}" for name, fix in _missing(self).items()]


#: What strong isolation needs on every host, each with its fix; as root, :data:`_NEEDED_AS_ROOT` too.
_NEEDED = {
    "bubblewrap": "install bubblewrap (apt-get install bubblewrap; scripts/setup_system.sh as root)",
    "seccomp_filter": "the seccomp filter needs libseccomp (apt-get install libseccomp2), the pyseccomp package and "
                      "a Python 3.9+ in /usr that commands see",
    "memory_cap": "no cgroup caps the memory of a sandbox's processes together (each process is capped alone, so "
                  "many processes or SysV shared memory can take the host's memory): as root, mount the cgroup v1 "
                  "memory and pids controllers or cgroup v2 with them; without root, run under a cgroup v2 that "
                  "systemd delegates to you (systemd-run --user --scope -p Delegate=yes <command>)",
}
_NEEDED_AS_ROOT = {"private_uid": "setpriv (util-linux) must switch to uids in SANDBOX_UID_RANGE",
                   "disk_quota": "root must be able to mount a tmpfs (not possible in this container)"}


def _missing(protections: Protections) -> dict[str, str]:
    needed = _NEEDED | (_NEEDED_AS_ROOT if os.geteuid() == 0 else {})
    return {name: fix for name, fix in needed.items() if not getattr(protections, name)}


@dataclasses.dataclass(frozen=True)
class Platform:
    """The host's tools that apply the protections, and the protections they give."""

    prlimit: str
    setpriv: str | None
    net_prefix: tuple[str, ...]
    protections: Protections
    unshare: str | None = None
    bwrap: str | None = None  # set when commands run under bubblewrap
    #: The interpreter that runs each sandbox's command server inside bubblewrap (None: one bwrap per command).
    server_python: str | None = None
    #: The command server (or its ``--exec``) confines itself: sets the IPC namespace's limits and, without the
    #: sandbox's tmpfs, mounts inode-capped tmp dirs, then leaves for a nested user namespace without capabilities.
    confine: bool = False
    #: Where sandboxes' cgroups are made (None: no cgroup can be had here).
    cgroups: CgroupHost | None = None
    #: Without root's tmpfs, one bwrap per command enters a namespace holding the working directory's tmpfs
    #: (:class:`~trajlab.sandbox.disk_quota.WorkTmpfs`) with this ``nsenter``; None: it cannot here.
    nsenter: str | None = None
    #: The seccomp filter (a BPF program, in hex) the command server loads, where it works here.
    seccomp_program: str | None = None


logger = logging.getLogger(__name__)

#: The setting that lets an env needing strong isolation run without it (see :func:`require_strong_isolation`).
ALLOW_WEAK_ENV = "TRAJLAB_SANDBOX_ALLOW_WEAK"


def probe_protections() -> Protections:
    """Which protections sandboxed commands get on this machine (probed once per process)."""
    return host_platform().protections


def require_strong_isolation(who: str, *, allow_weak: bool | Collection[str] | None = None) -> None:
    """Refuse to run ``who`` (an env running model-written code) with a sandbox weaker than this machine should give;
    where the user opted out, say loudly (a warning) what it runs without.

    Args:
        who: what needs the isolation, for the message, e.g. ``"the ctf env"``.
        allow_weak: run anyway without these protections (by name, as :class:`Protections` names them: say
            ``{"memory_cap"}``), or without any (True); None reads the ``TRAJLAB_SANDBOX_ALLOW_WEAK`` setting: ``1``
            for any, names separated by commas, or ``0`` (as unset) for none.

    Raises:
        MissingProtection: a needed protection is missing and the user did not opt out of it (the message says what
            to install and how to opt out), or the setting names a protection that strong isolation does not need.
    """
    if allow_weak is None:
        setting = os.environ.get(ALLOW_WEAK_ENV, "")
        allow_weak = setting == "1" or {name.strip() for name in setting.split(",") if name.strip() not in ("", "0")}
    if weak := missing_for(probe_protections(), allow_weak=allow_weak, who=who):
        logger.warning("%s runs without %s, as %s allows: %s", who, ", ".join(weak), ALLOW_WEAK_ENV,
                       "; ".join(probe_protections().missing_for_strong_isolation()))


def missing_for(protections: Protections, *, allow_weak: bool | Collection[str], who: str = "this") -> list[str]:
    """The protections strong isolation needs that ``protections`` lack, where ``allow_weak`` allows each (True:
    all); a :class:`MissingProtection` naming those it does not allow, or any name it does not know."""
    allowed = set(allow_weak) if not isinstance(allow_weak, bool) else set()
    if unknown := sorted(allowed - (_NEEDED.keys() | _NEEDED_AS_ROOT.keys())):
        raise MissingProtection(f"{ALLOW_WEAK_ENV} names no protection strong isolation needs: {unknown}; the names "
                                f"are {sorted(_NEEDED | _NEEDED_AS_ROOT)}, or 1 for all")
    missing = _missing(protections)
    if refused := {name: fix for name, fix in missing.items() if allow_weak is not True and name not in allowed}:
        raise MissingProtection(
            f"{who} runs model-written commands and needs a strongly isolated sandbox, but this machine lacks: "
            f"{'; '.join(f'{name}: {fix}' for name, fix in refused.items())}. Fix that, or set "
            f"{ALLOW_WEAK_ENV}={','.join(refused)} to run without {'it' if len(refused) == 1 else 'them'} "
            f"({ALLOW_WEAK_ENV}=1: without anything missing; probe_protections() lists what it still gives).")
    return sorted(missing)


@functools.cache
def host_platform(use_bubblewrap: bool = True) -> Platform:
    """Probe the host once: which tools exist and which protections work with them.

    Args:
        use_bubblewrap: False probes the fallback chain even where bubblewrap works (for tests and comparisons).
    """
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxError("the sandbox needs util-linux's prlimit to apply resource limits")
    setpriv = shutil.which("setpriv")
    root = os.geteuid() == 0
    probe_uid = SANDBOX_UID_RANGE[0]
    private_uid = root and setpriv is not None and _works(identity_prefix(setpriv, probe_uid))
    identity = identity_prefix(setpriv, probe_uid if private_uid else None)
    bwrap = shutil.which("bwrap") if use_bubblewrap else None
    if bwrap is not None and not _works([*identity, *bwrap_argv(bwrap, work=None, private_tmp=None, tmp_bytes=1 << 20),
                                         prlimit, "--nproc=64", "--"]):
        bwrap = None
    net_prefix = () if bwrap else next((prefix for prefix in _net_prefixes() if _works([*prefix, *identity])), ())
    unshare = shutil.which("unshare")
    cgroup_host = host_cgroups()
    disk_quota = private_uid and (bwrap is not None or unshare is not None) and _can_mount_private_tmp(unshare, bwrap)
    server_python = _server_python([*identity, *bwrap_argv(bwrap, work=None, private_tmp=None, tmp_bytes=1 << 20)]) \
        if bwrap is not None else None
    confine = ipc_limits = False
    if bwrap is not None and server_python is not None:
        sandbox_uid = probe_uid if private_uid else None
        confine = _confines(identity, bwrap, server_python, confinement(sandbox_uid, 1 << 20, 64, tmp=not disk_quota))
        ipc_limits = confine and _confines(identity, bwrap, server_python, confinement(
            sandbox_uid, 1 << 20, 64, tmp=not disk_quota, sysctl=ipc_sysctls(SandboxLimits())))
    seccomp = _seccomp_program([*identity, *bwrap_argv(bwrap, work=None, private_tmp=None, tmp_bytes=1 << 20)],
                               server_python) if bwrap is not None and server_python is not None else None
    nsenter = shutil.which("nsenter") if confine and not disk_quota and unshare is not None else None
    if nsenter is not None and not _holds_work_tmpfs(identity, unshare, nsenter):
        nsenter = None
    protections = Protections(
        private_uid=private_uid,
        process_cap=private_uid or not root or bwrap is not None,
        no_new_privs=setpriv is not None or bwrap is not None,
        network_namespace=bool(net_prefix) or bwrap is not None,
        user_namespace="--map-current-user" in net_prefix or bwrap is not None,
        disk_quota=disk_quota,
        inode_quota=disk_quota,
        bubblewrap=bwrap is not None,
        tmp_inode_quota=disk_quota or confine,
        work_dir_quota=disk_quota or confine,  # with one bwrap per command, only where nsenter is set
        cgroup_limits=cgroup_host is not None,
        memory_cap=f"cgroup v{cgroup_host.version}" if cgroup_host is not None else "",
        ipc_limits=ipc_limits or (disk_quota and bwrap is None),  # the chain's root step sets them too
        seccomp_filter=seccomp is not None,
    )
    return Platform(prlimit, setpriv, net_prefix, protections, unshare, bwrap, server_python, confine,
                    cgroups=cgroup_host, nsenter=nsenter, seccomp_program=seccomp)


def _seccomp_program(bwrap_prefix: list[str], python: str) -> str | None:
    """The seccomp filter (in hex) where it builds here and a command under it is refused ``unshare(0)``, a no-op
    that succeeds without it."""
    program = filter_program()
    if program is None:
        return None
    refused = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0) + 1)"
    command = (*confined_exec_argv(python, {"seccomp": program.hex()}), python, "-I", "-S", "-c", refused)
    return program.hex() if _works(bwrap_prefix, command=command) else None


def _confines(identity: list[str], bwrap: str, python: str, setup: dict) -> bool:
    """Whether the command server's confinement ``setup`` works under bubblewrap here."""
    return _works([*identity, *bwrap_argv(bwrap, work=None, private_tmp=None, tmp_bytes=1 << 20, confine=True)],
                  command=(*confined_exec_argv(python, setup), SHELL, "-c", ":"))


def _holds_work_tmpfs(identity: list[str], unshare: str, nsenter: str) -> bool:
    """Whether a :class:`~trajlab.sandbox.disk_quota.WorkTmpfs` can be held here and entered."""
    try:
        with tempfile.TemporaryDirectory() as directory:
            os.chmod(directory, 0o711)  # a sandbox uid (as root) mounts over it
            holder = WorkTmpfs(Path(directory), size=1 << 20, inodes=64, unshare=unshare, nsenter=nsenter,
                               identity=identity)
            try:
                return _works([*identity, *holder.enter_prefix()])
            finally:
                holder.close()
    except (OSError, SandboxError):
        return False


def _server_python(bwrap_prefix: list[str]) -> str | None:
    """A Python 3.9+ (``socket.recv_fds``) that commands see under bubblewrap (they see the host's ``/usr``) and that
    has what the command server imports: this process's own where it lives there, else the system's."""
    own = os.path.realpath(sys.executable)
    candidates = [own] if own.startswith("/usr/") else []
    candidates += ["/usr/bin/python3", "/usr/local/bin/python3"]
    check = "import contextlib, ctypes, errno, json, os, signal, socket; socket.recv_fds; os.posix_spawnp"
    return next((python for python in candidates
                 if os.path.exists(python) and _works(bwrap_prefix, command=(python, "-I", "-S", "-c", check))), None)


def _can_mount_private_tmp(unshare: str | None, bwrap: str | None) -> bool:
    """Whether this host can give a sandbox a capped tmpfs (and, without bubblewrap, bind it over /tmp in a mount
    namespace and set the limits of an IPC namespace)."""
    try:
        with tempfile.TemporaryDirectory() as directory:
            if not mount_tmpfs(directory, size=1 << 20, inodes=64):
                return False
            try:
                if bwrap is not None:
                    return True
                assert unshare is not None
                fstab_file = Path(directory, "fstab")
                fstab_file.write_text(fstab(Path(directory), ["/tmp"]))
                return _works(mount_namespace_prefix(unshare, fstab_file, network=False,
                                                     sysctl=ipc_sysctls(SandboxLimits())))
            finally:
                unmount(directory)
    except OSError:
        return False


def _net_prefixes() -> list[tuple[str, ...]]:
    """Ways to run a command without network (and with its own IPC namespace, so its SysV and POSIX IPC objects die
    with it), best first: plain namespaces, then the same in a user namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    return [(unshare, "--net", "--ipc", "--"), (unshare, "--net", "--ipc", "--map-current-user", "--")]


def _works(prefix: Sequence[str], command: Sequence[str] = (SHELL, "-c", ":")) -> bool:
    """Whether ``command`` (a no-op) runs under ``prefix`` on this host."""
    try:
        done = subprocess.run([*prefix, *command], env={"PATH": SAFE_PATH}, cwd="/",
                              capture_output=True, timeout=HELPER_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
