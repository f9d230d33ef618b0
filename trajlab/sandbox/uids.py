"""A private uid per sandbox when the host runs as root: switched to with ``setpriv``, its processes killed at the end.

Why: with its own unprivileged uid a sandbox's commands cannot read another sandbox's files or the host's root-only
files, signal other processes, or (without bubblewrap) escape cleanup by leaving their process group: every process
of the uid is killed. Uids are leased in :mod:`trajlab.sandbox.leases`, so two sandboxes never share one.
"""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.limits import HELPER_TIMEOUT_S, SAFE_PATH, SHELL

#: uids (and gids) leased to sandboxes when the host runs as root: high enough not to belong to real accounts.
#: The first one is only used to probe whether the host can switch to them.
SANDBOX_UID_RANGE = range(1_900_000_000, 1_900_000_000 + 65_536)


def identity_prefix(setpriv: str | None, uid: int | None) -> list[str]:
    """argv that runs the rest as ``uid`` (None: the host's own user) without new privileges, where setpriv exists."""
    if setpriv is None:
        return []
    ids = [] if uid is None else [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [setpriv, *ids, "--no-new-privs", "--"]


def kill_uid(setpriv: str, uid: int) -> None:
    """SIGKILL every process of ``uid``, also those that left the command's process group: kill(-1) as that uid."""
    subprocess.run([*identity_prefix(setpriv, uid), SHELL, "-c", "kill -KILL -1 2>/dev/null"],
                   env={"PATH": SAFE_PATH}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=HELPER_TIMEOUT_S, check=False)


def require_traversable(directory: Path) -> None:
    """Refuse a sandbox directory that its uid could not reach."""
    for parent in directory.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise SandboxError(f"sandbox uids cannot enter {parent}: pass a world-traversable base_dir")


def require_readable(path: Path) -> None:
    """Refuse a read-only path (bound into the sandbox) that the sandbox's own uid could not reach: bubblewrap binds
    it as that uid, and would fail with a bare "Permission denied" at the first command."""
    if not path.exists():
        raise SandboxError(f"read-only path {path} does not exist")
    for parent in path.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise SandboxError(f"read-only path {path}: the sandbox's own uid cannot enter {parent} (mode "
                               f"{stat.S_IMODE(parent.stat().st_mode):o}); let others enter it (chmod o+x {parent}) or "
                               "put what the sandbox reads in a directory others can read")
    needed = stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0)
    if path.stat().st_mode & needed != needed:
        raise SandboxError(f"read-only path {path} is not readable by others, as the sandbox's own uid would need")

