"""Nothing a sandbox makes outlives its owner: not after cleanup, and not after the host is killed mid-command (the
next start-up sweep removes what was left)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.sandbox.helpers import FAST, MODES, leftovers, needs_bwrap, needs_private_uid, run_as_nobody, running
from trajlab.sandbox import Sandbox
from trajlab.sandbox.cgroups import CGROUP_ROOT, PARENT
from trajlab.sandbox.leases import Lease, Record, lease_dir
from trajlab.sandbox.sweep import DIR_PREFIX, remove_leftovers

sweep_module = sys.modules["trajlab.sandbox.sweep"]  # the package's name `sweep` is the function

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


def deep_tree(top: Path, levels: int = 2500) -> None:
    """A chain of ``levels`` directories below ``top`` (deeper than any recursion limit, and longer than PATH_MAX),
    every 500th unreadable, made one descriptor at a time."""
    fd, locked = os.open(top, os.O_RDONLY), []
    for level in range(levels):
        os.mkdir("deep", dir_fd=fd)
        fd, parent = os.open("deep", os.O_RDONLY, dir_fd=fd), fd
        with open(os.open("file", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as file:
            file.write("x")
        if level % 500 == 0:
            locked.append(parent)
        else:
            os.close(parent)
    for parent in [*locked, fd]:
        os.fchmod(parent, 0)
        os.close(parent)


def test_leftovers_of_any_depth_and_mode_are_removed_without_following_links(tmp_path: Path) -> None:
    """What a host's cleanup or sweep may meet in a sandbox directory it did not mount (an unprivileged host's, or a
    record of a dead one): shutil.rmtree raised RecursionError on the deep tree, and the lease and directory stayed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("host data")
    root = tmp_path / f"{DIR_PREFIX}deep"
    (root / "a" / "b").mkdir(parents=True)
    deep_tree(root / "a")
    (root / "a" / "b" / "to_dir").symlink_to(outside)
    (root / "to_file").symlink_to(outside / "keep")
    os.setxattr(root / "a" / "b", "user.stash", b"x")
    remove_leftovers(Record(str(root)))
    assert not root.exists()
    assert os.listdir(outside) == ["keep"] and (outside / "keep").read_text() == "host data", "links are not followed"


@pytest.mark.skipif(os.geteuid() != 0, reason="sets immutable flags and mounts, as root")
def test_immutable_files_and_mounts_below_are_removed_as_root(tmp_path: Path) -> None:
    """Root's own leftovers, which no command can make: a mount point (detached) and immutable or append-only files
    (their flags cleared, where the file system has them)."""
    root = tmp_path / f"{DIR_PREFIX}flags"
    (root / "a" / "mnt").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(root / "a" / "mnt")], check=True)
    try:
        (root / "a" / "mnt" / "on_tmpfs").write_text("x")
        (root / "a" / "flagged").write_text("x")
        for flag, path in (("+i", root / "a" / "flagged"), ("+a", root / "a")):
            done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
            assert done.returncode == 0 or "Operation not supported" in done.stderr, done.stderr
        remove_leftovers(Record(str(root)))
        assert not root.exists()
    finally:
        if os.path.ismount(root / "a" / "mnt"):
            subprocess.run(["umount", "--lazy", str(root / "a" / "mnt")], check=True)
            subprocess.run(["chattr", "-R", "-ia", str(root)], capture_output=True)


@pytest.mark.parametrize("failure", [RecursionError("maximum recursion depth exceeded"), OSError(16, "Busy")],
                         ids=["recursion", "oserror"])
def test_a_leftover_that_cannot_be_removed_is_quarantined_and_blocks_no_sandbox(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failure: Exception) -> None:
    """Whatever removing a dead sandbox's leftovers raises, the sweep logs it, moves the directory aside (renamed,
    private, where a person can find it) and sets its lease aside, so that no later sweep meets it again, and the
    process goes on making sandboxes. It raised RecursionError into every Sandbox() of that user."""
    stuck = tmp_path / f"{DIR_PREFIX}stuck"
    (stuck / "kept").mkdir(parents=True)
    lease = Lease.anonymous()
    lease.record(Record(str(stuck)))
    lease.release(clean=False)  # as a killed host leaves it
    def fail(*_: object) -> None:
        raise failure
    monkeypatch.setattr(sweep_module, "remove_leftovers", fail)
    sweep_module.sweep.__wrapped__()  # this process's own sweep ran already
    quarantined = tmp_path / "trajlab-quarantined-stuck"
    assert not stuck.exists() and (quarantined / "kept").is_dir()
    assert quarantined.stat().st_mode & 0o777 == 0o700 and quarantined.stat().st_uid == os.geteuid()
    assert str(quarantined) in caplog.text and type(failure).__name__ in caplog.text
    assert not lease.path.exists() and lease.path.with_suffix(".quarantined").exists()
    monkeypatch.undo()
    sweep_module.sweep.__wrapped__()
    assert (quarantined / "kept").is_dir() and lease.path.with_suffix(".quarantined").exists(), "no sweep meets it"
    lease.path.with_suffix(".quarantined").unlink()  # as the person would, having looked
    with Sandbox(FAST) as box:
        assert box.run("echo ok").stdout == "ok\n"


# As an unprivileged host (no tmpfs of its own: per command, the files lie on its disk): what a command made, of any
# depth and mode, and with a NUL byte in a command, in each mode; and what a pool's wipe leaves, as JSON.
UNPRIVILEGED = """
import json, os
from trajlab.sandbox import Sandbox, SandboxLimits
from trajlab.sandbox.pool import SandboxPool
from tests.sandbox.test_sweep import DEEP
limits = SandboxLimits(wall_timeout_s=20.0)
report = {}
for name, options in {"bwrap": {}, "bwrap_per_command": {"reuse_namespaces": False},
                      "chain": {"use_bubblewrap": False}}.items():
    box, report[name] = Sandbox(limits, **options), {}
    box.write_file("deep.py", DEEP)
    made = box.run("python3 deep.py")
    report[name]["made"] = made.stdout + made.stderr
    try:
        nul = box.run("echo a\\0b")
        report[name]["nul"] = [nul.exit_code, box.read_file("deep.py") == DEEP.encode()]
    except Exception as exc:
        report[name]["nul"] = repr(exc)[:200]
    box.run("chmod 0 deep.py")
    try:
        box.read_file("deep.py")
    except Exception as exc:  # the host's own uid, without root's override
        report[name]["unreadable"] = type(exc).__name__
    try:
        box.cleanup()
    except Exception as exc:
        report[name]["cleanup"] = repr(exc)[:200]
    report[name]["left"] = os.path.exists(box.path)
with SandboxPool(limits, keep=1) as pool:  # bwrap only: a sandbox per command is never reused
    box = pool.acquire()
    box.write_file("deep.py", DEEP)
    box.run("python3 deep.py")
    box.run("python3 -c 'import os; [os.setxattr(p, \\"user.stash\\", b\\"x\\") for p in (\\".\\", \\"/tmp\\")]'")
    pool.release(box)
    again = pool.acquire()
    seen = again.run("python3 -c 'import os; print(os.listdir(), os.listxattr(\\".\\"), os.listxattr(\\"/tmp\\"))'")
    report["pool"] = {"reused": again is box, "seen": seen.stdout + seen.stderr}
    pool.release(again)
print(json.dumps(report))
"""

# A tree deeper than any recursion limit (and longer than PATH_MAX) in the command's working directory, every 500th
# level unreadable.
DEEP = """
import os
fd, locked = os.open(".", os.O_RDONLY), []
for level in range(2500):
    os.mkdir("deep", dir_fd=fd)
    fd, parent = os.open("deep", os.O_RDONLY, dir_fd=fd), fd
    if level % 500 == 1:
        locked.append(parent)
    else:
        os.close(parent)
for parent in locked:
    os.fchmod(parent, 0)
print("made")
"""


@needs_bwrap
def test_an_unprivileged_host_removes_any_tree_and_survives_a_nul_byte_in_every_mode() -> None:
    done = run_as_nobody(["-c", UNPRIVILEGED], timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    each = {"made": "made\n", "nul": [127, True], "unreadable": "SandboxPathError", "left": False}
    expected = {"bwrap": each, "bwrap_per_command": each, "chain": each, "pool": {"reused": True, "seen": "[] [] []\n"}}
    assert report == expected, json.dumps(report, indent=1)


def test_a_lease_this_version_cannot_read_is_kept_for_a_sweep_that_can() -> None:
    """Another trajlab's record (a field this one lacks) is not quarantined, which would hide its leftovers from the
    sweeps of the version that wrote it; the sweep logs it and goes on."""
    lease = Lease.anonymous()
    lease.path.write_text('busy {"root": "/nonexistent/trajlab-sandbox-x", "field_of_a_later_version": 1}')
    lease.release(clean=False)
    try:
        sweep_module.sweep.__wrapped__()
        assert lease.path.exists() and not lease.path.with_suffix(".quarantined").exists()
    finally:
        lease.path.unlink()
