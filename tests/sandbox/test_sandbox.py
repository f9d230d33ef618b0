"""The Sandbox as a whole, with real subprocesses: a private directory per sandbox, never shared."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sandbox.helpers import ADD_KEY, FAST, KEYCTL, MODES, PROTECTIONS, host_paths_seen, needs_key_calls
from trajlab.sandbox import Sandbox, SandboxError


def test_runs_in_a_private_directory_that_cleanup_removes() -> None:
    box = Sandbox(FAST)
    box.write_file("notes/a.txt", "hello\n")
    result = box.run("pwd; ls -A; cat notes/a.txt; stat -c %a .")
    assert result.exit_code == 0
    assert result.stdout.split() == [str(box.inside_path), "notes", "hello", "700"]
    assert box.read_file("notes/a.txt") == b"hello\n"
    box.cleanup()
    assert not box.path.exists()
    box.cleanup()
    with pytest.raises(SandboxError):
        box.run("true")


@pytest.mark.parametrize("mode", [mode for mode in MODES if mode.id != "chain"])
def test_commands_see_no_host_path_under_bubblewrap(mode: dict) -> None:
    with Sandbox(FAST, **mode) as box:
        assert host_paths_seen(box) == []
        if box.resettable:  # the next user from a pool
            box.reset()
            assert host_paths_seen(box) == []


def test_the_fallback_chain_runs_commands_at_the_host_path() -> None:
    """It cannot move the working directory: what commands see is the host's path, and write_file says so."""
    with Sandbox(FAST, use_bubblewrap=False) as box:
        assert box.inside_path == box.path
        assert box.write_file("a.txt", "") == box.path / "a.txt"
        assert box.run("pwd; echo $HOME").stdout.split() == [str(box.path)] * 2


@pytest.mark.parametrize("path", ["/", "/sandbox", "/sandbox/tools"])
def test_a_read_only_path_over_or_in_the_working_directory_is_refused(path: str) -> None:
    with pytest.raises(SandboxError, match="where commands see their working directory"):
        Sandbox(FAST, read_only_paths=[path])


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


# The session keyring's id, then the ids of the keys it holds (KEYCTL_READ: 4 bytes each), as "id:key,key".
SESSION_KEYS = f"""import ctypes
libc = ctypes.CDLL(None, use_errno=True)
keyctl = lambda *args: libc.syscall(ctypes.c_long({KEYCTL}), *map(ctypes.c_long, args))
def session_keys():
    buffer = ctypes.create_string_buffer(4096)
    size = libc.syscall(ctypes.c_long({KEYCTL}), ctypes.c_long(11), ctypes.c_long(-3), buffer, ctypes.c_long(4096))
    ids = [int.from_bytes(buffer.raw[i:i + 4], "little") for i in range(0, max(size, 0), 4)]
    return f"{{keyctl(0, -3, 0)}}:{{','.join(map(str, ids))}}"
"""


@needs_key_calls
@pytest.mark.parametrize("mode", [m for m in MODES if m.id != "chain"])
def test_commands_get_a_new_empty_session_keyring(mode: dict) -> None:
    """A command neither possesses the host's session keyring (so cannot read its keys) nor can leave keys in it."""
    scope: dict = {}
    exec(SESSION_KEYS, scope)
    libc = ctypes.CDLL(None, use_errno=True)
    host_key = libc.syscall(ctypes.c_long(ADD_KEY), b"user", b"host-secret", b"secret", ctypes.c_size_t(6),
                            ctypes.c_long(-3))
    assert host_key > 0, os.strerror(ctypes.get_errno())
    try:
        host_before = scope["session_keys"]()
        assert str(host_key) in host_before.split(":")[1].split(",")
        with Sandbox(FAST, **mode) as box:
            stash = (f"assert libc.syscall(ctypes.c_long({ADD_KEY}), b'user', b'stash', b'x', ctypes.c_size_t(1), "
                     f"ctypes.c_long(-3)) > 0 or ({PROTECTIONS.seccomp_filter} and ctypes.get_errno() == 1)\n")
            result = box.run(["python3", "-c", SESSION_KEYS + stash + "print(session_keys())"])
            assert result.exit_code == 0, result.stderr
            inside_id, inside_keys = result.stdout.strip().split(":")
        assert inside_id != host_before.split(":")[0], "the command possessed the host's session keyring"
        assert str(host_key) not in inside_keys.split(",")
        assert len(inside_keys.split(",")) == 1, "the command's session keyring held only the key it added"
        assert scope["session_keys"]() == host_before, "the command changed the host's session keyring"
    finally:
        libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(21), ctypes.c_long(host_key))  # KEYCTL_INVALIDATE
