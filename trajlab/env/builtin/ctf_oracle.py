"""The CTF reference policy: it sees only the conversation (and the task's kind), like a model would.

Why apart from the env: it is a client of the env's tools, never of its state; it reads files with ``run``, queries
the challenge's service, decodes in Python and submits, which proves every kind solvable through the rollout engine.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trajlab.env.base import tool_call_message
from trajlab.env.builtin.ctf_challenges import FLAG_RE, LAYERS, decode_layer


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
