"""Protections the host allows: no network inside a sandbox where a network namespace is available."""

from __future__ import annotations

import socket

import pytest

from tests.sandbox.helpers import PROTECTIONS
from trajlab.sandbox import Sandbox


@pytest.mark.skipif(not PROTECTIONS.network_namespace, reason="no network namespace on this machine")
def test_no_network_inside(sandbox: Sandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        result = sandbox.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"")
    assert result.exit_code != 0
    assert "unreachable" in result.stderr.lower() or "refused" in result.stderr.lower()
