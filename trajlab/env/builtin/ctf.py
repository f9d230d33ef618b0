"""CTF: capture a flag with shell commands run in a sandbox, plus the services some challenges offer.

Why: a many-turn task where every step depends on what the last command printed, and where the reward cannot be
talked into existence. Each episode gets a fresh random flag ``flag{<24 hex digits>}``, made in ``reset`` (never
stored in the task, never derived from its seed), and a fresh :class:`~trajlab.sandbox.Sandbox` (new, or an earlier
episode's wiped by :mod:`trajlab.sandbox.pool`): the model's commands
run only there, under bubblewrap (its own namespaces, no network, a read-only system), as an unprivileged uid of
their own, under time, memory, file-size and process limits. Where that isolation is missing, the env refuses to
start and says what to install, unless the user opts out: ``TRAJLAB_SANDBOX_ALLOW_WEAK=memory_cap`` names what
it may run without (``1`` allows everything; see the sandbox page), and a warning names it at every start.
Four kinds of challenge, each seeded by the task:

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
with 0. Nothing a command or tool prints counts. The sandboxes are given back (wiped) when the episode ends, in
``close`` (which trajlab's engine calls after every episode), when ``reset`` starts the next one, and, for runners
that never call ``close`` (TRL), when the env is garbage-collected.
"""

from __future__ import annotations

import hmac
import random
import weakref
from collections.abc import Iterator
from functools import cache
from typing import Any

from trajlab.env.base import Environment
from trajlab.env.builtin._split import split_of
from trajlab.env.builtin.ctf_challenges import KINDS, MAX_ENCRYPT_QUERIES, SAMPLE_FLAG, challenge, new_flag
from trajlab.env.builtin.ctf_oracle import oracle
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec, Knob
from trajlab.sandbox import Sandbox, SandboxLimits, SandboxResult, require_strong_isolation
from trajlab.sandbox.pool import shared_pool

TASKS_PER_KIND = 400
MAX_WRONG_SUBMISSIONS = 3
MIN_LAYERS, MAX_LAYERS = 3, 5  # an encoding challenge's layers, fixed by its layout seed

# The model's commands: generous enough for python3 and pipelines, small enough that a fork bomb or a busy loop
# ends within the episode's 10 s tool timeout (LIMITS). Where the sandbox has a disk quota, it is a tmpfs
# (memory) that also serves as the command's /tmp: a challenge needs a few kilobytes and a few files.
COMMAND_LIMITS = SandboxLimits(cpu_seconds=5, memory_bytes=512 << 20, file_size_bytes=16 << 20, max_processes=64,
                               open_files=256, wall_timeout_s=8.0, max_output_bytes=64 << 10, disk_bytes=32 << 20,
                               inodes=4096, total_memory_bytes=1 << 30)
SERVICE_LIMITS = SandboxLimits(cpu_seconds=2, memory_bytes=256 << 20, file_size_bytes=1 << 20, max_processes=8,
                               open_files=64, wall_timeout_s=5.0, max_output_bytes=16 << 10, disk_bytes=2 << 20,
                               inodes=256, total_memory_bytes=512 << 20)
MAX_COMMAND_CHARS = 8000
MAX_DATA_CHARS = 4000
OBSERVATION_HEAD, OBSERVATION_TAIL = 2000, 500  # characters of output kept before and after a cut
MAX_CONNECTIONS = 20


def _cleanup(sandboxes: list[Sandbox]) -> None:
    """Give an episode's sandboxes back to their pools, which wipe them for the next episode (or remove them); also the
    env's weakref finalizer (for runners that never call ``close``), so it must not hold the env."""
    while sandboxes:
        sandbox = sandboxes.pop()
        shared_pool(sandbox.limits).release(sandbox)


class CTF(Environment):
    """Capture the flag: explore a sandbox with shell commands, break the challenge, submit flag{...}."""

    def __init__(self, allow_weak_sandbox: bool | None = None) -> None:
        """Refuse to start where the sandbox would be weaker than this machine should give (bubblewrap or an aggregate
        memory cap missing, or as root no private uid or disk quota), unless ``allow_weak_sandbox`` (default: the
        ``TRAJLAB_SANDBOX_ALLOW_WEAK`` setting, ``1`` or the missing protections' names) says to run anyway."""
        require_strong_isolation("the ctf env", allow_weak=allow_weak_sandbox)
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

    def close(self) -> None:
        """Remove this episode's sandboxes (their processes and files)."""
        _cleanup(self._sandboxes)
        self._sandbox = self._service = None

    def _new_sandbox(self, limits: SandboxLimits) -> Sandbox:
        sandbox = shared_pool(limits).acquire()
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


def tasks(split: str, seed: int, min_layers: int = MIN_LAYERS, max_layers: int = MAX_LAYERS
          ) -> Iterator[dict[str, Any]]:
    """Tasks of one split in a seeded order: 400 layouts per kind, each in one split only (by the hash of its id).

    A task names a kind and a layout seed only; the flag (and a cipher's key) is drawn anew in every ``reset``.
    ``min_layers`` and ``max_layers`` keep the encoding challenges with that many layers (the other kinds have none).
    """
    chosen = [{"task_id": f"ctf-{kind}-{number:03d}", "kind": kind, "seed": number}
              for kind in KINDS for number in range(TASKS_PER_KIND)]
    chosen = [task for task in chosen if split_of(task["task_id"]) == split and (
        task["kind"] != "encoding" or min_layers <= encoding_layers(task["seed"]) <= max_layers)]
    random.Random(seed).shuffle(chosen)
    yield from chosen


def task_problems(task: dict[str, Any]) -> list[str]:
    """A given task's kind must be a challenge kind: any other fails every episode at ``reset``."""
    if task.get("kind") in KINDS:
        return []
    return [f"field 'kind' is {task.get('kind')!r}, not one of {', '.join(map(repr, KINDS))}"]


@cache
def encoding_layers(seed: int) -> int:
    """How many layers of encoding the encoding challenge of a layout seed has (its layout does not depend on the
    flag)."""
    return len(challenge("encoding", seed, SAMPLE_FLAG).facts["chain"])


SYSTEM_PROMPT = (
    "You solve a capture-the-flag challenge. Your working directory is in a Linux sandbox without network: run "
    "executes shell commands there (python3, base64, xxd, gzip and the usual tools are installed). Some challenges "
    "also offer a service, encrypt or connect; the first message says which. The flag looks like flag{...} with 24 "
    "lowercase hex digits inside the braces. Submit it with submit_flag: only that scores, and three wrong "
    "submissions end the challenge."
)

# What the reference policy needs, over all 1600 tasks with the tiny tokenizer: 6 turns (cipher: cat, four encrypt
# queries, submit), 1411 tokens, 101 new tokens in one turn (hidden: a command listing every hidden file), tool calls
# under 0.2 s. About twice that, so a model may explore and submit wrongly; the tokens also leave room for one
# observation cut at its longest (2500 characters). The tool timeout stays above COMMAND_LIMITS' 8 s wall limit, so
# the sandbox stops a command (and says so) before the engine gives up on the call.
LIMITS = EpisodeLimits(max_turns=12, max_episode_tokens=4096, max_new_tokens=256, tool_timeout_s=10.0)

# Every layer of an encoding challenge is one more command to find and run on the last one's output.
KNOBS = (
    Knob("min_layers", MIN_LAYERS, "fewest layers of an encoding challenge", MIN_LAYERS, MAX_LAYERS),
    Knob("max_layers", MAX_LAYERS, "most layers of an encoding challenge", MIN_LAYERS, MAX_LAYERS),
)

SPEC = EnvSpec(name="ctf", env_cls=CTF, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT, limits=LIMITS,
               knobs=KNOBS, check_task=task_problems)
