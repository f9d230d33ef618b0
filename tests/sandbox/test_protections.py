"""Protections the host allows (no network inside a sandbox), and envs refusing a machine that lacks them."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sandbox.helpers import PROTECTIONS
from trajlab.sandbox import ALLOW_WEAK_ENV, MissingProtection, Sandbox, require_strong_isolation


@pytest.mark.skipif(not PROTECTIONS.network_namespace, reason="no network namespace on this machine")
def test_no_network_inside(sandbox: Sandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        result = sandbox.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"")
    assert result.exit_code != 0
    assert "unreachable" in result.stderr.lower() or "refused" in result.stderr.lower()


def test_an_env_needing_strong_isolation_refuses_a_machine_without_bubblewrap(tmp_path: Path) -> None:
    """A real machine without bubblewrap: PATH holds every tool the sandbox uses but bwrap."""
    for tool in ("prlimit", "setpriv", "unshare", "mount", "umount", "sh", "ipcmk"):
        if (found := shutil.which(tool)) is not None:
            (tmp_path / tool).symlink_to(found)
    make_ctf = "from trajlab.env.builtin.ctf import CTF; env = CTF(); env.reset(kind='hidden', seed=0); env.close()"
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    refused = subprocess.run([sys.executable, "-c", make_ctf], env=env, capture_output=True, text=True)
    assert refused.returncode != 0
    assert "MissingProtection" in refused.stderr and "apt-get install bubblewrap" in refused.stderr
    assert f"{ALLOW_WEAK_ENV}=1" in refused.stderr
    opted_out = subprocess.run([sys.executable, "-c", make_ctf], env={**env, ALLOW_WEAK_ENV: "1"},
                               capture_output=True, text=True)
    assert opted_out.returncode == 0, opted_out.stderr


def test_strong_isolation_is_what_this_machine_gives() -> None:
    if PROTECTIONS.missing_for_strong_isolation():
        with pytest.raises(MissingProtection, match="bubblewrap"):
            require_strong_isolation("a test", allow_weak=False)
        require_strong_isolation("a test", allow_weak=True)
    else:
        require_strong_isolation("a test", allow_weak=False)
