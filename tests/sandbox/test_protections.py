"""Protections the host allows (no network inside a sandbox), and envs refusing a machine that lacks them."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sandbox.helpers import PROTECTIONS, run_as_nobody
from trajlab.sandbox import ALLOW_WEAK_ENV, MissingProtection, Sandbox, require_strong_isolation
from trajlab.sandbox.protections import missing_for


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


# An unprivileged host here has no cgroup of either kind (v1 needs root; the user owns no v2 cgroup).
REQUIRE = "from trajlab.sandbox import require_strong_isolation; require_strong_isolation('the attack')"


def test_strong_isolation_requires_a_memory_cap_and_an_opt_out_names_it() -> None:
    refused = run_as_nobody(["-c", REQUIRE])
    assert refused.returncode != 0 and "MissingProtection" in refused.stderr
    assert "memory_cap" in refused.stderr and "Delegate=yes" in refused.stderr, "names the missing cap and the fix"
    assert f"{ALLOW_WEAK_ENV}=memory_cap" in refused.stderr, "says how to opt out of that one by name"
    opted_out = run_as_nobody(["-c", REQUIRE], env={ALLOW_WEAK_ENV: "memory_cap"})
    assert opted_out.returncode == 0, opted_out.stderr
    assert "the attack runs without memory_cap" in opted_out.stderr, "running without the cap is said loudly"
    as_unset = run_as_nobody(["-c", REQUIRE], env={ALLOW_WEAK_ENV: "0"})
    assert as_unset.returncode != 0 and "names no protection" not in as_unset.stderr, "0 opts out of nothing"
    misspelt = run_as_nobody(["-c", REQUIRE], env={ALLOW_WEAK_ENV: "memory_cp"})
    assert misspelt.returncode != 0 and "memory_cp" in misspelt.stderr and "memory_cap" in misspelt.stderr


def test_a_protection_opted_out_by_name_does_not_cover_another() -> None:
    weak = dataclasses.replace(PROTECTIONS, bubblewrap=False, memory_cap="", cgroup_limits=False)
    with pytest.raises(MissingProtection, match="bubblewrap") as refused:
        missing_for(weak, allow_weak={"memory_cap"})
    assert "memory_cap" not in str(refused.value)
    assert missing_for(weak, allow_weak={"memory_cap", "bubblewrap"}) == ["bubblewrap", "memory_cap"]
    assert missing_for(weak, allow_weak=True) == ["bubblewrap", "memory_cap"]
