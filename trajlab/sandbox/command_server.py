"""The command server: PID 1 of a sandbox's long-lived bubblewrap namespaces, running its commands one at a time.

Why: starting bwrap (seven namespaces, about 40 mounts) costs about 10 ms a command; spawning from a process already
inside costs about 1 ms. As the PID namespace's init the server cannot be killed or stopped from inside (the kernel
drops signals sent to an init from its own namespace unless it handles them), and, made non-dumpable, commands that
run as its uid cannot trace it or open its descriptors. After each command's first process exits, it kills everything
else in the namespace and reaps it: nothing a command starts outlives it, as under one bwrap per command.

It runs under the system's ``python3 -I -S`` with the standard library only (trajlab is not visible inside). The
host's socket (SOCK_SEQPACKET) is the descriptor named by its one argument. Per command the host sends a JSON request
(argv, env) with the command's stdin, stdout and stderr as ancillary descriptors; the server
answers ``{"started": true}`` once it started the command and ``{"status": <wait status>}`` once nothing of the command
is left. It exits when the host closes the socket.
"""

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys

_PR_SET_DUMPABLE = 4
_CANNOT_RUN = 127 << 8  # the wait status of exit code 127
_MAX_REQUEST_BYTES = 1 << 20
_STREAMS = 3  # stdin, stdout, stderr


def main() -> None:
    # Python's own handler would be a way for commands to interrupt their init (SIGINT); SIGPIPE and SIGXFSZ, which
    # Python ignores, are restored in each command.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_DUMPABLE) failed: {os.strerror(ctypes.get_errno())}")
    control = socket.socket(fileno=int(sys.argv[1]))
    control.set_inheritable(False)
    control.send(b'{"ready": true}')
    while True:
        message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST_BYTES, _STREAMS)
        if not message:
            return
        pid = _spawn(json.loads(message), fds)
        control.send(b'{"started": true}')
        status = os.waitpid(pid, 0)[1] if pid is not None else _CANNOT_RUN
        _kill_the_rest()
        control.send(json.dumps({"status": status}).encode())


def _spawn(request: dict, fds: list) -> int | None:
    """Start the command in its own session, in the server's directory, with ``fds`` as its stdin, stdout and
    stderr (vfork and exec: no copy of the server's memory); None when it could not be started."""
    argv = request["argv"]
    try:
        for fd in fds:
            os.set_inheritable(fd, False)  # the command gets them as 0, 1 and 2 only
        actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)]
        return os.posix_spawnp(argv[0], argv, request["env"], file_actions=actions, setsid=True,
                               setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:  # as a shell reports a command it cannot run
        os.write(fds[2], f"{argv[0]}: {exc.strerror}\n".encode(errors="replace"))
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _kill_the_rest() -> None:
    """Kill every other process of the namespace (kill(-1) from its init reaches all of them) and reap them."""
    with contextlib.suppress(ProcessLookupError):  # none alive; zombies may still be there
        os.kill(-1, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:  # every process of the namespace descends from its init: none is left
            return


if __name__ == "__main__":
    main()
