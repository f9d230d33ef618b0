"""Limits every command gets: a scrubbed environment and rlimits on processes, file size, CPU and memory."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid

import pytest

from tests.sandbox.helpers import FAST, MODES, PROTECTIONS, leftovers, needs_private_uid, sysv_pin_command
from trajlab.sandbox import Sandbox, SandboxLimits


def test_host_secrets_do_not_leak(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJLAB_TEST_API_KEY", "sk-very-secret-value")
    result = sandbox.run("env")
    assert "sk-very-secret-value" not in result.stdout
    environment = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert set(environment) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD"}
    assert environment["HOME"] == environment["TMPDIR"] == str(sandbox.inside_path)
    if PROTECTIONS.private_uid:  # nor can the command read them from the host process
        assert sandbox.run(f"cat /proc/{os.getpid()}/environ").stdout == ""


def test_fork_bomb_is_capped_and_leaves_nothing_running(sandbox: Sandbox) -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    started = time.monotonic()
    result = sandbox.run(f"for i in $(seq 300); do sleep {marker} & done; wait")
    assert time.monotonic() - started < FAST.wall_timeout_s + 2
    if PROTECTIONS.process_cap:
        assert not result.timed_out and "fork" in result.stderr.lower()
    assert leftovers(marker) == ""


def test_file_size_limit_stops_disk_fill(sandbox: Sandbox) -> None:
    result = sandbox.run("head -c 10000000 /dev/zero > big")
    assert result.exit_code != 0
    assert os.path.getsize(sandbox.path / "big") == FAST.file_size_bytes


def test_cpu_burn_is_killed_at_the_cpu_limit() -> None:
    with Sandbox(SandboxLimits(cpu_seconds=1, wall_timeout_s=10)) as box:
        result = box.run("while :; do :; done")
    assert result.signal in {"SIGXCPU", "SIGKILL"} and not result.timed_out
    assert result.wall_s < 5


def test_memory_hog_fails(sandbox: Sandbox) -> None:
    result = sandbox.run("python3 -c 'x = bytearray(1 << 30); print(len(x))'")
    assert result.exit_code != 0 and "MemoryError" in result.stderr


@pytest.mark.parametrize(
    ("field", "value"),
    [("cpu_seconds", 0), ("memory_bytes", -1), ("max_processes", 2.5), ("wall_timeout_s", float("inf")),
     ("open_files", True), ("max_output_bytes", "1k")],
)
def test_bad_limits_are_rejected_with_the_field_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be a positive"):
        SandboxLimits(**{field: value})


# The fallback chain sets them as root only (in the mount namespace it makes before dropping to the sandbox's uid).
@pytest.mark.parametrize("mode", [*MODES[:2], pytest.param({"use_bubblewrap": False}, id="chain",
                                                           marks=needs_private_uid)])
def test_sysv_shared_memory_is_capped_by_the_ipc_namespace_limits(mode: dict[str, bool]) -> None:
    limits = dataclasses.replace(FAST, memory_bytes=512 << 20, total_memory_bytes=256 << 20)
    with Sandbox(limits, **mode) as box:
        pinned = box.run(sysv_pin_command())
        held = int(pinned.stdout.split()[-1]) if pinned.stdout.split() else 0
        assert held <= limits.total_memory_bytes, f"a command pinned {held >> 20} MiB of SysV shared memory"
        assert box.run("cat /proc/sys/kernel/shmall").stdout.strip() == str(limits.total_memory_bytes // 4096)
        raised = box.run("echo 1000000000 > /proc/sys/kernel/shmall; cat /proc/sys/kernel/shmall")
        assert raised.stdout.strip() == str(limits.total_memory_bytes // 4096), "commands cannot lift the limits"
        assert box.protections().ipc_limits
