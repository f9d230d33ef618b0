"""Private uids: processes that leave the group are killed, and a crashed holder's uid is cleared before reuse."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.sandbox.helpers import FAST, PROTECTIONS, escape_command, leftovers, needs_private_uid, running
from trajlab.sandbox import SANDBOX_UID_RANGE, Sandbox, uids


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
        monkeypatch.setattr(uids.secrets, "randbelow", lambda _: int(uid) - SANDBOX_UID_RANGE[0] - 1)
        with Sandbox(FAST) as heir:
            assert heir.uid == int(uid)
            assert leftovers(marker) == ""
            if PROTECTIONS.disk_quota:
                assert not Path(path).exists(), "the crashed sandbox's tmpfs was unmounted and removed"
    finally:
        shutil.rmtree(path, ignore_errors=True)
