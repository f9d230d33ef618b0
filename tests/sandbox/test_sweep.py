"""Nothing a sandbox makes outlives its owner: not after cleanup, and not after the host is killed mid-command (the
next start-up sweep removes what was left)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.sandbox.helpers import FAST, MODES, leftovers, needs_bwrap, needs_private_uid, running
from trajlab.sandbox import Sandbox
from trajlab.sandbox.cgroups import CGROUP_ROOT, PARENT
from trajlab.sandbox.leases import lease_dir

# The host: makes a sandbox, starts a command that leaves a daemon (setsid), an IPC object and a file, then waits.
HOST = """
import sys
from trajlab.sandbox import Sandbox, SandboxLimits
box = Sandbox(SandboxLimits(wall_timeout_s=60), use_bubblewrap=sys.argv[1] == "True")
print(box.path, box.uid, flush=True)
box.run("setsid sleep {marker} > /dev/null 2>&1 < /dev/null & ipcmk -Q > /dev/null; touch made; sleep {marker}")
"""


# The host: makes a sandbox, runs one command (which starts its command server) and waits, idle.
IDLE_HOST = """
import time
from trajlab.sandbox import Sandbox
box = Sandbox()
box.run("touch made")
print(box.path, box.uid, flush=True)
time.sleep(60)
"""


def traces(path: Path, uid: str) -> list[str]:
    """What of the sandbox at ``path`` is still on the host: its directory, mount, cgroups and lease file."""
    root = path.parent if path.name == "work" else path
    found = [str(p) for p in (path, root) if p.exists()]
    found += [str(root)] if os.path.ismount(root) else []
    found += [str(d) for c in ("memory", "pids") if (d := CGROUP_ROOT / c / PARENT / root.name).exists()]
    lease = lease_dir() / f"uid-{uid}.lease"
    return found + ([str(lease)] if uid != "None" and lease.exists() else [])


def ipcs() -> str:
    return subprocess.run(["ipcs"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("mode", MODES)
def test_cleanup_leaves_nothing(mode: dict[str, bool]) -> None:
    before = ipcs()
    box = Sandbox(FAST, **mode)
    box.run("ipcmk -Q; echo x > /tmp/f; mkdir -p a/b && touch a/b/c")
    assert traces(box.path, str(box.uid)) != []
    box.cleanup()
    assert traces(box.path, str(box.uid)) == [] and ipcs() == before


@pytest.mark.parametrize("use_bubblewrap", [pytest.param(True, marks=MODES[0].marks, id="bwrap"),
                                            pytest.param(False, marks=needs_private_uid, id="chain")])
def test_a_killed_host_leaves_nothing_after_the_next_start_up_sweep(use_bubblewrap: bool) -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    before = ipcs()
    host = subprocess.Popen([sys.executable, "-c", HOST.format(marker=marker), str(use_bubblewrap)],
                            stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    try:
        path_text, uid = host.stdout.readline().split()
        path = Path(path_text)
        deadline = time.monotonic() + 10
        while not (path / "made").exists() or running(marker).count(marker) < 2:
            assert time.monotonic() < deadline, "the host's command did not start"
            time.sleep(0.05)
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    if use_bubblewrap:
        assert leftovers(marker) == "", "--die-with-parent: the command died with its host"
    assert traces(path, uid) != [], "a killed host cannot clean up: the sweep has work to do"
    subprocess.run([sys.executable, "-c", "from trajlab.sandbox import sweep; sweep()"], check=True)
    assert leftovers(marker) == ""
    assert traces(path, uid) == []
    assert ipcs() == before


@needs_bwrap
def test_a_killed_host_leaves_no_idle_command_server_behind() -> None:
    host = subprocess.Popen([sys.executable, "-c", IDLE_HOST], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    try:
        path_text, uid = host.stdout.readline().split()
        path = Path(path_text)
        assert (path / "made").exists() and processes_in(path) != [], "the command server waits for the next command"
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    deadline = time.monotonic() + 2.0
    while processes_in(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_in(path) == [], "--die-with-parent: the command server died with its host"
    subprocess.run([sys.executable, "-c", "from trajlab.sandbox import sweep; sweep()"], check=True)
    assert traces(path, uid) == []


def processes_in(path: Path) -> list[int]:
    """The processes whose working directory is ``path``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/cwd") == str(path):
                found.append(int(pid))
    return found
