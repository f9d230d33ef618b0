"""Aggregate caps per sandbox: the memory of all its processes together (tmpfs and SysV pages included, no swap), and
their number; on cgroup v1 as root, and on cgroup v2 as root or in a cgroup systemd delegated to the user.

Why: rlimits cap one process at a time; 64 processes of 1 GiB each are still 64 GiB. Where a cgroup can be had, each
sandbox gets one (v1: one in the ``memory`` and one in the ``pids`` hierarchy; v2: one directory) and each command
joins it before anything else runs: the kernel then caps the memory and the processes of the whole sandbox, and
cleanup kills every process still in it (``cgroup.kill`` where the kernel has it).

cgroup v2 allows controllers in a cgroup's children only while the cgroup itself holds no process (the root of the
hierarchy excepted). As root the sandboxes' parent sits under the hierarchy's root (in a container's cgroup namespace
that root may hold processes: they move to a leaf, :data:`HOST_LEAF`, first). Without root it sits under this
process's own cgroup where the user may write there (systemd's ``Delegate=yes``: ``systemd-run --user --scope -p
Delegate=yes ...``), whose processes move to the leaf first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import SHELL

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The parent of every sandbox's cgroup (in each v1 controller; under the v2 base).
PARENT = "trajlab-sandboxes"
#: On v2, where the processes of the cgroup holding :data:`PARENT` move to, so that it may give controllers to it.
HOST_LEAF = "trajlab-host"
#: The v2 controllers a sandbox's cgroup needs.
CONTROLLERS = ("memory", "pids")
#: bwrap's own processes in a command's cgroup: itself and its PID namespace's init.
LAUNCHER_PROCESSES = 2
# Joins every cgroup.procs file given before "--", then execs the rest (as root, before dropping privileges).
_JOIN_SCRIPT = 'for f; do shift; [ "$f" = -- ] && exec "$@"; echo $$ > "$f" || exit 125; done'
_KILL_ROUNDS = 50


@dataclasses.dataclass(frozen=True)
class CgroupHost:
    """Where this host lets us make sandboxes' cgroups: cgroup ``version`` 1 or 2, under ``parents``."""

    version: int
    parents: tuple[Path, ...]

    def sandbox(self, name: str) -> SandboxCgroup:
        """The cgroup(s) of the sandbox named ``name`` (not made yet: :meth:`SandboxCgroup.create`)."""
        return SandboxCgroup([parent / name for parent in self.parents], self.version)


def find_cgroup_host(root: Path = CGROUP_ROOT, own_cgroup: Path = Path("/proc/self/cgroup"), *,
                     as_root: bool | None = None) -> CgroupHost | None:
    """Where sandboxes' cgroups can be made on this host (v2 first), or None where no cgroup can be had.

    Args:
        root: where the cgroup hierarchies are mounted.
        own_cgroup: this process's ``/proc/self/cgroup``.
        as_root: whether we are root; None: whether the effective uid is 0.
    """
    as_root = os.geteuid() == 0 if as_root is None else as_root
    return _v2_host(root, own_cgroup, as_root) or (_v1_host(root) if as_root else None)


@functools.cache
def host_cgroups() -> CgroupHost | None:
    """:func:`find_cgroup_host` for this process, once (it may move this process to :data:`HOST_LEAF`)."""
    return find_cgroup_host()


def _v1_host(root: Path) -> CgroupHost | None:
    """The v1 ``memory`` and ``pids`` hierarchies, where we may make cgroups in both."""
    parents = tuple(root / controller / PARENT for controller in CONTROLLERS)
    try:
        for parent in parents:
            parent.mkdir(exist_ok=True)
            if not os.access(parent, os.W_OK):
                return None
    except OSError:
        return None
    return CgroupHost(1, parents)


def _v2_host(root: Path, own_cgroup: Path, as_root: bool) -> CgroupHost | None:
    """A v2 parent for sandboxes whose subtree has the memory and pids controllers: under the unified hierarchy's
    root (as root), or under this process's own cgroup (without root: where the user was delegated it)."""
    mount = next((path for path in (root, root / "unified") if (path / "cgroup.controllers").is_file()), None)
    if mount is None:
        return None
    base = mount if as_root else _own_v2_cgroup(mount, own_cgroup)
    if base is None:
        return None
    if base.name == HOST_LEAF:  # started in the leaf an earlier process moved its cgroup's processes to
        base = base.parent
    try:
        if not set(CONTROLLERS) <= set((base / "cgroup.controllers").read_text().split()):
            return None
        if base != mount and (base / "cgroup.procs").read_text().split():
            _move_processes(base)
        _enable_controllers(base)
        parent = base / PARENT
        parent.mkdir(exist_ok=True)
        _enable_controllers(parent)
    except OSError:
        return None
    return CgroupHost(2, (parent,))


def _own_v2_cgroup(mount: Path, own_cgroup: Path) -> Path | None:
    """This process's cgroup in the unified hierarchy (the ``0::`` line of ``/proc/self/cgroup``)."""
    try:
        lines = own_cgroup.read_text().splitlines()
    except OSError:
        return None
    path = next((line[len("0::"):] for line in lines if line.startswith("0::")), None)
    return None if path is None else mount / path.lstrip("/")


def _enable_controllers(cgroup: Path) -> None:
    """Let ``cgroup``'s children have the memory and pids controllers; its processes move to the leaf when the kernel
    refuses for them (a container's root cgroup)."""
    control = cgroup / "cgroup.subtree_control"
    enable = " ".join(f"+{controller}" for controller in CONTROLLERS)
    try:
        control.write_text(enable)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        _move_processes(cgroup)
        control.write_text(enable)


def _move_processes(cgroup: Path) -> None:
    """Move every process of ``cgroup`` to its child :data:`HOST_LEAF` (including those that fork meanwhile)."""
    leaf = cgroup / HOST_LEAF
    leaf.mkdir(exist_ok=True)
    for _ in range(_KILL_ROUNDS):
        pids = (cgroup / "cgroup.procs").read_text().split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                (leaf / "cgroup.procs").write_text(pid)
        if pids == (cgroup / "cgroup.procs").read_text().split():  # nothing left that the kernel shows moving
            return


class SandboxCgroup:
    """One sandbox's cgroups, named after its directory; :meth:`remove` kills what is in them and deletes them."""

    def __init__(self, dirs: Sequence[Path], version: int) -> None:
        self.dirs, self.version = list(dirs), version

    @classmethod
    def recorded(cls, dirs: Sequence[str], name: str) -> SandboxCgroup:
        """The cgroups a lease recorded for the sandbox ``name`` (none listed: v1's, as leases did before v2), to
        remove them."""
        if not dirs:
            return cls([CGROUP_ROOT / controller / PARENT / name for controller in CONTROLLERS], 1)
        if any(Path(directory).name != name for directory in dirs):
            raise SandboxError(f"a lease lists cgroups {list(dirs)} that are not the sandbox's ({name})")
        return cls([Path(directory) for directory in dirs], 0)

    def create(self, *, memory_bytes: int, processes: int) -> None:
        """Make the cgroups with their caps (memory: ``memory_bytes``, no swap; processes: ``processes`` plus bwrap's
        own)."""
        for directory in self.dirs:
            directory.mkdir()
        pids_max = str(processes + LAUNCHER_PROCESSES)
        if self.version == 1:
            memory, pids = self.dirs
            (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
            (pids / "pids.max").write_text(pids_max)
            return
        (directory,) = self.dirs
        (directory / "memory.max").write_text(str(memory_bytes))
        if (swap := directory / "memory.swap.max").exists():  # where the kernel accounts swap
            swap.write_text("0")
        (directory / "pids.max").write_text(pids_max)

    def join_prefix(self) -> list[str]:
        """argv that moves the command into the cgroups, then runs the rest."""
        return [SHELL, "-c", _JOIN_SCRIPT, "sh", *(str(d / "cgroup.procs") for d in self.dirs), "--"]

    def kill(self) -> None:
        """SIGKILL every process in the cgroups, until none is left (pids.max bounds how many can appear)."""
        for directory in self.dirs:
            if (kill := directory / "cgroup.kill").exists():  # v2, Linux 5.14+: the whole subtree at once
                with contextlib.suppress(OSError):
                    kill.write_text("1")
        for _ in range(_KILL_ROUNDS):
            pids = self._pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def remove(self) -> None:
        """Kill what is left and delete the cgroups, children first (idempotent; a dying process may hold one a
        moment)."""
        self.kill()
        for directory in self.dirs:
            below = sorted((Path(parent) for parent, _, _ in os.walk(directory)), key=lambda p: -len(p.parts))
            for cgroup in below:
                for _ in range(_KILL_ROUNDS):
                    try:
                        cgroup.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:  # EBUSY while killed processes are reaped
                        time.sleep(0.002)

    def exists(self) -> bool:
        return any(directory.exists() for directory in self.dirs)

    def _pids(self) -> set[int]:
        """The processes in the cgroups and any cgroups made below them."""
        found: set[int] = set()
        for directory in self.dirs:
            for parent, _, _ in os.walk(directory):
                with contextlib.suppress(FileNotFoundError):
                    found.update(int(line) for line in Path(parent, "cgroup.procs").read_text().split())
        return found
