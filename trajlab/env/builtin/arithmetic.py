"""Two-step arithmetic with calculator tools: the first env a tiny model can learn.

The question ``Compute (a op b) op c.`` is solved by calling the first operation's tool, feeding its result to the
second, and submitting the final number. It needs real multi-turn tool use (a result read back from a tool), yet a
few-million-parameter model can learn it on a CPU because every step is copying numbers into the right slots.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
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
        """Per-call reward: 1/3 for each call that is the next step of the reference solution."""
        correct = self.solved_steps < len(self.plan) and self.plan[self.solved_steps] == (name, arguments)
        self.solved_steps += correct
        self.turn_rewards.append(1 / len(self.plan) if correct else 0.0)
        self.metrics["progress"] = self.solved_steps / len(self.plan)


APPLY = {"add": lambda x, y: x + y, "subtract": lambda x, y: x - y, "multiply": lambda x, y: x * y}


def make_task(a: int, b: int, c: int, first: str, second: str) -> dict[str, Any]:
    answer = APPLY[second](APPLY[first](a, b), c)
    question = f"Compute ({a} {SYMBOLS[first]} {b}) {SYMBOLS[second]} {c}."
    return {"question": question, "a": a, "b": b, "c": c, "ops": [first, second], "answer": answer}


def tasks(split: str, seed: int = 0, min_operand: int = MIN_OPERAND,
          max_operand: int = MAX_OPERAND) -> Iterator[dict[str, Any]]:
    """Tasks of one split, without repeats, operands drawn from ``min_operand`` to ``max_operand``; membership
    depends on the task only, never on the seed or the operand range (a task is in the same split at any range that
    holds it)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    total = (max_operand - min_operand + 1) ** 3 * len(SYMBOLS) ** 2
    while len(seen) < total:
        a, b, c = (rng.randint(min_operand, max_operand) for _ in range(3))
        first, second = rng.choice(list(SYMBOLS)), rng.choice(list(SYMBOLS))
        task = make_task(a, b, c, first, second)
        key = task["question"]
        if key in seen:
            continue
        seen.add(key)
        if split_of(key) == split:
            yield {"task_id": f"arithmetic-{a}-{first}-{b}-{second}-{c}", **task}


def solution(task: dict[str, Any]) -> list[tuple[str, dict[str, int]]]:
    """The reference sequence of calls for a task."""
    first, second = task["ops"]
    intermediate = APPLY[first](task["a"], task["b"])
    return [
        (first, {"a": task["a"], "b": task["b"]}),
        (second, {"a": intermediate, "b": task["c"]}),
        ("submit", {"answer": APPLY[second](intermediate, task["c"])}),
    ]


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: reads tool results from the conversation and makes the next call."""
    results = [m["content"] for m in messages if m["role"] == "tool"]
    first, second = task["ops"]
    if not results:
        call = (first, {"a": task["a"], "b": task["b"]})
    elif len(results) == 1:
        call = (second, {"a": int(results[0]), "b": task["c"]})
    else:
        call = ("submit", {"answer": int(results[-1])})
    return tool_call_message(*call)


SYSTEM_PROMPT = (
    "You solve arithmetic with the calculator tools. Call one tool at a time, use each result in the next call, "
    "then submit the final value."
)

# Larger operands are harder for a small model: more digits to copy from the question and tool results into calls.
KNOBS = (
    Knob("min_operand", MIN_OPERAND, "smallest operand", 1, 99),
    Knob("max_operand", MAX_OPERAND, "largest operand", 1, 99),
)

# Three tool calls solve a task; the other turns are room for a mistake or two.
SPEC = EnvSpec(name="arithmetic", env_cls=Arithmetic, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=6, max_episode_tokens=1024, max_new_tokens=128), knobs=KNOBS)
