"""Leases: what each sandbox made, in a file its live owner keeps locked, so that a dead owner's leftovers are found.

Why: a host killed with SIGKILL runs no cleanup. Each sandbox holds an exclusive flock on a lease file for its whole
life and records there, before making them, the things it makes (its directory, whether that is a tmpfs mount, its
cgroups, its uid). The kernel drops the lock when the owner dies, however it dies: a lease file that can be locked
but still reads ``busy`` belongs to a dead owner, and :mod:`trajlab.sandbox.sweep` removes what it lists. As root the
lease file is named after the sandbox's uid, which also keeps two sandboxes (in any processes) from sharing a uid.

A lease file is deleted by its holder once everything it lists is gone; a locker checks that the file it locked is
still the one at its path, so a file deleted under it is never mistaken for a lease.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.uids import SANDBOX_UID_RANGE

_BUSY = b"busy "
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclasses.dataclass(frozen=True)
class Record:
    """What one sandbox made: everything :func:`trajlab.sandbox.sweep.remove_leftovers` must remove."""

    root: str  # the sandbox's directory (a tmpfs mount point when ``mounted``)
    uid: int | None = None  # its private uid, whose processes are killed
    mounted: bool = False
    cgroup: bool = False  # it has cgroups named after its directory
    cgroup_dirs: tuple[str, ...] = ()  # which (none listed: cgroup v1's, as leases recorded before v2)


def lease_dir() -> Path:
    """This user's lease directory, made on first use; refused unless private to the user."""
    directory = Path(tempfile.gettempdir()) / f"trajlab-sandbox-leases-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SandboxError(f"{directory} must be a directory owned by uid {os.geteuid()} with mode 0700")
    return directory


class Lease:
    """A lease file held under an exclusive flock until :meth:`release`."""

    def __init__(self, path: Path, fd: int, uid: int | None) -> None:
        self.path, self.uid, self._fd = path, uid, fd

    @classmethod
    def for_new_uid(cls) -> Lease:
        """Lease a free sandbox uid (the first of the range is kept for probes)."""
        directory = lease_dir()
        for _ in range(256):
            uid = SANDBOX_UID_RANGE[1 + secrets.randbelow(len(SANDBOX_UID_RANGE) - 1)]
            if (lease := try_lock(directory / f"uid-{uid}.lease", create=True, uid=uid)) is not None:
                return lease
        raise SandboxError(f"no free sandbox uid in {SANDBOX_UID_RANGE}")

    @classmethod
    def anonymous(cls) -> Lease:
        """A lease of a sandbox that runs as the host's own user."""
        path = lease_dir() / f"box-{secrets.token_hex(8)}.lease"
        if (lease := try_lock(path, create=True, uid=None)) is None:
            raise SandboxError(f"could not lock the new lease file {path}")
        return lease

    def left_over(self) -> Record | None:
        """The record of a dead holder that did not clean up, or None."""
        assert self._fd is not None
        content = os.pread(self._fd, 1 << 16, 0)
        if not content.startswith(_BUSY):
            return None
        try:
            return Record(**json.loads(content[len(_BUSY):]))
        except (ValueError, TypeError) as exc:
            raise SandboxError(f"lease file {self.path} is corrupt: {content[:200]!r}") from exc

    def record(self, record: Record) -> None:
        """Record what the sandbox is about to make, for the case that this process dies."""
        assert self._fd is not None
        content = _BUSY + json.dumps(dataclasses.asdict(record)).encode()
        os.pwrite(self._fd, content, 0)
        os.ftruncate(self._fd, len(content))

    def release(self, *, clean: bool) -> None:
        """Give the lease back (idempotent); ``clean``: everything recorded is gone, so the file goes too."""
        if self._fd is None:
            return
        if clean:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


def try_lock(path: Path, *, create: bool, uid: int | None) -> Lease | None:
    """Lock the lease file at ``path``, or None when another process holds it (or it vanished)."""
    try:
        fd = os.open(path, _OPEN_FLAGS | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(path)  # deleted (and perhaps made anew) by its last holder
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    return Lease(path, fd, uid)


def unlocked_leases() -> Iterator[Lease]:
    """Every lease file no live process holds, locked in turn; the caller releases each."""
    for path in sorted(lease_dir().glob("*.lease")):
        uid = int(path.stem.removeprefix("uid-")) if path.stem.startswith("uid-") else None
        if (lease := try_lock(path, create=False, uid=uid)) is not None:
            yield lease
