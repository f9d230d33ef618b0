"""Removing what a sandbox made: at its cleanup, and at start-up for every sandbox whose owner died.

Why: nothing a sandbox creates may outlive its owner. ``cleanup`` and the start-up sweep remove the same things, from
the same record (:mod:`trajlab.sandbox.leases`): the processes of its uid and cgroups, its cgroups, its tmpfs mount
and its directory. Processes under bubblewrap already died with their owner (``--die-with-parent``); their IPC
objects died with their IPC namespace.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from pathlib import Path

from trajlab.sandbox.cgroups import SandboxCgroup
from trajlab.sandbox.disk_quota import unmount
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.leases import Record, unlocked_leases
from trajlab.sandbox.uids import kill_uid

logger = logging.getLogger(__name__)

#: Every sandbox directory's name starts so; nothing else is ever removed.
DIR_PREFIX = "trajlab-sandbox-"


def remove_leftovers(record: Record) -> None:
    """Kill the processes of the recorded sandbox, delete its cgroups, unmount its tmpfs and delete its directory."""
    setpriv = shutil.which("setpriv")
    if record.uid is not None and setpriv is not None:
        kill_uid(setpriv, record.uid)
    root = Path(record.root)
    if record.cgroup:
        SandboxCgroup.recorded(record.cgroup_dirs, root.name).remove()
    if not root.name.startswith(DIR_PREFIX):
        return
    if record.mounted and os.path.ismount(root):
        unmount(root)
    if not root.exists():
        return
    if os.geteuid() != 0:
        _make_removable(root)
    try:
        shutil.rmtree(root)
    except OSError as exc:  # kept in the lease, for the sweep of the next process that makes a sandbox
        raise SandboxError(f"could not delete the sandbox directory {root}: {exc}") from exc


@functools.cache
def sweep() -> int:
    """Remove what sandboxes of dead owners left (once per process, before its first sandbox); how many there were."""
    swept = 0
    for lease in unlocked_leases():
        try:
            if (record := lease.left_over()) is not None:
                remove_leftovers(record)
                swept += 1
        except SandboxError as exc:  # one stuck directory must not keep this process from making sandboxes
            logger.warning("%s; its lease %s is kept for the next sweep", exc, lease.path)
            lease.release(clean=False)
            continue
        except BaseException:
            lease.release(clean=False)  # kept, for its owner's next sweep or a person to read
            raise
        lease.release(clean=True)
    return swept


def _make_removable(root: Path) -> None:
    """Let a non-root host delete directories that its commands (same uid) made unreadable."""
    with contextlib.suppress(OSError):
        root.chmod(0o700)
    for parent, dirs, _ in os.walk(root):
        for name in dirs:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
