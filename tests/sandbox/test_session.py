"""A sandbox's long-lived bubblewrap: one namespace for its commands, a command server they cannot touch, the same
namespace after a timeout, and a new one after the server's death."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sandbox.helpers import FAST, live_processes, needs_bwrap, server_of
from trajlab.sandbox import Sandbox
from trajlab.sandbox.session import SERVER_INSIDE

pytestmark = needs_bwrap

NAMESPACES = "readlink /proc/self/ns/pid /proc/self/ns/net /proc/self/ns/ipc"


@pytest.fixture
def box() -> Iterator[Sandbox]:
    with Sandbox(FAST) as sandbox:
        yield sandbox


def test_commands_share_one_namespace_whose_init_is_the_server(box: Sandbox) -> None:
    first, second = box.run(NAMESPACES), box.run(NAMESPACES)
    assert first.stdout == second.stdout and first.stdout.count("[") == 3
    assert SERVER_INSIDE in box.run("tr '\\000' ' ' < /proc/1/cmdline").stdout


def test_commands_cannot_kill_stop_or_read_the_server(box: Sandbox) -> None:
    namespaces = box.run(NAMESPACES).stdout
    result = box.run("kill -KILL 1; kill -STOP 1; kill -INT 1; kill -TERM 1; cat /proc/1/environ; ls /proc/1/fd; "
                     "ls /proc/1/root")
    assert result.stderr.count("Permission denied") == 3
    after = box.run(f"{NAMESPACES}; ps -o stat= -p 1")
    assert after.stdout.startswith(namespaces) and after.stdout.split()[-1].startswith("S"), "the server still serves"


def test_exit_statuses_are_exact(box: Sandbox) -> None:
    """Unlike bwrap's own status (128 + N for signal N), the server reports the command's wait status."""
    assert [box.run(command).exit_code for command in ("exit 137", "kill -TERM $$", "exit 0")] == [137, -15, 0]


def test_a_timeout_kills_the_command_and_what_it_started_and_keeps_the_namespace() -> None:
    """The server ends a command past its time (SIGUSR1 from the host): its files in /tmp stay for the next one."""
    with Sandbox(dataclasses.replace(FAST, wall_timeout_s=0.5)) as box:
        before = box.run(f"{NAMESPACES}; echo kept > /tmp/note").stdout
        late = box.run("setsid sleep 30 & sleep 10")
        assert late.timed_out and late.exit_code == -signal.SIGKILL
        after = box.run(f"{NAMESPACES}; cat /tmp/note; ps -e -o comm= | grep -c sleep")
    assert after.stdout.splitlines() == [*before.splitlines(), "kept", "0"]


def test_a_command_that_signals_the_server_ends_only_itself(box: Sandbox) -> None:
    namespaces = box.run(NAMESPACES).stdout
    assert box.run("kill -USR1 1; sleep 5; echo survived").exit_code == -signal.SIGKILL
    assert box.run(NAMESPACES).stdout == namespaces


def test_the_servers_death_mid_command_reads_as_killed_and_the_next_command_works(box: Sandbox) -> None:
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(box.run, "touch started; sleep 10")
        while not (box.path / "started").exists():
            time.sleep(0.01)
        os.kill(server_of(box), signal.SIGKILL)  # as the kernel's OOM killer would, say
        result = running.result(timeout=2)
    assert result.exit_code == -signal.SIGKILL and not result.timed_out
    assert box.run("echo back").stdout == "back\n"


def test_a_server_gone_between_commands_is_replaced(box: Sandbox) -> None:
    before = box.run(NAMESPACES).stdout
    server = server_of(box)
    os.kill(server, signal.SIGKILL)
    while server in live_processes(SERVER_INSIDE):  # dead before the next command, not while taking it
        time.sleep(0.01)
    after = box.run(NAMESPACES)
    assert after.exit_code == 0 and after.stdout != before


@pytest.mark.parametrize("argument", ["a\0b", "\ud800"], ids=["nul", "surrogate"])
def test_the_server_answers_a_command_it_cannot_start_and_goes_on(box: Sandbox, argument: str) -> None:
    """Sandbox.run refuses such commands before they reach the server; should one reach it anyway, the server (PID 1,
    holding the namespace and, unprivileged, the files) reports it as a shell would and survives."""
    namespaces = box.run(NAMESPACES).stdout
    session = box._session  # the server's own request path, below Sandbox.run's check
    assert session is not None
    result = session.run(["echo", argument], None, FAST)
    assert result.exit_code == 127 and "echo" in result.stderr, result
    assert box.run(NAMESPACES).stdout == namespaces, "the same server took the next command"
