"""Removing what a sandbox made: at its cleanup, and at start-up for every sandbox whose owner died.

Why: nothing a sandbox creates may outlive its owner. ``cleanup`` and the start-up sweep remove the same things, from
the same record (:mod:`trajlab.sandbox.leases`): the processes of its uid and cgroups, its cgroups, its tmpfs mount
and its directory, whatever a command made there (any depth, unreadable directories; see
:func:`~trajlab.sandbox.command_server.empty_tree`). Processes under bubblewrap already died with their owner
(``--die-with-parent``); their IPC objects died with their IPC namespace.

What still cannot be removed must not keep anyone from making sandboxes: the sweep logs it and quarantines it, its
directory renamed ``trajlab-quarantined-*`` (next to where it was, private to the host's user) and its lease file
``*.quarantined`` (in the lease directory), which no later sweep reads; a person can look at both, then delete them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from pathlib import Path

from trajlab.sandbox.cgroups import SandboxCgroup
from trajlab.sandbox.command_server import remove_tree, top_mounts_below
from trajlab.sandbox.disk_quota import unmount
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.leases import Lease, Record, unlocked_leases
from trajlab.sandbox.uids import kill_uid

logger = logging.getLogger(__name__)

#: Every sandbox directory's name starts so; nothing else is ever removed.
DIR_PREFIX = "trajlab-sandbox-"
#: A directory that could not be removed is renamed so (after the prefix, its sandbox name's end), and left alone.
QUARANTINE_PREFIX = "trajlab-quarantined-"
#: How many leases :func:`new_lease` tries whose dead holders' leftovers were quarantined, before it gives up.
_LEASE_TRIES = 8


def remove_leftovers(record: Record) -> None:
    """Kill the processes of the recorded sandbox, delete its cgroups, unmount its tmpfs and delete its directory.

    Raises:
        SandboxError: something below the directory could not be deleted.
    """
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
    if not os.path.lexists(root):
        return
    if os.geteuid() == 0:  # none a command can make; the host's own, each detached with what is mounted below it
        for mount in top_mounts_below(str(root)):
            unmount(mount)
    try:
        left = remove_tree(str(root))
    except OSError as exc:
        raise SandboxError(f"could not delete the sandbox directory {root}: {exc}") from exc
    if left:
        raise SandboxError(f"could not delete {left} entries below the sandbox directory {root}")


@functools.cache
def sweep() -> int:
    """Remove what sandboxes of dead owners left (once per process, before its first sandbox); how many were removed.
    What cannot be removed is quarantined (logged), never raised."""
    swept = 0
    for lease in unlocked_leases():
        try:
            cleared = clear_left_over(lease)
        except BaseException:  # KeyboardInterrupt, say
            lease.release(clean=False)  # kept, for its owner's next sweep or a person to read
            raise
        swept += cleared is True
        lease.release(clean=cleared is not False)  # a quarantined one's file was renamed
    return swept


def new_lease(private_uid: bool) -> Lease:
    """A lease for a new sandbox: one of a free uid (``private_uid``) or an anonymous one, whatever its dead last
    holder left removed (or quarantined, and another lease taken)."""
    for _ in range(_LEASE_TRIES):
        lease = Lease.for_new_uid() if private_uid else Lease.anonymous()
        try:
            cleared = clear_left_over(lease)
        except BaseException:
            lease.release(clean=False)
            raise
        if cleared is not False:
            return lease
        lease.release(clean=False)
    raise SandboxError(f"the leftovers of the last {_LEASE_TRIES} holders of sandbox uids could not be removed (see "
                       "the log for where they were quarantined)")


def clear_left_over(lease: Lease) -> bool | None:
    """Remove what the dead last holder of ``lease`` left: None when it left nothing, True when that was removed,
    False when it could not be (whatever was raised, even RecursionError): then it is logged and quarantined. A lease
    this version cannot read (another trajlab's, say) is logged and kept as it is, for a sweep that can: False."""
    try:
        record = lease.left_over()
    except Exception as exc:
        logger.warning("%s; kept for a later sweep", exc)
        return False
    if record is None:
        return None
    try:
        remove_leftovers(record)
        return True
    except Exception as exc:  # one stuck sandbox must not keep this user from making sandboxes
        _quarantine(lease, record, exc)
        return False


def _quarantine(lease: Lease, record: Record, exc: Exception) -> None:
    """Set the lease file and the recorded directory aside, where no sweep looks, private to the host's user."""
    where = "no directory"
    if (root := Path(record.root)).name.startswith(DIR_PREFIX) and os.path.lexists(root):
        where = str(root)
        with contextlib.suppress(OSError):  # a mount point that would not go (EBUSY) stays where it is
            root = root.rename(root.with_name(QUARANTINE_PREFIX + root.name.removeprefix(DIR_PREFIX)))
            where = str(root)
        with contextlib.suppress(OSError):  # out of reach of the uid its files belong to, which may be leased again
            if not root.is_symlink():
                os.chown(root, os.geteuid(), os.getegid())
                os.chmod(root, 0o700)
    with contextlib.suppress(OSError):
        lease.path.rename(lease.path.with_suffix(".quarantined"))
    logger.error("could not remove what a sandbox left (%s: %s); quarantined for a person to look at and delete: "
                 "directory %s, lease %s", type(exc).__name__, exc, where, lease.path.with_suffix(".quarantined"))
