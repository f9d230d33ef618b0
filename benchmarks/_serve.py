"""What the serve benchmarks share: `trajlab serve` on the tiny model, a real subprocess on a free loopback port.

Imported by ``serve_rss.py`` and ``serve_soak.py`` (run as scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from trajlab.models.tiny import init_tiny_model


def start_server(work: Path, serve_args: Sequence[str], *, timeout_s: float = 180) -> tuple[subprocess.Popen, int]:
    """A tiny model in ``work/tiny`` served as ``tiny``, recording into ``work/sessions``, with ``serve_args`` added;
    returns the process and its port once ``/health`` answers. The caller terminates it.

    The process's stderr is a pipe, read only to say why it failed to start or died."""
    model = init_tiny_model(work / "tiny", seed=0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "trajlab.cli", "--quiet", "serve", "--model", str(model), "--port", str(port),
         "--served-model-name", "tiny", "--record-dir", str(work / "sessions"), *serve_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return server, port
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit(f"the server did not start: {server.stderr.read().decode()}") from None
            time.sleep(0.2)
