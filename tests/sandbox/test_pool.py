"""A sandbox given back to a :class:`SandboxPool` comes back to its next user as a new sandbox would, whatever its last
user left: files anywhere it could write, unreadable directories of any depth, extended attributes, SysV and POSIX IPC
objects, keys, daemons."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.sandbox.helpers import ADD_KEY, FAST, KEYCTL, PROTECTIONS, needs_bwrap, needs_key_calls
from trajlab.sandbox import Sandbox, SandboxError
from trajlab.sandbox.pool import SandboxPool

# What a hostile last user leaves: everything it can write outside its processes, which die with its command.
LEAVE = f"""
import ctypes, os, socket, subprocess
libc, rt = ctypes.CDLL(None, use_errno=True), ctypes.CDLL("librt.so.1", use_errno=True)
os.makedirs("d/e")
for path in ("d/e/f", ".hidden", "/tmp/x", "/var/tmp/y", "/dev/shm/z"):
    open(path, "w").write("secret")
open("/dev/shm/big", "wb").write(b"x" * (1 << 20))
for place in (".", "/tmp", "/var/tmp", "/dev/shm", "d/e/f", "/tmp/x"):
    os.setxattr(place, "user.stash", b"secret")
os.symlink("/etc/passwd", "link")
os.mkfifo("fifo")
socket.socket(socket.AF_UNIX).bind("sock")
fd, locked = os.open("d/e", os.O_RDONLY), []
for level in range(2500):  # deeper than any recursion limit, some levels unreadable
    os.mkdir("deep", dir_fd=fd)
    fd, parent = os.open("deep", os.O_RDONLY, dir_fd=fd), fd
    (locked if level % 500 == 0 else []).append(parent)
    if parent not in locked:
        os.close(parent)
for parent in locked:
    os.fchmod(parent, 0)
os.chmod("d/e", 0)
os.chmod("d", 0)
os.chmod(".", 0o777)
for place in ("/tmp", "/var/tmp", "/dev/shm"):
    os.chmod(place, 0o1757)
    os.utime(place, (1e9, 1e9))  # a time a later user could read: 2001
assert libc.shmget(0, 4096, 0o1600) >= 0 and libc.shmget(1234, 4096, 0o1600) >= 0
assert libc.semget(0, 1, 0o1600) >= 0 and libc.msgget(0, 0o1600) >= 0
assert rt.mq_open(b"/queue", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0
def keyctl(*args):
    return libc.syscall(ctypes.c_long({KEYCTL}), *map(ctypes.c_long, args))
persistent = keyctl(22, -1, -3)  # linked into the session keyring: possessed, so writable
for keyring in (-3, -4, -5, persistent):  # refused (EPERM) only where the sandbox's seccomp filter is on
    assert libc.syscall(ctypes.c_long({ADD_KEY}), b"user", b"stash%d" % keyring, b"secret", ctypes.c_size_t(6),
                        ctypes.c_long(keyring)) >= 0 or ({PROTECTIONS.seccomp_filter} and ctypes.get_errno() == 1)
subprocess.Popen(["setsid", "sleep", "100"], start_new_session=True)
print("left")
"""

# What a user can see of the state earlier users could leave, as JSON.
OBSERVE = f"""
import ctypes, hashlib, json, os
libc = ctypes.CDLL(None, use_errno=True)
def keyctl(*args):
    return libc.syscall(ctypes.c_long({KEYCTL}), *map(ctypes.c_long, args))
def linked(keyring):  # the ids of the keys a keyring holds, 4 bytes each
    return keyctl(11, keyring, 0, 0)
def xattrs(path):
    try:
        return {{name: os.getxattr(path, name, follow_symlinks=False).hex()
                for name in os.listxattr(path, follow_symlinks=False)}}
    except OSError as exc:  # a symlink (no user xattrs), a file system without them
        return exc.strerror
def contents(path):
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW | os.O_NONBLOCK)) as file:
            return hashlib.sha256(file.read()).hexdigest()
    except OSError as exc:
        return exc.strerror
def files(top):  # every file below top: its name, mode, extended attributes and contents
    found = []
    for root, dirs, names in os.walk(top):
        for path in sorted(os.path.join(root, name) for name in dirs + names):
            found.append([path, oct(os.lstat(path).st_mode), xattrs(path), contents(path)])
    return found
places = (".", "/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")
space = os.statvfs(".")
print(json.dumps({{
    "files": {{place: files(place) for place in places}},
    "modes": [oct(os.stat(place).st_mode) for place in places],
    "xattrs": [xattrs(place) for place in places],
    "set_times": [place for place in places if os.stat(place).st_mtime < 1.5e9],
    "free": [space.f_bfree, space.f_ffree],
    "ipc": {{kind: open(f"/proc/sysvipc/{{kind}}").read().splitlines()[1:] for kind in ("shm", "sem", "msg")}},
    "keys": [linked(keyring) for keyring in (-3, -4, -5, keyctl(22, -1, -3))],
    "processes": len([pid for pid in os.listdir("/proc") if pid.isdigit()]),
}}))
"""


def observe(box: Sandbox) -> dict:
    box.write_file("observe.py", OBSERVE)
    result = box.run("python3 observe.py")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@needs_bwrap
@needs_key_calls
def test_a_released_sandbox_comes_back_as_a_new_one_would_be() -> None:
    with SandboxPool(FAST, keep=1) as pool, Sandbox(FAST) as new:
        box = pool.acquire()
        box.write_file("leave.py", LEAVE)
        left = box.run("python3 leave.py")
        assert left.stdout == "left\n", left.stderr
        dirty = observe(box)
        assert len(dirty["files"]["."]) >= 6 and [f[0] for f in dirty["files"]["/dev/mqueue"]] == ["/dev/mqueue/queue"]
        assert all(xattrs == {"user.stash": b"secret".hex()} for xattrs in dirty["xattrs"][:4]), dirty["xattrs"]
        assert dirty["set_times"] == ["/tmp", "/var/tmp", "/dev/shm"], dirty["set_times"]
        assert all(len(objects) >= 1 for objects in dirty["ipc"].values()) and all(dirty["keys"]), dirty
        pool.release(box)
        again = pool.acquire()
        assert again is box and pool.made == 1, "the released sandbox was handed out again"
        assert observe(again) == observe(new)
        pool.release(again)


@needs_bwrap
def test_a_pool_keeps_what_it_may_and_cleans_up_the_rest() -> None:
    with SandboxPool(FAST, keep=1) as pool:
        first, second = pool.acquire(), pool.acquire()
        paths = [Path(first.path), Path(second.path)]
        pool.release(first)
        pool.release(second)  # beyond keep: cleaned up
        assert paths[0].exists() and not paths[1].exists()
        assert pool.acquire() is first and pool.made == 2
        pool.release(first)
    assert not paths[0].exists(), "closing the pool cleans up what it kept"
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire()


def test_a_sandbox_that_cannot_be_reset_is_cleaned_up_not_reused() -> None:
    box = Sandbox(FAST, reuse_namespaces=False)
    assert not box.resettable
    with pytest.raises(SandboxError, match="only a sandbox whose commands share one bwrap"):
        box.reset()
    with SandboxPool(FAST) as pool:
        pool.release(box)
        assert not Path(box.path).exists()


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="needs a file the sandbox's uid cannot delete: root makes one")
def test_a_sandbox_whose_wipe_leaves_something_is_cleaned_up() -> None:
    with SandboxPool(FAST) as pool:
        box = pool.acquire()
        assert box.uid is not None
        stuck = Path(box.path) / "stuck"
        stuck.mkdir()  # root's, not the sandbox uid's: it can neither empty nor chmod it
        (stuck / "file").write_text("x")
        pool.release(box)
        assert not Path(box.path).exists()
        replacement = pool.acquire()
        assert replacement is not box
        pool.release(replacement)


@needs_bwrap
def test_times_a_last_user_set_on_the_directories_that_stay_are_not_handed_on() -> None:
    """A directory's access and modification times are 16 bytes a user may set at will: left on the directories that
    stay (the working directory and the tmp directories, with nothing in them to delete), the next user read them."""
    places = ". /tmp /var/tmp /dev/shm"
    with SandboxPool(FAST, keep=1) as pool:
        box = pool.acquire()
        assert box.run(f"touch -d @1000000000 {places}").exit_code == 0
        assert box.run(f"stat -c %X%Y {places}").stdout.split() == ["10000000001000000000"] * 4
        pool.release(box)
        again = pool.acquire()
        assert again is box
        assert "1000000000" not in again.run(f"stat -c %X%Y {places}").stdout
        pool.release(again)
