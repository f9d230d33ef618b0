"""Append-only trajectory store: one JSON object per line, fsynced as each episode finishes.

A crash (even ``kill -9``) can only cut the line being written; opening the store again drops that partial tail,
so earlier lines are never lost and a resumed run skips every episode id already on disk. One writer per file is
enforced with an advisory lock. Every line is checked against the schema it will be read with before it is written:
a trajectory that would not read back (a backend's tokens that are not integers) is stored as an ``error`` row
with the reason instead, so a file never holds a line that makes the next run refuse it.

The images a trajectory's model saw live beside the file, in ``<name>.images/`` (``trajectories.jsonl`` ->
``trajectories.images/``), one PNG per image named by its hash (:mod:`trajlab.rollout.images`); they are written
and synced before the line that names them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType

from pydantic import ValidationError

from trajlab.errors import UserError, refuse_special_file
from trajlab.rollout.types import TaskKey, Trajectory, task_key


class StoreError(ValueError):
    """A trajectory file has a bad line (not a torn tail): says which line and why."""


def image_dir(path: str | Path) -> Path:
    """The folder of a trajectory file's images."""
    return Path(path).with_suffix(".images")


def write_images(folder: Path, image_ids: Iterable[str], png: Callable[[str], bytes]) -> None:
    """Write the images that ``folder`` lacks (``png(id)`` gives one's bytes), each whole (a temporary file renamed)
    and synced, so that no line written afterwards names an image that is not there."""
    folder.mkdir(exist_ok=True)
    wrote = False
    for image_id in dict.fromkeys(image_ids):
        target = folder / image_id
        if target.exists():
            continue
        partial = folder / f".{image_id}.partial"
        try:
            with open(partial, "wb") as handle:
                handle.write(png(image_id))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        wrote = True
    if wrote:
        directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def read_trajectories(path: str | Path) -> Iterator[Trajectory]:
    """Every complete line of a trajectory file, validated (token invariant included).

    A final line without a newline is the torn tail of an interrupted write and is skipped.

    Raises:
        StoreError: a complete line that is not a valid trajectory, naming the file and line number.
        UserError: ``path`` is a directory, FIFO or device (a FIFO would block the reader for good).
        FileNotFoundError: there is no ``path``.
    """
    refuse_special_file(path, "a trajectory file (JSONL, as `trajlab collect` writes)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such trajectory file (JSONL, as `trajlab collect` writes)")
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.endswith(b"\n"):
                _check_torn_tail(raw, path, number)
                return
            yield _parse_line(raw, path, number)


def task_keys(path: str | Path) -> frozenset[TaskKey]:
    """The ``(env, task_id)`` keys of the tasks a trajectory file's episodes ran: what RL leaves out of its train
    tasks when they are SFT's demonstrations."""
    return frozenset(task_key(trajectory.env, trajectory.task) for trajectory in read_trajectories(path))


def _check_torn_tail(raw: bytes, path: str | Path, number: int) -> None:
    """A last line without a newline is a torn write only if it is the start of a record; anything else means the
    file is not a trajectory file, and repairing it would destroy it."""
    if not raw.lstrip().startswith(b"{"):
        raise StoreError(f"{path}:{number}: not a trajectory line (nor the torn start of one): is this a trajectory "
                         "file (JSONL, as `trajlab collect` writes)?")


def _parse_line(raw: bytes, path: str | Path, number: int) -> Trajectory:
    try:
        trajectory = Trajectory.model_validate_json(raw)
        if trajectory.images:
            trajectory.attach_images(directory=image_dir(path))
        return trajectory
    except ValidationError as exc:
        raise StoreError(f"{path}:{number}: not a valid trajectory: {_problems(exc)}") from exc


def _problems(error: ValidationError) -> str:
    """The first three problems of a validation error in one line, each with where it is."""
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in error.errors()[:3])
    return problems + (f" (and {error.error_count() - 3} more)" if error.error_count() > 3 else "")


def _line(trajectory: Trajectory) -> bytes:
    """The trajectory as the line to append, checked against the schema it is read back with.

    Raises:
        ValueError, TypeError: the line would not read back (pydantic's ``ValidationError``), or the trajectory holds
            values JSON cannot carry (the encoder's).
    """
    line = (json.dumps(trajectory.model_dump(mode="json", warnings=False), ensure_ascii=False) + "\n").encode()
    Trajectory.model_validate_json(line)
    return line


def _error_row(trajectory: Trajectory, problem: Exception) -> Trajectory:
    """What is stored of a trajectory whose line would not read back: the episode as an ``error`` (run again on
    resume, never trained on) with the reason, and none of the parts that could hold the bad values."""
    reason = _problems(problem) if isinstance(problem, ValidationError) else f"{type(problem).__name__}: {problem}"
    return Trajectory(id=trajectory.id, env=trajectory.env, task=trajectory.task, messages=[], tools=[], reward=0.0,
                      status="error", stop_reason="exception", policy=trajectory.policy, split=trajectory.split,
                      group=trajectory.group, error=f"not stored as it was: {reason}")


class TrajectoryStore:
    """Appends trajectories to a JSONL file; use as a context manager.

    Opening repairs a torn last line left by a crash, and ``ids`` holds every episode id already stored, so a
    resumed collection can skip them; ``errors`` those of episodes that ended in ``error`` (the machinery failed, not
    the policy), which a resumed collection runs again (:meth:`remove`).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.ids: set[str] = set()
        self.errors: set[str] = set()
        self._fd: int | None = None

    def __enter__(self) -> TrajectoryStore:
        try:  # a device never ends and a FIFO blocks: reading either back would never finish
            refuse_special_file(self.path, "the path of a trajectory file (JSONL)")
        except UserError as exc:
            raise StoreError(str(exc)) from None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._fd)
            self._fd = None
            raise StoreError(
                f"{self.path} is being written by another process; wait for it or use another --out."
            ) from exc
        try:
            self._repair_and_index()
        except StoreError:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock
            self._fd = None

    def _repair_and_index(self) -> None:
        complete = 0
        with open(self.path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if not raw.endswith(b"\n"):
                    _check_torn_tail(raw, self.path, number)
                    break
                self._index(_parse_line(raw, self.path, number))
                complete += len(raw)
        if complete < os.path.getsize(self.path):
            os.truncate(self.path, complete)

    def append(self, trajectory: Trajectory) -> None:
        """Write one trajectory as one line, durably, before returning; one that would not read back is written as
        an ``error`` row that says why (:func:`_error_row`).

        Raises:
            StoreError: the line could not be written whole (disk full, quota); the file is cut back to the
                episodes before it, so it stays valid and the same command resumes once there is room.
        """
        if self._fd is None:
            raise RuntimeError("TrajectoryStore is not open; use it as a context manager")
        if trajectory.id in self.ids:
            raise StoreError(f"episode {trajectory.id!r} is already in {self.path}")
        try:
            line = _line(trajectory)
        except (ValueError, TypeError) as exc:
            trajectory = _error_row(trajectory, exc)
            try:
                line = _line(trajectory)
            except (ValueError, TypeError) as again:  # the task itself cannot be stored: no row can say so
                raise StoreError(f"{self.path}: cannot store episode {trajectory.id!r}: {trajectory.error}; and its "
                                 f"task cannot be stored either ({type(again).__name__}: {again})") from again
        before = os.fstat(self._fd).st_size
        try:
            if trajectory.images:
                write_images(image_dir(self.path), trajectory.images, trajectory.image_png)
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({written} of {len(line)} bytes written)")
            os.fsync(self._fd)
        except OSError as exc:
            os.ftruncate(self._fd, before)  # frees what the partial line took; needs no new space
            raise StoreError(f"{self.path}: cannot store episode {trajectory.id!r} ({exc.strerror or exc}); the "
                             f"file keeps its {len(self.ids)} episodes before it. Free some space and run the same "
                             "command again: it resumes.") from exc
        self._index(trajectory)

    def _index(self, trajectory: Trajectory) -> None:
        self.ids.add(trajectory.id)
        if trajectory.status == "error":
            self.errors.add(trajectory.id)

    def remove(self, ids: set[str], keep_in: str | Path) -> list[Trajectory]:
        """Take the trajectories with these ids out of the file, appending them to ``keep_in`` first (so nothing
        is lost), and return them; a later run can then store those episodes again.

        The file is rewritten beside itself and renamed over the old one (atomic), and the lock moves to it.
        """
        if self._fd is None:
            raise RuntimeError("TrajectoryStore is not open; use it as a context manager")
        taken: list[Trajectory] = []
        kept: list[bytes] = []
        with open(self.path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                trajectory = _parse_line(raw, self.path, number)
                if trajectory.id in ids:
                    taken.append(trajectory)
                else:
                    kept.append(raw)
        if not taken:
            return []
        with TrajectoryStore(keep_in) as side:
            for trajectory in taken:
                side.ids.discard(trajectory.id)  # the same episode may have failed in several runs
                side.append(trajectory)
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "wb") as handle:
            handle.writelines(kept)
            handle.flush()
            os.fsync(handle.fileno())
        fd = os.open(partial, os.O_RDWR | os.O_APPEND)
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else knows this file yet
        os.replace(partial, self.path)
        os.close(self._fd)
        self._fd = fd
        self.ids -= ids
        self.errors -= ids
        return taken
