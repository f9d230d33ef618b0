"""The :class:`Sandbox`: a private directory (and, as root, a private uid) in which to run untrusted commands.

Why: this is where the package's parts meet. A sandbox takes a lease (and, as root, a uid), records what it is about
to make, makes its directory (a tmpfs under a quota where the host allows it) and its cgroups, builds each command's
argv from the protections the host gives (bubblewrap where it works), runs it, and at the end kills what is left and
removes everything it made.

The cgroups, identity, namespaces and limits are applied by exec-ing tools (``sh``, ``setpriv``, ``bwrap``,
``prlimit``) in front of the command rather than by a ``preexec_fn``, which may deadlock a process that runs many
episodes on threads.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from trajlab.sandbox.bwrap import (
    MQUEUE_DIR,
    PRIVATE_TMP_DIRS,
    TMPFS_MODE,
    WORK_INSIDE,
    PidNamespace,
    bwrap_argv,
    exit_code,
)
from trajlab.sandbox.cgroups import SandboxCgroup
from trajlab.sandbox.disk_quota import (
    DIR_MODE,
    WorkTmpfs,
    fstab_path,
    lay_out,
    mount_base_dir,
    mount_namespace_prefix,
    mount_tmpfs,
)
from trajlab.sandbox.errors import SandboxError
from trajlab.sandbox.files import inside_path, read_file, write_file
from trajlab.sandbox.leases import Record
from trajlab.sandbox.limits import SHELL, SandboxLimits, ipc_sysctls, rlimit_options, scrubbed_environment
from trajlab.sandbox.process import SandboxResult, run_process, unsendable
from trajlab.sandbox.protections import Protections, host_platform
from trajlab.sandbox.session import SERVER_INSIDE, CommandSession, confined_exec_argv, confinement
from trajlab.sandbox.sweep import DIR_PREFIX, new_lease, remove_leftovers, sweep
from trajlab.sandbox.uids import identity_prefix, kill_uid, require_readable, require_traversable


class Sandbox:
    """A private directory (and, as root, a private uid) in which to run untrusted commands, one at a time.

    Use it as a context manager, or call :meth:`cleanup`, which kills what is left running and deletes everything
    the sandbox made. What a process killed before its cleanup left is removed when the next process makes its
    first sandbox (:func:`trajlab.sandbox.sweep.sweep`).

    Args:
        limits: the resource limits; :class:`SandboxLimits`' defaults when None.
        base_dir: where to make the sandbox directory; a private tmpfs mount point under ``/run`` when None and the
            host allows a disk quota, else the system's temporary directory.
        use_bubblewrap: False runs commands under the fallback chain even where bubblewrap works (for tests and
            comparisons; :func:`~trajlab.sandbox.require_strong_isolation` judges the default).
        reuse_namespaces: under bubblewrap, make the namespaces once and start each command inside them
            (:mod:`trajlab.sandbox.session`); False starts bwrap for each command (for tests and comparisons; also
            what happens where commands would see no Python 3.9+ to run the command server).
        read_only_paths: host paths (absolute, readable by the sandbox's uid) that commands see read-only at the same
            path, under bubblewrap: a program's installation outside ``/usr``, say. Elsewhere commands see the host's
            files anyway.

    Attributes:
        path: the sandbox's working directory on the host.
        inside_path: the same directory as commands see it (their cwd, ``HOME`` and ``TMPDIR``): under bubblewrap
            :data:`~trajlab.sandbox.bwrap.WORK_INSIDE`, which says nothing of the host; under the fallback chain,
            which cannot move it, :attr:`path`.
    """

    def __init__(self, limits: SandboxLimits | None = None, base_dir: str | Path | None = None, *,
                 use_bubblewrap: bool = True, reuse_namespaces: bool = True,
                 read_only_paths: Sequence[str | Path] = ()) -> None:
        self.limits = limits or SandboxLimits()
        self._read_only = tuple(str(Path(path).resolve()) for path in read_only_paths)
        for path in self._read_only:
            if Path(WORK_INSIDE).is_relative_to(path) or Path(path).is_relative_to(WORK_INSIDE):
                raise SandboxError(f"read-only path {path} would cover or lie in {WORK_INSIDE}, where commands see "
                                   f"their working directory: give a directory that neither holds nor lies in it")
        self._platform = host_platform(use_bubblewrap)
        protections = self._platform.protections
        self._lock = threading.Lock()
        self._closed = False
        self._record: Record | None = None
        self._cgroup: SandboxCgroup | None = None
        self._session: CommandSession | None = None
        self._work_tmpfs: WorkTmpfs | None = None
        sweep()
        self._lease = new_lease(protections.private_uid)  # the uid's last holder may have died after the sweep
        self._mounted = protections.disk_quota
        try:
            if self._mounted and base_dir is None:
                base_dir = mount_base_dir()
            self._root = Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir=base_dir)).resolve()
            self.path = self._root
            if self._platform.cgroups is not None:
                self._cgroup = self._platform.cgroups.sandbox(self._root.name)
            self._record = Record(str(self._root), self._lease.uid, self._mounted, self._cgroup is not None,
                                  tuple(str(directory) for directory in self._cgroup.dirs) if self._cgroup else ())
            self._lease.record(self._record)
            if self._mounted:
                # One tmpfs holds the working directory and the command's /tmp: both count against the quota.
                if not mount_tmpfs(self._root, size=self.limits.disk_bytes, inodes=self.limits.inodes):
                    raise SandboxError(f"could not mount a {self.limits.disk_bytes}-byte tmpfs at {self._root}")
                assert self._lease.uid is not None
                self.path = lay_out(self._root, self._lease.uid)
            if self._cgroup is not None:
                self._cgroup.create(memory_bytes=self.limits.total_memory_bytes,
                                    processes=self.limits.max_processes)
            if self._lease.uid is not None:
                require_traversable(self.path)
                for path in self._read_only:
                    require_readable(Path(path))
                os.chown(self.path, self._lease.uid, self._lease.uid)
            self.inside_path = Path(WORK_INSIDE) if self._platform.bwrap is not None else self.path
            server = self._platform.bwrap is not None and self._platform.server_python is not None and \
                reuse_namespaces
            # The command server (or its --exec) sets the IPC namespace's limits; without the sandbox's tmpfs it caps
            # the tmp dirs itself, and the server also makes the working directory a capped tmpfs, which the host
            # then reaches through /proc.
            self._confine = self._platform.confine
            self._work_in_namespace = self._confine and server and not self._mounted
            sysctl = ipc_sysctls(self.limits) if protections.ipc_limits else None
            self._setup = confinement(self.uid, self.limits.disk_bytes, self.limits.inodes, tmp=not self._mounted,
                                      work=self.inside_path if self._work_in_namespace else None,
                                      sysctl=sysctl) if self._confine else {}
            if self._confine and not self._mounted and not server and self._platform.nsenter is not None:
                assert self._platform.unshare is not None
                self._work_tmpfs = WorkTmpfs(self.path, size=self.limits.disk_bytes, inodes=self.limits.inodes,
                                             unshare=self._platform.unshare, nsenter=self._platform.nsenter,
                                             identity=identity_prefix(self._platform.setpriv, self.uid))
            if self._platform.seccomp_program is not None:  # loaded by the server (or --exec) once set up
                self._setup["seccomp"] = self._platform.seccomp_program
            if server:
                self._session = CommandSession(self._session_argv, self._platform.server_python, cwd=self.path,
                                               env=scrubbed_environment(self.inside_path),
                                               kill_leftovers=self._kill_leftovers,
                                               setup=self._setup, keeps_files=self._work_in_namespace)
        except BaseException:
            self._tear_down()
            raise

    @property
    def uid(self) -> int | None:
        """The uid commands run as, or None when they run as the host's own user."""
        return self._lease.uid

    def protections(self) -> Protections:
        """Which protections this sandbox's commands get (the same for every sandbox of this process and mode)."""
        protections = self._platform.protections
        # One bwrap per command without root's tmpfs, where no namespace could hold one between its commands.
        if self._confine and not self._mounted and not self._work_in_namespace and self._work_tmpfs is None:
            protections = dataclasses.replace(protections, work_dir_quota=False)
        return protections

    def run(self, command: str | Sequence[str], stdin: str | None = None) -> SandboxResult:
        """Run ``command`` (a string goes to ``/bin/sh -c``) in the sandbox directory and wait for it.

        The command ends when its first process exits: whatever it left running is killed (under bubblewrap, with
        its PID namespace).
        """
        argv = [SHELL, "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("empty command")
        with self._lock:
            self._require_open()
            if (refused := unsendable(argv, stdin)) is not None:
                return refused
            if self._session is not None:
                limited = [self._platform.prlimit, *rlimit_options(self.limits), "--", *argv]
                return self._session.run(limited, stdin, self.limits)
            pid_namespace = PidNamespace() if self._platform.bwrap is not None else None
            result = run_process(self._launch_argv(argv, pid_namespace), stdin, cwd=self.path,
                                 env=scrubbed_environment(self.inside_path), limits=self.limits,
                                 kill_leftovers=self._kill_leftovers, pid_namespace=pid_namespace)
        if self._platform.bwrap is not None:
            result = dataclasses.replace(result, exit_code=exit_code(result.exit_code))
        return result

    def process_argv(self, command: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that run ``command`` in this sandbox as a long-lived process the caller starts
        with its own pipes (an MCP server on stdin/stdout), in a new session, with the sandbox directory as its
        working directory. Under bubblewrap it gets its own bwrap and namespaces, even where :meth:`run` reuses one:
        killing the process's group (or the host's death) ends everything it started. :meth:`cleanup` after it exits.
        """
        if not command:
            raise ValueError("empty command")
        with self._lock:
            self._require_open()
            return self._launch_argv(list(command), None), scrubbed_environment(self.inside_path)

    @property
    def resettable(self) -> bool:
        """Whether :meth:`reset` can make this sandbox as new: its commands share one bwrap and its command server."""
        return self._session is not None

    def reset(self) -> None:
        """Make the sandbox as new for its next user (:class:`~trajlab.sandbox.pool.SandboxPool`), keeping its uid,
        tmpfs, cgroups and namespaces: delete every file in its directory and private tmp directories (restoring
        their modes), every POSIX message queue and SysV IPC object of its namespace and every key of its uid's
        keyrings. Processes need nothing: none outlives its command. A :class:`SandboxError` when anything is left
        (the sandbox is then to be cleaned up, not used again) or when the sandbox is not :attr:`resettable`.
        """
        with self._lock:
            self._require_open()
            if self._session is None:
                raise SandboxError("only a sandbox whose commands share one bwrap can be reset: clean it up instead")
            private_tmp = [(d, DIR_MODE if self._mounted else TMPFS_MODE) for d in PRIVATE_TMP_DIRS]
            self._session.wipe([(str(self.inside_path), DIR_MODE), *private_tmp, (MQUEUE_DIR, None)])

    def write_file(self, path: str, content: str | bytes) -> Path:
        """Write a file inside the sandbox directory, creating parent directories; refuses symlinks and ``..``.
        Returns its path as commands see it."""
        inside = inside_path(path)
        with self._lock:
            self._require_open()
            write_file(self._host_view(), inside, content, owner=self.uid)
            return self.inside_path.joinpath(*inside.parts)

    def read_file(self, path: str) -> bytes:
        """Read a file inside the sandbox directory; refuses symlinks, ``..`` and files hard-linked from elsewhere."""
        inside = inside_path(path)
        with self._lock:
            self._require_open()
            return read_file(self._host_view(), inside)

    def _host_view(self) -> Path:
        """The sandbox directory as the host reaches it: in the command server's namespace where it lives there."""
        if self._work_tmpfs is not None:
            return self._work_tmpfs.host_root() / self.path.relative_to("/")
        if self._work_in_namespace:
            assert self._session is not None
            return self._session.host_root() / self.inside_path.relative_to("/")
        return self.path

    def cleanup(self) -> None:
        """Kill whatever the sandbox left running, delete what it made and give back its lease. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tear_down()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def _launch_argv(self, argv: list[str], pid_namespace: PidNamespace | None) -> list[str]:
        platform = self._platform
        join = self._cgroup.join_prefix() if self._cgroup is not None else []
        rlimits = [platform.prlimit, *rlimit_options(self.limits), "--"]
        identity = identity_prefix(platform.setpriv, self.uid)
        if platform.bwrap is not None:
            # The rlimits apply inside, where RLIMIT_NPROC counts only the processes of the command's own user
            # namespace. Without a Python inside, the command keeps the session keyring of whoever started bwrap.
            confined = [] if platform.server_python is None else confined_exec_argv(platform.server_python, self._setup)
            return [*self._bwrap_prefix(pid_namespace, init=bool(confined)), *confined, *rlimits, *argv]
        if not self._mounted:
            return [*join, *rlimits, *platform.net_prefix, *identity, *argv]
        # Root sets up the command's mount namespace (and network namespace), then drops to the sandbox uid.
        assert platform.unshare is not None
        sysctl = ipc_sysctls(self.limits) if platform.protections.ipc_limits else None
        namespaces = mount_namespace_prefix(platform.unshare, fstab_path(self._root),
                                            network=platform.protections.network_namespace, sysctl=sysctl)
        return [*join, *rlimits, *namespaces, *identity, *argv]

    def _session_argv(self, pid_namespace: PidNamespace, server_source: int) -> list[str]:
        """What starts the sandbox's long-lived bwrap, up to the command server's argv."""
        return self._bwrap_prefix(pid_namespace, server=(server_source, SERVER_INSIDE))

    def _bwrap_prefix(self, pid_namespace: PidNamespace | None, server: tuple[int, str] | None = None,
                      init: bool = False) -> list[str]:
        """Root joins the cgroups and drops to the sandbox uid, then bwrap makes the namespaces."""
        assert self._platform.bwrap is not None
        join = self._cgroup.join_prefix() if self._cgroup is not None else []
        private_tmp = self._root / "tmp" if self._mounted else None
        box = bwrap_argv(self._platform.bwrap, work=None if self._work_in_namespace else self.path,
                         private_tmp=private_tmp, tmp_bytes=self.limits.disk_bytes, pid_namespace=pid_namespace,
                         server=server, confine=self._confine, read_only=self._read_only, init=init,
                         fresh_work=self._work_in_namespace)
        enter = self._work_tmpfs.enter_prefix() if self._work_tmpfs is not None else []
        return [*join, *identity_prefix(self._platform.setpriv, self.uid), *enter, *box]

    def _kill_leftovers(self) -> None:
        if self._cgroup is not None:
            self._cgroup.kill()
        if self.uid is not None and self._platform.setpriv is not None and self._platform.bwrap is None:
            kill_uid(self._platform.setpriv, self.uid)

    def _tear_down(self) -> None:
        """Remove what the sandbox recorded; the lease file goes only once that worked."""
        if self._record is None:  # failed before making anything (perhaps clearing a dead holder's leftovers)
            self._lease.release(clean=False)
            return
        try:
            if self._session is not None:
                self._session.close()
            if self._work_tmpfs is not None:
                self._work_tmpfs.close()
            self._kill_leftovers()
            remove_leftovers(dataclasses.replace(self._record, uid=None))  # its processes were just killed
        except BaseException:
            self._lease.release(clean=False)
            raise
        self._lease.release(clean=True)

    def _require_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.path} was cleaned up")
