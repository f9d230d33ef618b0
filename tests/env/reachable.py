"""Paths the sandbox's own uid can read, for the servers the tests run in it.

The checkout's own path where others may enter it; else a mirror of hard links (a copy across file systems) under a
fresh world-readable directory in /tmp, removed at exit, and by the next run when a killed run could not (once the
clone is gone, its mirror of the venv's packages holds 2 GB). A clone made in ``mktemp -d`` (mode 0700) is such a
checkout: the sandbox refuses a read-only path its uid cannot reach, saying why (``tests/sandbox/test_long_lived.py``),
and a user's server must live where that uid can read it; the tests' servers are moved there instead.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.uids import require_readable

_COUNT = itertools.count()
_PREFIX = "trajlab-test-mirror-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _remove_orphans() -> None:
    """Mirrors whose test process is gone: a killed process never ran its atexit."""
    for old in Path("/tmp").glob(f"{_PREFIX}*-*"):
        owner = old.name.removeprefix(_PREFIX).split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(old, ignore_errors=True)


@functools.cache
def _mirror_root() -> Path:
    _remove_orphans()
    root = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir="/tmp"))
    root.chmod(0o755)
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def reachable(path: str) -> str:
    """``path`` if the sandbox's uid can read it, else its world-readable mirror."""
    try:
        require_readable(Path(path))
        return path
    except SandboxError:
        pass
    target = _mirror_root() / str(next(_COUNT))
    linked = subprocess.run(["cp", "-al", path, str(target)], capture_output=True)
    if linked.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(["cp", "-a", path, str(target)], check=True)
    return str(target)
