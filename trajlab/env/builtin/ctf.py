"""CTF: capture a flag with shell commands run in a sandbox, plus the services some challenges offer.

Why: a many-turn task where every step depends on what the last command printed, and where the reward cannot be
talked into existence. Each episode gets a fresh random flag ``flag{<24 hex digits>}``, made in ``reset`` (never
stored in the task, never derived from its seed), and a fresh :class:`~trajlab.sandbox.Sandbox`: the model's commands
run only there, as an unprivileged uid of their own, without network, under time, memory, file-size and process
limits. Four kinds of challenge, each seeded by the task:

- ``encoding``: a file holds the flag under 3 to 5 layers of encoding (base64, hex, rot13, reversed text, gzip then
  base64) in a seeded order; ``note.txt`` says how many layers there are and which kinds exist.
- ``hidden``: the flag is in a dotfile inside nested hidden directories, among visible and hidden decoys whose fake
  flags lack the real format.
- ``cipher``: ``ciphertext.hex`` is the flag XORed with a secret per-episode keystream. The ``encrypt`` tool encrypts
  chosen plaintext at a chosen offset of the same stream, but at most 6 or 8 bytes per query: the keystream bytes
  are independent and uniformly random, so the 24 unknown bytes of the flag take at least 3 queries. The key stays
  in the host process; the sandbox never sees it.
- ``service``: ``service.py`` is the source of a small vulnerable program. ``connect(data)`` runs it in a second
  sandbox (another uid: the model can neither read its input nor change its code) with the flag as the first line
  of its input, then ``data``. Reading files never shows the flag; the bug must be exploited. The bug is one of an
  off-by-one index check, a length field trusted over the data's real length (Heartbleed), or a session string
  built from user input (injection).

Reward: 1.0 only when ``submit_flag`` gets this episode's flag exactly; after 3 wrong submissions the episode ends
with 0. Nothing a command or tool prints counts. The sandboxes are removed when the episode ends, when ``reset``
starts the next one, and when the env is garbage-collected.
"""

from __future__ import annotations

import ast
import base64
import binascii
import codecs
import gzip
import hmac
import random
import re
import secrets
import string
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trajlab.env.base import Environment, tool_call_message
from trajlab.env.builtin._split import split_of
from trajlab.env.registry import EnvSpec
from trajlab.sandbox import Sandbox, SandboxLimits, SandboxResult

KINDS = ("encoding", "hidden", "cipher", "service")
TASKS_PER_KIND = 400
FLAG_RE = re.compile(r"flag\{[0-9a-f]{24}\}")
MAX_WRONG_SUBMISSIONS = 3

# The model's commands: generous enough for python3 and pipelines, small enough that a fork bomb or a busy loop
# ends within the rollout engine's default 10 s tool timeout. Where the sandbox has a disk quota, it is a tmpfs
# (memory) that also serves as the command's /tmp: a challenge needs a few kilobytes.
COMMAND_LIMITS = SandboxLimits(cpu_seconds=5, memory_bytes=512 << 20, file_size_bytes=16 << 20, max_processes=64,
                               open_files=256, wall_timeout_s=8.0, max_output_bytes=64 << 10, disk_bytes=32 << 20)
SERVICE_LIMITS = SandboxLimits(cpu_seconds=2, memory_bytes=256 << 20, file_size_bytes=1 << 20, max_processes=8,
                               open_files=64, wall_timeout_s=5.0, max_output_bytes=16 << 10, disk_bytes=2 << 20)
MAX_COMMAND_CHARS = 8000
MAX_DATA_CHARS = 4000
OBSERVATION_HEAD, OBSERVATION_TAIL = 2000, 500  # characters of output kept before and after a cut

LAYERS = ("base64", "hex", "rot13", "reverse", "gzip")
MAX_BLOB_CHARS = 320  # an encoded flag stays short enough to read in one observation
KEYSTREAM_BYTES = 32
MAX_ENCRYPT_QUERIES = 16
MAX_CONNECTIONS = 20


SAMPLE_FLAG = "flag{5f0c8e1a9b7d2c4e6a8f0b1d}"  # only to measure encodings, never a real flag


def new_flag() -> str:
    """A fresh flag from the OS's CSPRNG: nothing in the task or its seed predicts it."""
    return "flag{" + secrets.token_hex(12) + "}"


# ---------------------------------------------------------------------------------------------------------------
# Challenges, laid out from a task's seed around a fresh flag.


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


# The vulnerable programs. The flag arrives only on the program's stdin, sent by the env when connect() runs it.
NOTES_SERVICE = string.Template('''\
import sys

FLAG = sys.stdin.readline().strip()  # the server sends the flag as the first line of input
NOTES = $notes
STORE = NOTES + [FLAG]  # the admin note is kept right after the public ones

for line in sys.stdin:
    command, _, argument = line.strip().partition(" ")
    if command == "list":
        print(len(NOTES), "public notes")
    elif command == "$read":
        index = int(argument)
        if index < 0 or index > len(NOTES):
            print("no such note")
        else:
            print(STORE[index])
    else:
        print("commands: list, $read INDEX")
''')

ECHO_SERVICE = string.Template('''\
import sys

FLAG = sys.stdin.readline().strip()  # the server sends the flag as the first line of input
SIZE = $size
memory = bytearray(b"." * (2 * SIZE))
memory[SIZE:SIZE + len(FLAG)] = FLAG.encode()  # the secret half, right after the echo buffer

for line in sys.stdin:
    # $verb LENGTH TEXT: echo back the first LENGTH bytes of TEXT
    parts = line.rstrip("\\n").split(" ", 2)
    if len(parts) != 3 or parts[0] != "$verb" or not parts[1].isdigit() or int(parts[1]) > len(memory):
        print("usage: $verb LENGTH TEXT")
        continue
    data = parts[2].encode()[:SIZE]
    memory[:len(data)] = data
    print(memory[:int(parts[1])].decode(errors="replace"))
''')

COOKIE_SERVICE = string.Template('''\
import sys

FLAG = sys.stdin.readline().strip()  # the server sends the flag as the first line of input


def parse(cookie):
    fields = {}
    for item in cookie.split(";"):
        key, _, value = item.partition("=")
        fields[key] = value
    return fields


for line in sys.stdin:
    cookie = "$role=$low;$name=" + line.strip()
    session = parse(cookie)
    if session["$role"] == "$high":
        print("Welcome back. The flag is", FLAG)
    else:
        print("Hello", session["$name"] + ". Only the $high $role may read the flag.")
''')

NOTE_TEXTS = ("welcome to the notes service", "remember to water the plants", "meeting moved to friday",
              "the coffee machine is fixed", "backups run at midnight", "do not feed the cat")


def service_program(rng: random.Random) -> tuple[str, str]:
    """A vulnerable program and its bug's name."""
    bug = rng.choice(["off_by_one", "trusted_length", "injection"])
    if bug == "off_by_one":
        notes = rng.sample(NOTE_TEXTS, rng.randint(2, 5))
        return NOTES_SERVICE.substitute(notes=repr(notes), read=rng.choice(["show", "read", "get"])), bug
    if bug == "trusted_length":
        return ECHO_SERVICE.substitute(size=rng.choice([32, 40, 48, 64]), verb=rng.choice(["ECHO", "PING"])), bug
    role, name = rng.choice([("role", "name"), ("level", "user"), ("group", "login")])
    low, high = rng.choice([("guest", "admin"), ("user", "root"), ("visitor", "staff")])
    return COOKIE_SERVICE.substitute(role=role, name=name, low=low, high=high), bug


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


# ---------------------------------------------------------------------------------------------------------------
# The environment.


def _cleanup(sandboxes: list[Sandbox]) -> None:
    """Remove an episode's sandboxes; also the env's weakref finalizer, so it must not hold the env."""
    while sandboxes:
        sandboxes.pop().cleanup()


class CTF(Environment):
    """Capture the flag: explore a sandbox with shell commands, break the challenge, submit flag{...}."""

    def __init__(self) -> None:
        super().__init__()
        self.kind = ""
        self._flag = ""
        self._keystream = b""
        self._block = 0
        self._sandboxes: list[Sandbox] = []
        self._sandbox: Sandbox | None = None
        self._service: Sandbox | None = None
        weakref.finalize(self, _cleanup, self._sandboxes)

    def reset(self, **task: Any) -> str:
        super().reset()
        _cleanup(self._sandboxes)
        self._sandbox = self._service = None
        self.kind, self._flag = "", new_flag()
        setup = challenge(str(task["kind"]), int(task["seed"]), self._flag)
        self.kind = str(task["kind"])
        self._keystream, self._block = setup.keystream, setup.block
        self.metrics = {"commands": 0, "failed_commands": 0, "timeouts": 0, "oracle_queries": 0, "connections": 0,
                        "submissions": 0, "wrong_submissions": 0, "inapplicable_calls": 0}
        self._sandbox = self._new_sandbox(COMMAND_LIMITS)
        for path, content in setup.files.items():
            self._sandbox.write_file(path, content)
        if setup.program:
            self._service = self._new_sandbox(SERVICE_LIMITS)
            self._service.write_file("service.py", setup.program)
        return (f"{setup.intro} Use run to execute shell commands in your working directory and submit_flag to "
                f"answer; the flag looks like flag{{...}} with 24 lowercase hex digits inside the braces.")

    def run(self, command: str) -> str:
        """Run a shell command in your working directory in the sandbox; returns its output and exit code.

        Args:
            command: a /bin/sh command line, e.g. "ls -la"
        """
        if (refusal := self._refusal()) is not None:
            return refusal
        if not command.strip():
            return "Error: empty command."
        if len(command) > MAX_COMMAND_CHARS:
            return f"Error: the command has {len(command)} characters; at most {MAX_COMMAND_CHARS} are accepted."
        assert self._sandbox is not None
        self.metrics["commands"] += 1
        result = self._sandbox.run(command)
        self.metrics["failed_commands"] += result.exit_code != 0
        self.metrics["timeouts"] += result.timed_out
        return describe(result, COMMAND_LIMITS)

    def submit_flag(self, flag: str) -> str:
        """Submit the flag; a correct one ends the challenge, and only 3 wrong ones are allowed.

        Args:
            flag: the flag, e.g. "flag{0123456789abcdef01234567}"
        """
        if (refusal := self._refusal()) is not None:
            return refusal
        self.metrics["submissions"] += 1
        if hmac.compare_digest(flag.strip().encode(), self._flag.encode()):
            self.reward, self.success = 1.0, True
            self._finish()
            return "Correct: that is the flag. The challenge is solved."
        self.metrics["wrong_submissions"] += 1
        left = MAX_WRONG_SUBMISSIONS - self.metrics["wrong_submissions"]
        if left > 0:
            return f"Wrong flag. {left} submission{'s' if left > 1 else ''} left."
        self.reward, self.success = 0.0, False
        self._finish()
        return "Wrong flag. No submissions left: the challenge is over."

    def encrypt(self, plaintext: str, offset: int = 0) -> str:
        """Encrypt text with the cipher challenge's secret keystream from an offset; a few bytes per query.

        Args:
            plaintext: the text to encrypt (its UTF-8 bytes)
            offset: the position in the keystream of the first byte, from 0
        """
        if (refusal := self._refusal("encrypt", "cipher", "an encryption service")) is not None:
            return refusal
        data = plaintext.encode()
        if not data:
            return "Error: nothing to encrypt."
        if not 0 <= offset < len(self._keystream):
            return f"Error: offset must be between 0 and {len(self._keystream) - 1}, got {offset}."
        if self.metrics["oracle_queries"] >= MAX_ENCRYPT_QUERIES:
            return f"Error: the encryption service answers {MAX_ENCRYPT_QUERIES} queries per challenge; none left."
        self.metrics["oracle_queries"] += 1
        chunk = data[: min(self._block, len(self._keystream) - offset)]
        encrypted = bytes(a ^ b for a, b in zip(chunk, self._keystream[offset:], strict=False))
        cut = f" (only the first {len(chunk)} bytes were encrypted)" if len(chunk) < len(data) else ""
        return f"Encrypted bytes {offset} to {offset + len(chunk) - 1}{cut}: {encrypted.hex()}"

    def connect(self, data: str) -> str:
        """Send input to the service challenge's server; it feeds service.py the flag, then your data.

        Args:
            data: the input lines for the service, e.g. "list"
        """
        if (refusal := self._refusal("connect", "service", "a service to connect to")) is not None:
            return refusal
        if len(data) > MAX_DATA_CHARS:
            return f"Error: the data has {len(data)} characters; at most {MAX_DATA_CHARS} are accepted."
        if self.metrics["connections"] >= MAX_CONNECTIONS:
            return f"Error: the service accepts {MAX_CONNECTIONS} connections per challenge; none left."
        assert self._service is not None
        self.metrics["connections"] += 1
        result = self._service.run(["python3", "-I", "service.py"], stdin=f"{self._flag}\n{data}\n")
        return describe(result, SERVICE_LIMITS)

    def _refusal(self, tool: str = "", kind: str = "", what: str = "") -> str | None:
        """Why a tool call does nothing now: no episode, the episode is over, or the tool is not for this kind."""
        if not self.kind:
            return "Error: no challenge is running; reset() starts one."
        if self.done:
            return "The challenge is over; nothing was done."
        if kind and self.kind != kind:
            self.metrics["inapplicable_calls"] += 1
            return (f"Error: {tool} does not apply to this challenge: it is a '{self.kind}' challenge, and only "
                    f"'{kind}' challenges have {what}. Use run and submit_flag.")
        return None

    def _new_sandbox(self, limits: SandboxLimits) -> Sandbox:
        sandbox = Sandbox(limits)
        self._sandboxes.append(sandbox)
        return sandbox

    def _finish(self) -> None:
        self.done = True
        _cleanup(self._sandboxes)


def describe(result: SandboxResult, limits: SandboxLimits) -> str:
    """A command's output for the model: stdout then stderr, the middle cut when long, then the exit status."""
    text = result.stdout
    if result.stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
    if len(text) > OBSERVATION_HEAD + OBSERVATION_TAIL:
        cut = len(text) - OBSERVATION_HEAD - OBSERVATION_TAIL
        text = f"{text[:OBSERVATION_HEAD]}\n[... {cut} characters cut ...]\n{text[-OBSERVATION_TAIL:]}"
    status = f"exit code {result.exit_code}"
    if result.signal is not None:
        status += f", killed by {result.signal}"
    if result.timed_out:
        status += f", stopped at the {limits.wall_timeout_s:g} s time limit"
    if result.stdout_truncated or result.stderr_truncated:
        status += f", output beyond {limits.max_output_bytes} bytes dropped"
    return f"{text.rstrip()}\n[{status}]" if text.strip() else f"[{status}; no output]"


def tasks(split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Tasks of one split in a seeded order: 400 layouts per kind, each in one split only (by the hash of its id).

    A task names a kind and a layout seed only; the flag (and a cipher's key) is drawn anew in every ``reset``.
    """
    chosen = [{"task_id": f"ctf-{kind}-{number:03d}", "kind": kind, "seed": number}
              for kind in KINDS for number in range(TASKS_PER_KIND)]
    chosen = [task for task in chosen if split_of(task["task_id"]) == split]
    random.Random(seed).shuffle(chosen)
    yield from chosen


# ---------------------------------------------------------------------------------------------------------------
# The reference policy: it sees only the conversation (and the task's kind), like a model would.


@dataclass(frozen=True)
class Step:
    """One tool call of the conversation so far and what it returned."""

    tool: str
    arguments: dict[str, Any]
    result: str


Move = tuple[str, dict[str, Any]] | str | None  # a tool call, a flag to submit, or nothing left to try

HEX_RE = re.compile(r"\b[0-9a-f]{20,}\b")
ENCRYPTED_RE = re.compile(r"Encrypted bytes (\d+) to (\d+)[^:]*: ([0-9a-f]+)")


def peel(blob: str, max_layers: int = 6) -> str | None:
    """The flag under at most ``max_layers`` layers of encoding, searched breadth-first over the layer kinds."""
    frontier, seen = [blob], {blob}
    for _ in range(max_layers + 1):
        if found := next((text for text in frontier if FLAG_RE.fullmatch(text)), None):
            return found
        deeper = []
        for text in frontier:
            for layer in LAYERS:
                decoded = decode_layer(layer, text)
                if decoded is not None and decoded not in seen:
                    seen.add(decoded)
                    deeper.append(decoded)
        frontier = deeper
    return None


def solve_encoding(steps: list[Step]) -> Move:
    if not steps:
        return "run", {"command": "head -n 20 *"}
    return next((flag for word in steps[0].result.split() if len(word) >= 16 and (flag := peel(word))), None)


def solve_hidden(steps: list[Step]) -> Move:
    if not steps:
        return "run", {"command": "find . -type f"}
    if len(steps) == 1:
        hidden = [path for path in steps[0].result.splitlines() if path.startswith("./") and "/." in path]
        return ("run", {"command": "head -n 5 " + " ".join(hidden)}) if hidden else None
    found = FLAG_RE.search(steps[-1].result)
    return found.group() if found else None


def solve_cipher(steps: list[Step]) -> Move:
    """Keystream bytes come free where the flag's format is known, and from encrypting A's everywhere else."""
    if not steps:
        return "run", {"command": "cat ciphertext.hex"}
    line = HEX_RE.search(steps[0].result)
    if line is None:
        return None
    ciphertext = bytes.fromhex(line.group())
    known = {i: c ^ p for i, (c, p) in enumerate(zip(ciphertext, b"flag{", strict=False))}
    known[len(ciphertext) - 1] = ciphertext[-1] ^ ord("}")
    for step in steps[1:]:
        if step.tool == "encrypt" and (reply := ENCRYPTED_RE.search(step.result)):
            start, encrypted = int(reply.group(1)), bytes.fromhex(reply.group(3))
            plain = step.arguments["plaintext"].encode()[: len(encrypted)]
            known.update((start + i, c ^ p) for i, (c, p) in enumerate(zip(encrypted, plain, strict=True)))
    missing = [i for i in range(len(ciphertext)) if i not in known]
    if missing:
        return "encrypt", {"plaintext": "A" * (missing[-1] - missing[0] + 1), "offset": missing[0]}
    return bytes(c ^ known[i] for i, c in enumerate(ciphertext)).decode(errors="replace")


def exploit(source: str) -> str | None:
    """The input that makes a service program print the flag, worked out from its source."""
    read, notes = re.search(r'elif command == "(\w+)":', source), re.search(r"^NOTES = (\[.*\])$", source, re.M)
    if read and notes:  # index len(NOTES) passes the off-by-one check and lands on the flag
        return f"{read.group(1)} {len(ast.literal_eval(notes.group(1)))}"
    size, verb = re.search(r"^SIZE = (\d+)$", source, re.M), re.search(r'parts\[0\] != "(\w+)"', source)
    if size and verb:  # a length covering the whole memory echoes the secret half too
        return f"{verb.group(1)} {2 * int(size.group(1))} x"
    cookie, high = re.search(r'cookie = "(\w+)=\w+;\w+=" \+', source), re.search(r'\] == "(\w+)":', source)
    if cookie and high:  # a later field overrides the role the server set
        return f"x;{cookie.group(1)}={high.group(1)}"
    return None


def solve_service(steps: list[Step]) -> Move:
    if not steps:
        return "run", {"command": "cat service.py"}
    if len(steps) == 1:
        data = exploit(steps[0].result)
        return ("connect", {"data": data}) if data else None
    found = FLAG_RE.search(steps[-1].result)
    return found.group() if found else None


SOLVERS: dict[str, Callable[[list[Step]], Move]] = {
    "encoding": solve_encoding,
    "hidden": solve_hidden,
    "cipher": solve_cipher,
    "service": solve_service,
}


def steps_of(messages: list[dict[str, Any]]) -> list[Step]:
    calls = [call["function"] for m in messages if m["role"] == "assistant" for call in m.get("tool_calls") or []]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    return [Step(call["name"], call["arguments"], result) for call, result in zip(calls, results, strict=False)]


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: reads files with run, queries the challenge's service, decodes in Python, submits."""
    steps = steps_of(messages)
    move = None if steps and steps[-1].tool == "submit_flag" else SOLVERS[task["kind"]](steps)
    if move is None:
        return {"role": "assistant", "content": "I could not find the flag."}
    if isinstance(move, str):
        return tool_call_message("submit_flag", {"flag": move})
    return tool_call_message(*move)


SYSTEM_PROMPT = (
    "You solve a capture-the-flag challenge. Your working directory is in a Linux sandbox without network: run "
    "executes shell commands there (python3, base64, xxd, gzip and the usual tools are installed). Some challenges "
    "also offer a service, encrypt or connect; the first message says which. The flag looks like flag{...} with 24 "
    "lowercase hex digits inside the braces. Submit it with submit_flag: only that scores, and three wrong "
    "submissions end the challenge."
)

SPEC = EnvSpec(name="ctf", env_cls=CTF, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT)
