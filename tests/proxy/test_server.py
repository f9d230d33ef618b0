"""``trajlab serve`` end to end: a real subprocess on a loopback port, spoken to by the openai SDK."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from openai import OpenAI
from typer.testing import CliRunner

from trajlab.cli import app
from trajlab.proxy.recording import read_session


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(*args: str, port: int) -> Iterator[str]:
    """``trajlab serve ARGS`` in a process of its own until the block ends; yields the base URL once it answers."""
    server = subprocess.Popen([sys.executable, "-m", "trajlab.cli", "serve", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
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
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_trajlab_serve_answers_and_records(tiny_model_dir, tmp_path):
    port = free_port()
    records = tmp_path / "sessions"
    with serving("--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny-test",
                 "--record-dir", str(records), "--max-batch-size", "4", port=port) as url:
        api = OpenAI(base_url=f"{url}/sessions/cli/v1", api_key="k", max_retries=0)
        assert [m.id for m in api.models.list()] == ["tiny-test"]
        response = api.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, extra_body={"return_token_ids": True})
    (record,) = read_session(records / "cli.jsonl")
    assert record["choices"][0]["token_ids"] == response.choices[0].model_extra["token_ids"]


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("source", ["config", "set"])
def test_serve_takes_its_settings_from_a_config_file_or_set(source, tiny_model_dir, tmp_path):
    """serve.port and serve.max_body_bytes from the file, or from --set over a file that says otherwise; an option
    on the command line wins over both (--record-dir over serve.record_dir)."""
    port, records = free_port(), tmp_path / "sessions"
    in_file = {"port": port, "max_body_bytes": 2000} if source == "config" else {"port": 1, "max_body_bytes": 10}
    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({"model": {"path": str(tiny_model_dir)},  # JSON is YAML
                                  "serve": {**in_file, "served_model_name": "tiny-test",
                                            "record_dir": str(tmp_path / "elsewhere")}}))
    sets = ["--set", f"serve.port={port}", "--set", "serve.max_body_bytes=2000"] if source == "set" else []
    with serving("--config", str(config), *sets, "--record-dir", str(records), port=port) as url:
        chat = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert post(f"{url}/sessions/small/v1/chat/completions", json.dumps(chat).encode())[0] == 200
        padded = {**chat, "messages": [{"role": "user", "content": "x" * 3000}]}
        status, error = post(f"{url}/sessions/big/v1/chat/completions", json.dumps(padded).encode())
    assert status == 413 and "exceeds the limit of 2000 bytes" in error["error"]["message"]
    assert [r["status"] for r in read_session(records / "small.jsonl")] == [200]
    assert [r["status"] for r in read_session(records / "big.jsonl")] == [413]


def test_serve_refuses_a_missing_model_or_an_unknown_parser(tiny_model_dir, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["serve", "--model", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "does not exist" in " ".join(missing.stdout.split())
    parser = runner.invoke(app, ["serve", "--model", str(tiny_model_dir), "--parser", "hermess"])
    assert parser.exit_code == 1 and "Did you mean 'hermes'" in " ".join(parser.stdout.split())
