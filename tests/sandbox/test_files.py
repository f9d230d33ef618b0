"""The host's file access inside a sandbox: paths, symlinks and ownership."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajlab.sandbox import Sandbox, SandboxPathError


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a/../../escape", "", "."])
def test_paths_outside_the_sandbox_are_refused(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(SandboxPathError):
        sandbox.write_file(path, "x")
    with pytest.raises(SandboxPathError):
        sandbox.read_file(path)


@pytest.mark.parametrize("path", ["a\0b", "dir/\ud800"], ids=["nul", "lone_surrogate"])
def test_paths_no_file_can_have_are_refused_with_the_sandboxs_error(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(SandboxPathError, match="cannot name a file"):
        sandbox.write_file(path, "x")
    with pytest.raises(SandboxPathError, match="cannot name a file"):
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


def test_fifos_directories_and_sockets_are_refused_at_once(sandbox: Sandbox) -> None:
    """Only regular files are read or written: a FIFO without a reader must neither block the host nor raise a bare
    OSError (ENXIO), nor a directory (EISDIR)."""
    made = sandbox.run("mkfifo fifo && mkdir dir && "
                       "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")'")
    assert made.exit_code == 0, made.stderr
    for path in ("fifo", "dir", "sock"):
        with pytest.raises(SandboxPathError, match="not a regular file"):
            sandbox.write_file(path, "x")
        with pytest.raises(SandboxPathError, match="not a regular file"):
            sandbox.read_file(path)
    assert sandbox.run("ls -F").stdout.split() == ["dir/", "fifo|", "sock="]
