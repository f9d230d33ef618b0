"""openai-harmony offline: its vocabulary file written from the gpt-oss tokenizer trajlab ships.

openai-harmony downloads ``o200k_base.tiktoken`` the first time it loads an encoding, which fails without a
network. The file is the same byte-level BPE as gpt-oss's tokenizer.json (each token's bytes, base64, and its rank),
so it is rebuilt from that, checked against the published file's sha256, and openai-harmony is pointed at it with
``TIKTOKEN_ENCODINGS_BASE`` (unless the user set that already).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trajlab.errors import require
from trajlab.models.families import cache_root, family_dir

O200K_BASE = "o200k_base.tiktoken"
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENCODINGS_BASE_ENV = "TIKTOKEN_ENCODINGS_BASE"


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level map reversed: the character a byte-level BPE vocabulary writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + shifted
            shifted += 1
    return {chr(char): byte for byte, char in chars.items()}


def o200k_base_text(tokenizer_json: Path) -> bytes:
    """The ``.tiktoken`` file of a byte-level BPE tokenizer.json: ``<base64 of the token's bytes> <rank>`` a line."""
    vocab = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["vocab"]
    decode = byte_decoder()
    lines = (f"{base64.b64encode(bytes(decode[char] for char in token)).decode()} {rank}\n"
             for token, rank in sorted(vocab.items(), key=lambda item: item[1]))
    return "".join(lines).encode()


def encodings_folder() -> Path:
    """The folder holding ``o200k_base.tiktoken`` (written and checked on first use), under trajlab's cache."""
    folder = cache_root() / "tiktoken"
    target = folder / O200K_BASE
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_BASE_SHA256:
        return folder
    data = o200k_base_text(family_dir("gpt-oss") / "tokenizer.json")
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise OSError(f"o200k_base.tiktoken rebuilt from gpt-oss's tokenizer.json hashes to {digest}, not the "
                      f"published {O200K_BASE_SHA256}: the shipped tokenizer files are damaged")
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{O200K_BASE}.{os.getpid()}"
    partial.write_bytes(data)
    partial.replace(target)  # atomic: a concurrent reader sees the whole file or none
    return folder


def harmony_encoding() -> Any:
    """openai-harmony's gpt-oss encoding (``HarmonyEncodingName.HARMONY_GPT_OSS``), loaded without a network."""
    harmony = require("openai_harmony", feature="the harmony format (gpt-oss)",
                      install="pip install 'trajlab[harmony]'")
    if ENCODINGS_BASE_ENV not in os.environ:
        os.environ[ENCODINGS_BASE_ENV] = str(encodings_folder())
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
