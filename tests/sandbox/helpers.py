"""What the sandbox tests share: fast limits, this machine's protections and modes, and leftover processes."""

from __future__ import annotations

import base64
import contextlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trajlab.sandbox import Sandbox, SandboxLimits, probe_protections
from trajlab.sandbox.session import SERVER_INSIDE

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
PROTECTIONS = probe_protections()
FAST = SandboxLimits(cpu_seconds=2, memory_bytes=512 << 20, file_size_bytes=1 << 20, max_processes=32,
                     wall_timeout_s=5.0, max_output_bytes=4096)
needs_private_uid = pytest.mark.skipif(not PROTECTIONS.private_uid, reason="sandboxes share the host's uid here")
needs_bwrap = pytest.mark.skipif(not PROTECTIONS.bubblewrap, reason="bubblewrap is missing or does not work here "
                                 "(scripts/setup_system.sh installs it as root)")
#: The ways of running commands, as :class:`Sandbox` options: bubblewrap (where it works) with the namespaces made
#: once per sandbox, bubblewrap started per command, and the fallback chain.
MODES = [pytest.param({}, id="bwrap", marks=needs_bwrap),
         pytest.param({"reuse_namespaces": False}, id="bwrap_per_command", marks=needs_bwrap),
         pytest.param({"use_bubblewrap": False}, id="chain")]
#: keyctl and add_key by machine (the C library wraps neither)
_KEY_CALLS = {"x86_64": (250, 248), "aarch64": (219, 217)}
KEYCTL, ADD_KEY = _KEY_CALLS.get(platform.machine(), (0, 0))
needs_key_calls = pytest.mark.skipif(not KEYCTL, reason=f"no keyctl call number known for {platform.machine()}")


def running(marker: str) -> str:
    """Processes whose command line holds ``marker``."""
    return subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout


def live_processes(marker: str) -> dict[int, str]:
    """Processes alive now (not zombies) whose command line holds ``marker``, by pid, read at once from ``/proc``:
    unlike :func:`running`, quick enough to see a process the kernel is still killing."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline, open(f"/proc/{pid}/stat") as stat:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # it exited meanwhile
            continue
        if marker in command and state != "Z":
            found[int(pid)] = command
    return found


def run_as_nobody(args: list[str], stdin: str = "", *, env: dict[str, str] | None = None,
                  timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` as the unprivileged user nobody, importing this checkout's trajlab and tests (the system's
    Python: the venv's belongs to root); skips the test where that cannot run."""
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if os.geteuid() != 0 or not os.path.exists(python) or shutil.which("setpriv") is None:
        pytest.skip(f"needs root with {python} and setpriv to run as an unprivileged user")
    packages = Path(sysconfig.get_paths()["purelib"])
    with _traversable(REPO, packages):
        return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, *args],
                              input=stdin, capture_output=True, text=True, cwd="/", timeout=timeout_s, check=False,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{packages}", **(env or {})})


@contextlib.contextmanager
def _traversable(*paths: Path) -> Iterator[None]:
    """Let other users pass through the folders above ``paths`` for the block (a clone in ``mktemp -d`` sits in a
    0700 folder, which would keep the unprivileged child from importing trajlab); their modes are restored after."""
    changed = {}
    for path in paths:
        for folder in Path(path).resolve().parents:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH and folder not in changed:
                changed[folder] = mode
                folder.chmod(mode | stat.S_IXOTH)
    try:
        yield
    finally:
        for folder, mode in changed.items():
            folder.chmod(stat.S_IMODE(mode))


def server_of(box: Sandbox) -> int:
    """The pid of ``box``'s command server: bwrap's child, bwrap being the process started in the sandbox's host
    directory (the server's own cwd is /sandbox, in its namespace). Another user's processes (the root tests') are
    skipped, as unreadable."""
    def cwd(pid: int) -> str:
        with contextlib.suppress(OSError):
            return os.readlink(f"/proc/{pid}/cwd")
        return ""

    def parent(pid: int) -> int:
        with contextlib.suppress(OSError):
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return 0

    return next(pid for pid in live_processes(SERVER_INSIDE)
                if cwd(parent(pid)) == str(box.path) and cwd(pid) != str(box.path))


def leftovers(marker: str) -> str:
    """Processes whose command line holds ``marker``, waiting a little for killed ones to be reaped."""
    deadline = time.monotonic() + 2.0
    while (found := running(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def escape_command(marker: str) -> str:
    """Start a sleeper that leaves the command's process group (and its pipes), then give it time to do so."""
    return f"setsid sleep {marker} > /dev/null 2>&1 < /dev/null & sleep 0.2"


#: Pins SysV shared memory, 64 MiB a segment up to 1 GiB, touching every page and leaving the segments behind when it
#: exits; prints how many bytes it holds after each segment.
SYSV_PIN = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype, libc.shmat.argtypes = ctypes.c_void_p, (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
held = 0
for _ in range(16):
    segment = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    address = libc.shmat(segment, None, 0) if segment >= 0 else None
    if address in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(address, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(address))
    held += 64 << 20
    print(held, flush=True)
"""


def sysv_pin_command() -> str:
    """:data:`SYSV_PIN` as a shell command (the sandbox's Python reads it from stdin)."""
    return f"echo {base64.b64encode(SYSV_PIN.encode()).decode()} | base64 -d | python3 -"


#: What a command reads to learn where its sandbox lives on the host, one read at a time (whole mount tables would go
#: over a test's output cap): the root and mount point of each mount, each mount's source and mount point.
WHERE_AM_I = ("cut -d' ' -f4,5 /proc/self/mountinfo", "cut -d' ' -f4,5 /proc/1/mountinfo",
              "cut -d' ' -f1,2 /proc/self/mounts", "pwd; echo $HOME; echo $TMPDIR")


def host_paths_seen(box: Sandbox) -> list[str]:
    """The host paths a command of ``box`` finds in its mount tables, working directory and environment: the
    sandbox's host directory, any sandbox's (as root under ``/run``, without under ``/tmp``), this checkout, and what
    the host's ``/etc`` symlinks point to (a bind of one shows its target)."""
    results = [box.run(command) for command in WHERE_AM_I]
    assert all(result.exit_code == 0 and not result.stdout_truncated for result in results), results
    seen = "".join(result.stdout for result in results)
    needles = {str(box.path), "/run/trajlab-sandboxes", "trajlab-sandbox-", str(REPO)}
    needles |= {os.path.realpath(f"/etc/{name}") for name in ("localtime", "os-release")
                if os.path.islink(f"/etc/{name}")}
    return sorted(needle for needle in needles if needle in seen)
