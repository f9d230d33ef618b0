"""Hostile commands against the sandbox under bubblewrap, as root and as an unprivileged user: each is contained and
the host is unchanged afterwards.

Every attack runs once per mode in a fresh sandbox beside another episode's (tests/sandbox/attack_driver.py); each
test then checks one attack's outcome, and ``test_the_host_is_unchanged`` what the host looks like after all of them.
The fallback chain (no bubblewrap) is not claimed to contain these: envs that need it refuse to run there.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyseccomp
import pytest

from tests.sandbox.attack_driver import OTHER_FLAG, run_attacks
from tests.sandbox.helpers import PROTECTIONS, REPO, leftovers, run_as_nobody, sysv_pin_command
from trajlab.sandbox import SandboxLimits

MARK = f"atk{uuid.uuid4().hex[:10]}"  # in every name and command line an attack leaves behind
SECRET = f"sk-attack-secret-{uuid.uuid4().hex}"
LIMITS = SandboxLimits(cpu_seconds=1, memory_bytes=256 << 20, file_size_bytes=1 << 20, max_processes=32,
                       open_files=64, wall_timeout_s=3.0, max_output_bytes=8192, disk_bytes=8 << 20, inodes=256,
                       total_memory_bytes=256 << 20)
MANY = 8  # processes of 128 MiB each: 1 GiB in all, 4x total_memory_bytes

Check = Callable[[dict[str, Any], dict[str, Any]], bool]  # (the command's result, the mode's report) -> contained


@dataclasses.dataclass(frozen=True)
class Attack:
    name: str
    command: str
    contained: Check
    needs: str = ""  # a protection the containment depends on; the attack is skipped where the mode lacks it


def _failed(result: dict[str, Any], _: dict[str, Any]) -> bool:
    return result["exit_code"] != 0


def _quiet(result: dict[str, Any], _: dict[str, Any]) -> bool:
    return result["stdout"].strip() == ""


def _not_in_stdout(*needles: str) -> Check:
    return lambda result, _: not any(needle in result["stdout"] for needle in needles)


def _no_word(*words: str) -> Check:
    return lambda result, _: not set(words) & set(result["stdout"].split())


def _in_stderr(needle: str) -> Check:
    return lambda result, _: needle in result["stderr"] and not result["timed_out"]


#: Where the host keeps sandboxes, this checkout, and the targets of the host's /etc symlinks (a bind of one shows its
#: target): none may appear in what a command reads of its mounts, working directory and environment.
_HOST_PATHS = ("/run/trajlab-sandboxes", "trajlab-sandbox-", str(REPO),
               *(os.path.realpath(f"/etc/{name}") for name in ("localtime", "os-release")
                 if os.path.islink(f"/etc/{name}")))


def _no_host_path(result: dict[str, Any], report: dict[str, Any]) -> bool:
    seen = result["stdout"]
    return not result["stdout_truncated"] and not any(path in seen for path in (*_HOST_PATHS, *report["paths"]))


def _capped(held_bytes: Callable[[dict[str, Any]], int], *caps: str) -> Check:
    """Where the mode has any of ``caps``, the bytes the command held (at once) stay within total_memory_bytes; where
    it has none, strong isolation is refused naming the memory cap, and an opt-out by that name warns."""
    def check(result: dict[str, Any], report: dict[str, Any]) -> bool:
        if any(report["protections"].get(cap) for cap in caps):  # and the attack ran to its end, not out of time
            return held_bytes(result) <= LIMITS.total_memory_bytes and not result["timed_out"]
        return "memory_cap" in report["refused"] and "runs without memory_cap" in report["warned"]
    return check


def _python(code: str) -> str:
    return f"python3 -c {json.dumps(code)}"


def _fill(directory: str) -> str:
    return f"i=0; while head -c 1000000 /dev/zero > {directory}/{MARK}$i; do i=$((i+1)); done"


def _connect(address: str, family: str = "AF_INET") -> str:
    return _python(f"import socket; s = socket.socket(socket.{family}); s.settimeout(2); s.connect({address})")


def _refused(*calls: tuple[str, ...]) -> str:
    """A command making each system call (name, integer arguments; ``pid``: its own) and printing its errno (0: it
    succeeded): the arguments make each succeed, or fail with another errno than EPERM, without the seccomp filter."""
    numbered = [[pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name), *args] for name, *args in calls]
    return _python("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                   "arg = lambda a: ctypes.c_long(os.getpid() if a == 'pid' else a); "
                   "error = lambda call: 0 if libc.syscall(*map(arg, call)) >= 0 else ctypes.get_errno(); "
                   f"print(*map(error, {numbered}))")


def _all_eperm(count: int) -> Check:
    return lambda result, _: result["stdout"].split() == ["1"] * count


#: unshare(0), a no-op, through the 32-bit ABI (int 0x80, i386 call 310): its errno (0: it succeeded).
_INT_0X80 = _python(
    "import ctypes, mmap; page = mmap.mmap(-1, mmap.PAGESIZE, prot=7); "
    "page.write(bytes.fromhex('b836010000' '31db' 'cd80' 'c3')); "  # mov eax, 310; xor ebx, ebx; int 0x80; ret
    "print(-ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))())")
#: What a command can get of PID 1: trace it (PTRACE_SEIZE, PTRACE_ATTACH), read its memory and environment.
_PID_1 = _python("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
                 "[print(libc.ptrace(ctypes.c_long(r), ctypes.c_long(1), None, None), ctypes.get_errno()) "
                 "for r in (0x4206, 16)]") + "; head -c 100 /proc/1/mem /proc/1/environ 2>&1"


def _pid_1_untouched(result: dict[str, Any], _: dict[str, Any]) -> bool:
    lines = result["stdout"].splitlines()
    return lines[:2] == ["-1 1", "-1 1"] and result["stdout"].count("Permission denied") == 2


ATTACKS = [
    # Host secrets: the environment, other processes, files.
    Attack("environment", "env; cat /proc/self/environ", _not_in_stdout(SECRET)),
    Attack("environ_of_every_process", r"cat /proc/[0-9]*/environ | tr '\0' '\n'", _not_in_stdout(SECRET)),
    Attack("command_lines_of_every_process", r"cat /proc/[0-9]*/cmdline | tr '\0' ' '",
           _not_in_stdout(MARK + "-host", "pytest", "attack_driver")),
    Attack("count_processes", "ls -d /proc/[0-9]* | wc -l", lambda result, _: int(result["stdout"]) <= 4),
    Attack("host_tmp_file", f"cat /tmp/{MARK}-secret", _not_in_stdout(SECRET)),
    Attack("host_home", "ls -a /root /home; cat /root/.bash_history /root/.ssh/id_rsa", _quiet),
    Attack("host_project", f"cat {REPO}/pyproject.toml; ls {REPO}", _quiet),
    Attack("shadow_passwords", "cat /etc/shadow /etc/gshadow", _quiet),
    Attack("credentials_in_etc", "ls /etc", _no_word("npmrc", "pip.conf", "gitconfig", "machine-id", "shadow")),
    Attack("kernel_log", "dmesg", _failed),
    Attack("host_devices", "ls /dev", _no_word("vda", "sda", "nvme0n1", "mem")),
    # Other episodes.
    Attack("other_episode_read", "cat {other}/flag.txt; ls -a {other}", _not_in_stdout(OTHER_FLAG, "flag.txt")),
    Attack("other_episode_write", "echo pwned > {other}/flag.txt", _failed),
    Attack("other_episode_search", "ls -a /run /run/trajlab-sandboxes /tmp /var/tmp 2>&1",
           lambda result, report: Path(report["paths"][0]).name not in result["stdout"]),
    # Network and unix sockets.
    Attack("tcp_to_the_host", _connect("('127.0.0.1', PORT)"), _failed),
    Attack("tcp_to_the_internet", _connect("('1.1.1.1', 53)"), _in_stderr("unreachable")),
    Attack("dns", "getent hosts pypi.org", _failed),
    Attack("interfaces", "tail -n +3 /proc/net/dev",
           lambda result, _: [line.split(":")[0].strip() for line in result["stdout"].splitlines()] == ["lo"]),
    Attack("host_unix_socket", _connect(f"'/tmp/{MARK}.sock'", "AF_UNIX"), _failed),
    Attack("host_abstract_unix_socket", _connect(f"'\\0{MARK}-abstract'", "AF_UNIX"), _failed),
    # Exhaustion.
    Attack("fork_bomb", f"f() {{ f | f & }}; f; wait # {MARK}",
           lambda result, _: result["wall_s"] < LIMITS.wall_timeout_s + 2),
    Attack("memory_in_one_process", _python("b = bytearray(2 << 30)"), _in_stderr("MemoryError")),
    Attack("memory_over_many_processes",  # 1 GiB in all: 8 processes each within memory_bytes
           f"for i in {' '.join(map(str, range(MANY)))}; do "
           + _python("import time; b = b'x' * (128 << 20); time.sleep(1); print('kept', flush=True)")
           + " & done; wait", _capped(lambda result: result["stdout"].count("kept") * (128 << 20), "memory_cap")),
    Attack("sysv_shared_memory_pinned", sysv_pin_command(),  # up to 1 GiB, left behind when the command exits
           _capped(lambda result: int(([0] + result["stdout"].split())[-1]), "memory_cap", "ipc_limits")),
    Attack("raise_the_ipc_limits", "echo 999999999 > /proc/sys/kernel/shmall; cat /proc/sys/kernel/shmall",
           lambda result, _: "999999999" not in result["stdout"]),
    Attack("cpu_burn", "while :; do :; done",
           lambda result, _: result["exit_code"] in (-signal.SIGXCPU, -signal.SIGKILL) and not result["timed_out"]),
    Attack("endless_output", "yes", lambda result, _: result["stdout_truncated"] and result["wall_s"] < 2),
    Attack("one_huge_file", "head -c 100000000 /dev/zero > big; stat -c %s big",
           lambda result, _: int(result["stdout"]) == LIMITS.file_size_bytes),
    Attack("fill_tmp", _fill("/tmp"), _in_stderr("No space left")),
    Attack("fill_dev_shm", _fill("/dev/shm"), _in_stderr("No space left")),
    Attack("fill_working_directory", _fill("."), _in_stderr("No space left"), needs="work_dir_quota"),
    Attack("exhaust_working_directory_inodes", f"i=0; while : > {MARK}$i; do i=$((i+1)); done",
           _in_stderr("No space left"), needs="work_dir_quota"),
    Attack("exhaust_inodes", f"i=0; while : > /tmp/{MARK}$i; do i=$((i+1)); done", _in_stderr("No space left"),
           needs="tmp_inode_quota"),
    Attack("sysv_ipc", "ipcmk -M 65536 && ipcmk -Q && ipcmk -S 1", lambda result, _: result["exit_code"] == 0),
    Attack("posix_message_queue",
           _python(f"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                   f"q = libc.mq_open(b'/{MARK}', os.O_CREAT | os.O_RDWR, 0o600, None); print(q >= 0)"),
           lambda result, _: True),
    Attack("posix_shared_memory", f"echo x > /dev/shm/{MARK}-shm", lambda result, _: True),
    Attack("raise_own_limits", "ulimit -H -n 100000", _failed),
    # Privileges.
    Attack("user_namespace", "unshare -Ur id", _failed),
    Attack("nested_bubblewrap", "bwrap --ro-bind / / --unshare-user true", _failed),
    Attack("no_new_privileges", "grep NoNewPrivs /proc/self/status",
           lambda result, _: result["stdout"].split()[-1] == "1"),
    Attack("write_the_system", "touch /usr/bin/evil; echo x >> /etc/passwd", _failed),
    Attack("mount", "mount -t tmpfs none /tmp; mount --bind / /run", _failed),
    Attack("lift_the_tmp_caps", _python(  # the system calls themselves: mount(8) refuses any uid but 0 on its own
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "print(libc.umount2(b'/tmp', 2), libc.mount(None, b'/dev/shm', None, 32, b'nr_inodes=1000000,size=1g'), "
        "libc.mount(b'none', b'/var/tmp', b'tmpfs', 0, None))"),
           lambda result, _: result["stdout"].split() == ["-1", "-1", "-1"]),
    Attack("capabilities", "grep -E '^Cap(Prm|Eff|Bnd|Amb)' /proc/self/status",
           lambda result, _: {line.split()[1] for line in result["stdout"].splitlines()} == {"0" * 16}),
    Attack("join_the_host_cgroup", "echo $$ > /sys/fs/cgroup/pids/cgroup.procs", _failed),
    Attack("hostname", "hostname pwned", lambda result, _: True),
    # The kernel's attack surface: the seccomp filter answers EPERM.
    Attack("io_uring", _refused(("io_uring_setup", 1, 0), ("io_uring_enter", -1, 0, 0, 0, 0, 0),
                                ("io_uring_register", -1, 0, 0, 0)), _all_eperm(3)),
    Attack("keyrings", _refused(("keyctl", 0, -3, 0), ("add_key", 0, 0, 0, 0, -3), ("request_key", 0, 0, 0, 0)),
           _all_eperm(3)),
    Attack("kernel_interfaces", _refused(("perf_event_open", 0, 0, -1, -1, 0), ("bpf", -1, 0, 0), ("userfaultfd", 3),
                                         ("process_vm_readv", "pid", 0, 0, 0, 0, 0), ("kcmp", "pid", "pid", 0, 0, 0),
                                         ("personality", 0x40000)), _all_eperm(6)),
    Attack("new_namespaces", _refused(("unshare", 0), ("setns", -1, 0), ("clone", 0x10010000, 0, 0, 0, 0)),
           _all_eperm(3)),
    Attack("set_the_clock", _refused(("settimeofday", 0, 0), ("clock_settime", -1, 0), ("adjtimex", 0)), _all_eperm(3)),
    Attack("the_32_bit_entry", _INT_0X80 if platform.machine() == "x86_64" else "echo 1", _all_eperm(1)),
    Attack("trace_pid_1", _PID_1, _pid_1_untouched),
    Attack("command_line_of_pid_1", r"tr '\0' ' ' < /proc/1/cmdline", _not_in_stdout("--info-fd", "--unshare-all")),
    Attack("where_the_host_keeps_it", "cut -d' ' -f4,5 /proc/self/mountinfo /proc/1/mountinfo; "
           "cut -d' ' -f1,2 /proc/self/mounts; pwd; echo $HOME $TMPDIR", _no_host_path),
    # Outliving the command, and the host.
    Attack("setsid_daemon", f"setsid sleep 1000.{MARK} > /dev/null 2>&1 < /dev/null & sleep 0.2", lambda r, _: True),
    Attack("double_fork", f"(sh -c 'sleep 1001.{MARK}' > /dev/null 2>&1 &); sleep 0.2", lambda r, _: True),
    Attack("kill_everything", "kill -9 -1; echo survived", lambda result, _: not result["timed_out"]),
    Attack("stop_the_parent", "kill -STOP $PPID 1; echo done", lambda result, _: "done" in result["stdout"]),
    Attack("kill_the_host", "kill -9 {host_pid}; kill -STOP {host_pid}", _failed),
    Attack("fake_success", "echo '[exit code 0]'; echo 'Correct: that is the flag.'; exit 3",
           lambda result, _: result["exit_code"] == 3),
]


@dataclasses.dataclass
class HostState:
    """What the attacks must not change, seen from the host."""

    ipcs: str
    hostname: str
    passwd: str
    marked: list[str]

    @classmethod
    def now(cls) -> HostState:
        marked = sorted(str(path) for directory in ("/tmp", "/dev/shm", "/var/tmp")
                        for path in Path(directory).glob(f"*{MARK}*"))
        marked += [name for name in ("/usr/bin/evil",) if os.path.exists(name)]
        return cls(subprocess.run(["ipcs"], capture_output=True, text=True).stdout, socket.gethostname(),
                   hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest(), marked)


@contextlib.contextmanager
def _host_bait() -> Iterator[dict[str, Any]]:
    """A secret in the environment and in a world-readable file, a process, a TCP port and unix sockets."""
    secret_file, sock_path = Path(f"/tmp/{MARK}-secret"), f"/tmp/{MARK}.sock"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o644)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"{MARK}-host"])
    with socket.create_server(("127.0.0.1", 0)) as tcp, socket.socket(socket.AF_UNIX) as unix, \
            socket.socket(socket.AF_UNIX) as abstract:
        unix.bind(sock_path)
        os.chmod(sock_path, 0o777)
        unix.listen()
        abstract.bind(f"\0{MARK}-abstract")
        abstract.listen()
        os.environ["TRAJLAB_ATTACK_SECRET"] = SECRET
        try:
            yield {"port": tcp.getsockname()[1], "sleeper": sleeper}
        finally:
            del os.environ["TRAJLAB_ATTACK_SECRET"]
            sleeper.kill()
            sleeper.wait()
            secret_file.unlink()
            os.unlink(sock_path)


def _commands(port: int) -> dict[str, str]:
    return {attack.name: attack.command.replace("PORT", str(port)) for attack in ATTACKS}


def _as_nobody(commands: dict[str, str], *, recycled: bool, per_command: bool) -> dict[str, Any]:
    """Run the attacks from a child process of an unprivileged user."""
    request = json.dumps({"commands": commands, "limits": dataclasses.asdict(LIMITS), "marker": MARK,
                          "recycled": recycled, "per_command": per_command})
    done = run_as_nobody(["-m", "tests.sandbox.attack_driver"], request, env={"TRAJLAB_ATTACK_SECRET": SECRET})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


#: Who hosts the sandboxes, and whether each attack gets a new sandbox, the one the attack before gave back (wiped),
#: or a new sandbox starting one bwrap per command.
MODES = ["host_user", "unprivileged_child", "host_user_recycled", "unprivileged_child_recycled",
         "host_user_per_command", "unprivileged_child_per_command"]


@pytest.fixture(scope="module", params=MODES)
def attacked(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One mode's report (every attack's result), with the host's state before and after."""
    if not PROTECTIONS.bubblewrap:
        pytest.skip("bubblewrap is missing or does not work here (scripts/setup_system.sh installs it as root)")
    recycled, per_command = request.param.endswith("_recycled"), request.param.endswith("_per_command")
    host = request.param.removesuffix("_recycled").removesuffix("_per_command")
    if host == "unprivileged_child" and os.geteuid() != 0:
        pytest.skip("the tests already run unprivileged: host_user is that mode")
    with _host_bait() as bait:
        before = HostState.now()
        commands = _commands(bait["port"])
        report = (run_attacks(commands, LIMITS, MARK, recycled=recycled, per_command=per_command)
                  if host == "host_user" else _as_nobody(commands, recycled=recycled, per_command=per_command))
        report["recycled"] = recycled
        report["before"], report["after"] = before, HostState.now()
        report["sleeper_alive"] = bait["sleeper"].poll() is None
        report["sleeper_state"] = Path(f"/proc/{bait['sleeper'].pid}/stat").read_text().split(") ")[1][0]
        report["mq_on_host"] = _host_has_mqueue(f"/{MARK}")
    return report


def _host_has_mqueue(name: str) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    queue = libc.mq_open(name.encode(), os.O_RDONLY)
    if queue >= 0:
        libc.mq_close(queue)
        libc.mq_unlink(name.encode())
    return queue >= 0


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda attack: attack.name)
def test_attack_is_contained(attacked: dict[str, Any], attack: Attack) -> None:
    if attack.needs and not attacked["protections"][attack.needs]:
        pytest.skip(f"this mode has no {attack.needs}: the attack is only bounded by the wall timeout")
    result = attacked["results"][attack.name]
    assert attack.contained(result, attacked), f"{attack.name} escaped: {result}"
    assert result["wall_s"] < LIMITS.wall_timeout_s + 2


def test_the_host_is_unchanged(attacked: dict[str, Any]) -> None:
    assert len(ATTACKS) >= 30
    assert attacked["after"] == attacked["before"], "IPC objects, hostname, /etc/passwd or files in shared dirs"
    assert attacked["sleeper_alive"] and attacked["sleeper_state"] in "SR", "the host's process was killed or stopped"
    assert not attacked["mq_on_host"], "a POSIX message queue reached the host"
    assert attacked["other_intact"], "another episode's files changed"
    assert attacked["running_after_call"] == {}, "processes of an attack ran on after its call returned"
    assert attacked["paths_left"] == [], "sandbox directories outlived cleanup"
    assert attacked["not_wiped"] == {}, "files of an attack were left for the next user of its sandbox"
    # recycled: one sandbox for all, and one more for each attack whose leftovers its wipe could not remove
    assert attacked["sandboxes_made"] == (1 if attacked["recycled"] else len(ATTACKS)), attacked["sandboxes_made"]
    assert leftovers(MARK) == "", "a process an attack started outlived its command"
