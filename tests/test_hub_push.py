"""Pushing a model (`trajlab model push`) and a dataset (`trajlab dataset --push-to-hub`) through huggingface_hub.

There is no network here, so the Hub is a FAKE: a real HTTP server on loopback that speaks the four endpoints
huggingface_hub's upload uses (create the repository, ask how each file is uploaded, commit them inline), keeps
what was committed and checks the token. A push that works runs in a real `trajlab` process pointed at it by
``HF_ENDPOINT``, so everything up to the wire is the real client; the refusals run in this process.
"""

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import Result
from huggingface_hub import constants
from typer.testing import CliRunner

from trajlab.cli import app
from trajlab.env import load_env
from trajlab.rollout.types import Trajectory

TOKEN = "hf_fake_write_token"


class FakeHub(BaseHTTPRequestHandler):
    """A FAKE Hugging Face Hub: ``committed[(repo_type, repo)][path] = bytes`` of every file committed."""

    committed: dict[tuple[str, str], dict[str, bytes]] = {}
    created: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(401, {"error": "Invalid credentials in Authorization header"})
        parts = self.path.split("?")[0].strip("/").split("/")
        hub = "http://{}:{}".format(*self.server.server_address)
        if parts[:3] == ["api", "repos", "create"]:
            request = json.loads(body)
            self.created.append(request)
            return self._reply(200, {"url": f"{hub}/{request['organization']}/{request['name']}"})
        kind, repo, action = parts[1].removesuffix("s"), "/".join(parts[2:4]), parts[4]
        if action == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if action == "commit":
            store = self.committed.setdefault((kind, repo), {})
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    store[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self._reply(200, {"commitUrl": f"{hub}/{repo}/commit/{'0' * 40}", "commitOid": "0" * 40})
        self._reply(404, {"error": f"the fake Hub has no {self.path}"})

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_hub():
    FakeHub.committed, FakeHub.created = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _trajlab(args: list, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`trajlab ...` in its own process, with a Hugging Face home of its own (no stored token) and ``env`` on top."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    clean.update(HF_HOME=str(tmp_path / "hf-home"), PYTHONPATH=str(Path(__file__).parents[1]), **env)
    return subprocess.run([sys.executable, "-m", "trajlab.cli", *map(str, args)], capture_output=True, text=True,
                          env=clean, timeout=300)


@pytest.fixture
def demos(tmp_path) -> Path:
    """Two oracle-shaped trajectories of arithmetic: what `trajlab dataset` builds a dataset from."""
    spec = load_env("arithmetic")
    path = tmp_path / "demos.jsonl"
    rows = []
    for i, task in enumerate(spec.iter_tasks("train", 0)):
        if i == 2:
            break
        rows.append(Trajectory(id=f"d{i}", env="arithmetic", task=task, status="success", reward=1.0, tools=[],
                               messages=[{"role": "user", "content": task["question"]},
                                         {"role": "assistant", "content": "done"}]).model_dump_json())
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """This process's huggingface_hub with no token anywhere (none in the environment, none stored by a login)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    return monkeypatch


def _cli(args: list) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_without_a_token_each_push_says_how_to_give_one(tmp_path, tiny_model_dir, demos, hub_env):
    for args in (["model", "push", tiny_model_dir, "--repo", "me/tiny"],
                 ["dataset", "--kind", "rl", "--from", demos, "--out", tmp_path / "rl.parquet",
                  "--push-to-hub", "me/tasks"]):
        result = _cli(args)
        assert result.exit_code == 1, result.stdout
        assert result.stdout.startswith("error: no Hugging Face token to push with: set HF_TOKEN"), result.stdout
        assert "hf auth login" in result.stdout and len(result.stdout.strip().splitlines()) == 1
    assert not (tmp_path / "rl.parquet").exists(), "refused before anything was built"


def test_a_model_and_a_dataset_reach_the_hub_byte_for_byte(tmp_path, tiny_model_dir, demos, fake_hub):
    result = _trajlab(["model", "push", tiny_model_dir, "--repo", "me/tiny", "--private"], tmp_path,
                      HF_ENDPOINT=fake_hub, HF_TOKEN=TOKEN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Pushed" in result.stdout and "me/tiny" in result.stdout
    pushed = FakeHub.committed[("model", "me/tiny")]
    assert pushed == {f.name: f.read_bytes() for f in tiny_model_dir.iterdir() if f.is_file()}
    assert FakeHub.created[0] == {**FakeHub.created[0], "name": "tiny", "organization": "me", "visibility": "private"}

    out = tmp_path / "rl.parquet"
    result = _trajlab(["dataset", "--kind", "rl", "--from", demos, "--out", out, "--push-to-hub", "me/tasks"],
                      tmp_path, HF_ENDPOINT=fake_hub, HF_TOKEN=TOKEN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert FakeHub.committed[("dataset", "me/tasks")] == {"rl.parquet": out.read_bytes()}
    assert FakeHub.created[1]["type"] == "dataset"


def test_a_token_the_hub_refuses_and_a_folder_that_is_no_model_are_one_line(tmp_path, tiny_model_dir, fake_hub,
                                                                             hub_env):
    hub_env.setattr(constants, "ENDPOINT", fake_hub)
    hub_env.setenv("HF_TOKEN", "hf_wrong")
    result = _cli(["model", "push", tiny_model_dir, "--repo", "me/tiny"])
    assert result.exit_code == 1 and result.stdout.startswith("error: pushing ") and "401" in result.stdout
    hub_env.setenv("HF_TOKEN", TOKEN)
    result = _cli(["model", "push", tmp_path, "--repo", "me/tiny"])
    assert result.exit_code == 1 and "not a model directory (no config.json)" in result.stdout
    result = _cli(["model", "push", tiny_model_dir, "--repo", "not a repo"])
    assert result.exit_code == 1 and "'not a repo' is no Hugging Face repository id" in result.stdout
    assert FakeHub.committed == {}
