"""The real tokenizer files trajlab ships: every family unpacks, checks out against its sha256 and loads offline."""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
from pathlib import Path

import pytest

from trajlab.models import families
from trajlab.models.families import DATA, export_family, family, family_dir, family_names, load_family_tokenizer

VOCAB = {  # tokens in each family's tokenizer (base vocabulary + added tokens), as upstream documents them
    "qwen3": 151_669, "qwen3-coder": 151_669, "qwen3.5": 151_669, "qwen2.5": 151_665,
    "llama3.1": 128_256, "llama3.2": 128_256, "mistral-nemo": 131_072, "gpt-oss": 200_019,
}
END_OF_TURN = {"qwen3": "<|im_end|>", "qwen2.5": "<|im_end|>", "llama3.1": "<|eot_id|>", "llama3.2": "<|eot_id|>",
               "mistral-nemo": "</s>", "gpt-oss": "<|return|>"}


def test_every_family_is_shipped_and_nothing_else():
    assert family_names() == sorted(VOCAB)
    manifest = json.loads((DATA / "manifest.json").read_text())
    used = {stored for entry in manifest["families"].values() for stored in entry["files"].values()}
    assert used == set(manifest["stored"]), "a stored file no family uses, or a family file that is not stored"
    on_disk = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file()} - {"manifest.json"}
    assert on_disk == {info["path"] for info in manifest["stored"].values()} | {
        f"licenses/{name}" for entry in manifest["families"].values() for name in entry["license_files"]}


@pytest.mark.parametrize("name", sorted(VOCAB))
def test_family_loads_with_its_vocabulary_and_template(name):
    tokenizer = load_family_tokenizer(name)
    assert len(tokenizer) == VOCAB[name]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hello, 世界 🌍"}], tokenize=False)
    assert "Hello, 世界 🌍" in rendered
    ids = tokenizer.encode("Hello, 世界 🌍", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Hello, 世界 🌍"
    if name in END_OF_TURN:
        assert tokenizer.eos_token == END_OF_TURN[name]


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss"])
def test_stored_files_hash_to_the_upstream_sha256(name):
    stored = json.loads((DATA / "manifest.json").read_text())["stored"]
    for stored_name in family(name)["files"].values():
        info = stored[stored_name]
        raw = (DATA / info["path"]).read_bytes()
        data = lzma.decompress(raw) if info["path"].endswith(".xz") else raw
        assert hashlib.sha256(data).hexdigest() == info["sha256"] and len(data) == info["bytes"]


def test_license_texts_travel_with_the_files(tmp_path):
    export_family("llama3.2", tmp_path)
    assert "LLAMA 3.2 COMMUNITY LICENSE AGREEMENT" in (tmp_path / "LICENSE-Llama-3.2").read_text()
    assert "Built with Llama" in (tmp_path / "NOTICE-Llama").read_text()
    export_family("qwen3", tmp_path / "qwen3")
    assert "Apache License" in (tmp_path / "qwen3" / "LICENSE-Apache-2.0").read_text()


def test_unpacked_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAJLAB_CACHE", str(tmp_path))
    first = family_dir("qwen2.5")
    assert first.parent == tmp_path / "tokenizers" and (first / "tokenizer.json").exists()
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert family_dir("qwen2.5") == first and (first / "tokenizer.json").stat().st_mtime_ns == stamp
    (first / ".complete").unlink()  # an interrupted unpacking is redone, not trusted
    assert family_dir("qwen2.5") == first and (first / ".complete").exists()
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [first.name]


def test_a_damaged_file_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "data"
    shutil.copytree(DATA, copy)
    (copy / "qwen2.5" / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(families, "DATA", copy)
    with pytest.raises(OSError, match="qwen2.5/tokenizer_config.json is damaged"):
        export_family("qwen2.5", tmp_path / "out")


def test_an_unknown_family_names_the_shipped_ones():
    with pytest.raises(ValueError, match="unknown tokenizer family 'qwen9'.*gpt-oss.*qwen3"):
        family("qwen9")


def test_the_rebuild_script_describes_what_is_stored():
    """scripts/tokenizers/manifest.py is the source of manifest.json: the two must not drift apart."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("m", Path(__file__).parents[2] / "scripts/tokenizers/manifest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    manifest = json.loads((DATA / "manifest.json").read_text())
    assert manifest["families"] == module.FAMILIES
    assert {k: {f: v[f] for f in module.STORED[k]} for k, v in manifest["stored"].items()} == module.STORED
