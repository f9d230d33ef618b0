"""The sandbox for untrusted commands, exercised with real subprocesses: files, secrets, network, limits, paths."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trajlab import sandbox as sandbox_module
from trajlab.sandbox import (
    SANDBOX_UID_RANGE,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxPathError,
    probe_protections,
)

PROTECTIONS = probe_protections()
FAST = SandboxLimits(cpu_seconds=2, memory_bytes=512 << 20, file_size_bytes=1 << 20, max_processes=32,
                     wall_timeout_s=5.0, max_output_bytes=4096)
needs_private_uid = pytest.mark.skipif(not PROTECTIONS.private_uid, reason="sandboxes share the host's uid here")


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(FAST) as box:
        yield box


def running(marker: str) -> str:
    """Processes whose command line holds ``marker``."""
    return subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout


def leftovers(marker: str) -> str:
    """Processes whose command line holds ``marker``, waiting a little for killed ones to be reaped."""
    deadline = time.monotonic() + 2.0
    while (found := running(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def escape_command(marker: str) -> str:
    """Start a sleeper that leaves the command's process group (and its pipes), then give it time to do so."""
    return f"setsid sleep {marker} > /dev/null 2>&1 < /dev/null & sleep 0.2"


def test_runs_in_a_private_directory_that_cleanup_removes() -> None:
    box = Sandbox(FAST)
    box.write_file("notes/a.txt", "hello\n")
    result = box.run("pwd; ls -A; cat notes/a.txt; stat -c %a .")
    assert result.exit_code == 0
    assert result.stdout.split() == [str(box.path), "notes", "hello", "700"]
    assert box.read_file("notes/a.txt") == b"hello\n"
    box.cleanup()
    assert not box.path.exists()
    box.cleanup()
    with pytest.raises(SandboxError):
        box.run("true")


def test_two_sandboxes_never_see_each_others_files() -> None:
    with Sandbox(FAST) as first, Sandbox(FAST) as second:
        assert first.path != second.path
        first.run("echo flag > secret.txt")
        assert second.run("ls -A").stdout == ""
        if PROTECTIONS.private_uid:
            assert first.uid != second.uid
            peek = second.run(f"cat {first.path}/secret.txt")
            assert peek.exit_code != 0 and "flag" not in peek.stdout


def test_concurrent_sandboxes_keep_their_own_files() -> None:
    def episode(index: int) -> tuple[str, int | None]:
        with Sandbox(FAST) as box:
            box.write_file("id.txt", str(index))
            return box.run("sleep 0.1; cat id.txt; ls -A").stdout, box.uid

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(episode, range(16)))
    assert [stdout for stdout, _ in outcomes] == [f"{index}id.txt\n" for index in range(16)]
    if PROTECTIONS.private_uid:
        assert len({uid for _, uid in outcomes}) == 16


def test_host_secrets_do_not_leak(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJLAB_TEST_API_KEY", "sk-very-secret-value")
    result = sandbox.run("env")
    assert "sk-very-secret-value" not in result.stdout
    environment = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert set(environment) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD"}
    assert environment["HOME"] == environment["TMPDIR"] == str(sandbox.path)
    if PROTECTIONS.private_uid:  # nor can the command read them from the host process
        assert sandbox.run(f"cat /proc/{os.getpid()}/environ").stdout == ""


def test_runs_argument_lists_with_stdin(sandbox: Sandbox) -> None:
    result = sandbox.run(["sort", "-r"], stdin="a\nc\nb\n")
    assert (result.exit_code, result.stdout) == (0, "c\nb\na\n")


@pytest.mark.skipif(not PROTECTIONS.network_namespace, reason="no network namespace on this machine")
def test_no_network_inside(sandbox: Sandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        result = sandbox.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"")
    assert result.exit_code != 0
    assert "unreachable" in result.stderr.lower() or "refused" in result.stderr.lower()


def test_fork_bomb_is_capped_and_leaves_nothing_running(sandbox: Sandbox) -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    started = time.monotonic()
    result = sandbox.run(f"for i in $(seq 300); do sleep {marker} & done; wait")
    assert time.monotonic() - started < FAST.wall_timeout_s + 2
    if PROTECTIONS.process_cap:
        assert not result.timed_out and "fork" in result.stderr.lower()
    assert leftovers(marker) == ""


@needs_private_uid
def test_cleanup_kills_processes_that_left_the_process_group() -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    box = Sandbox(FAST)
    box.run(escape_command(marker))
    assert running(marker) != ""
    box.cleanup()
    assert leftovers(marker) == ""


@needs_private_uid
def test_a_uid_whose_holder_crashed_is_cleared_before_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    crash = (f"from trajlab.sandbox import Sandbox; box = Sandbox(); print(box.uid, box.path); "
             f"box.run({escape_command(marker)!r}); import os; os._exit(0)")
    uid, path = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True,
                               check=True).stdout.split()
    try:
        assert running(marker) != ""
        monkeypatch.setattr(sandbox_module.secrets, "randbelow", lambda _: int(uid) - SANDBOX_UID_RANGE[0] - 1)
        with Sandbox(FAST) as heir:
            assert heir.uid == int(uid)
            assert leftovers(marker) == ""
            if PROTECTIONS.disk_quota:
                assert not Path(path).exists(), "the crashed sandbox's tmpfs was unmounted and removed"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_file_size_limit_stops_disk_fill(sandbox: Sandbox) -> None:
    result = sandbox.run("head -c 10000000 /dev/zero > big")
    assert result.exit_code != 0
    assert os.path.getsize(sandbox.path / "big") == FAST.file_size_bytes


@pytest.mark.skipif(not PROTECTIONS.disk_quota, reason="no private tmpfs for sandboxes on this machine (needs root)")
def test_many_files_cannot_fill_the_disk_or_the_shared_tmp() -> None:
    quota = SandboxLimits(file_size_bytes=4 << 20, disk_bytes=16 << 20, wall_timeout_s=10.0)
    with Sandbox(quota) as box, Sandbox(quota) as other:
        fill = "for d in . /tmp /var/tmp /dev/shm; do i=0; while head -c 4000000 /dev/zero > $d/f$i; do i=$((i+1)); done; done"  # noqa: E501
        result = box.run(fill)
        assert "No space left on device" in result.stderr and not result.timed_out
        sizes = box.run("du -sk . /tmp | cut -f1").stdout.split()
        assert sum(int(kib) for kib in sizes) * 1024 <= quota.disk_bytes, "all writable places share the one quota"
        assert not any(Path(d, "f0").exists() for d in ("/tmp", "/var/tmp", "/dev/shm")), "host dirs untouched"
        box.run("rm -f f* /tmp/f*; echo mine > /tmp/note")
        assert other.run("cat /tmp/note").exit_code != 0, "sandboxes do not meet in /tmp"
        assert box.run("cat /tmp/note").stdout == "mine\n", "a command's /tmp files stay for the next command"


def test_cpu_burn_is_killed_at_the_cpu_limit() -> None:
    with Sandbox(SandboxLimits(cpu_seconds=1, wall_timeout_s=10)) as box:
        result = box.run("while :; do :; done")
    assert result.signal in {"SIGXCPU", "SIGKILL"} and not result.timed_out
    assert result.wall_s < 5


def test_memory_hog_fails(sandbox: Sandbox) -> None:
    result = sandbox.run("python3 -c 'x = bytearray(1 << 30); print(len(x))'")
    assert result.exit_code != 0 and "MemoryError" in result.stderr


def test_infinite_output_is_truncated_and_flagged(sandbox: Sandbox) -> None:
    result = sandbox.run("yes; echo unreachable >&2")
    assert len(result.stdout) == FAST.max_output_bytes and result.stdout_truncated
    assert not result.stderr_truncated and not result.timed_out
    assert result.wall_s < 2


def test_wall_timeout_kills_a_sleeper() -> None:
    with Sandbox(SandboxLimits(wall_timeout_s=0.5)) as box:
        result = box.run("sleep 100")
    assert result.timed_out and result.signal == "SIGKILL"
    assert result.wall_s < 2


def test_closing_its_output_does_not_end_the_command_early(sandbox: Sandbox) -> None:
    result = sandbox.run("exec > /dev/null 2>&1; sleep 0.3; touch finished")
    assert result.exit_code == 0 and (sandbox.path / "finished").exists()


def test_background_children_do_not_hold_the_call_open(sandbox: Sandbox) -> None:
    result = sandbox.run("sleep 100 & echo done")
    assert (result.stdout, result.timed_out) == ("done\n", False)
    assert result.wall_s < 1


@pytest.mark.parametrize(
    ("field", "value"),
    [("cpu_seconds", 0), ("memory_bytes", -1), ("max_processes", 2.5), ("wall_timeout_s", float("inf")),
     ("open_files", True), ("max_output_bytes", "1k")],
)
def test_bad_limits_are_rejected_with_the_field_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be a positive"):
        SandboxLimits(**{field: value})


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a/../../escape", "", "."])
def test_paths_outside_the_sandbox_are_refused(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(SandboxPathError):
        sandbox.write_file(path, "x")
    with pytest.raises(SandboxPathError):
        sandbox.read_file(path)


def test_symlinks_out_of_the_sandbox_are_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("host data")
    sandbox.run(f"ln -s {tmp_path} dir_link; ln -s {outside} file_link")
    for path in ("dir_link/outside.txt", "file_link"):
        with pytest.raises(SandboxPathError):
            sandbox.read_file(path)
        with pytest.raises(SandboxPathError):
            sandbox.write_file(path, "overwritten")
    assert outside.read_text() == "host data"


def test_written_files_belong_to_the_sandbox(sandbox: Sandbox) -> None:
    sandbox.write_file("deep/dir/tool.sh", "echo ok")
    result = sandbox.run("sh deep/dir/tool.sh && echo more >> deep/dir/tool.sh && echo new > deep/dir/other")
    assert result.exit_code == 0, result.stderr
    assert sandbox.read_file("deep/dir/tool.sh") == b"echo okmore\n"


def test_a_real_time_signal_is_named_by_number(sandbox: Sandbox) -> None:
    result = sandbox.run("kill -40 $$")
    assert result.exit_code == -40 and result.signal == "signal 40"
