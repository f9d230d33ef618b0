"""A long-lived process in a sandbox, started by the caller with its own pipes (``Sandbox.process_argv``), and host
paths it sees read-only (``read_only_paths``): what an MCP stdio server needs."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.sandbox.helpers import needs_bwrap, needs_private_uid
from trajlab.sandbox import Sandbox, SandboxError

SCRIPT = """
import os, sys
for line in sys.stdin:
    try:
        open(sys.argv[1] + "/written", "w")
        wrote = "wrote"
    except OSError:
        wrote = "read-only"
    print(line.strip(), open(sys.argv[1] + "/data.txt").read().strip(), wrote, os.getuid(), flush=True)
"""


@needs_bwrap
def test_a_long_lived_process_talks_over_its_pipes_and_sees_read_only_paths() -> None:
    with tempfile.TemporaryDirectory() as top:  # under /tmp: the sandbox's uid must reach it (pytest's is 0700)
        shared = Path(top) / "shared"
        shared.mkdir()
        for path in (Path(top), shared):
            path.chmod(0o755)
        check(shared)


def check(shared: Path) -> None:
    (shared / "data.txt").write_text("hello")
    (shared / "server.py").write_text(SCRIPT)
    with Sandbox(read_only_paths=[shared]) as box:
        argv, environment = box.process_argv(["/usr/bin/python3", str(shared / "server.py"), str(shared)])
        process = subprocess.Popen(argv, env=environment, cwd=box.path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, start_new_session=True)
        try:
            for turn in ("one", "two"):  # the same process answers each line
                process.stdin.write(turn + "\n")
                process.stdin.flush()
                word, data, wrote, uid = process.stdout.readline().split()
                assert (word, data, wrote) == (turn, "hello", "read-only")
            assert box.uid is None or int(uid) == box.uid
        finally:
            process.stdin.close()
            assert process.wait(10) == 0, "it ends when its stdin closes"
    assert not (shared / "written").exists()
    without = Sandbox()
    try:
        argv, environment = without.process_argv(["/bin/cat", str(shared / "data.txt")])
        seen = subprocess.run(argv, env=environment, cwd=without.path, capture_output=True, text=True, timeout=10)
        assert seen.returncode != 0 and "No such file" in seen.stderr, "not bound: not there"
    finally:
        without.cleanup()


@needs_bwrap
@needs_private_uid
def test_a_read_only_path_the_sandbox_uid_cannot_reach_is_refused_at_once_saying_why() -> None:
    with tempfile.TemporaryDirectory() as top:  # mode 0700: only its owner enters it
        inner = Path(top) / "packages"
        inner.mkdir()
        with pytest.raises(SandboxError, match=rf"the sandbox's own uid cannot enter {top} \(mode 700\); let others "
                                               rf"enter it \(chmod o\+x {top}\)"):
            Sandbox(read_only_paths=[inner])
        with pytest.raises(SandboxError, match="does not exist"):
            Sandbox(read_only_paths=[Path(top) / "missing"])
