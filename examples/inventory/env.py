"""An env written outside trajlab, as a new user would: look up a quantity, act on it, report the result.

A shop assistant restocks one shelf: ``lookup(item)`` says how many units are on the shelf and how many are
missing, ``order(item, quantity)`` brings the missing units, ``report(units)`` says how many the shelf now holds
and ends the episode. Every number the model needs is printed by a tool, so a few-million-parameter model learns
it on a CPU by copying numbers into the right calls.

Run it with ``trajlab run examples/inventory/config.yaml`` from the repository root (the README's "Your own env, end
to end" walks through it).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from typing import Any

from trajlab import Environment, EnvSpec
from trajlab.env import tool_call_message
from trajlab.env.limits import EpisodeLimits

ITEMS = ("apples", "pears", "plums", "lemons", "limes", "onions", "leeks", "carrots", "beans", "rice", "flour", "tea")


class Inventory(Environment):
    """Restock a shop shelf: look up its stock, order what is missing, report what it holds."""

    def reset(self, **task: Any) -> str:
        super().reset()  # reward 0, not done, no metrics
        self.item, self.target = task["item"], int(task["target"])
        self.shelf = int(task["stock"])
        self.looked_up = False
        self.turn_rewards = []  # optional: one reward per call, for RL's per-turn credit (the `progress` reward)
        self.metrics = {"ordered": 0}
        return (f"Restock the {self.item} shelf to {self.target} units: look up its stock, order what is missing, "
                "then report how many units the shelf holds.")

    def lookup(self, item: str) -> str:
        """Look up how many units of an item are on the shelf and how many are missing.

        Args:
            item: the item's name, e.g. "apples"
        """
        self._check(item)
        missing = self.target - self.shelf
        # a step toward the goal pays once: a reward that a repeated call earns again is what RL learns to farm
        # (BENCHMARKS.md: four lookups and nothing else, from imperfect demonstrations)
        self.turn_rewards.append(0.0 if self.looked_up else 1 / 3)
        self.looked_up = True
        return f"{self.shelf} {item} on the shelf, {missing} short of {self.target}."

    def order(self, item: str, quantity: int) -> str:
        """Order units of an item; they go on the shelf at once.

        Args:
            item: the item's name
            quantity: how many units to order
        """
        self._check(item)
        if quantity < 1:
            raise ValueError("quantity must be at least 1")
        self.shelf += quantity
        self.metrics["ordered"] += quantity
        self.turn_rewards.append(1 / 3 if self.shelf == self.target else 0.0)
        return f"Ordered {quantity} {item}; the shelf holds {self.shelf}."

    def report(self, units: int) -> str:
        """Report how many units the shelf holds now; ends the task.

        Args:
            units: the units on the shelf
        """
        self.done = True
        self.success = self.shelf == self.target and units == self.shelf
        self.reward = 1.0 if self.success else 0.0
        self.turn_rewards.append(1 / 3 if self.success else 0.0)
        return "Thank you." if self.success else f"That is not right: the shelf holds {self.shelf} of {self.target}."

    def _check(self, item: str) -> None:
        # A tool that raises gives the model an error observation; the episode goes on.
        if item != self.item:
            raise ValueError(f"this task restocks {self.item}, not {item!r}")


def tasks(split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Every (item, stock, target) with targets 5 to 20, a fifth of them held out as ``test``, in a seeded order."""
    chosen = []
    for item in ITEMS:
        for target in range(5, 21):
            for stock in range(target):
                task_id = f"inventory-{item}-{stock}-{target}"
                held_out = hashlib.sha256(task_id.encode()).digest()[0] % 5 == 0  # by content: never both splits
                if held_out == (split == "test"):
                    chosen.append({"task_id": task_id, "item": item, "stock": stock, "target": target})
    random.Random(seed).shuffle(chosen)
    yield from chosen


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: look up, order the shortfall the lookup printed, report what the order said the shelf holds."""
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if not results or not (short := re.search(r"(\d+) short", results[0])):
        return tool_call_message("lookup", {"item": task["item"]})
    if len(results) == 1:
        return tool_call_message("order", {"item": task["item"], "quantity": int(short.group(1))})
    holds = re.search(r"holds (\d+)", results[-1])
    return tool_call_message("report", {"units": int(holds.group(1)) if holds else task["target"]})


SYSTEM_PROMPT = "You restock a shop with the lookup, order and report tools. Call one tool at a time."

# Three calls solve a task; one more turn leaves room for a mistake.
SPEC = EnvSpec(name="inventory", env_cls=Inventory, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=4, max_episode_tokens=512, max_new_tokens=48))
