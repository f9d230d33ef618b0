"""Running one command to its end: stdin, capped output, wall timeout, exits that leave children or close pipes."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from tests.sandbox.helpers import FAST, live_processes, needs_bwrap
from trajlab.sandbox import Sandbox, SandboxLimits


def test_runs_argument_lists_with_stdin(sandbox: Sandbox) -> None:
    result = sandbox.run(["sort", "-r"], stdin="a\nc\nb\n")
    assert (result.exit_code, result.stdout) == (0, "c\nb\na\n")


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


def test_a_real_time_signal_is_named_by_number(sandbox: Sandbox) -> None:
    result = sandbox.run("kill -40 $$")
    assert result.exit_code == -40 and result.signal == "signal 40"


@needs_bwrap
def test_nothing_of_a_killed_command_runs_once_its_call_returned() -> None:
    """The kernel kills a PID namespace's processes after its init, while the host goes on: without waiting for that,
    a writer could still write into the directory that cleanup is deleting (it did, in the unprivileged attacks)."""
    marker = f"writer{uuid.uuid4().hex[:10]}"
    writer = f"i=0; while :; do head -c 1000000 /dev/zero > {marker}$((i % 8)); i=$((i + 1)); done"
    for _ in range(5):
        with Sandbox(dataclasses.replace(FAST, wall_timeout_s=0.5)) as box:
            assert box.run(writer).timed_out
            assert live_processes(marker) == {}
        assert not box.path.exists()


@pytest.mark.parametrize("command", ["echo a\0b", ["echo", "\ud800"], ["ech\0o"]], ids=["nul", "surrogate", "argv0"])
def test_a_command_no_program_can_receive_is_the_commands_error_and_the_sandbox_goes_on(
        sandbox: Sandbox, command: str | list[str]) -> None:
    """A model's command with a NUL byte or a lone surrogate is an observation for the model (exit code 127, the
    reason on stderr, as a shell reports a command it cannot run), not the machinery's error; files stay."""
    sandbox.write_file("kept.txt", "kept")
    result = sandbox.run(command)
    assert result.exit_code == 127 and "NUL byte" in result.stderr and not result.timed_out, result
    after = sandbox.run("cat kept.txt")
    assert (after.exit_code, after.stdout) == (0, "kept")


def test_stdin_with_a_lone_surrogate_is_the_commands_error(sandbox: Sandbox) -> None:
    result = sandbox.run("cat", stdin="a\ud800b")
    assert result.exit_code == 127 and "stdin" in result.stderr, result
    assert sandbox.run("cat", stdin="fine\0bytes").stdout == "fine\0bytes", "a NUL byte is data on stdin"
