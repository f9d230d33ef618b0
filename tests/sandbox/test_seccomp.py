"""The system-call filter (``trajlab/sandbox/seccomp.py``): under bubblewrap, in every mode, as root and unprivileged,
commands get EPERM for the calls container runtimes refuse (io_uring, keyrings, ptrace, perf, bpf, userfaultfd,
mounts, namespaces, the clock, modules...), through the 32-bit ABI too, and cannot trace or read PID 1."""

from __future__ import annotations

import dataclasses
import errno
import json
import platform
import subprocess
import sys

import pytest

from tests.sandbox.helpers import FAST, MODES, PROTECTIONS, needs_bwrap, run_as_nobody
from trajlab.sandbox import MissingProtection, Sandbox

pytestmark = needs_bwrap
BWRAP_MODES = [mode for mode in MODES if mode.id != "chain"]
X86_64 = platform.machine() == "x86_64"

#: Each call with arguments that make it succeed, or fail with another errno than EPERM, without the filter
#: (BUF: a zeroed buffer, PID: the caller); the few that need a capability fail with EPERM either way.
CALLS = {
    "io_uring_setup": [1, "BUF"], "io_uring_enter": [-1, 0, 0, 0, 0, 0], "io_uring_register": [-1, 0, 0, 0],
    "keyctl": [0, -3, 0], "add_key": ["b:user", "b:stash", "b:x", 1, -3], "request_key": ["b:user", "b:absent", 0, 0],
    "ptrace": [0x7FFF, 1, 0, 0], "perf_event_open": [0, 0, -1, -1, 0], "bpf": [-1, 0, 0], "userfaultfd": [3],
    "unshare": [0], "setns": [-1, 0], "mount": [0, 0, 0, 0, 0], "umount2": ["b:/tmp", 0], "pivot_root": [0, 0],
    "swapoff": [0], "reboot": [0, 0, 0, 0], "kexec_load": [0, 0, 0, 0], "init_module": [0, 0, 0],
    "finit_module": [-1, 0, 0], "delete_module": [0, 0], "acct": [0], "settimeofday": [0, 0],
    "clock_settime": [-1, 0], "adjtimex": [0], "name_to_handle_at": [-1, 0, 0, 0, 0],
    "open_by_handle_at": [-1, 0, 0], "quotactl": [0, 0, 0, 0], "process_vm_readv": ["PID", 0, 0, 0, 0, 0],
    "kcmp": ["PID", "PID", 0, 0, 0], "personality": [0x0040000], "fanotify_init": [0, 0],
    "clone": [0x10000000 | 0x10000, 0, 0, 0, 0],  # CLONE_NEWUSER | CLONE_THREAD: EINVAL without the filter
    "clone3": [0, 0],  # ENOSYS with the filter (its flags cannot be inspected), as Docker answers: libc falls back
}
EXPECTED = {name: errno.ENOSYS if name == "clone3" else errno.EPERM for name in CALLS}

#: Calls each syscall in CALLS (by its number here) and, on x86_64, unshare(0) through ``int 0x80`` (the i386 ABI,
#: call 310): prints each call's errno (0: it succeeded) as JSON.
PROBE = """
import ctypes, json, mmap, os, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
def arg(value):
    if value == "BUF":
        return ctypes.create_string_buffer(256)
    if value == "PID":
        return ctypes.c_long(os.getpid())
    return value[2:].encode() if isinstance(value, str) else ctypes.c_long(value)
def call(number, args):
    ctypes.set_errno(0)
    return 0 if libc.syscall(ctypes.c_long(number), *map(arg, args)) >= 0 else ctypes.get_errno()
calls = json.loads(sys.argv[1])
report = {name: call(number, args) for name, (number, args) in calls.items()}
if platform.machine() == "x86_64":  # mov eax, 310; xor ebx, ebx; int 0x80; ret
    code = bytes.fromhex("b836010000" "31db" "cd80" "c3")
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    report["int 0x80 unshare"] = -function()
print(json.dumps(report))
"""


def _calls() -> dict[str, list]:
    pyseccomp = pytest.importorskip("pyseccomp")
    return {name: [pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name), args] for name, args in CALLS.items()}


def _expected() -> dict[str, int]:
    return {**EXPECTED, "int 0x80 unshare": errno.EPERM} if X86_64 else EXPECTED


def _probe(box: Sandbox) -> dict[str, int]:
    box.write_file("probe.py", PROBE)
    result = box.run(["python3", "probe.py", json.dumps(_calls())])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("mode", BWRAP_MODES)
def test_the_calls_container_runtimes_refuse_are_refused(mode: dict) -> None:
    with Sandbox(FAST, **mode) as box:
        seen = _probe(box)
        assert box.run("true").exit_code == 0, "commands still run after the probe"
    wrong = {name: errno.errorcode.get(seen.get(name, 0), seen.get(name)) for name, want in _expected().items()
             if seen.get(name) != want}
    assert wrong == {}, "these calls were not refused (errno seen; 0: it succeeded)"


@pytest.mark.parametrize("mode", BWRAP_MODES)
def test_ordinary_programs_still_work_under_the_filter(mode: dict) -> None:
    """Threads (clone3 falls back to clone), subprocesses, the default personality query, sockets, python."""
    script = ("import subprocess, threading, socket, ctypes; t = threading.Thread(target=print, args=('thread',)); "
              "t.start(); t.join(); print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout, "
              "end=''); socket.socketpair(); print(ctypes.CDLL(None).personality(0xffffffff) >= 0)")
    with Sandbox(FAST, **mode) as box:
        result = box.run(["python3", "-c", script])
        assert result.stdout.split() == ["thread", "child", "True"], result.stderr
        assert box.run("grep ^Seccomp: /proc/self/status").stdout.split() == ["Seccomp:", "2"]


#: What a command can learn of, or do to, PID 1: trace it, read its memory and environment; its command line.
PID_1 = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
report = {}
for name, request in (("seize", 0x4206), ("attach", 16)):
    ctypes.set_errno(0)
    report[name] = [libc.ptrace(ctypes.c_long(request), ctypes.c_long(1), None, None), ctypes.get_errno()]
for name in ("environ", "mem"):
    try:
        with open(f"/proc/1/{name}", "rb") as file:
            report[name] = file.read(64).decode(errors="replace") if name == "environ" else "opened"
    except OSError as exc:
        report[name] = exc.strerror
cmdline = open("/proc/1/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")
report["program"] = cmdline.split()[0]
report["bwrap_options"] = any(f"--{option}" in cmdline for option in ("unshare-" + "all", "info-" + "fd"))
print(json.dumps(report))
"""


def _check_pid_1(report: dict) -> None:
    assert report["seize"] == [-1, errno.EPERM] and report["attach"] == [-1, errno.EPERM], report
    assert report["environ"] == report["mem"] == "Permission denied", report
    assert not report["program"].endswith("bwrap") and not report["bwrap_options"], f"PID 1 is bubblewrap: {report}"


@pytest.mark.parametrize("mode", BWRAP_MODES)
def test_pid_1_cannot_be_traced_or_read(mode: dict) -> None:
    with Sandbox(FAST, **mode) as box:
        result = box.run(["python3", "-c", PID_1])
    assert result.exit_code == 0, result.stderr
    _check_pid_1(json.loads(result.stdout))


# The same, from a child of the unprivileged user nobody (the tests run as root): JSON per mode on stdout.
AS_NOBODY = """
import json, sys
from trajlab.sandbox import Sandbox, SandboxLimits
probe, pid_1, calls = json.loads(sys.stdin.read())
report = {}
for name, options in (("server", {}), ("per_command", {"reuse_namespaces": False})):
    with Sandbox(SandboxLimits(wall_timeout_s=10.0), **options) as box:
        box.write_file("probe.py", probe)
        report[name] = [box.run(["python3", "probe.py", json.dumps(calls)]).stdout,
                        box.run(["python3", "-c", pid_1]).stdout]
print(json.dumps(report))
"""


def test_unprivileged_sandboxes_filter_too() -> None:
    done = run_as_nobody(["-c", AS_NOBODY], json.dumps([PROBE, PID_1, _calls()]))
    assert done.returncode == 0, done.stderr
    for mode, (probe, pid_1) in json.loads(done.stdout).items():
        seen = json.loads(probe)
        assert {name: seen.get(name) for name in _expected()} == _expected(), mode
        _check_pid_1(json.loads(pid_1))


def test_strong_isolation_requires_the_filter() -> None:
    assert PROTECTIONS.seccomp_filter, "this machine has libseccomp and pyseccomp: the filter should be on"
    missing = dataclasses.replace(PROTECTIONS, seccomp_filter=False).missing_for_strong_isolation()
    assert [line for line in missing if line.startswith("seccomp_filter: ")] != []


def test_without_the_binding_the_filter_is_reported_missing() -> None:
    """pyseccomp not importable (``sys.modules[name] = None`` makes its import fail): loud, never silently off."""
    code = ("import sys; sys.modules['pyseccomp'] = None\n"
            "from trajlab.sandbox import probe_protections, require_strong_isolation\n"
            "assert not probe_protections().seccomp_filter\n"
            "require_strong_isolation('a test', allow_weak=False)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert MissingProtection.__name__ in done.stderr and "seccomp filter" in done.stderr, done.stderr


def test_only_the_default_personalities_can_be_set() -> None:
    """Linux and 32-bit Linux (``linux32``) may be set, and asked for; no other bit, with bit 31 set or not (the
    kernel reads 32 bits: 0x80040000 would switch address space randomisation off as 0x40000 does)."""
    script = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
              "print(*[libc.personality(ctypes.c_ulong(p)) >= 0 or ctypes.get_errno() "
              "for p in (8, 0, 0xffffffff, 0x40000, 0x80040000, 0x400000, 0x1)])")
    with Sandbox(FAST) as box:
        result = box.run(["python3", "-c", script])
    assert result.stdout.split() == ["True", "True", "True"] + [str(errno.EPERM)] * 4, result.stderr
