"""Run untrusted commands (model tool calls) in a throwaway sandbox.

Commands written by a model in training are untrusted: they must not read the host process's secrets, reach the
network, exhaust the machine, or touch another episode's files. Each :class:`Sandbox` owns a private 0700 directory
and, when the host runs as root, its own unprivileged uid, leased for its lifetime so that concurrent sandboxes (in
this or any other process) never share one. Every command runs in a new session under rlimits (CPU seconds, address
space, file size, processes, open files), a wall-clock timeout, an output cap, a scrubbed environment and, where the
OS allows it, a fresh network namespace holding only a down loopback interface. :func:`probe_protections` reports
which of these this machine provides; the sandbox still runs, with fewer protections, where some are missing.

The limits and identity are applied by exec-ing util-linux tools (``prlimit``, ``unshare``, ``setpriv``) in front of
the command rather than by a ``preexec_fn``, which may deadlock a process that runs many episodes on threads.

As root, the sandbox directory is also a size-capped tmpfs, and each command runs in its own mount namespace where
that tmpfs stands in for /tmp, /var/tmp, /dev/shm and /run/lock: everything a command can write lives inside the cap,
so no loop of files can fill the host's disk or memory.

Not isolated: commands can read world-readable host files. Without root they can write into world-writable
directories such as /tmp (their files there are private by default: umask 077), up to the file size limit per file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import IO

#: uids (and gids) leased to sandboxes when the host runs as root: high enough not to belong to real accounts.
#: The first one is only used to probe whether the host can switch to them.
SANDBOX_UID_RANGE = range(1_900_000_000, 1_900_000_000 + 65_536)

#: Where sandboxes live when their directory is a tmpfs mount (as root): outside every directory a command's mount
#: namespace replaces, so the sandbox keeps its path inside.
MOUNT_BASE_DIR = "/run/trajlab-sandboxes"
#: World-writable places a command could otherwise fill; with a disk quota each is the sandbox's own ``.tmp``.
#: /tmp goes last: binding it first would hide a sandbox that lives under /tmp from the later binds.
_SHARED_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock", "/tmp")
# Run as root inside the command's new mount namespace: bind the sandbox's tmp over each shared writable directory
# (one `mount` for all, from the sandbox's fstab: an exec per bind would halve throughput), then exec the rest of argv.
_BIND_SCRIPT = 'mount --all --fstab "$1" || exit 125; shift; exec "$@"'
_SHELL = "/bin/sh"
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 1 << 16
_POLL_S = 0.05  # how often to check whether the command exited while its pipes stay open
_EXIT_GRACE_S = 0.2  # how long to drain output after the command exited and its process group was killed
_PROBE_TIMEOUT_S = 10.0
_BUSY, _CLEAN = b"busy", b"done"  # lease file content while a sandbox holds the uid, and once it cleaned up
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class SandboxError(RuntimeError):
    """The sandbox cannot run here, or was used after :meth:`Sandbox.cleanup`."""


class SandboxPathError(ValueError):
    """A path given to :meth:`Sandbox.write_file` / :meth:`Sandbox.read_file` would leave the sandbox directory."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-command resource limits. CPU, memory, file size and open files are per process."""

    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # RLIMIT_AS: virtual address space
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE: largest file a process may write
    max_processes: int = 64  # RLIMIT_NPROC: enforced only when commands do not run as uid 0 (see Protections)
    open_files: int = 256
    wall_timeout_s: float = 30.0
    max_output_bytes: int = 1 << 20  # kept of stdout and of stderr each; the command is stopped beyond it
    disk_bytes: int = 256 << 20  # all files of the sandbox together, where Protections.disk_quota (tmpfs: RAM)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kinds = (int, float) if field.name == "wall_timeout_s" else (int,)
            valid = isinstance(value, kinds) and not isinstance(value, bool) and 0 < value < math.inf
            if not valid:
                kind = "finite number" if float in kinds else "integer"
                raise ValueError(f"SandboxLimits.{field.name} must be a positive {kind}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Protections:
    """Which protections commands get on this machine, beyond those always applied.

    Always applied: private directory, scrubbed environment, rlimits on CPU, memory, file size and open files, wall
    timeout, output cap, and killing the command's process group when it ends.
    """

    #: Each sandbox runs as its own unprivileged uid (the host is root): sandboxes cannot read each other's files or
    #: signal each other, and processes that leave the process group (setsid) are still killed at cleanup.
    private_uid: bool
    #: RLIMIT_NPROC is enforced (the kernel ignores it for uid 0); without private_uid it counts every process of the
    #: host's user, not only the sandbox's.
    process_cap: bool
    #: setuid binaries cannot raise privileges (setpriv --no-new-privs).
    no_new_privs: bool
    #: Commands see only a down loopback interface: no network at all.
    network_namespace: bool
    #: The network namespace sits in a user namespace, because the host cannot create one directly.
    user_namespace: bool
    #: The sandbox directory is a tmpfs of ``disk_bytes``, and commands see it in place of /tmp, /var/tmp, /dev/shm
    #: and /run/lock: their files cannot fill the host's disk or memory, nor meet another sandbox's in /tmp.
    disk_quota: bool = False


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one command did. ``exit_code`` follows :mod:`subprocess`: ``-N`` when signal N killed the command."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float

    @property
    def signal(self) -> str | None:
        """Name of the signal that killed the command (``SIGXCPU``: CPU limit, ``SIGXFSZ``: file size limit)."""
        if self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:  # a real-time signal has no name
            return f"signal {-self.exit_code}"


@dataclasses.dataclass(frozen=True)
class _Platform:
    prlimit: str
    setpriv: str | None
    net_prefix: tuple[str, ...]
    protections: Protections
    unshare: str | None = None


def probe_protections() -> Protections:
    """Which protections sandboxed commands get on this machine (probed once per process)."""
    return _platform().protections


@functools.cache
def _platform() -> _Platform:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxError("the sandbox needs util-linux's prlimit to apply resource limits")
    setpriv = shutil.which("setpriv")
    probe_uid = SANDBOX_UID_RANGE[0]
    private_uid = os.geteuid() == 0 and setpriv is not None and _works(_identity_prefix(setpriv, probe_uid))
    identity = _identity_prefix(setpriv, probe_uid if private_uid else None)
    net_prefix = next((prefix for prefix in _net_prefixes() if _works([*prefix, *identity])), ())
    unshare = shutil.which("unshare")
    protections = Protections(
        private_uid=private_uid,
        process_cap=private_uid or os.geteuid() != 0,
        no_new_privs=setpriv is not None,
        network_namespace=bool(net_prefix),
        user_namespace="--map-current-user" in net_prefix,
        disk_quota=private_uid and unshare is not None and _can_mount_private_tmp(unshare),
    )
    return _Platform(prlimit, setpriv, net_prefix, protections, unshare)


def _can_mount_private_tmp(unshare: str) -> bool:
    """Whether this host can give a sandbox a tmpfs and bind it over /tmp in a command's own mount namespace."""
    try:
        with tempfile.TemporaryDirectory() as directory:
            if not _mount_tmpfs(directory, size=1 << 20):
                return False
            try:
                fstab = Path(directory, "fstab")
                fstab.write_text(_fstab(Path(directory), ["/tmp"]))
                return _works([unshare, "--mount", "--", _SHELL, "-c", _BIND_SCRIPT, "sh", str(fstab)])
            finally:
                _unmount(directory)
    except OSError:
        return False


def _mount_tmpfs(path: str | Path, *, size: int) -> bool:
    """Mount a root-owned tmpfs that others may traverse but not list; the sandbox owns the directories in it."""
    options = f"size={size},mode=0711,uid=0,gid=0,nosuid,nodev"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "trajlab-sandbox", str(path)],
                          capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False)
    return done.returncode == 0


def _fstab(source: Path, targets: Sequence[str]) -> str:
    """fstab lines binding ``source`` over each target (fstab escapes whitespace as octal)."""
    def escape(path: str) -> str:
        return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")

    return "".join(f"{escape(str(source))} {escape(target)} none bind 0 0\n" for target in targets)


def _remove_stale_mount(root: str) -> None:
    """Unmount and delete the tmpfs sandbox a crashed process left behind (recorded in its uid's lease file)."""
    path = Path(root)
    if root and path.parent == Path(MOUNT_BASE_DIR) and path.name.startswith("trajlab-sandbox-") and path.is_dir():
        _unmount(path)
        shutil.rmtree(path, ignore_errors=True)


def _unmount(path: str | Path) -> None:
    """Detach a sandbox's tmpfs; lazily, so that a process still holding it open cannot make cleanup fail."""
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False)


def _net_prefixes() -> list[tuple[str, ...]]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    return [(unshare, "--net", "--"), (unshare, "--net", "--map-current-user", "--")]


def _identity_prefix(setpriv: str | None, uid: int | None) -> list[str]:
    if setpriv is None:
        return []
    ids = [] if uid is None else [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [setpriv, *ids, "--no-new-privs", "--"]


def _works(prefix: Sequence[str]) -> bool:
    try:
        done = subprocess.run([*prefix, _SHELL, "-c", ":"], env={"PATH": _SAFE_PATH}, cwd="/",
                              capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _lease_uid() -> tuple[int, int]:
    """Lease a sandbox uid: an exclusive flock on its lease file, held until the returned fd is closed."""
    directory = Path(tempfile.gettempdir()) / "trajlab-sandbox-uids"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SandboxError(f"{directory} must be a directory owned by uid {os.geteuid()} with mode 0700")
    for _ in range(256):
        uid = SANDBOX_UID_RANGE[1 + secrets.randbelow(len(SANDBOX_UID_RANGE) - 1)]  # the first one is for probing
        fd = os.open(directory / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise SandboxError(f"no free sandbox uid in {SANDBOX_UID_RANGE}")


def _kill_uid(setpriv: str, uid: int) -> None:
    """SIGKILL every process of ``uid``, also those that left the command's process group: kill(-1) as that uid."""
    subprocess.run([*_identity_prefix(setpriv, uid), _SHELL, "-c", "kill -KILL -1 2>/dev/null"],
                   env={"PATH": _SAFE_PATH}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S, check=False)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` exited, without reaping it: its process group id stays reserved until :meth:`Popen.wait`."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _require_traversable(directory: Path) -> None:
    for parent in directory.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise SandboxError(f"sandbox uids cannot enter {parent}: pass a world-traversable base_dir")


def _make_removable(root: Path) -> None:
    """Let a non-root host delete directories that its commands (same uid) made unreadable."""
    root.chmod(0o700)
    for parent, dirs, _ in os.walk(root):
        for name in dirs:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)


def _relative_parts(path: str) -> tuple[str, ...]:
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise SandboxPathError(f"{path!r} is not a relative path inside the sandbox directory")
    return parts


@contextlib.contextmanager
def _stdin_source(text: str | None) -> Iterator[IO[bytes] | int]:
    """A file for the command's stdin: unlike a pipe, it cannot block the host when the command does not read it."""
    if text is None:
        yield subprocess.DEVNULL
        return
    with tempfile.TemporaryFile() as file:
        file.write(text.encode())
        file.seek(0)
        yield file


class _Capture:
    """Output of one stream, keeping at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    def feed(self, chunk: bytes) -> bool:
        """Keep what fits; False once the stream went over the limit."""
        room = self.limit - len(self.data)
        self.data += chunk[:room]
        self.truncated = len(chunk) > room
        return not self.truncated

    def text(self) -> str:
        return self.data.decode(errors="replace")


@dataclasses.dataclass
class _Pumped:
    stdout: _Capture
    stderr: _Capture
    timed_out: bool = False
    drained: bool = True  # every pipe reached end of file or was closed for going over the output cap


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), or None: then exits are polled."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _pump(process: subprocess.Popen[bytes], deadline: float, limit: int) -> _Pumped:
    """Read the command's stdout and stderr until it exited and both pipes closed, or the deadline passes.

    When the command exits, its process group is killed at once so that background children cannot hold the pipes
    open; pipes still open after a short grace belong to a process that left the group. A stream going over the
    output cap is closed: its writer then gets SIGPIPE/EPIPE, as with ``| head -c``.
    """
    pumped = _Pumped(_Capture(limit), _Capture(limit))
    captures = {process.stdout: pumped.stdout, process.stderr: pumped.stderr}
    pidfd = _pidfd(process.pid)
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector, contextlib.ExitStack() as stack:
        for pipe in captures:
            selector.register(pipe, selectors.EVENT_READ)
        if pidfd is not None:
            stack.callback(os.close, pidfd)
            selector.register(pidfd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now >= deadline:
                pumped.timed_out, pumped.drained = exited_at is None, False
                return pumped
            if exited_at is None and _has_exited(process.pid):
                exited_at = now
                _kill_group(process.pid)
                if pidfd is not None:
                    selector.unregister(pidfd)
            if exited_at is not None and (not captures or now - exited_at >= _EXIT_GRACE_S):
                pumped.drained = not captures
                return pumped
            if exited_at is not None:
                timeout = exited_at + _EXIT_GRACE_S - now
            else:
                timeout = deadline - now if pidfd is not None else _POLL_S
            for key, _ in selector.select(min(timeout, deadline - now)):
                if key.fileobj in captures:
                    _read_into(selector, key.fileobj, captures)


def _read_into(selector: selectors.BaseSelector, pipe: IO[bytes], captures: dict[IO[bytes], _Capture]) -> None:
    """Read what ``pipe`` has; on end of file or output over the cap, stop watching it and close it."""
    chunk = os.read(pipe.fileno(), _READ_CHUNK)
    if not chunk or not captures[pipe].feed(chunk):
        selector.unregister(pipe)
        pipe.close()
        del captures[pipe]


class Sandbox:
    """A private directory (and, as root, a private uid) in which to run untrusted commands, one at a time.

    Use it as a context manager, or call :meth:`cleanup`, which kills what is left running and deletes the directory.
    """

    def __init__(self, limits: SandboxLimits | None = None, base_dir: str | Path | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._platform = _platform()
        self._lock = threading.Lock()
        self._closed = False
        self._uid, self._lease_fd = _lease_uid() if self._platform.protections.private_uid else (None, None)
        self._mounted = False
        try:
            quota = self._platform.protections.disk_quota
            if quota and base_dir is None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(MOUNT_BASE_DIR, 0o711)
                base_dir = MOUNT_BASE_DIR
            self._root = Path(tempfile.mkdtemp(prefix="trajlab-sandbox-", dir=base_dir)).resolve()
            self.path = self._root
            if self._uid is not None:
                lease = os.pread(self._lease_fd, 4096, 0)
                if lease.startswith(_BUSY):  # its last holder died without cleaning up
                    self._kill_leftovers()
                    _remove_stale_mount(lease[len(_BUSY):].decode(errors="replace").strip())
            if quota and self._uid is not None:
                # One tmpfs holds the working directory and the command's /tmp: both count against disk_bytes.
                self._mounted = _mount_tmpfs(self._root, size=self.limits.disk_bytes)
                if not self._mounted:
                    raise SandboxError(f"could not mount a {self.limits.disk_bytes}-byte tmpfs at {self._root}")
                self.path = self._root / "work"
                for directory in (self.path, self._private_tmp):
                    directory.mkdir(mode=0o700)
                    os.chown(directory, self._uid, self._uid)
                targets = [t for t in _SHARED_WRITABLE if os.path.isdir(t) and not self._root.is_relative_to(t)]
                self._fstab_path.write_text(_fstab(self._private_tmp, targets))
            if self._uid is not None:
                _require_traversable(self.path)
                os.chown(self.path, self._uid, self._uid)
                os.ftruncate(self._lease_fd, 0)
                os.pwrite(self._lease_fd, _BUSY + (b" " + bytes(self._root) if self._mounted else b""), 0)
        except BaseException:
            if self._mounted:
                _unmount(self._root)
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
        argv = [_SHELL, "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("empty command")
        with self._lock:
            self._require_open()
            return self._run(argv, stdin)

    def write_file(self, path: str, content: str | bytes) -> Path:
        """Write a file inside the sandbox directory, creating parent directories; refuses symlinks and ``..``."""
        parts = _relative_parts(path)
        data = content.encode() if isinstance(content, str) else content
        with self._lock, self._open_dir(parts[:-1], path, create=True) as dir_fd:
            fd = self._open_file(parts[-1], dir_fd, os.O_WRONLY | os.O_CREAT, path)
            with os.fdopen(fd, "wb") as file:
                file.truncate()
                file.write(data)
                if self._uid is not None:
                    os.fchown(fd, self._uid, self._uid)
        return self.path.joinpath(*parts)

    def read_file(self, path: str) -> bytes:
        """Read a file inside the sandbox directory; refuses symlinks, ``..`` and files hard-linked from elsewhere."""
        parts = _relative_parts(path)
        with self._lock, self._open_dir(parts[:-1], path, create=False) as dir_fd:
            fd = self._open_file(parts[-1], dir_fd, os.O_RDONLY, path)
            with os.fdopen(fd, "rb") as file:
                return file.read()

    def cleanup(self) -> None:
        """Kill whatever the sandbox left running, delete its directory and give back its uid. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._kill_leftovers()
                if self._mounted:
                    _unmount(self._root)
                if os.geteuid() != 0:
                    _make_removable(self._root)
                shutil.rmtree(self._root)
                if self._lease_fd is not None:
                    os.ftruncate(self._lease_fd, 0)
                    os.pwrite(self._lease_fd, _CLEAN, 0)  # the next holder of this uid need not kill leftovers
            finally:
                self._release_uid()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def _run(self, argv: list[str], stdin: str | None) -> SandboxResult:
        started = time.monotonic()
        with _stdin_source(stdin) as source:
            process = subprocess.Popen(self._launch_argv(argv), stdin=source, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, cwd=self.path, env=self._environment(), umask=0o077,
                                       start_new_session=True)
        drained = False
        try:
            pumped = _pump(process, started + self.limits.wall_timeout_s, self.limits.max_output_bytes)
            drained = pumped.drained
        finally:
            _kill_group(process.pid)
            if not drained:  # something that left the process group may still hold the pipes
                self._kill_leftovers()
            process.wait()
            for pipe in (process.stdout, process.stderr):
                pipe.close()
        return SandboxResult(
            exit_code=process.returncode,
            stdout=pumped.stdout.text(),
            stderr=pumped.stderr.text(),
            timed_out=pumped.timed_out,
            stdout_truncated=pumped.stdout.truncated,
            stderr_truncated=pumped.stderr.truncated,
            wall_s=time.monotonic() - started,
        )

    def _launch_argv(self, argv: list[str]) -> list[str]:
        limits = self.limits
        rlimits = [
            f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",  # SIGXCPU, then SIGKILL a second later
            f"--as={limits.memory_bytes}",
            f"--fsize={limits.file_size_bytes}",
            f"--nproc={limits.max_processes}",
            f"--nofile={limits.open_files}",
            "--core=0",
        ]
        platform = self._platform
        identity = _identity_prefix(platform.setpriv, self._uid)
        if not self._mounted:
            return [platform.prlimit, *rlimits, "--", *platform.net_prefix, *identity, *argv]
        # Root sets up the command's mount namespace (and network namespace), then drops to the sandbox uid.
        net = ["--net"] if platform.protections.network_namespace else []
        return [platform.prlimit, *rlimits, "--", platform.unshare, "--mount", *net, "--", _SHELL, "-c",
                _BIND_SCRIPT, "sh", str(self._fstab_path), *identity, *argv]

    @property
    def _private_tmp(self) -> Path:
        return self._root / "tmp"

    @property
    def _fstab_path(self) -> Path:
        return self._root / "fstab"

    def _environment(self) -> dict[str, str]:
        home = str(self.path)
        return {"PATH": _SAFE_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}

    def _kill_leftovers(self) -> None:
        if self._uid is not None and self._platform.setpriv is not None:
            _kill_uid(self._platform.setpriv, self._uid)

    def _release_uid(self) -> None:
        if self._lease_fd is not None:
            os.close(self._lease_fd)
            self._lease_fd = None

    def _require_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.path} was cleaned up")

    @contextlib.contextmanager
    def _open_dir(self, parts: Sequence[str], path: str, *, create: bool) -> Iterator[int]:
        """An fd of directory ``parts`` under the sandbox, walked one component at a time without following links."""
        self._require_open()
        fd = os.open(self.path, _DIR_FLAGS)
        try:
            for part in parts:
                made = create and _mkdir_at(part, fd)
                child = _open_at(part, fd, _DIR_FLAGS, path)
                os.close(fd)
                fd = child
                if made and self._uid is not None:
                    os.fchown(fd, self._uid, self._uid)
            yield fd
        finally:
            os.close(fd)

    def _open_file(self, name: str, dir_fd: int, flags: int, path: str) -> int:
        fd = _open_at(name, dir_fd, flags | _FILE_FLAGS, path)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise SandboxPathError(f"{path!r} is not a regular file of the sandbox")
        return fd


def _mkdir_at(name: str, dir_fd: int) -> bool:
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def _open_at(name: str, dir_fd: int, flags: int, path: str, mode: int = 0o600) -> int:
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SandboxPathError(f"{path!r} goes through a symlink or a non-directory") from exc
        raise
