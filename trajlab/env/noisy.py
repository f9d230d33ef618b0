"""A noisy reference policy: an env's oracle that makes plausible wrong calls, for imperfect demonstrations.

Demonstrations from an optimal reference leave RL little to add once SFT has copied them; demonstrations with
mistakes in them are where RL has to beat SFT. :class:`NoisyReference` makes any env's oracle imperfect without
env code: in a share ``p`` of the situations it meets, it makes a plausible wrong call instead of its own.

- A *situation* is the conversation so far. Whether the reference errs in one, and how, is drawn from a hash of the
  seed and that conversation, so it errs the same way every time it meets the same situation, like a demonstrator
  with blind spots. (Noise drawn afresh per episode would not survive SFT: greedy decoding keeps the most frequent
  call of each situation, which stays the reference's own for any p below 1/2.) Where situations recur across tasks
  (the same hints in ``guess``), the mistakes are consistent and learnable; where every task's conversation is its
  own, they fall on a share ``p`` of the turns at random.
- The wrong call is derived from the env's tool schemas: one argument of the reference's call changed (an integer
  or number moved by 1 to 3, another value of an enum, a boolean flipped, two adjacent characters of a string
  swapped), or another of the env's tools with arguments of the right types, taken from the reference's call where
  the names match. After it, the reference goes on from what its mistake returned.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Callable
from typing import Any

Oracle = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]
ToolsOf = Callable[[dict[str, Any]], list[dict[str, Any]]]
"""``tools_of(task)``: the tool schemas of the env that runs ``task``."""


class NoisyReference:
    """A reference policy (``oracle(task, messages)``) that errs in a share ``noise`` of the situations it meets.

    Args:
        oracle: the env's reference policy.
        tools_of: the tool schemas offered for a task (the env's own; in a mixture, the task's env's).
        noise: the share of situations in which the reference errs, from 0 to 1.
        seed: which situations, and which mistakes: another seed gives other blind spots.
        name: the reference's own name; each trajectory records ``NAME+noiseP`` as its policy.
    """

    def __init__(self, oracle: Oracle, tools_of: ToolsOf, noise: float, *, seed: int, name: str = "oracle") -> None:
        if not 0 <= noise <= 1:
            raise ValueError(f"reference noise is a share of situations, from 0 to 1; got {noise}")
        self.oracle, self.tools_of, self.noise, self.seed = oracle, tools_of, noise, seed
        self.name = f"{name}+noise{noise:g}"

    def __call__(self, task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        return self._mistake(task, messages) or self.oracle(task, messages)

    def erred_turns(self, task: dict[str, Any], messages: list[dict[str, Any]]) -> list[int]:
        """The indexes of the assistant turns of a conversation this reference rolled out where it erred: the
        situations are replayed, so nothing is kept between calls."""
        turns, turn = [], 0
        for index, message in enumerate(messages):
            if message.get("role") == "assistant":
                if self._mistake(task, messages[:index]) is not None:
                    turns.append(turn)
                turn += 1
        return turns

    def _mistake(self, task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The wrong call this reference makes in a situation, or None where it makes the oracle's."""
        rng = random.Random(self._digest(messages))
        if rng.random() >= self.noise:
            return None
        # None where nothing plausible can be done instead (no call, or one tool without arguments)
        return wrong_call(self.oracle(task, messages), self.tools_of(task), rng)

    def _digest(self, messages: list[dict[str, Any]]) -> str:
        text = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(f"{self.seed}\x00{text}".encode()).hexdigest()


def wrong_call(message: dict[str, Any], tools: list[dict[str, Any]], rng: random.Random) -> dict[str, Any] | None:
    """``message`` with one of its tool calls replaced by a plausible wrong one (see the module doc), or None when
    it makes no call or no other call is possible."""
    calls = message.get("tool_calls") or []
    if not calls:
        return None
    index = rng.randrange(len(calls))
    call = calls[index]["function"]
    name, arguments = call["name"], dict(call.get("arguments") or {})
    schemas = {tool["function"]["name"]: tool["function"].get("parameters", {}) for tool in tools}
    options: list[tuple[str, dict[str, Any]]] = []
    for key, value in sorted(arguments.items()):
        changed = _changed(value, schemas.get(name, {}).get("properties", {}).get(key, {}), rng)
        if changed is not None:
            options.append((name, {**arguments, key: changed}))
    for other, parameters in sorted(schemas.items()):
        if other != name:
            options.append((other, _arguments_for(parameters, arguments, rng)))
    if not options:
        return None
    name, arguments = options[rng.randrange(len(options))]
    wrong = copy.deepcopy(message)
    wrong["tool_calls"][index]["function"] = {"name": name, "arguments": arguments}
    return wrong


def _changed(value: Any, schema: dict[str, Any], rng: random.Random) -> Any:
    """Another plausible value of an argument, or None when there is none."""
    if "enum" in schema:
        others = [choice for choice in schema["enum"] if choice != value]
        return rng.choice(others) if others else None
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + rng.choice((-3, -2, -1, 1, 2, 3))
    if isinstance(value, str) and len(set(value)) > 1:
        places = [i for i in range(len(value) - 1) if value[i] != value[i + 1]]
        i = rng.choice(places)
        return value[:i] + value[i + 1] + value[i] + value[i + 2:]
    return None


def _arguments_for(parameters: dict[str, Any], given: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Arguments of the right types for a tool's required parameters: the reference's value of the same name where it
    has one of that type, else a value of the reference's call of that type, else a small default."""
    properties = parameters.get("properties", {})
    arguments = {}
    for key in parameters.get("required", []):
        schema = properties.get(key, {})
        if "enum" in schema:
            arguments[key] = rng.choice(schema["enum"])
            continue
        kind = {"integer": int, "number": float, "boolean": bool, "string": str}.get(schema.get("type", ""), str)
        same = [value for value in given.values() if type(value) is kind]
        if type(given.get(key)) is kind:
            arguments[key] = given[key]
        elif same:
            arguments[key] = rng.choice(same)
        else:
            arguments[key] = {int: rng.randint(0, 9), float: float(rng.randint(0, 9)), bool: rng.random() < 0.5,
                              str: ""}[kind]
    return arguments
