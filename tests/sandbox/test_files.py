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
