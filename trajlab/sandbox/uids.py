"""A private uid per sandbox when the host runs as root: leased, switched to with ``setpriv``, killed at the end.

Why: with its own unprivileged uid a sandbox's commands cannot read another sandbox's files, signal its processes,
or escape cleanup by leaving their process group (every process of the uid is killed). A uid is leased with an
exclusive flock on a lease file, so concurrent sandboxes in this or any other process never share one, and the lease
file records whether its last holder cleaned up, so the next holder can clear what a crashed process left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import subprocess
import tempfile
from pathlib import Path

from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import HELPER_TIMEOUT_S, SAFE_PATH, SHELL

#: uids (and gids) leased to sandboxes when the host runs as root: high enough not to belong to real accounts.
#: The first one is only used to probe whether the host can switch to them.
SANDBOX_UID_RANGE = range(1_900_000_000, 1_900_000_000 + 65_536)

_BUSY, _CLEAN = b"busy", b"done"  # lease file content while a sandbox holds the uid, and once it cleaned up


class UidLease:
    """A sandbox uid held exclusively (an flock on its lease file) until :meth:`release`."""

    def __init__(self) -> None:
        self.uid, self._fd = _lease()

    def crashed_holder(self) -> str | None:
        """None if the uid's last holder cleaned up (or there was none); else the tmpfs it recorded, or ''."""
        assert self._fd is not None
        lease = os.pread(self._fd, 4096, 0)
        if not lease.startswith(_BUSY):
            return None
        return lease[len(_BUSY):].decode(errors="replace").strip()

    def mark_busy(self, mount_root: Path | None) -> None:
        """Record that the uid is in use, and the sandbox's tmpfs if it has one, for the case that this process dies."""
        self._write(_BUSY + (b" " + bytes(mount_root) if mount_root is not None else b""))

    def mark_clean(self) -> None:
        """Record that nothing of the uid is left: the next holder need not kill leftovers."""
        self._write(_CLEAN)

    def release(self) -> None:
        """Give the uid back (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, content: bytes) -> None:
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, content, 0)


def _lease() -> tuple[int, int]:
    """Lease a sandbox uid: an exclusive flock on its lease file, held until the returned fd is closed."""
    directory = Path(tempfile.gettempdir()) / "trajlab-sandbox-uids"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SandboxError(f"{directory} must be a directory owned by uid {os.geteuid()} with mode 0700")
    for _ in range(256):
        uid = SANDBOX_UID_RANGE[1 + secrets.randbelow(len(SANDBOX_UID_RANGE) - 1)]  # the first one is for probing
        fd = os.open(directory / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise SandboxError(f"no free sandbox uid in {SANDBOX_UID_RANGE}")


def identity_prefix(setpriv: str | None, uid: int | None) -> list[str]:
    """argv that runs the rest as ``uid`` (None: the host's own user) without new privileges, where setpriv exists."""
    if setpriv is None:
        return []
    ids = [] if uid is None else [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [setpriv, *ids, "--no-new-privs", "--"]


def kill_uid(setpriv: str, uid: int) -> None:
    """SIGKILL every process of ``uid``, also those that left the command's process group: kill(-1) as that uid."""
    subprocess.run([*identity_prefix(setpriv, uid), SHELL, "-c", "kill -KILL -1 2>/dev/null"],
                   env={"PATH": SAFE_PATH}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=HELPER_TIMEOUT_S, check=False)


def require_traversable(directory: Path) -> None:
    """Refuse a sandbox directory that its uid could not reach."""
    for parent in directory.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise SandboxError(f"sandbox uids cannot enter {parent}: pass a world-traversable base_dir")
