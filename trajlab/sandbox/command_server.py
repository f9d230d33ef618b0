"""The command server: PID 1 of a sandbox's long-lived bubblewrap namespaces, running its commands one at a time.

Why: starting bwrap (seven namespaces, about 40 mounts) costs about 10 ms a command; forking from a process already
inside costs about 1 ms. As the PID namespace's init the server cannot be killed or stopped from inside (the kernel
drops signals sent to an init from its own namespace unless it handles them), and, made non-dumpable, commands that
run as its uid cannot trace it or open its descriptors. After each command's first process exits, it kills everything
else in the namespace and reaps it: nothing a command starts outlives it, as under one bwrap per command.

It runs under the system's ``python3 -I -S`` with the standard library only (trajlab is not visible inside). The
host's socket (SOCK_SEQPACKET) is the descriptor named by its one argument. Per command the host sends a JSON request
(argv, env, cwd, umask, rlimits) with the command's stdin, stdout and stderr as ancillary descriptors; the server
answers ``{"started": true}`` once it forked the command and ``{"status": <wait status>}`` once nothing of the command
is left. It exits when the host closes the socket.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import socket
import sys

_PR_SET_DUMPABLE = 4
_MAX_REQUEST_BYTES = 1 << 20
_STREAMS = 3  # stdin, stdout, stderr


def main() -> None:
    # Python's own handler would be a way for commands to interrupt their init (SIGINT); SIGPIPE and SIGXFSZ, which
    # Python ignores, are restored in each command.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_DUMPABLE) failed: {os.strerror(ctypes.get_errno())}")
    control = socket.socket(fileno=int(sys.argv[1]))
    control.send(b'{"ready": true}')
    while True:
        message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST_BYTES, _STREAMS)
        if not message:
            return
        pid = os.fork()
        if pid == 0:
            _run(json.loads(message), fds)
        for fd in fds:
            os.close(fd)
        control.send(b'{"started": true}')
        _, status = os.waitpid(pid, 0)
        _kill_the_rest()
        control.send(json.dumps({"status": status}).encode())


def _run(request: dict, fds: list) -> None:
    """In the forked child: become the command (never returns)."""
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(_STREAMS, os.sysconf("SC_OPEN_MAX"))
        for name in ("SIGPIPE", "SIGXFSZ"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        os.umask(request["umask"])
        os.chdir(request["cwd"])
        for name, soft, hard in request["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.execvpe(request["argv"][0], request["argv"], request["env"])
    except BaseException as exc:  # as a shell reports a command it cannot run
        os.write(2, f"{request['argv'][0]}: {exc}\n".encode(errors="replace"))
    os._exit(127)


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
