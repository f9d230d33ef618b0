"""The host's reads and writes of files inside a sandbox directory, which the sandbox's commands also control.

Why: the host writes a task's files into the sandbox and reads results back, with its own privileges, in a directory
where a command may have planted symlinks or hard links to host files. Every path is walked one component at a time
from a directory descriptor without following links, and only a regular file with no other link is read or written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from trajlab.sandbox.errors import SandboxPathError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclasses.dataclass(frozen=True)
class InsidePath:
    """A relative path that stays inside the sandbox directory: as given (for messages) and as its components."""

    text: str
    parts: tuple[str, ...]


def inside_path(path: str) -> InsidePath:
    """``path`` checked to be relative and free of ``..``.

    Raises:
        SandboxPathError: the path is absolute, empty, climbs out with ``..``, or holds a NUL byte or a character
            with no bytes (a lone surrogate).
    """
    try:
        unnamable = b"\0" in os.fsencode(path)
    except UnicodeEncodeError:
        unnamable = True
    if unnamable:
        raise SandboxPathError(f"{path!r} cannot name a file: it holds a NUL byte or a character that has no bytes "
                               "(a lone surrogate); give the path as plain text")
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise SandboxPathError(f"{path!r} is not a relative path inside the sandbox directory")
    return InsidePath(path, parts)


def write_file(directory: Path, path: InsidePath, content: str | bytes, *, owner: int | None) -> Path:
    """Write a file under ``directory``, creating parent directories (given to ``owner`` when not None)."""
    data = content.encode() if isinstance(content, str) else content
    with _open_dir(directory, path, create=True, owner=owner) as dir_fd:
        fd = _open_file(path.parts[-1], dir_fd, os.O_WRONLY | os.O_CREAT, path.text)
        with os.fdopen(fd, "wb") as file:
            file.truncate()
            file.write(data)
            if owner is not None:
                os.fchown(fd, owner, owner)
    return directory.joinpath(*path.parts)


def read_file(directory: Path, path: InsidePath) -> bytes:
    """Read a file under ``directory``."""
    with _open_dir(directory, path, create=False, owner=None) as dir_fd:
        fd = _open_file(path.parts[-1], dir_fd, os.O_RDONLY, path.text)
        with os.fdopen(fd, "rb") as file:
            return file.read()


@contextlib.contextmanager
def _open_dir(directory: Path, path: InsidePath, *, create: bool, owner: int | None) -> Iterator[int]:
    """An fd of the directory holding ``path``, walked one component at a time without following links."""
    fd = _open_at(str(directory), None, _DIR_FLAGS, path.text)
    try:
        for part in path.parts[:-1]:
            made = create and _mkdir_at(part, fd)
            child = _open_at(part, fd, _DIR_FLAGS, path.text)
            os.close(fd)
            fd = child
            if made and owner is not None:
                os.fchown(fd, owner, owner)
        yield fd
    finally:
        os.close(fd)


def _open_file(name: str, dir_fd: int, flags: int, path: str) -> int:
    """A regular file's descriptor; anything else there (a FIFO, which would block or fail with ENXIO, a directory,
    a socket, a device) is refused before it is opened."""
    with contextlib.suppress(FileNotFoundError):  # a new file, for a write
        _require_regular(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), path)
    fd = _open_at(name, dir_fd, flags | _FILE_FLAGS, path)
    try:
        _require_regular(os.fstat(fd), path)
    except SandboxPathError:
        os.close(fd)
        raise
    return fd


def _require_regular(info: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        raise SandboxPathError(f"{path!r} is not a regular file of the sandbox (a directory, FIFO, socket, symlink, "
                               "device or a file hard-linked from elsewhere): only regular files are read or written")


def _mkdir_at(name: str, dir_fd: int) -> bool:
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def _open_at(name: str, dir_fd: int | None, flags: int, path: str, mode: int = 0o600) -> int:
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SandboxPathError(f"{path!r} goes through a symlink or a non-directory") from exc
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # replaced by a FIFO, socket or directory since its lstat
            raise SandboxPathError(f"{path!r} is not a regular file of the sandbox") from exc
        if exc.errno == errno.EACCES:  # a host without root, whose uid commands share, meets their chmod
            raise SandboxPathError(f"{path!r}: a command took away the permission to open it (or a directory on "
                                   "the way)") from exc
        raise
