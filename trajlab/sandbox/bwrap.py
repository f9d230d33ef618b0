"""Isolation by bubblewrap (``bwrap``): the argv that runs a command in fresh namespaces with a read-only system.

Why: a real, audited tool gives each command its own user, PID, IPC, network, UTS, cgroup and mount namespaces in a
few milliseconds, as root and unprivileged. Inside, the command sees a read-only ``/usr`` and a short list of ``/etc``
files (never the host's home, ``/run``, ``/var`` or ``/sys``), a fresh ``/proc`` holding only its own processes, a
minimal ``/dev``, only a loopback interface (abstract unix sockets of the host live in the host's network namespace),
its sandbox's working directory, and a private ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/dev/mqueue``. It cannot
create user namespaces (``--disable-userns``, or the command server's confinement), and when its first process exits,
or the host dies (``--die-with-parent``), the PID namespace's init exits and the kernel kills everything left in it:
nothing a command starts outlives it. That killing is asynchronous, so :class:`PidNamespace` waits for it before a
command's call returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
from pathlib import Path

from trajlab.sandbox.command_server import CONFINE_CAPABILITIES
from trajlab.sandbox.errors import SandboxError

#: The system directories the command sees, read-only; where the host has merged /usr they are symlinks.
_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: What of /etc commands see: enough for the dynamic linker, the alternatives symlinks, users' names, Python and
#: TLS roots. Not the rest, which may hold credentials (npmrc, pip.conf, gitconfig, machine-id, ssh host keys).
_ETC = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "hosts",
        "host.conf", "localtime", "timezone", "mime.types", "magic", "magic.mime", "ssl", "ca-certificates",
        "protocols", "services", "debian_version", "os-release", "inputrc", "perl", "python3", "bash.bashrc",
        "profile")
#: Where the command may write besides its working directory: each is its sandbox's private tmp.
PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
#: The mode of each fresh tmpfs bwrap makes for them (without a disk quota): everyone's, sticky, as /tmp is.
TMPFS_MODE = 0o1777
#: Where commands see the POSIX message queues of their IPC namespace (so that a wipe can find them).
MQUEUE_DIR = "/dev/mqueue"
#: Where commands see their sandbox's working directory (their cwd, HOME and TMPDIR): a path that says nothing of where
#: it lives on the host, whose bind shows only its place on the sandbox's own tmpfs in ``/proc/self/mountinfo``.
WORK_INSIDE = "/sandbox"
#: Exit statuses above this (and at most this + 64) mean the command died of signal (status - this).
SIGNAL_STATUS_BASE = 128


#: How long the kernel may take to kill what was left in a command's PID namespace before the call fails.
NAMESPACE_END_TIMEOUT_S = 5.0


class PidNamespace:
    """The PID namespace of one bwrap command, to wait until everything in it died.

    Why: killing bwrap kills its namespace's init, and the kernel then kills the rest of the namespace while the
    host goes on; a command that was writing files could still write into its directory while the host deletes it, or
    into the next command's files. bwrap's ``--info-fd`` gives the init's pid; a pidfd opened on it while bwrap, its
    parent, lives becomes readable only once the kernel killed and reaped every other process of the namespace.
    """

    def __init__(self) -> None:
        self._info_read, self.info_fd = os.pipe()
        self._init: int | None = None  # a pidfd on the namespace's init
        self.init_pid: int | None = None

    def attach(self, bwrap_pid: int, timeout_s: float) -> None:
        """Read which process is the namespace's init, once bwrap ``bwrap_pid`` started (its ``--info-fd``).

        Nothing is attached when bwrap failed before making the namespace (its error is on stderr), or its init
        already exited (then the kernel had killed the rest).
        """
        os.close(self.info_fd)
        info = b""
        while select.select([self._info_read], [], [], timeout_s)[0] and (chunk := os.read(self._info_read, 4096)):
            info += chunk
        os.close(self._info_read)
        with contextlib.suppress(ValueError, KeyError, TypeError):  # no or partial info: bwrap failed early
            init_pid = int(json.loads(info)["child-pid"])
            with contextlib.suppress(OSError):
                self._init = os.pidfd_open(init_pid)
                if not _is_child(init_pid, of=bwrap_pid):  # the init exited and its pid went to another process
                    self.close()
                else:
                    self.init_pid = init_pid

    def signal_init(self, number: int) -> bool:
        """Send signal ``number`` to the namespace's init (through its pidfd: never to a process that took its pid);
        whether it was sent."""
        if self._init is None:
            return False
        try:
            signal.pidfd_send_signal(self._init, number)
        except ProcessLookupError:
            return False
        return True

    def abandon(self) -> None:
        """Close the info pipe of a bwrap that could not be started."""
        os.close(self.info_fd)
        os.close(self._info_read)

    def wait_for_end(self) -> None:
        """Return once nothing of the namespace is left; a :class:`SandboxError` when the kernel takes too long."""
        if self._init is None:
            return
        try:
            if not select.select([self._init], [], [], NAMESPACE_END_TIMEOUT_S)[0]:
                raise SandboxError(f"the processes of a sandbox command were still running "
                                   f"{NAMESPACE_END_TIMEOUT_S} s after it was killed")
        finally:
            self.close()

    def close(self) -> None:
        if self._init is not None:
            os.close(self._init)
            self._init, self.init_pid = None, None


def _is_child(pid: int, *, of: int) -> bool:
    """Whether process ``pid`` is a child of ``of`` (a pidfd opened on it keeps the answer true while it lives)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == of


def bwrap_argv(bwrap: str, *, work: Path | None, private_tmp: Path | None, tmp_bytes: int,
               pid_namespace: PidNamespace | None = None, server: tuple[int, str] | None = None,
               confine: bool = False, read_only: tuple[str, ...] = (), init: bool = False,
               fresh_work: bool = False) -> list[str]:
    """argv that runs the rest in fresh namespaces, in :data:`WORK_INSIDE` (``/`` without a working directory, for
    probes).

    Args:
        bwrap: the ``bwrap`` executable.
        work: the sandbox's working directory on the host, seen at :data:`WORK_INSIDE` inside.
        private_tmp: a directory (on the sandbox's capped tmpfs) bound over each of :data:`PRIVATE_TMP_DIRS`, so that
            its files stay as long as the sandbox; None gives each bwrap fresh tmpfs of ``tmp_bytes`` each.
        tmp_bytes: the size cap of each fresh tmpfs when ``private_tmp`` is None.
        pid_namespace: where bwrap reports the namespace's init, for the host to wait for its end.
        server: a descriptor holding the command server's source and where to put it inside, read-only; the command
            then runs as the PID namespace's init (:mod:`trajlab.sandbox.command_server`).
        confine: the command is the command server (or its ``--exec``), which mounts the private tmp dirs with inode
            caps and then disables user namespaces and drops its capabilities itself: it starts as its user
            namespace's root with the capabilities that needs.
        read_only: more host paths the command sees read-only at the same path (a program's installation, say).
        init: the command (the command server's ``--exec``) runs as the PID namespace's init, as ``server`` does,
            instead of bwrap's own init, which commands could trace and read: it runs as their uid, dumpable, and
            holds bwrap's argv.
        fresh_work: without ``work``, an empty :data:`WORK_INSIDE`, where the command server mounts the working
            directory's tmpfs (``confine``); binding the host's directory there would show its host path.
    """
    info = ["--info-fd", str(pid_namespace.info_fd)] if pid_namespace is not None else []
    if confine:
        privileges = ["--uid", "0", "--gid", "0", "--cap-drop", "ALL"]
        for capability in CONFINE_CAPABILITIES:
            privileges += ["--cap-add", capability]
    else:
        privileges = ["--disable-userns", "--cap-drop", "ALL"]
    argv = [bwrap, *info, "--unshare-all", "--unshare-user", *privileges, "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for name in _ETC:
        argv += _etc_argv(f"/etc/{name}")
    argv += ["--proc", "/proc", "--dev", "/dev", "--mqueue", MQUEUE_DIR]
    for target in PRIVATE_TMP_DIRS:
        if private_tmp is None:
            argv += ["--size", str(tmp_bytes), "--perms", f"{TMPFS_MODE:o}", "--tmpfs", target]
        else:
            argv += ["--bind", str(private_tmp), target]
    for path in read_only:
        argv += ["--ro-bind", path, path]
    if work is not None:
        argv += ["--bind", str(work), WORK_INSIDE]
    elif fresh_work:
        argv += ["--dir", WORK_INSIDE]
    if server is not None or init:
        argv += ["--as-pid-1"]
    if server is not None:
        argv += ["--ro-bind-data", str(server[0]), server[1]]
    return [*argv, "--chdir", WORK_INSIDE if work is not None or fresh_work else "/", "--"]


def _etc_argv(path: str) -> list[str]:
    """bwrap's options that show ``path`` read-only. A symlink into ``/usr`` stays a symlink: a bind of it would show
    its target's path in ``/proc/self/mountinfo``, and ``/usr`` is there anyway."""
    if os.path.islink(path) and os.path.realpath(path).startswith("/usr/"):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind-try", path, path]


def exit_code(status: int) -> int:
    """A command's exit code as :mod:`subprocess` gives it: bwrap reports death by signal N as 128 + N.

    A command that exits with such a status itself (``exit 137``) reads as killed by that signal.
    """
    if SIGNAL_STATUS_BASE < status <= SIGNAL_STATUS_BASE + 64:
        return SIGNAL_STATUS_BASE - status
    return status
