"""Isolation by bubblewrap (``bwrap``): the argv that runs a command in fresh namespaces with a read-only system.

Why: a real, audited tool gives each command its own user, PID, IPC, network, UTS, cgroup and mount namespaces in a
few milliseconds, as root and unprivileged. Inside, the command sees a read-only ``/usr`` and a short list of ``/etc``
files (never the host's home, ``/run``, ``/var`` or ``/sys``), a fresh ``/proc`` holding only its own processes, a
minimal ``/dev``, only a loopback interface (abstract unix sockets of the host live in the host's network namespace),
its sandbox's working directory, and a private ``/tmp``, ``/var/tmp`` and ``/dev/shm``. It cannot create user
namespaces (``--disable-userns``), and when its first process exits, or the host dies (``--die-with-parent``), the
PID namespace's init exits and the kernel kills everything left in it: nothing a command starts outlives it.
"""

from __future__ import annotations

import os
from pathlib import Path

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
#: Exit statuses above this (and at most this + 64) mean the command died of signal (status - this).
SIGNAL_STATUS_BASE = 128


def bwrap_argv(bwrap: str, *, work: Path | None, private_tmp: Path | None, tmp_bytes: int) -> list[str]:
    """argv that runs the rest in fresh namespaces, in ``work`` (None: ``/``, for probes).

    Args:
        bwrap: the ``bwrap`` executable.
        work: the sandbox's working directory, seen at the same path inside.
        private_tmp: a directory (on the sandbox's capped tmpfs) bound over each of :data:`PRIVATE_TMP_DIRS`, so that
            its files stay from one command to the next; None gives each command fresh tmpfs of ``tmp_bytes`` each.
        tmp_bytes: the size cap of each fresh tmpfs when ``private_tmp`` is None.
    """
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for name in _ETC:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for target in PRIVATE_TMP_DIRS:
        if private_tmp is None:
            argv += ["--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", target]
        else:
            argv += ["--bind", str(private_tmp), target]
    if work is not None:
        argv += ["--bind", str(work), str(work)]
    return [*argv, "--chdir", str(work or "/"), "--"]


def exit_code(status: int) -> int:
    """A command's exit code as :mod:`subprocess` gives it: bwrap reports death by signal N as 128 + N.

    A command that exits with such a status itself (``exit 137``) reads as killed by that signal.
    """
    if SIGNAL_STATUS_BASE < status <= SIGNAL_STATUS_BASE + 64:
        return SIGNAL_STATUS_BASE - status
    return status
