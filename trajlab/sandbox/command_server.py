"""The command server: PID 1 of a sandbox's long-lived bubblewrap namespaces, running its commands one at a time.

Why: starting bwrap (seven namespaces, about 40 mounts) costs about 10 ms a command; spawning from a process already
inside costs about 1 ms. As the PID namespace's init the server cannot be killed or stopped from inside (the kernel
drops signals sent to an init from its own namespace unless it handles them), and, made non-dumpable, commands that
run as its uid cannot trace it or open its descriptors. After each command's first process exits, it kills everything
else in the namespace and reaps it: nothing a command starts outlives it, as under one bwrap per command.

It runs under the system's ``python3 -I -S`` with the standard library only (trajlab is not visible inside). The
host's socket (SOCK_SEQPACKET) is the descriptor named by its one argument. Per command the host sends a JSON request
(argv, env) with the command's stdin, stdout and stderr as ancillary descriptors; the server
answers ``{"started": true}`` once it started the command and ``{"status": <wait status>}`` once nothing of the command
is left. Between commands the host may ask it to wipe the sandbox for its next user (``{"wipe": [[dir, mode], ...]}``,
answered ``{"left": <what could not be removed>}``): the directories' contents, the IPC namespace's SysV objects and
the keyrings of the sandbox's uid, the state that commands can leave behind when none of their processes is left. It
exits when the host closes the socket.

Started without root's tmpfs (see :func:`trajlab.sandbox.bwrap.bwrap_argv`, ``confine``), it first confines itself
and so every command: as its user namespace's root it mounts ``/tmp``, ``/var/tmp`` and ``/dev/shm`` as tmpfs capped
in bytes and inodes (bwrap's own tmpfs has no inode cap), then enters a nested user namespace, its parent allowed no
other, mapped to the host user's ids, and drops every capability for good: commands cannot unmount those caps or
make user namespaces. Last, it loads the sandbox's system-call filter (:mod:`trajlab.sandbox.seccomp`), which
refuses the calls that setup needed, for itself and every command. One bwrap per command runs the same steps with
``--exec SETUP ARGV...``, then runs the command as its child, staying the namespace's init: PID 1 is then a process
commands cannot trace or read, not bwrap's own init, which runs as their uid and is dumpable.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import signal
import socket
import stat
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing collections costs about 2 ms of each server's start
    from collections.abc import Callable, Collection

_PR_SET_DUMPABLE = 4
_CANNOT_RUN = 127 << 8  # the wait status of exit code 127
_MAX_REQUEST_BYTES = 1 << 20
_STREAMS = 3  # stdin, stdout, stderr
_IPC_RMID = 0
#: The keyctl system call's number on this machine (the C library has no wrapper); None: keyrings cannot be wiped.
_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 280, "s390x": 280}.get(os.uname().machine)
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_CLEAR, _KEYCTL_LINK, _KEYCTL_GET_PERSISTENT = 1, 7, 8, 22
_SESSION_KEYRING, _USER_KEYRING, _USER_SESSION_KEYRING = -3, -4, -5
#: A kernel without (persistent) keyrings has none to wipe; nor has one where a seccomp filter refuses keyrings (the
#: sandbox's own, loaded before any command runs, or a container's around the host).
_NO_KEYRINGS = (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 2, 4, 0x1000, 0x4000
_MS_RDONLY, _MS_REMOUNT, _MS_PROC = 1, 32, 2 | 4 | 8  # _MS_PROC: nosuid, nodev, noexec, as bwrap mounts /proc
_CLONE_NEWUSER = 0x10000000
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
#: noroot, no_setuid_fixup, keep_caps (off) and no_cap_ambient_raise, each locked: uid 0 never regains capabilities
_SECURE_BITS = 0x1 | 0x2 | 0x4 | 0x8 | 0x20 | 0x40 | 0x80
_CAPABILITY_VERSION_3 = 0x20080522
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: FS_IOC_GETFLAGS and FS_IOC_SETFLAGS (_IOR/_IOW('f', 1 or 2, long)); FS_IMMUTABLE_FL | FS_APPEND_FL
_FS_IOC_GETFLAGS = 2 << 30 | ctypes.sizeof(ctypes.c_long) << 16 | ord("f") << 8 | 1
_FS_IOC_SETFLAGS = 1 << 30 | ctypes.sizeof(ctypes.c_long) << 16 | ord("f") << 8 | 2
_UNDELETABLE_FLAGS = 0x10 | 0x20
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_SIGNAL_STATUS_BASE = 128  # bwrap's exit status for a command killed by signal N: 128 + N
#: What bwrap must grant the server for :func:`_confine` (it keeps none of them).
CONFINE_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_SETPCAP", "CAP_SETFCAP")


def main() -> None:
    """``FD SETUP``: serve commands on socket FD; ``--exec SETUP ARGV...``: run ARGV alone. SETUP is JSON, see
    :func:`_confine`."""
    libc = ctypes.CDLL(None, use_errno=True)
    # Commands inherit this process's session keyring: a new, empty one, not the one of whoever started bwrap.
    if _keyctl(libc, _KEYCTL_JOIN_SESSION_KEYRING, 0) < 0 and ctypes.get_errno() not in _NO_KEYRINGS:
        sys.exit(f"could not join a new session keyring: {os.strerror(ctypes.get_errno())}")
    setup = json.loads(sys.argv[2])
    _confine(libc, setup)
    if sys.argv[1] != "--exec" and "uid" in setup:  # the server again, as a program of the nested namespace (then
        # its /proc entries belong to no uid of the commands', not to its namespace's root); it loads the filter there
        os.set_inheritable(int(sys.argv[1]), True)
        rest = json.dumps({key: value for key, value in setup.items() if key == "seccomp"})
        os.execv(sys.executable, [sys.executable, "-I", "-S", sys.argv[0], sys.argv[1], rest])
    _filter_system_calls(libc, setup)
    # Python's own handler would be a way for commands to interrupt their init (SIGINT); SIGPIPE and SIGXFSZ, which
    # Python ignores, are restored in each command.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.argv[1] == "--exec":
        sys.exit(_run_as_init(libc, sys.argv[3:]))
    # The host's way to end a command that ran out of time, keeping the namespace (and its files) for the next one.
    # Commands can send it too: it kills only them.
    signal.signal(signal.SIGUSR1, _kill_all_but_me)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_DUMPABLE) failed: {os.strerror(ctypes.get_errno())}")
    control = socket.socket(fileno=int(sys.argv[1]))
    control.set_inheritable(False)
    control.send(b'{"ready": true}')
    while True:
        message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST_BYTES, _STREAMS)
        if not message:
            return
        request = json.loads(message)
        if "wipe" in request:
            control.send(json.dumps({"left": _wipe(request["wipe"], libc)}).encode())
            continue
        pid = _spawn(request, fds)
        control.send(b'{"started": true}')
        status = os.waitpid(pid, 0)[1] if pid is not None else _CANNOT_RUN
        _kill_the_rest()
        control.send(json.dumps({"status": status}).encode())


def _confine(libc: ctypes.CDLL, setup: dict) -> None:
    """With a confinement ``setup`` (one with a ``"uid"``): write ``setup["sysctl"]`` (``{name under /proc/sys:
    value}``: the IPC namespace's limits, which only its user namespace's root may set), mount ``setup["tmpfs"]``
    (``[[dir, bytes, inodes, mode], ...]``, in that order; a mount already below one of them is bound again onto it),
    then leave for a nested user namespace (``setup["uid"]``, ``["gid"]``) that no command can leave or nest,
    without capabilities. Exits the process on any failure: a command must never run half-confined."""
    if "uid" not in setup:
        return
    for name, value in setup["sysctl"].items():
        _write(f"/proc/sys/{name}", str(value))
    for directory, size, inodes, mode in setup["tmpfs"]:  # the working directory last: it may lie below /tmp
        # What bwrap bound below it (the working directory, in a /tmp sandbox) is bound again onto the new tmpfs.
        kept = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in top_mounts_below(directory)]
        options = f"size={size},nr_inodes={inodes},mode={mode:o}".encode()
        mounted = libc.mount(b"tmpfs", directory.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options)
        _check(mounted, f"mount {directory}")
        for path, fd in kept:
            os.makedirs(path, exist_ok=True)
            _check(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None),
                   f"bind {path}")
            os.close(fd)
    # This user namespace may hold one more: the nested one made next, where commands then cannot make any.
    _write("/proc/sys/user/max_user_namespaces", "1")
    # Commands run as the uid that owns the IPC namespace's limits, and may write them: /proc/sys goes read-only.
    _check(libc.mount(b"/proc/sys", b"/proc/sys", None, _MS_BIND, None), "bind /proc/sys")
    _check(libc.mount(None, b"/proc/sys", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_PROC, None),
           "remount /proc/sys read-only")
    _check(libc.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{setup['uid']} 0 1")
    _write("/proc/self/gid_map", f"{setup['gid']} 0 1")
    # The mounts belong to the parent namespace, where this one has no capability; these drop the rest for good.
    with open("/proc/sys/kernel/cap_last_cap") as last:
        for capability in range(int(last.read()) + 1):
            _check(libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT)")
    _check(libc.prctl(_PR_SET_SECUREBITS, _SECURE_BITS, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    os.chdir(os.getcwd())  # the working directory as mounted now, not the one bwrap entered under it


class _Program(ctypes.Structure):
    """``struct sock_fprog``: a BPF program's length in instructions (8 bytes each) and its address."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _filter_system_calls(libc: ctypes.CDLL, setup: dict) -> None:
    """Load ``setup["seccomp"]`` (a BPF program, in hex) for this process and everything it starts; exits the
    process when it cannot: a command must never run unfiltered where the host asked for the filter."""
    if "seccomp" not in setup:
        return
    code = bytes.fromhex(setup["seccomp"])
    buffer = ctypes.create_string_buffer(code)
    program = _Program(len(code) // 8, ctypes.addressof(buffer))
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "loading the seccomp filter")


def _run_as_init(libc: ctypes.CDLL, argv: list) -> int:
    """Run ``argv`` as this process's child, reaping whatever else ends up ours meanwhile (as the namespace's init,
    orphans do); its exit status as bwrap gives it (128 + N for signal N). Not dumpable: commands, which run as this
    uid, cannot trace it or read its memory, environment or descriptors."""
    _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:  # as a shell reports a command it cannot run
        print(f"{argv[0]}: {exc.strerror}", file=sys.stderr)
        return _CANNOT_RUN >> 8
    while True:
        reaped, status = os.wait()
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            return _SIGNAL_STATUS_BASE - code if code < 0 else code


def top_mounts_below(directory: str, points: list[str] | None = None) -> list[str]:
    """The mount points strictly below ``directory`` that are not below another of them, among ``points`` (None:
    this namespace's, :func:`mount_points`)."""
    found: list[str] = []
    for point in mount_points() if points is None else points:
        if point.startswith(directory.rstrip("/") + "/") and not any(point.startswith(f"{top}/") for top in found):
            found.append(point)
    return found


def mount_points() -> list[str]:
    """This mount namespace's mount points, in mount order (``/proc/self/mountinfo``: the fifth field, with spaces and
    the like octal-escaped)."""
    with open("/proc/self/mountinfo") as mountinfo:
        fields = [line.split()[4] for line in mountinfo]
    return [re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field) if "\\" in field else field
            for field in fields]


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as file:
            file.write(text)
    except OSError as exc:
        sys.exit(f"could not write {text!r} to {path}: {exc.strerror}")


def _check(result: int, what: str) -> None:
    if result != 0:
        sys.exit(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def _spawn(request: dict, fds: list) -> int | None:
    """Start the command in its own session, in the server's directory, with ``fds`` as its stdin, stdout and
    stderr (vfork and exec: no copy of the server's memory); None when it could not be started."""
    argv = request["argv"]
    try:
        for fd in fds:
            os.set_inheritable(fd, False)  # the command gets them as 0, 1 and 2 only
        actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)]
        return os.posix_spawnp(argv[0], argv, request["env"], file_actions=actions, setsid=True,
                               setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except (OSError, ValueError) as exc:  # as a shell reports a command it cannot run; ValueError: a NUL byte or a
        # lone surrogate, which no exec can pass (a command's fault: the server, and its namespace, must go on)
        why = exc.strerror if isinstance(exc, OSError) else "an argument holds a NUL byte or a character with no bytes"
        os.write(fds[2], f"{argv[0]}: {why}\n".encode(errors="replace"))
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _kill_all_but_me(*_: object) -> None:
    """Kill every other process of the namespace; the wait for the command then returns."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


def _kill_the_rest() -> None:
    """Kill every other process of the namespace (kill(-1) from its init reaches all of them) and reap them."""
    _kill_all_but_me()  # none alive raises nothing; zombies may still be there
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:  # every process of the namespace descends from its init: none is left
            return


def _wipe(directories: list, libc: ctypes.CDLL) -> int:
    """Delete what commands left in ``directories`` (each emptied and its extended attributes removed; given its mode,
    and its times set to now, unless the mode is None), in SysV IPC and in keyrings; returns how many things could not
    be removed. Nothing else runs: no file changes meanwhile."""
    left, seen, points = 0, set(), mount_points()
    for directory, mode in directories:
        status = os.stat(directory)
        if (status.st_dev, status.st_ino) in seen:  # /tmp, /var/tmp and /dev/shm may be one directory
            continue
        seen.add((status.st_dev, status.st_ino))
        try:
            if mode is not None:  # first: a command may have made it unreadable
                os.chmod(directory, mode)
            left += empty_around_mounts(directory, points) + _remove_xattrs(directory)
            if mode is not None:
                os.utime(directory)  # times a command set (16 bytes of its choosing) are not handed on
        except OSError:
            left += 1
    return left + _remove_ipc_objects(libc) + _clear_keyrings(libc)


def _remove_xattrs(path: str) -> int:
    """Remove the extended attributes of a directory that stays (its files' go with them); returns how many that
    commands could have set (``user.*``, ACLs) are left. ``security.*`` and ``trusted.*`` need capabilities that
    commands lack, and may be the system's own."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:  # a file system without extended attributes: none to remove
            return 0
        raise
    left = 0
    for name in names:
        try:
            os.removexattr(path, name, follow_symlinks=False)
        except OSError:
            left += not name.startswith(("security.", "trusted."))
    return left


def empty_around_mounts(directory: str, points: list[str]) -> int:
    """Delete everything below ``directory`` but the mount points there, among ``points`` (another sandbox's working
    directory, bound below /tmp, say), and the directories on the way to them; returns how many entries could not be
    deleted."""
    keep: dict[str, set[str]] = {directory: set()}
    for mount in top_mounts_below(directory, points):
        while mount.rstrip("/") != directory.rstrip("/"):
            mount, name = os.path.split(mount)
            keep.setdefault(mount, set()).add(name)
    return sum(empty_tree(path, names) for path, names in keep.items())


def remove_tree(path: str) -> int:
    """Delete the directory ``path`` and everything below it on its file system, as :func:`empty_tree`; returns how
    many entries could not be deleted."""
    parent, name = os.open(os.path.dirname(path) or ".", _DIR_OPEN), os.path.basename(path)
    try:
        # readable (a command may have taken that away), and never a symlink
        os.close(_open_dir(parent, name, os.stat(name, dir_fd=parent, follow_symlinks=False).st_dev))
        if left := empty_tree(path):
            return left
        _unflagged(os.rmdir, parent, name)
        return 0
    finally:
        os.close(parent)


def empty_tree(directory: str, keep: Collection[str] = ()) -> int:
    """Delete everything below ``directory`` on its file system but the entries named in ``keep``, without following
    links; returns how many entries could not be deleted (a mount point among them).

    Why not recursion (``shutil.rmtree``): a command can make a tree deeper than any recursion limit, descriptor limit
    or PATH_MAX. Each directory's own subdirectories are moved up into ``directory`` and emptied in turn, so any depth
    costs two descriptors and short names. Directories a command made unreadable are made its owner's again;
    immutable and append-only flags are cleared where the caller may (root, on a file system that has them). The host
    uses it too (:func:`trajlab.sandbox.sweep.remove_leftovers`): this module is the one copy that runs inside and out.
    """
    top = os.open(directory, _DIR_OPEN)
    try:
        device, left = os.fstat(top).st_dev, 0
        with os.scandir(top) as scan:
            pending = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in scan if entry.name not in keep]
        while pending:
            name, is_dir = pending.pop()
            try:
                if is_dir:
                    _empty_one_level(top, name, device, pending)
                _unflagged(os.rmdir if is_dir else os.unlink, top, name)
            except FileNotFoundError:
                pass
            except OSError:  # EXDEV: a mount point, kept
                left += 1
        return left
    finally:
        os.close(top)


def _empty_one_level(top: int, name: str, device: int, pending: list[tuple[str, bool]]) -> None:
    """Delete the files of ``top``'s subdirectory ``name`` and move its subdirectories up into ``top`` (onto
    ``pending``)."""
    directory = _open_dir(top, name, device)
    try:
        with os.scandir(directory) as scan:
            entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in scan]
        for child, is_dir in entries:
            if not is_dir:
                _unflagged(os.unlink, directory, child)
                continue
            moved = _free_name(top, child, directory)
            def move(path: str, dir_fd: int, to: str = moved) -> None:
                os.rename(path, to, src_dir_fd=dir_fd, dst_dir_fd=top)
            try:
                _unflagged(move, directory, child)
            except PermissionError:  # moving a directory rewrites its "..": one a command made unwritable is made
                _unflagged(lambda path, dir_fd: _make_owners(path, dir_fd, device), directory, child)  # writable
                _unflagged(move, directory, child)
            pending.append((moved, True))
    finally:
        os.close(directory)


def _open_dir(dir_fd: int, name: str, device: int) -> int:
    """``dir_fd``'s subdirectory ``name``, opened for listing (made its owner's when a command made it unreadable);
    OSError EXDEV when it is a mount point, not on ``device``."""
    try:
        directory = os.open(name, _DIR_OPEN, dir_fd=dir_fd)
    except PermissionError:
        _unflagged(lambda path, dir_fd: _make_owners(path, dir_fd, device), dir_fd, name)
        directory = os.open(name, _DIR_OPEN, dir_fd=dir_fd)
    if os.fstat(directory).st_dev != device:
        os.close(directory)
        raise OSError(errno.EXDEV, "a mount point", name)
    return directory


def _make_owners(name: str, dir_fd: int, device: int) -> None:
    """Give the directory ``name`` (never a symlink, never on another file system) mode 0700."""
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if os.fstat(fd).st_dev != device:
            raise OSError(errno.EXDEV, "a mount point", name)
        os.chmod(f"/proc/self/fd/{fd}", 0o700)  # chmod has no flag not to follow a symlink; this cannot be one
    finally:
        os.close(fd)


def _free_name(top: int, name: str, directory: int) -> str:
    """A name no entry of ``top`` has, for ``directory``'s subdirectory ``name`` (after its inode: unique, unless a
    command made such a name first)."""
    inode, attempt = os.stat(name, dir_fd=directory, follow_symlinks=False).st_ino, 0
    while True:
        free = f".trajlab-wiped-{inode}-{attempt}"
        try:
            os.stat(free, dir_fd=top, follow_symlinks=False)
        except FileNotFoundError:
            return free
        attempt += 1


def _unflagged(operation: Callable[..., object], dir_fd: int, name: str) -> None:
    """``operation(name, dir_fd=dir_fd)``, again after clearing immutable and append-only flags from the entry and its
    directory when those refused it."""
    try:
        operation(name, dir_fd=dir_fd)
    except PermissionError:
        if not _clear_flags(dir_fd) | _clear_flags(dir_fd, name):
            raise
        operation(name, dir_fd=dir_fd)


def _clear_flags(dir_fd: int, name: str | None = None) -> bool:
    """Clear the immutable and append-only flags of the directory ``dir_fd`` (or of its regular file or directory
    ``name``); whether any was set and cleared."""
    fd = dir_fd
    try:
        if name is not None:
            if not stat.S_ISREG(mode := os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode) and \
                    not stat.S_ISDIR(mode):
                return False
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        import fcntl  # here: only root's rare retry needs it, and each import slows every server's start

        flags = int.from_bytes(fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(4)), sys.byteorder)
        if not flags & _UNDELETABLE_FLAGS:
            return False
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, (flags & ~_UNDELETABLE_FLAGS).to_bytes(4, sys.byteorder))
        return True
    except OSError:  # no flags on this file system, or not root
        return False
    finally:
        if fd != dir_fd:
            os.close(fd)


def _remove_ipc_objects(libc: ctypes.CDLL) -> int:
    """Remove every SysV shared memory segment, semaphore set and message queue of the IPC namespace."""
    left = 0
    removers = {"shm": lambda id_: libc.shmctl(id_, _IPC_RMID, None), "sem": lambda id_: libc.semctl(id_, 0, _IPC_RMID),
                "msg": lambda id_: libc.msgctl(id_, _IPC_RMID, None)}
    for kind, remove in removers.items():
        with open(f"/proc/sysvipc/{kind}") as table:
            next(table)  # the header
            left += sum(remove(int(line.split()[1])) != 0 for line in table)
    return left


def _clear_keyrings(libc: ctypes.CDLL) -> int:
    """Empty the uid's persistent, user and session keyrings (a process's own die with it)."""
    if _KEYCTL is None:  # keys may be there, and cannot be reached
        return 1
    left = 0
    # linked into the session keyring, which is cleared last
    persistent = _keyctl(libc, _KEYCTL_GET_PERSISTENT, -1, _SESSION_KEYRING)
    if persistent >= 0:
        left += _keyctl_failed(libc, _KEYCTL_CLEAR, persistent)
    elif ctypes.get_errno() not in _NO_KEYRINGS:
        left += 1
    for keyring in (_USER_KEYRING, _USER_SESSION_KEYRING, _SESSION_KEYRING):
        left += _keyctl_failed(libc, _KEYCTL_CLEAR, keyring)
    # as the kernel made it: the user session keyring links the user keyring
    return left + _keyctl_failed(libc, _KEYCTL_LINK, _USER_KEYRING, _USER_SESSION_KEYRING)


def _keyctl(libc: ctypes.CDLL, *args: int) -> int:
    """The keyctl system call; -1 with errno ENOSYS on a machine whose call number is not known."""
    if _KEYCTL is None:
        ctypes.set_errno(errno.ENOSYS)
        return -1
    return libc.syscall(ctypes.c_long(_KEYCTL), *map(ctypes.c_long, args))


def _keyctl_failed(libc: ctypes.CDLL, *args: int) -> bool:
    """Whether a keyctl operation failed, on a kernel that has keyrings."""
    return _keyctl(libc, *args) != 0 and ctypes.get_errno() not in _NO_KEYRINGS


if __name__ == "__main__":
    main()
