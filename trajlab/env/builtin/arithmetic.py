"""Two-step arithmetic with calculator tools: the first env a tiny model can learn.

The question ``Compute (a op b) op c.`` is solved by calling the first operation's tool, feeding its result to the
second, and submitting the final number (the ``operations`` knob makes the chain shorter or longer: a horizon). It
needs real multi-turn tool use (a result read back from a tool), yet a few-million-parameter model can learn it on a
CPU because every step is copying numbers into the right slots.

Besides its own reference policy it has an imperfect one, ``sign_slip`` (``collect.reference: sign_slip``): it
drops the minus sign of a negative product on three tasks in four, so its demonstrations teach a slip the reward
sees (the quickstart trains on them, failures included, and RL learns to keep the sign).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from trajlab.env.base import Environment, tool_call_message
from trajlab.env.builtin._split import split_of
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec, Knob

SYMBOLS = {"add": "+", "subtract": "-", "multiply": "*"}
MIN_OPERAND, MAX_OPERAND = 1, 9


class Arithmetic(Environment):
    """Compute a two-step arithmetic expression with calculator tools, then submit the result."""

    def reset(self, **task: Any) -> str:
        super().reset()
        self.plan = solution(task)
        self.answer = int(task["answer"])
        self.solved_steps = 0
        self.turn_rewards = []
        self.metrics = {"tool_calls": 0, "progress": 0.0}
        return task["question"]

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return self._calculate("add", a, b, a + b)

    def subtract(self, a: int, b: int) -> str:
        """Subtract b from a.

        Args:
            a: the integer to subtract from
            b: the integer to subtract
        """
        return self._calculate("subtract", a, b, a - b)

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return self._calculate("multiply", a, b, a * b)

    def submit(self, answer: int) -> str:
        """Submit the final answer; ends the episode.

        Args:
            answer: the value of the whole expression
        """
        self._score_step("submit", {"answer": answer})
        self.done = True
        self.success = answer == self.answer
        self.reward = 1.0 if self.success else 0.0
        return "Correct." if self.success else "Wrong."

    def _calculate(self, name: str, a: int, b: int, value: int) -> str:
        self.metrics["tool_calls"] += 1
        self._score_step(name, {"a": a, "b": b})
        return str(value)

    def _score_step(self, name: str, arguments: dict[str, int]) -> None:
        """Per-call reward: 1/(calls in the solution) for each call that is the next step of the reference solution."""
        correct = self.solved_steps < len(self.plan) and self.plan[self.solved_steps] == (name, arguments)
        self.solved_steps += correct
        self.turn_rewards.append(1 / len(self.plan) if correct else 0.0)
        self.metrics["progress"] = self.solved_steps / len(self.plan)


APPLY = {"add": lambda x, y: x + y, "subtract": lambda x, y: x - y, "multiply": lambda x, y: x * y}
OPERAND_KEYS = "abcdef"  # a task's operands, in order: the fields a, b, c, ... of its dict
MIN_OPERATIONS, MAX_OPERATIONS = 1, len(OPERAND_KEYS) - 1


def make_task(operands: Sequence[int], ops: Sequence[str]) -> dict[str, Any]:
    """The task applying ``ops`` left to right: ``(a op b) op c`` and so on, one operand more than operations."""
    expression, answer = str(operands[0]), operands[0]
    for position, (op, operand) in enumerate(zip(ops, operands[1:], strict=True)):
        expression = f"({expression})" if position else expression
        expression, answer = f"{expression} {SYMBOLS[op]} {operand}", APPLY[op](answer, operand)
    return {"question": f"Compute {expression}.", **dict(zip(OPERAND_KEYS, operands, strict=False)), "ops": list(ops),
            "answer": answer}


def operands_of(task: dict[str, Any]) -> list[int]:
    return [task[key] for key in OPERAND_KEYS[:len(task["ops"]) + 1]]


def tasks(split: str, seed: int, min_operand: int = MIN_OPERAND, max_operand: int = MAX_OPERAND,
          operations: int = 2) -> Iterator[dict[str, Any]]:
    """Tasks of one split, without repeats, ``operations`` operations on operands drawn from ``min_operand`` to
    ``max_operand``; membership depends on the task only, never on the seed or the knobs (a task is in the same split
    at any setting that holds it)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    total = (max_operand - min_operand + 1) ** (operations + 1) * len(SYMBOLS) ** operations
    while len(seen) < total:
        operands = [rng.randint(min_operand, max_operand) for _ in range(operations + 1)]
        ops = [rng.choice(list(SYMBOLS)) for _ in range(operations)]
        task = make_task(operands, ops)
        key = task["question"]
        if key in seen:
            continue
        seen.add(key)
        if split_of(key) == split:
            steps = [str(x) for pair in zip(operands, ops, strict=False) for x in pair] + [str(operands[-1])]
            yield {"task_id": "arithmetic-" + "-".join(steps), **task}


def solution(task: dict[str, Any]) -> list[tuple[str, dict[str, int]]]:
    """The reference sequence of calls for a task."""
    first, *rest = operands_of(task)
    calls, value = [], first
    for op, operand in zip(task["ops"], rest, strict=True):
        calls.append((op, {"a": value, "b": operand}))
        value = APPLY[op](value, operand)
    return [*calls, ("submit", {"answer": value})]


def task_problems(task: dict[str, Any]) -> list[str]:
    """A given task's operations must be calculator tools, each with its operand: anything else fails every episode
    at ``reset`` (a KeyError naming only the missing key)."""
    ops = task["ops"]  # a list: checked against the generator's tasks first
    unknown = [op for op in ops if not isinstance(op, str) or op not in SYMBOLS]
    if unknown:
        return [f"field 'ops' holds {', '.join(map(repr, unknown))}, not one of {', '.join(map(repr, SYMBOLS))}"]
    if not MIN_OPERATIONS <= len(ops) <= MAX_OPERATIONS:
        return [f"field 'ops' holds {len(ops)} operations, not {MIN_OPERATIONS} to {MAX_OPERATIONS}"]
    missing = [key for key in OPERAND_KEYS[:len(ops) + 1] if not isinstance(task.get(key), int)]
    return [f"{len(ops)} operations need operand field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
            "(an integer)"] if missing else []


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: reads tool results from the conversation and makes the next call; after as many results
    as operations (more, when a noisy reference's mistake called a tool instead of submitting) it submits the last."""
    results = [m["content"] for m in messages if m["role"] == "tool"]
    operands, ops = operands_of(task), task["ops"]
    step = len(results)
    if step >= len(ops):
        return tool_call_message("submit", {"answer": int(results[-1])})
    left = operands[0] if step == 0 else int(results[-1])
    return tool_call_message(ops[step], {"a": left, "b": operands[step + 1]})


SIGN_SLIP_SHARE = 0.75  # of the tasks that end in a negative product, the share sign_slip demonstrates wrongly


def sign_slip_oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """An imperfect reference policy that usually drops the minus sign of a negative product: when the expression
    ends in a multiplication with a negative result, it submits the result without its sign on a share
    ``SIGN_SLIP_SHARE`` of those tasks (which ones depends on the question only, so a task is demonstrated the same
    way every time); otherwise it acts as :func:`oracle` does. So it fails most tasks ``(a - b) * c`` with ``a < b``
    and solves the rest."""
    return oracle_dropping_sign(task, messages, slips(task["question"]))


def oracle_dropping_sign(task: dict[str, Any], messages: list[dict[str, Any]], slipped: bool) -> dict[str, Any]:
    """:func:`oracle`'s move, except that where ``slipped`` a final product is submitted without its sign: the move
    of every sign-slip demonstrator, whichever tasks it slips on."""
    call = oracle(task, messages)
    function = call["tool_calls"][0]["function"]
    if slipped and function["name"] == "submit" and task["ops"][-1] == "multiply":
        return tool_call_message("submit", {"answer": abs(function["arguments"]["answer"])})
    return call


def slips(question: str, share: float = SIGN_SLIP_SHARE) -> bool:
    """Whether the sign-slip reference drops the sign on this question: a fixed hash, the same in every run, that
    picks a share ``share`` of all questions."""
    return zlib.crc32(question.encode()) % 1000 < share * 1000


SYSTEM_PROMPT = (
    "You solve arithmetic with the calculator tools. Call one tool at a time, use each result in the next call, "
    "then submit the final value."
)

# Larger operands are harder for a small model: more digits to copy from the question and tool results into calls.
KNOBS = (
    Knob("min_operand", MIN_OPERAND, "smallest operand", 1, 99),
    Knob("max_operand", MAX_OPERAND, "largest operand", 1, 99),
    Knob("operations", 2, "operations in the expression, each one tool call before the submit (a longer horizon)",
         MIN_OPERATIONS, MAX_OPERATIONS),
)

# Three tool calls solve a task at the default two operations; the other turns are room for a mistake or two. More
# operations need more turns: raise rollout.max_turns (a curriculum stage sets its own).
SPEC = EnvSpec(name="arithmetic", env_cls=Arithmetic, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=6, max_episode_tokens=1024, max_new_tokens=128), knobs=KNOBS,
               references={"sign_slip": sign_slip_oracle}, check_task=task_problems)
