"""CTF challenges, laid out procedurally from a task's (kind, seed) around a fresh flag: one function per kind.

Why apart from the env: a layout is a pure function of the task, testable without a sandbox, while the flag and a
cipher's key are drawn anew in every episode (the OS's CSPRNG), so no task file or seed predicts them. The
service kind's vulnerable programs are in :mod:`~trajlab.env.builtin.ctf_service`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import gzip
import random
import re
import secrets
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trajlab.env.builtin.ctf_service import service_program

KINDS = ("encoding", "hidden", "cipher", "service")
FLAG_RE = re.compile(r"flag\{[0-9a-f]{24}\}")
LAYERS = ("base64", "hex", "rot13", "reverse", "gzip")
MAX_BLOB_CHARS = 320  # an encoded flag stays short enough to read in one observation
KEYSTREAM_BYTES = 32
MAX_ENCRYPT_QUERIES = 16
SAMPLE_FLAG = "flag{5f0c8e1a9b7d2c4e6a8f0b1d}"  # only to measure encodings, never a real flag


def new_flag() -> str:
    """A fresh flag from the OS's CSPRNG: nothing in the task or its seed predicts it."""
    return "flag{" + secrets.token_hex(12) + "}"


@dataclass
class Challenge:
    """One episode's challenge: what the model is told, what its sandbox holds, and what stays on the host."""

    intro: str
    files: dict[str, str]  # path in the model's sandbox -> content
    keystream: bytes = b""  # cipher: the secret key, host-side only
    block: int = 0  # cipher: bytes encrypted per query at most
    program: str = ""  # service: the program the service sandbox runs
    facts: dict[str, Any] = field(default_factory=dict)  # how it was built, for tests; never shown to the model


def encode_layer(layer: str, text: str) -> str:
    if layer == "base64":
        return base64.b64encode(text.encode()).decode()
    if layer == "hex":
        return text.encode().hex()
    if layer == "rot13":
        return codecs.encode(text, "rot13")
    if layer == "reverse":
        return text[::-1]
    if layer == "gzip":
        return base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()
    raise ValueError(f"unknown layer {layer!r}; layers are {LAYERS}")


def decode_layer(layer: str, text: str) -> str | None:
    """Undo one layer, or None when ``text`` cannot be that layer's output (the result must be printable ASCII)."""
    try:
        if layer == "base64":
            raw = base64.b64decode(text, validate=True)
        elif layer == "hex":
            raw = bytes.fromhex(text)
        elif layer == "gzip":
            raw = gzip.decompress(base64.b64decode(text, validate=True))
        else:
            raw = encode_layer(layer, text).encode()  # rot13 and reverse are their own inverses
        decoded = raw.decode("ascii")
    except (ValueError, binascii.Error, OSError, EOFError, zlib.error, UnicodeDecodeError):
        return None
    return decoded if decoded.isprintable() else None


def encoding_chain(rng: random.Random) -> list[str]:
    """3 to 5 layers, innermost first, drawn from ``rng``.

    base64 may come any number of times, every other layer once at most (rot13 or reverse twice would cancel out,
    hex or gzip twice would make the blob too long), and at least two layers change the alphabet. The length check
    uses a fixed sample flag, so a seed always gives the same chain; the margin covers gzip's variation.
    """
    while True:
        chain = [rng.choice(LAYERS) for _ in range(rng.randint(3, 5))]
        repeated = any(chain.count(layer) > 1 for layer in LAYERS if layer != "base64")
        changing = sum(layer in ("base64", "hex", "gzip") for layer in chain)
        if not repeated and changing >= 2 and len(apply_chain(chain, SAMPLE_FLAG)) <= MAX_BLOB_CHARS - 40:
            return chain


def apply_chain(chain: list[str], text: str) -> str:
    for layer in chain:
        text = encode_layer(layer, text)
    return text


def encoding_challenge(rng: random.Random, flag: str) -> Challenge:
    chain = encoding_chain(rng)
    name = rng.choice(["secret.txt", "message.enc", "blob.dat", "payload.txt", "transmission.txt", "dump.b64"])
    note = (f"The flag in {name} went through {len(chain)} layers of encoding, applied one after the other. Each "
            "layer is one of: base64, hex, rot13, reversed text, gzip (its bytes then base64-encoded). Undo them "
            "from the outermost in.\n")
    return Challenge(
        intro=f"Your working directory holds an encoded flag in {name}; note.txt explains how it was encoded.",
        files={name: apply_chain(chain, flag) + "\n", "note.txt": note},
        facts={"chain": chain},
    )


VISIBLE_DIRS = ("docs", "src", "logs", "backup", "notes", "data", "www", "scripts")
FILLERS = (
    ("readme.txt", "Internal files. Ask ops before deleting anything.\n"),
    ("todo.txt", "- rotate the logs\n- renew the certificate\n- water the plants\n"),
    ("app.log", "INFO start\nWARN disk 81% full\nINFO stop\n"),
    ("main.py", "print('hello')\n"),
    ("index.html", "<h1>It works</h1>\n"),
    ("backup.sh", "tar czf /tmp/backup.tgz .\n"),
)
DECOY_FLAGS = ("flag{nice_try}", "flag{this_is_not_the_flag}", "flag{decoy}", "flag{look_deeper}", "FLAG{almost}")
REAL_HIDDEN_DIRS = (".config", ".local", ".secret", ".vault", ".keys", ".private", ".stash")
REAL_HIDDEN_FILES = (".flag", ".key", ".token", ".treasure", ".loot")


def hidden_challenge(rng: random.Random, flag: str) -> Challenge:
    dirs = rng.sample(VISIBLE_DIRS, 3)
    decoys = rng.sample(DECOY_FLAGS, 3)
    files = {f"{d}/{name}": content for d in dirs for name, content in rng.sample(FILLERS, 2)}
    files["flag.txt"] = decoys[0] + "\n"
    files[".bash_history"] = "ls\ncat flag.txt\nmv flag.txt .trash/\n"
    files[f".trash/{rng.choice(['old_flag.txt', 'flag.bak'])}"] = f"{decoys[1]} (revoked)\n"
    files[f"{dirs[0]}/.cache/notes"] = f"not the flag either: {decoys[2]}\n"
    depth = rng.randint(2, 3)
    parts = [rng.choice(["", *dirs]), *rng.sample(REAL_HIDDEN_DIRS, depth - 1), rng.choice(REAL_HIDDEN_FILES)]
    path = "/".join(part for part in parts if part)
    files[path] = flag + "\n"
    return Challenge(
        intro="The flag is hidden somewhere under your working directory, among decoys. Not everything shows up in "
              "a plain ls.",
        files=files,
        facts={"path": path},
    )


def cipher_challenge(rng: random.Random, flag: str) -> Challenge:
    block = rng.choice([6, 8])
    keystream = secrets.token_bytes(KEYSTREAM_BYTES)
    ciphertext = bytes(a ^ b for a, b in zip(flag.encode(), keystream, strict=False))
    readme = (f"ciphertext.hex is the flag encrypted with a stream cipher: a secret keystream, fixed for this "
              f"challenge, is combined byte by byte with the plaintext. The encrypt tool encrypts your plaintext "
              f"with the same keystream, starting at the offset you choose, but at most {block} bytes per query "
              f"and {MAX_ENCRYPT_QUERIES} queries in all.\n")
    return Challenge(
        intro="The flag was encrypted into ciphertext.hex; an encryption service (the encrypt tool) uses the same "
              "secret key. Read README.txt.",
        files={"ciphertext.hex": ciphertext.hex() + "\n", "README.txt": readme},
        keystream=keystream,
        block=block,
    )


def service_challenge(rng: random.Random, flag: str) -> Challenge:
    program, bug = service_program(rng)
    readme = ("service.py is the source of the service behind the connect tool. connect(data) starts service.py "
              "on the server, sends it the flag as the first line of its input, then your data, and returns what "
              "it printed. You may run service.py here too, with input of your own (the real flag is not here).\n")
    return Challenge(
        intro="A service holds the flag; its source is service.py and the connect tool talks to it. Find its bug "
              "and make it reveal the flag. Read README.txt.",
        files={"service.py": program, "README.txt": readme},
        program=program,
        facts={"bug": bug},
    )


CHALLENGES: dict[str, Callable[[random.Random, str], Challenge]] = {
    "encoding": encoding_challenge,
    "hidden": hidden_challenge,
    "cipher": cipher_challenge,
    "service": service_challenge,
}


def challenge(kind: str, seed: int, flag: str) -> Challenge:
    """The challenge of a task: its layout comes from (kind, seed), its flag and key from the caller / the OS."""
    if kind not in CHALLENGES:
        raise ValueError(f"Unknown CTF challenge kind {kind!r}; kinds are {list(KINDS)}.")
    return CHALLENGES[kind](random.Random(f"ctf:{kind}:{seed}"), flag)
