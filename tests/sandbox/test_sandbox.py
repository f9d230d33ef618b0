"""The Sandbox as a whole, with real subprocesses: a private directory per sandbox, never shared."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sandbox.helpers import FAST, PROTECTIONS
from trajlab.sandbox import Sandbox, SandboxError


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
