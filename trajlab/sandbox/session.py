"""A sandbox's long-lived bubblewrap: its namespaces made once, its commands started inside by the command server.

Why: making seven namespaces and about 40 mounts for every command capped a sandbox at about 100 commands/s on 2
cores. Here bwrap starts once per sandbox (lazily, on its first command) with :mod:`trajlab.sandbox.command_server`
as the PID namespace's init, and each command is its child (vfork and exec), writing straight into the host's
pipes. What a command left running is killed before its call returns, as with one bwrap per command; so is a command
that times out (the host signals the server), and the namespace stays. A command whose output cannot be read to the
end, or a server that does not answer, takes the whole namespace with it, and the next command starts a new one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from trajlab.sandbox.bwrap import PRIVATE_TMP_DIRS, TMPFS_MODE, PidNamespace
from trajlab.sandbox.disk_quota import DIR_MODE
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import COMMAND_UMASK, HELPER_TIMEOUT_S, SandboxLimits
from trajlab.sandbox.process import SandboxResult, pump, stdin_file

#: The server's source, and where commands' namespaces see it (a read-only copy: the sandbox's uid may not be able to
#: reach the installed file, in a clone under a private directory, say).
SERVER_SOURCE = Path(__file__).with_name("command_server.py")
SERVER_INSIDE = "/run/trajlab/command_server.py"


def confinement(uid: int | None, tmp_bytes: int, tmp_inodes: int, *, work: Path | None = None, tmp: bool = True,
                sysctl: dict[str, int] | None = None) -> dict:
    """The command server's SETUP for :func:`~trajlab.sandbox.command_server._confine`: the private tmp dirs (with
    ``tmp``; and ``work``, the working directory, when given) as tmpfs of ``tmp_bytes`` and ``tmp_inodes`` each, the
    ``/proc/sys`` values of ``sysctl`` (the IPC namespace's limits), and commands running as ``uid`` (None: the host's
    own user)."""
    uid_, gid = (os.getuid(), os.getgid()) if uid is None else (uid, uid)
    tmpfs = [[directory, tmp_bytes, tmp_inodes, TMPFS_MODE] for directory in PRIVATE_TMP_DIRS] if tmp else []
    if work is not None:
        tmpfs.append([str(work), tmp_bytes, tmp_inodes, DIR_MODE])
    return {"tmpfs": tmpfs, "sysctl": sysctl or {}, "uid": uid_, "gid": gid}


def confined_exec_argv(python: str, setup: dict) -> list[str]:
    """argv (inside bwrap) that gives the rest a new session keyring and ``setup``'s confinement (none for ``{}``),
    as the command server gives its commands, then runs it: for one bwrap per command."""
    return [python, "-I", "-S", "-c", _server_source().decode(), "--exec", json.dumps(setup)]
_MAX_REPLY_BYTES = 4096


class CommandSession:
    """One long-lived bwrap running the command server, for one sandbox's commands, one at a time.

    Args:
        launch_prefix: builds the argv that starts bwrap (with the server as PID 1), up to the server's own argv, given
            the namespace watch to report to and the descriptor bwrap reads the server's source from.
        python: the interpreter that runs the server, as commands see it.
        cwd, env: the server's (and each command's) working directory and environment.
        kill_leftovers: kills what the sandbox's uid or cgroups still run, when the namespace is torn down.
        setup: the server's confinement (:func:`confinement`), for a bwrap started with ``confine``; None: none.
        keeps_files: the namespace holds the sandbox's files (``setup`` mounts its working directory), so a second
            server, which would start with none of them, is refused.
    """

    def __init__(self, launch_prefix: Callable[[PidNamespace, int], list[str]], python: str, *, cwd: Path,
                 env: dict[str, str], kill_leftovers: Callable[[], None], setup: dict | None = None,
                 keeps_files: bool = False) -> None:
        self._launch_prefix, self._python = launch_prefix, python
        self._setup = json.dumps(setup or {})
        self._keeps_files = keeps_files
        self._started = False
        self._cwd, self._env = cwd, env
        self._kill_leftovers = kill_leftovers
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._pid_namespace: PidNamespace | None = None

    def run(self, argv: list[str], stdin: str | None, limits: SandboxLimits) -> SandboxResult:
        """Run ``argv`` (which applies its own rlimits) as the server's child, within ``limits``' wall timeout and
        output cap.

        A server that died before it took the command (killed from outside since the last one) is replaced, and the
        command sent again.
        """
        started = time.monotonic()
        request = json.dumps({"argv": argv, "env": self._env}).encode()
        for _ in range(2):
            control = self._running_control()
            if (result := self._run_once(control, request, stdin, limits, started)) is not None:
                return result
            self.close()
        raise SandboxError("a sandbox's command server died twice before it could take a command")

    def wipe(self, directories: list[tuple[str, int | None]]) -> None:
        """Between commands, delete what they left for the next user: every file below ``directories`` (each given
        its mode, or kept as it is for None), the IPC namespace's SysV objects and the uid's keyrings
        (:func:`trajlab.sandbox.command_server._wipe`); a :class:`SandboxError` when anything is left."""
        control = self._running_control()
        try:
            control.send(json.dumps({"wipe": directories}).encode())
            ready = select.select([control], [], [], HELPER_TIMEOUT_S)[0]
            reply = json.loads(control.recv(_MAX_REPLY_BYTES)) if ready else None
        except (OSError, ValueError) as exc:  # the server died (b"" is no JSON)
            reply = exc
        if not isinstance(reply, dict) or reply.get("left") != 0:
            self.close()
            raise SandboxError(f"a sandbox could not be wiped for its next user: {reply or 'no reply'}")

    def _run_once(self, control: socket.socket, request: bytes, stdin: str | None, limits: SandboxLimits,
                  started: float) -> SandboxResult | None:
        """The command's result, or None when the server was gone before it started the command."""
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            with stdin_file(stdin) as source:
                socket.send_fds(control, [request], [source.fileno(), out_write, err_write])
        except OSError:
            os.close(out_read)
            os.close(err_read)
            return None
        finally:
            os.close(out_write)
            os.close(err_write)
        end = _ServerEnd(control)
        with open(out_read, "rb", buffering=0) as stdout, open(err_read, "rb", buffering=0) as stderr:
            pumped = pump(stdout, stderr, end, started + limits.wall_timeout_s, limits.max_output_bytes)
        if end.status is not None and pumped.drained:
            return pumped.result(os.waitstatus_to_exitcode(end.status), started)
        if not end.started and not pumped.timed_out:
            return None
        if not (pumped.timed_out and self._end_command(end)):
            self.close()  # output held open, the server died while the command ran, or it could not end the command
        return pumped.result(-signal.SIGKILL, started)

    def _end_command(self, end: _ServerEnd) -> bool:
        """Have the server kill a command past its time (and everything it started), keeping the namespace; whether
        the server reported it ended."""
        assert self._pid_namespace is not None
        if not self._pid_namespace.signal_init(signal.SIGUSR1):
            return False
        deadline = time.monotonic() + HELPER_TIMEOUT_S
        while not end.ended():
            if not select.select([self._control], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return False
        return end.status is not None

    def host_root(self) -> Path:
        """Where the host sees the namespace's root: ``/proc/<server>/root``. The server is started first when none
        runs. A :class:`SandboxError` when a server was lost since the first one started: with ``keeps_files``, its
        mounts held files that are gone."""
        self._running_control()
        assert self._pid_namespace is not None and self._pid_namespace.init_pid is not None
        return Path(f"/proc/{self._pid_namespace.init_pid}/root")

    def close(self) -> None:
        """Kill the namespace (the server and whatever runs) and wait until nothing of it is left. Idempotent."""
        if self._process is None:
            return
        process, self._process = self._process, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        self._kill_leftovers()
        process.wait()
        assert process.stderr is not None and self._control is not None and self._pid_namespace is not None
        process.stderr.close()
        self._control.close()
        self._pid_namespace.wait_for_end()

    def _running_control(self) -> socket.socket:
        """The control socket of the running server, started first when there is none."""
        if self._process is None:
            if self._started and self._keeps_files:
                raise SandboxError("the sandbox's command server died, and its working directory (a tmpfs of its "
                                   "namespace) with it; clean this sandbox up and use a new one")
            self._started = True
            return self._start()
        assert self._control is not None
        return self._control

    def _start(self) -> socket.socket:
        host_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid_namespace = PidNamespace()
        source = _source_pipe()
        argv = [*self._launch_prefix(pid_namespace, source), self._python, "-I", "-S", SERVER_INSIDE,
                str(server_end.fileno()), self._setup]
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, cwd=self._cwd, env=self._env, umask=COMMAND_UMASK,
                                       start_new_session=True,
                                       pass_fds=(server_end.fileno(), pid_namespace.info_fd, source))
        except OSError as exc:
            pid_namespace.abandon()
            host_end.close()
            raise SandboxError(f"could not start a sandbox's command server: {exc}") from exc
        finally:
            server_end.close()
            os.close(source)
        self._process, self._control, self._pid_namespace = process, host_end, pid_namespace
        pid_namespace.attach(process.pid, HELPER_TIMEOUT_S)
        ready = select.select([host_end], [], [], HELPER_TIMEOUT_S)[0] and host_end.recv(_MAX_REPLY_BYTES)
        if ready != b'{"ready": true}':
            assert process.stderr is not None
            os.killpg(process.pid, signal.SIGKILL)
            why = process.stderr.read(_MAX_REPLY_BYTES).decode(errors="replace").strip()
            self.close()
            raise SandboxError(f"a sandbox's command server did not start: {why or 'no reply'}")
        return host_end


def _source_pipe() -> int:
    """A pipe holding the server's source, read to its end by bwrap (``--ro-bind-data``)."""
    read, write = os.pipe()
    try:
        os.write(write, _server_source())  # a few KiB: within the pipe's buffer
    finally:
        os.close(write)
    return read


@functools.cache
def _server_source() -> bytes:
    return SERVER_SOURCE.read_bytes()


class _ServerEnd:
    """The server's replies on one command: that it started, then that it ended and nothing of it is left (or the
    end of the socket: the server died)."""

    def __init__(self, control: socket.socket) -> None:
        self._control = control
        self.fd: int | None = control.fileno()
        self.started = False
        self.status: int | None = None  # the command's wait status; None when the server gave none

    def ended(self) -> bool:
        while True:
            try:
                reply = json.loads(self._control.recv(_MAX_REPLY_BYTES, socket.MSG_DONTWAIT))
            except BlockingIOError:
                return False
            except (OSError, ValueError):  # the socket broke, or b"" (the server died), or not its reply
                return True
            if reply == {"started": True} and not self.started:
                self.started = True
                continue
            status = reply.get("status") if isinstance(reply, dict) and self.started else None
            self.status = status if isinstance(status, int) and not isinstance(status, bool) else None
            return True
