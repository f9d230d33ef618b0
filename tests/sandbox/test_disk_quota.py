"""The tmpfs quota: a loop of files fills only the sandbox's own cap, /tmp included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sandbox.helpers import PROTECTIONS
from trajlab.sandbox import Sandbox, SandboxLimits


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
