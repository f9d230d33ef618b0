"""The :class:`Sandbox`: a private directory (and, as root, a private uid) in which to run untrusted commands.

Why: this is where the package's parts meet. A sandbox leases its uid, makes its directory (a tmpfs under a quota
where the host allows it), builds each command's argv from the protections the host gives, runs it, and at the end
kills what is left and removes everything it made.

The limits and identity are applied by exec-ing util-linux tools (``prlimit``, ``unshare``, ``setpriv``) in front of
the command rather than by a ``preexec_fn``, which may deadlock a process that runs many episodes on threads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from trajlab.sandbox.disk_quota import (
    fstab_path,
    lay_out,
    mount_base_dir,
    mount_namespace_prefix,
    mount_tmpfs,
    remove_stale_mount,
    unmount,
)
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.files import inside_path, read_file, write_file
from trajlab.sandbox.limits import SHELL, SandboxLimits, rlimit_options, scrubbed_environment
from trajlab.sandbox.process import SandboxResult, run_process
from trajlab.sandbox.protections import Protections, host_platform
from trajlab.sandbox.uids import UidLease, identity_prefix, kill_uid, require_traversable


class Sandbox:
    """A private directory (and, as root, a private uid) in which to run untrusted commands, one at a time.

    Use it as a context manager, or call :meth:`cleanup`, which kills what is left running and deletes the directory.
    """

    def __init__(self, limits: SandboxLimits | None = None, base_dir: str | Path | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._platform = host_platform()
        self._lock = threading.Lock()
        self._closed = False
        self._lease = UidLease() if self._platform.protections.private_uid else None
        self._uid = self._lease.uid if self._lease is not None else None
        self._mounted = False
        try:
            quota = self._platform.protections.disk_quota
            if quota and base_dir is None:
                base_dir = mount_base_dir()
            self._root = Path(tempfile.mkdtemp(prefix="trajlab-sandbox-", dir=base_dir)).resolve()
            self.path = self._root
            if self._lease is not None and (crashed := self._lease.crashed_holder()) is not None:
                self._kill_leftovers()  # its last holder died without cleaning up
                remove_stale_mount(crashed)
            if quota and self._lease is not None:
                # One tmpfs holds the working directory and the command's /tmp: both count against disk_bytes.
                self._mounted = mount_tmpfs(self._root, size=self.limits.disk_bytes)
                if not self._mounted:
                    raise SandboxError(f"could not mount a {self.limits.disk_bytes}-byte tmpfs at {self._root}")
                self.path = lay_out(self._root, self._lease.uid)
            if self._lease is not None:
                require_traversable(self.path)
                os.chown(self.path, self._lease.uid, self._lease.uid)
                self._lease.mark_busy(self._root if self._mounted else None)
        except BaseException:
            if self._mounted:
                unmount(self._root)
            with contextlib.suppress(OSError, AttributeError):  # AttributeError: failed before the directory existed
                shutil.rmtree(self._root)
            self._release_uid()
            raise

    @property
    def uid(self) -> int | None:
        """The uid commands run as, or None when they run as the host's own user."""
        return self._uid

    def protections(self) -> Protections:
        """Which protections this sandbox's commands get (the same for every sandbox of this process)."""
        return self._platform.protections

    def run(self, command: str | Sequence[str], stdin: str | None = None) -> SandboxResult:
        """Run ``command`` (a string goes to ``/bin/sh -c``) in the sandbox directory and wait for it.

        The command ends when its first process exits: whatever it left running in its process group is killed.
        """
        argv = [SHELL, "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("empty command")
        with self._lock:
            self._require_open()
            return run_process(self._launch_argv(argv), stdin, cwd=self.path, env=scrubbed_environment(self.path),
                               limits=self.limits, kill_leftovers=self._kill_leftovers)

    def write_file(self, path: str, content: str | bytes) -> Path:
        """Write a file inside the sandbox directory, creating parent directories; refuses symlinks and ``..``."""
        inside = inside_path(path)
        with self._lock:
            self._require_open()
            return write_file(self.path, inside, content, owner=self._uid)

    def read_file(self, path: str) -> bytes:
        """Read a file inside the sandbox directory; refuses symlinks, ``..`` and files hard-linked from elsewhere."""
        inside = inside_path(path)
        with self._lock:
            self._require_open()
            return read_file(self.path, inside)

    def cleanup(self) -> None:
        """Kill whatever the sandbox left running, delete its directory and give back its uid. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._kill_leftovers()
                if self._mounted:
                    unmount(self._root)
                if os.geteuid() != 0:
                    _make_removable(self._root)
                shutil.rmtree(self._root)
                if self._lease is not None:
                    self._lease.mark_clean()
            finally:
                self._release_uid()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def _launch_argv(self, argv: list[str]) -> list[str]:
        platform = self._platform
        rlimits = rlimit_options(self.limits)
        identity = identity_prefix(platform.setpriv, self._uid)
        if not self._mounted:
            return [platform.prlimit, *rlimits, "--", *platform.net_prefix, *identity, *argv]
        # Root sets up the command's mount namespace (and network namespace), then drops to the sandbox uid.
        assert platform.unshare is not None
        namespaces = mount_namespace_prefix(platform.unshare, fstab_path(self._root),
                                            network=platform.protections.network_namespace)
        return [platform.prlimit, *rlimits, "--", *namespaces, *identity, *argv]

    def _kill_leftovers(self) -> None:
        if self._uid is not None and self._platform.setpriv is not None:
            kill_uid(self._platform.setpriv, self._uid)

    def _release_uid(self) -> None:
        if self._lease is not None:
            self._lease.release()

    def _require_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.path} was cleaned up")


def _make_removable(root: Path) -> None:
    """Let a non-root host delete directories that its commands (same uid) made unreadable."""
    root.chmod(0o700)
    for parent, dirs, _ in os.walk(root):
        for name in dirs:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
