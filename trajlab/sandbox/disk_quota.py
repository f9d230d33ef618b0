"""The disk quota: as root, a sandbox directory that is a tmpfs capped in bytes and inodes, also the command's /tmp;
without root, for one bwrap per command, a tmpfs over the working directory held in a namespace (:class:`WorkTmpfs`).

Why: a file size rlimit caps one file, not a loop of files. As root, the sandbox directory is a tmpfs of
``disk_bytes`` and ``inodes``, and each command sees it in place of /tmp, /var/tmp and /dev/shm (bubblewrap binds
it there; without bubblewrap, a mount namespace also covers /run/lock): everything a command can write lives inside
the cap, so it cannot fill the host's disk or memory, nor meet another sandbox's files in /tmp.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import HELPER_TIMEOUT_S, SAFE_PATH, SHELL

#: Where sandboxes live when their directory is a tmpfs mount (as root): outside every directory a command's mount
#: namespace replaces, so the sandbox keeps its path inside.
MOUNT_BASE_DIR = "/run/trajlab-sandboxes"
#: World-writable places a command could otherwise fill; with a disk quota each is the sandbox's own ``tmp``.
#: /tmp goes last: binding it first would hide a sandbox that lives under /tmp from the later binds.
_SHARED_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock", "/tmp")
#: The mode of a sandbox's working directory and private tmp: its uid's alone (as ``mkdtemp`` makes one).
DIR_MODE = 0o700
# Run as root inside the command's new mount and IPC namespaces: bind the sandbox's tmp over each shared writable
# directory (one `mount` for all, from the sandbox's fstab: an exec per bind would halve throughput), set the IPC
# namespace's limits ("name=value ..." under /proc/sys; only root may change them there), then exec the rest of argv.
_BIND_SCRIPT = ('mount --all --fstab "$1" || exit 125; for s in $2; do echo "${s#*=}" > "/proc/sys/${s%%=*}" || '
                'exit 125; done; shift 2; exec "$@"')


def mount_base_dir() -> str:
    """The directory under which tmpfs sandboxes are made, created on first use."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(MOUNT_BASE_DIR, 0o711)
    return MOUNT_BASE_DIR


def mount_tmpfs(path: str | Path, *, size: int, inodes: int) -> bool:
    """Mount a root-owned tmpfs that others may traverse but not list; the sandbox owns the directories in it."""
    options = f"size={size},nr_inodes={inodes},mode=0711,uid=0,gid=0,nosuid,nodev"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "trajlab-sandbox", str(path)],
                          capture_output=True, timeout=HELPER_TIMEOUT_S, check=False)
    return done.returncode == 0


def lay_out(root: Path, uid: int) -> Path:
    """Fill a freshly mounted tmpfs: the working directory, the command's private tmp and the fstab binding it.

    Returns the working directory. Both directories are on the one tmpfs, so both count against the quota.
    """
    work, private_tmp = root / "work", root / "tmp"
    for directory in (work, private_tmp):
        directory.mkdir(mode=DIR_MODE)
        os.chown(directory, uid, uid)
    targets = [t for t in _SHARED_WRITABLE if os.path.isdir(t) and not root.is_relative_to(t)]
    fstab_path(root).write_text(fstab(private_tmp, targets))
    return work


def fstab_path(root: Path) -> Path:
    """Where a tmpfs sandbox keeps the fstab of its commands' binds: outside their working directory."""
    return root / "fstab"


def fstab(source: Path, targets: Sequence[str]) -> str:
    """fstab lines binding ``source`` over each target (fstab escapes whitespace as octal)."""
    def escape(path: str) -> str:
        return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")

    return "".join(f"{escape(str(source))} {escape(target)} none bind 0 0\n" for target in targets)


def mount_namespace_prefix(unshare: str, fstab_file: Path, *, network: bool,
                           sysctl: Mapping[str, int] | None = None) -> list[str]:
    """argv that runs the rest in new mount, IPC (and network) namespaces, as root, with the fstab's binds in place
    and the IPC namespace's limits ``sysctl`` (:func:`~trajlab.sandbox.limits.ipc_sysctls`) set."""
    net = ["--net"] if network else []
    settings = " ".join(f"{name}={value}" for name, value in (sysctl or {}).items())
    return [unshare, "--mount", "--ipc", *net, "--", SHELL, "-c", _BIND_SCRIPT, "sh", str(fstab_file), settings]


def unmount(path: str | Path) -> None:
    """Detach a sandbox's tmpfs; lazily, so that a process still holding it open cannot make cleanup fail."""
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=HELPER_TIMEOUT_S, check=False)


# Run in a new user namespace (as its root) and mount namespace: mount the capped tmpfs over the working directory,
# say so, then hold the namespaces until the host closes stdin (or dies).
_HOLD_SCRIPT = 'mount -t tmpfs -o "$2" trajlab-work "$1" || exit 125; echo ready; read -r _'


class WorkTmpfs:
    """A tmpfs of ``size`` bytes and ``inodes`` files over a sandbox's working directory, in a user and mount namespace
    that a small process holds for the sandbox's life; each command's bwrap starts inside them (``nsenter``).

    Why: without root, one bwrap per command has no tmpfs that lasts from one command to the next, so its working
    directory would be a host directory capped only per file. The host reaches the files through
    ``/proc/<holder>/root``. The holder dies with its host (its stdin is the host's pipe).
    """

    def __init__(self, path: Path, *, size: int, inodes: int, unshare: str, nsenter: str,
                 identity: Sequence[str] = ()) -> None:
        self._nsenter = nsenter
        options = f"size={size},nr_inodes={inodes},mode={DIR_MODE:o},nosuid,nodev"
        self._holder = subprocess.Popen(
            [*identity, unshare, "--user", "--map-root-user", "--mount", "--", SHELL, "-c", _HOLD_SCRIPT, "sh",
             str(path), options],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", env={"PATH": SAFE_PATH})
        assert self._holder.stdout is not None
        ready = select.select([self._holder.stdout], [], [], HELPER_TIMEOUT_S)[0] and self._holder.stdout.readline()
        if ready != b"ready\n":
            self.close()
            assert self._holder.stderr is not None
            why = self._holder.stderr.read().decode(errors="replace").strip()
            raise SandboxError(f"could not hold a {size}-byte tmpfs over {path}: {why or 'no answer'}")

    def enter_prefix(self) -> list[str]:
        """argv that runs the rest inside the holder's namespaces, keeping the caller's uid and groups."""
        return [self._nsenter, "--target", str(self._holder.pid), "--user", "--mount", "--preserve-credentials", "--"]

    def host_root(self) -> Path:
        """Where the host sees the namespace's root."""
        return Path(f"/proc/{self._holder.pid}/root")

    def close(self) -> None:
        """Let the holder go, and with it the tmpfs (once no command holds it either). Idempotent."""
        if self._holder.returncode is None:
            self._holder.kill()
            self._holder.wait()
        for pipe in (self._holder.stdin, self._holder.stdout, self._holder.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
