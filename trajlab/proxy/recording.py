"""Per-session call recordings: one JSONL file per session, one line per call, fsynced before the response.

Each line is a plain JSON object (its fields are listed in docs/recording-server.md): the request as
received, the exact prompt token ids, and per choice the completion token ids, their logprobs, the finish reason
and the parsed message, so an exporter can later rebuild each session's append-only token history. The images a
session's requests held live beside its file, in ``<session>.images/`` (as a trajectory file's do), one PNG per image
named by its hash; the lines name them by that id and never hold their bytes.

Writes go through ``O_APPEND`` under a per-session thread lock and an advisory file lock, so concurrent calls of
one session (from threads or from several server processes) never interleave within a line, and calls of
different sessions never touch the same file. A crash can only cut the line being written; the torn tail is
dropped the next time the file is opened for writing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trajlab.data.store import image_dir, write_images

SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
RECORD_SCHEMA = "trajlab.proxy.call/1"


def valid_session_id(session_id: str) -> bool:
    return SESSION_ID.fullmatch(session_id) is not None


class SessionRecorder:
    """Appends call records to ``<root>/<session_id>.jsonl``.

    Args:
        root: directory of the session files; created on first write.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._locks: dict[str, threading.Lock] = {}
        self._repaired: set[str] = set()
        self._guard = threading.Lock()

    def path(self, session_id: str) -> Path:
        if not valid_session_id(session_id):  # the app checks first; this keeps the file inside root regardless
            raise ValueError(f"invalid session id {session_id!r}")
        return self.root / f"{session_id}.jsonl"

    def append(self, session_id: str, record: dict[str, Any], images: Mapping[str, bytes] | None = None) -> None:
        """Write one record as one line of the session's file, durably, before returning; ``images`` (PNG bytes by
        id) are written to the session's image folder first, so no line names an image that is not there."""
        path = self.path(session_id)
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode()
        with self._guard:
            lock = self._locks.setdefault(session_id, threading.Lock())
        with lock:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if images:
                    write_images(image_dir(path), images, images.__getitem__)
                if session_id not in self._repaired:
                    _drop_torn_tail(fd)
                    self._repaired.add(session_id)
                written = os.write(fd, line)
                if written != len(line):
                    self._repaired.discard(session_id)  # cut the partial line before the next record
                    raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
                os.fsync(fd)
            finally:
                os.close(fd)  # closing releases the file lock


def _drop_torn_tail(fd: int) -> None:
    """Cut a last line without its newline (left by a crash mid-write), so the next record starts a fresh line."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    complete, offset = 0, 0
    while chunk := os.pread(fd, 1 << 20, offset):
        if (at := chunk.rfind(b"\n")) != -1:
            complete = offset + at + 1
        offset += len(chunk)
    os.ftruncate(fd, complete)


def read_session(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every complete record of a session file, in the order written (a torn last line is skipped)."""
    with open(path, "rb") as handle:
        for raw in handle:
            if raw.endswith(b"\n"):
                yield json.loads(raw)
