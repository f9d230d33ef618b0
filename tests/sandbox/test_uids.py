"""Processes that leave the command's process group: under bubblewrap they die with the command; in the fallback
chain, cleanup kills every process of the sandbox's private uid."""

from __future__ import annotations

import uuid

from tests.sandbox.helpers import FAST, escape_command, leftovers, needs_bwrap, needs_private_uid, running
from trajlab.sandbox import Sandbox


@needs_bwrap
def test_under_bubblewrap_nothing_outlives_its_command() -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    with Sandbox(FAST) as box:
        result = box.run(escape_command(marker))
        assert result.exit_code == 0, result.stderr
        assert leftovers(marker) == "", "the PID namespace died with the command's first process"


@needs_private_uid
def test_chain_cleanup_kills_processes_that_left_the_process_group() -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    box = Sandbox(FAST, use_bubblewrap=False)
    box.run(escape_command(marker))
    assert running(marker) != ""
    box.cleanup()
    assert leftovers(marker) == ""
