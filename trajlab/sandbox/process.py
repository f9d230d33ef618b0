"""One launched command, run to its end: stdin from a file, output read under a cap, exit and timeout detected.

Why: an untrusted command may never read its input, write without end, close its output and keep running, or leave
children behind that hold its pipes open. Each case must end the call within the wall timeout, with what the command
printed, and kill what it left in its process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Protocol

from trajlab.sandbox.bwrap import PidNamespace
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import COMMAND_UMASK, SandboxLimits

_READ_CHUNK = 1 << 16
_POLL_S = 0.05  # how often to check whether the command exited while its pipes stay open
_EXIT_GRACE_S = 0.2  # how long to drain output after the command exited and its process group was killed


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one command did. ``exit_code`` follows :mod:`subprocess`: ``-N`` when signal N killed the command."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float

    @property
    def signal(self) -> str | None:
        """Name of the signal that killed the command (``SIGXCPU``: CPU limit, ``SIGXFSZ``: file size limit)."""
        if self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:  # a real-time signal has no name
            return f"signal {-self.exit_code}"


#: The exit code of a command that could not be started, as a shell reports one.
CANNOT_RUN = 127


def unsendable(argv: list[str], stdin: str | None) -> SandboxResult | None:
    """The result of a command no program can receive, or None when it can be run.

    Why: an argument with a NUL byte or a lone surrogate has no bytes that exec can pass (Python raises ValueError).
    It is the command's own fault, e.g. a model's output, so the caller gets it as a failed command (exit code 127,
    the reason on stderr), never as the sandbox's error, which would end the episode as ``error``.
    """
    if not all(_has_bytes(arg) and "\0" not in arg for arg in argv):
        what = "command holds a NUL byte or a character with no bytes (a lone surrogate)"
    elif stdin is not None and not _has_bytes(stdin):
        what = "stdin holds a character with no bytes (a lone surrogate)"
    else:
        return None
    return SandboxResult(exit_code=CANNOT_RUN, stdout="", stderr=f"sh: the {what}, which no program can receive\n",
                         timed_out=False, stdout_truncated=False, stderr_truncated=False, wall_s=0.0)


def _has_bytes(text: str) -> bool:
    """Whether ``text`` encodes as arguments and stdin are passed (UTF-8, undecodable bytes kept as surrogates)."""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True


def run_process(argv: list[str], stdin: str | None, *, cwd: Path, env: dict[str, str], limits: SandboxLimits,
                kill_leftovers: Callable[[], None], pid_namespace: PidNamespace | None = None) -> SandboxResult:
    """Run ``argv`` in a new session and wait for it, within ``limits``' wall timeout and output cap.

    The command ends when its first process exits: whatever it left running in its process group is killed, and
    ``kill_leftovers`` is called when its output could not be read to the end. When ``argv`` runs bwrap with
    ``pid_namespace``'s options, the call returns only once everything in that namespace died.
    """
    started = time.monotonic()
    pass_fds = (pid_namespace.info_fd,) if pid_namespace is not None else ()
    with stdin_file(stdin) as source:
        try:
            process = subprocess.Popen(argv, stdin=source, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                       env=env, umask=COMMAND_UMASK, start_new_session=True, pass_fds=pass_fds)
        except OSError as exc:  # the host could not start it (no processes or memory left, a launcher gone)
            if pid_namespace is not None:
                pid_namespace.abandon()
            raise SandboxError(f"could not start a sandbox command: {exc}") from exc
    drained = False
    end = _ProcessEnd(process)
    try:
        if pid_namespace is not None:
            pid_namespace.attach(process.pid, limits.wall_timeout_s)
        assert process.stdout is not None and process.stderr is not None
        pumped = pump(process.stdout, process.stderr, end, started + limits.wall_timeout_s, limits.max_output_bytes)
        drained = pumped.drained
    finally:
        end.close()
        _kill_group(process.pid)
        if not drained:  # something that left the process group may still hold the pipes
            kill_leftovers()
        process.wait()
        for pipe in (process.stdout, process.stderr):
            pipe.close()
        if pid_namespace is not None:
            pid_namespace.wait_for_end()
    return pumped.result(process.returncode, started)


class CommandEnd(Protocol):
    """How :func:`pump` learns that the command's first process exited."""

    #: Readable once the command may have ended; None: :meth:`ended` is polled.
    fd: int | None

    def ended(self) -> bool:
        """Whether the command ended, without blocking."""
        ...


class _ProcessEnd:
    """The end of a launched process; its process group is killed at once, so that background children cannot hold
    the pipes open."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._pid = process.pid
        self.fd = _pidfd(process.pid)

    def ended(self) -> bool:
        if not _has_exited(self._pid):
            return False
        _kill_group(self._pid)
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` exited, without reaping it: its process group id stays reserved until :meth:`Popen.wait`."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


@contextlib.contextmanager
def stdin_file(text: str | None) -> Iterator[IO[bytes]]:
    """A file for the command's stdin (``/dev/null`` for None): unlike a pipe, it cannot block the host when the
    command does not read it."""
    if text is None:
        with open(os.devnull, "rb") as devnull:
            yield devnull
        return
    with tempfile.TemporaryFile() as file:
        file.write(os.fsencode(text))  # as arguments are: bytes that were not UTF-8 kept
        file.seek(0)
        yield file


class _Capture:
    """Output of one stream, keeping at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    def feed(self, chunk: bytes) -> bool:
        """Keep what fits; False once the stream went over the limit."""
        room = self.limit - len(self.data)
        self.data += chunk[:room]
        self.truncated = len(chunk) > room
        return not self.truncated

    def text(self) -> str:
        return self.data.decode(errors="replace")


@dataclasses.dataclass
class Pumped:
    """What :func:`pump` read, and how the command ended."""

    stdout: _Capture
    stderr: _Capture
    timed_out: bool = False
    drained: bool = True  # every pipe reached end of file or was closed for going over the output cap

    def result(self, exit_code: int, started: float) -> SandboxResult:
        return SandboxResult(exit_code=exit_code, stdout=self.stdout.text(), stderr=self.stderr.text(),
                             timed_out=self.timed_out, stdout_truncated=self.stdout.truncated,
                             stderr_truncated=self.stderr.truncated, wall_s=time.monotonic() - started)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), or None: then exits are polled."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def pump(stdout: IO[bytes], stderr: IO[bytes], end: CommandEnd, deadline: float, limit: int) -> Pumped:
    """Read the command's stdout and stderr until it ended and both pipes closed, or the deadline passes.

    Pipes still open a short grace after the command ended belong to a process that left it. A stream going over
    the output cap is closed: its writer then gets SIGPIPE/EPIPE, as with ``| head -c``.
    """
    pumped = Pumped(_Capture(limit), _Capture(limit))
    captures = {stdout: pumped.stdout, stderr: pumped.stderr}
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for pipe in captures:
            selector.register(pipe, selectors.EVENT_READ)
        end_fd = end.fd
        if end_fd is not None:
            selector.register(end_fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now >= deadline:
                pumped.timed_out, pumped.drained = exited_at is None, False
                return pumped
            if exited_at is None and end.ended():
                exited_at = now
                if end_fd is not None:
                    selector.unregister(end_fd)
            if exited_at is not None and (not captures or now - exited_at >= _EXIT_GRACE_S):
                pumped.drained = not captures
                return pumped
            if exited_at is not None:
                timeout = exited_at + _EXIT_GRACE_S - now
            else:
                timeout = deadline - now if end_fd is not None else _POLL_S
            for key, _ in selector.select(min(timeout, deadline - now)):
                if key.fileobj in captures:
                    _read_into(selector, key.fileobj, captures)


def _read_into(selector: selectors.BaseSelector, pipe: IO[bytes], captures: dict[IO[bytes], _Capture]) -> None:
    """Read what ``pipe`` has; on end of file or output over the cap, stop watching it and close it."""
    chunk = os.read(pipe.fileno(), _READ_CHUNK)
    if not chunk or not captures[pipe].feed(chunk):
        selector.unregister(pipe)
        pipe.close()
        del captures[pipe]
