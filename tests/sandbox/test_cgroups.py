"""The cgroup code's side of the caps: which cgroup a sandbox gets, and what it writes there.

This machine's memory and pids controllers sit on cgroup v1, so the cgroup v2 code is exercised here against a fake
cgroup root (a tmp dir laid out as cgroup2): the tests named ``..._file_writes_only`` check the files it writes, not
that a kernel enforces them; and on the kernel's own cgroup2 hierarchy without those controllers: joining, moving
processes, ``cgroup.kill`` and removal, not the caps. The caps themselves are checked by the attack suite wherever a
kernel gives them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from trajlab.sandbox.cgroups import CGROUP_ROOT, HOST_LEAF, PARENT, SandboxCgroup, _move_processes, find_cgroup_host
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.leases import Record
from trajlab.sandbox.limits import SHELL
from trajlab.sandbox.sweep import remove_leftovers

NAME = "trajlab-sandbox-abc123"
USER_SCOPE = "user.slice/user-1000.slice/user@1000.service/app.slice/run-r1.scope"


def _cgroup2(directory: Path, *, controllers: str = "cpuset cpu io memory hugetlb pids rdma misc",
             procs: str = "") -> Path:
    """A directory holding what the kernel puts in every cgroup2 directory that the code reads or writes."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.controllers").write_text(controllers + "\n")
    (directory / "cgroup.subtree_control").write_text("")
    (directory / "cgroup.procs").write_text(procs)
    return directory


def _own_cgroup(tmp_path: Path, path: str) -> Path:
    """A fake /proc/self/cgroup of a process in ``path`` of the unified hierarchy (a hybrid host's lines too)."""
    own = tmp_path / "self-cgroup"
    own.write_text(f"4:memory:/\n1:name=systemd:/{path}\n0::/{path}\n")
    return own


def test_cgroup_v2_file_writes_only_as_root(tmp_path: Path) -> None:
    """Exercises only the file writes, on a fake cgroup2 root: as root, sandboxes get cgroups below a parent under the
    hierarchy's root, whose subtree has the memory and pids controllers; each gets memory.max and pids.max (and
    cgroup.kill at the end). Not exercised: that a kernel enforces them."""
    root = _cgroup2(tmp_path / "cgroup", procs="1\n")
    host = find_cgroup_host(root, _own_cgroup(tmp_path, "init.scope"), as_root=True)
    assert host is not None and host.version == 2 and host.parents == (root / PARENT,)
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (root / PARENT / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert not (root / HOST_LEAF).exists(), "the hierarchy's root may hold processes: none are moved"

    cgroup = host.sandbox(NAME)
    cgroup.create(memory_bytes=256 << 20, processes=32)
    directory = root / PARENT / NAME
    assert cgroup.dirs == [directory]
    assert (directory / "memory.max").read_text() == str(256 << 20)
    assert (directory / "pids.max").read_text() == "34", "the processes plus bwrap and its PID namespace's init"
    assert not (directory / "memory.swap.max").exists(), "swap is capped only where the kernel has the file"
    assert cgroup.join_prefix()[-2:] == [str(directory / "cgroup.procs"), "--"]

    (directory / "cgroup.kill").write_text("")  # as a kernel of 5.14 or later makes it
    cgroup.kill()
    assert (directory / "cgroup.kill").read_text() == "1"
    for made in directory.iterdir():  # the kernel's files go with the directory
        made.unlink()
    cgroup.remove()
    assert not directory.exists()


def test_cgroup_v2_file_writes_only_in_a_delegated_user_cgroup(tmp_path: Path) -> None:
    """Exercises only the file writes, on a fake cgroup2 root: without root, sandboxes get cgroups below the cgroup
    systemd delegated to the user (this process's own, from /proc/self/cgroup). Its processes move to a leaf first (a
    cgroup with processes cannot give controllers to its children), and a later process of that leaf finds the same
    parent. Not exercised: the kernel's checks (who may write, which processes may move)."""
    root = _cgroup2(tmp_path / "cgroup", procs="1\n")
    scope = _cgroup2(root / USER_SCOPE, procs="4242\n")
    host = find_cgroup_host(root, _own_cgroup(tmp_path, USER_SCOPE), as_root=False)
    assert host is not None and host.version == 2 and host.parents == (scope / PARENT,)
    assert (scope / HOST_LEAF / "cgroup.procs").read_text() == "4242", "the scope's process moved to the leaf"
    assert (scope / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (scope / PARENT / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (root / "cgroup.subtree_control").read_text() == "", "nothing above the delegated cgroup is touched"

    later = find_cgroup_host(root, _own_cgroup(tmp_path, f"{USER_SCOPE}/{HOST_LEAF}"), as_root=False)
    assert later == host, "a process started in the leaf uses the same parent"


@pytest.mark.parametrize(("layout", "why"), [
    ("no_memory", "the memory controller is not in the delegated cgroup"),
    ("not_cgroup2", "no cgroup2 hierarchy at the root"),
])
def test_cgroup_v2_file_writes_only_no_cgroup_where_none_can_be_had(tmp_path: Path, layout: str, why: str) -> None:
    """Exercises only the file reads, on a fake cgroup root: where the delegated cgroup lacks a controller, or there
    is no cgroup2 hierarchy, no cgroup is made (and nothing is written)."""
    root = tmp_path / "cgroup"
    if layout == "no_memory":
        _cgroup2(root, procs="1\n")
        _cgroup2(root / USER_SCOPE, controllers="cpu io pids", procs="4242\n")
    else:
        root.mkdir()
    assert find_cgroup_host(root, _own_cgroup(tmp_path, USER_SCOPE), as_root=False) is None, why
    assert not list(root.rglob(PARENT)) and not list(root.rglob(HOST_LEAF))


def test_a_recorded_cgroup_is_found_again_for_removal() -> None:
    v2 = f"/sys/fs/cgroup/{USER_SCOPE}/{PARENT}/{NAME}"
    assert SandboxCgroup.recorded([v2], NAME).dirs == [Path(v2)]
    assert SandboxCgroup.recorded([], NAME).dirs == [CGROUP_ROOT / "memory" / PARENT / NAME,
                                                     CGROUP_ROOT / "pids" / PARENT / NAME], "a lease from before v2"
    with pytest.raises(SandboxError, match="not the sandbox's"):
        SandboxCgroup.recorded(["/sys/fs/cgroup/user.slice"], NAME)


def _writable_cgroup2() -> Path | None:
    """The kernel's unified hierarchy, where this process may make cgroups in it (as root)."""
    mount = next((path for path in (CGROUP_ROOT, CGROUP_ROOT / "unified") if (path / "cgroup.controllers").is_file()),
                 None)
    return mount if mount is not None and os.geteuid() == 0 and os.access(mount, os.W_OK) else None


@pytest.mark.skipif(_writable_cgroup2() is None, reason="needs root and a cgroup2 hierarchy")
def test_cgroup_v2_joining_the_leaf_move_cgroup_kill_and_removal_on_the_kernel() -> None:
    """The kernel's cgroup2 (here a hybrid host's, without the memory and pids controllers, so not the caps): a
    cgroup's processes move to the leaf; a command joins its sandbox's cgroup, and cleanup kills it, a daemon it left
    and a cgroup it made below, then removes them all."""
    mount = _writable_cgroup2()
    assert mount is not None
    base = mount / f"trajlab-test-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    try:
        held = subprocess.Popen([SHELL, "-c", f"echo $$ > {base}/cgroup.procs && exec sleep 30"])
        deadline = time.monotonic() + 5
        while not (base / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.01)
        _move_processes(base)
        assert (base / "cgroup.procs").read_text().split() == []
        assert (base / HOST_LEAF / "cgroup.procs").read_text().split() == [str(held.pid)]
        held.kill()
        held.wait()

        cgroup = SandboxCgroup([base / NAME], 2)
        cgroup.dirs[0].mkdir()
        below = cgroup.dirs[0] / "made-by-the-command"
        command = subprocess.Popen([*cgroup.join_prefix(), SHELL, "-c", f"mkdir {below}; sh -c 'echo $$ > "
                                    f"{below}/cgroup.procs; exec setsid sleep 31' & exec sleep 32"])
        while len(cgroup._pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert command.pid in cgroup._pids() and len(cgroup._pids()) == 2
        cgroup.remove()
        assert command.wait(timeout=5) == -signal.SIGKILL
        assert not cgroup.exists()
    finally:
        for directory in sorted((Path(path) for path, _, _ in os.walk(base)), key=lambda path: -len(path.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()


def test_cgroup_v2_file_writes_only_a_recorded_cgroup_goes_with_its_sandbox(tmp_path: Path) -> None:
    """Exercises only the removal, on a fake cgroup root: what a lease recorded of a v2 sandbox (its cgroup's path,
    which depends on where its host ran) is what cleanup and the sweep remove."""
    directory = tmp_path / USER_SCOPE / PARENT / NAME
    directory.mkdir(parents=True)
    remove_leftovers(Record(root=str(tmp_path / NAME), cgroup=True, cgroup_dirs=(str(directory),)))
    assert not directory.exists() and directory.parent.exists()
