"""``trajlab serve`` end to end: a real subprocess on a loopback port, spoken to by the openai SDK."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI
from typer.testing import CliRunner

from trajlab.cli import app
from trajlab.proxy.recording import read_session


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_trajlab_serve_answers_and_records(tiny_model_dir, tmp_path):
    port = free_port()
    records = tmp_path / "sessions"
    command = [sys.executable, "-m", "trajlab.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
               "--served-model-name", "tiny-test", "--record-dir", str(records), "--max-batch-size", "4"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "trajlab serve did not come up"
                time.sleep(0.2)
        api = OpenAI(base_url=f"http://127.0.0.1:{port}/sessions/cli/v1", api_key="k", max_retries=0)
        assert [m.id for m in api.models.list()] == ["tiny-test"]
        response = api.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, extra_body={"return_token_ids": True})
    finally:
        server.terminate()
        server.wait(timeout=30)
    (record,) = read_session(records / "cli.jsonl")
    assert record["choices"][0]["token_ids"] == response.choices[0].model_extra["token_ids"]


def test_serve_refuses_a_missing_model_or_an_unknown_parser(tiny_model_dir, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["serve", "--model", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "does not exist" in " ".join(missing.stdout.split())
    parser = runner.invoke(app, ["serve", "--model", str(tiny_model_dir), "--parser", "hermess"])
    assert parser.exit_code == 1 and "Did you mean 'hermes'" in " ".join(parser.stdout.split())
