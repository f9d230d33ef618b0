"""Models by Hugging Face name, offline: a Hugging Face cache built here, resolved by huggingface_hub's own logic."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from trajlab.models.hub import resolve_model_dir
from trajlab.models.loading import load_model, load_tokenizer

NAME = "trajlab-test/Tiny-Twin"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(model_dir: Path, cache: Path, name: str = NAME) -> Path:
    """``model_dir`` stored in ``cache`` as ``hf download`` stores a repository: content-addressed blobs, a
    snapshot of links to them, and refs/main naming the snapshot's commit. Returns the snapshot folder."""
    repo = cache / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(model_dir.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline_cache(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model cached under NAME, and huggingface_hub pointed at that cache with the network off."""
    cache = tmp_path / "hub"
    snapshot = _hf_cache(tiny_model_dir, cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, snapshot


def test_a_cached_name_resolves_to_its_snapshot_and_loads(offline_cache, tiny_model_dir):
    cache, snapshot = offline_cache
    assert resolve_model_dir(NAME) == snapshot
    assert resolve_model_dir(tiny_model_dir) == tiny_model_dir, "a directory stays what it is"
    model, tokenizer = load_model(NAME, device="cpu"), load_tokenizer(NAME)
    assert model.config.vocab_size == len(tokenizer) and tokenizer.response_template is not None


def test_a_name_neither_cached_nor_downloadable_says_how_to_get_it(offline_cache):
    cache, _ = offline_cache
    with pytest.raises(FileNotFoundError) as missing:
        load_model("Qwen/Qwen3-1.7B", device="cpu")
    message = str(missing.value)
    assert "'Qwen/Qwen3-1.7B' is no local directory" in message and str(cache) in message
    assert "network is off (HF_HUB_OFFLINE)" in message
    assert "`hf download Qwen/Qwen3-1.7B`" in message and "give a model directory" in message
    with pytest.raises(FileNotFoundError, match="'runs/a/b' does not exist"):
        resolve_model_dir("runs/a/b")  # no name either: a mistyped path


def test_a_failed_download_is_said(tmp_path, monkeypatch):
    """With the network allowed, a name that is nowhere (no network here, or no such repository online) fails
    with the download's reason and the same advice."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(FileNotFoundError, match=r"downloading it failed: .*`hf download trajlab-test/no-such-model"):
        resolve_model_dir("trajlab-test/no-such-model-for-issue-40")


@pytest.mark.slow(31)
def test_eval_and_sft_by_name_from_the_cache(tiny_model_dir, tmp_path):
    """The command line with the standard variables: HF_HUB_CACHE holds the model, HF_HUB_OFFLINE keeps the network
    off; the policy and the model to train are given by name."""
    _hf_cache(tiny_model_dir, tmp_path / "hub")
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    def trajlab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trajlab.cli", *args], capture_output=True, text=True, env=env,
                              timeout=600, cwd=tmp_path)

    evaluated = trajlab("eval", "--env", "arithmetic", "--policy", NAME, "--num-tasks", "2", "--max-turns", "2",
                        "--out", "eval")
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["episodes"] == 2
    trajlab("collect", "--env", "arithmetic", "--policy", "oracle", "--tokenizer", NAME, "--episodes", "4",
            "--split", "train", "--out", "demos.jsonl")
    trained = trajlab("sft", "--model", NAME, "--from", "demos.jsonl", "--out", "sft", "--set", "sft.max_steps=1")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert (tmp_path / "sft" / "final" / "config.json").is_file()
    missing = trajlab("eval", "--env", "arithmetic", "--policy", "Qwen/Qwen3-1.7B", "--out", "eval2")
    assert missing.returncode == 1 and "`hf download Qwen/Qwen3-1.7B`" in missing.stdout, missing.stdout
