"""A second env of one's own, written from docs/own-env.md after the default RL recipe was chosen: buy train tickets.

Why it is here: the default RL recipe (BENCHMARKS.md, issue 45) was chosen on ``arithmetic`` and
``examples/inventory``; this env was written afterwards, as a newcomer would write one, to see the recipe on an env
it was not chosen on. Unlike inventory it has no per-call rewards (``turn_rewards``), so the default's ``progress``
reward is the final reward again, on the last turn, and RL learns from the outcome alone; its calls copy words as
well as numbers.

``find_route(origin, destination)`` prints the route's number and fares, ``buy(route, adults, children)`` buys the
tickets and prints the total and a booking number, ``confirm(booking, total)`` ends the task. Success: the task's
tickets bought once on the right route, and the booking and total confirmed as ``buy`` printed them.

Run it with ``PYTHONPATH=. trajlab run examples/tickets/config-noisy.yaml`` from the repository root.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Iterator
from typing import Any

from trajlab import Environment, EnvSpec
from trajlab.env import tool_call_message
from trajlab.env.limits import EpisodeLimits

CITIES = ("Leeds", "York", "Bath", "Derby", "Hull", "Ely", "Wells", "Truro", "Perth", "Oban")


def _number(*parts: object, low: int, high: int) -> int:
    """A number from ``low`` to ``high`` fixed by ``parts``: the same route always has the same number and fares."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return low + int.from_bytes(digest[:4], "big") % (high - low + 1)


class Tickets(Environment):
    """Buy train tickets for a party: find the route, buy the tickets, confirm the booking."""

    def reset(self, **task: Any) -> str:
        super().reset()  # reward 0, not done, no metrics
        self.origin, self.destination = task["origin"], task["destination"]
        self.adults, self.children = int(task["adults"]), int(task["children"])
        self.route = _number(self.origin, self.destination, low=10, high=99)
        self.adult_fare = _number("adult", self.route, low=5, high=30)
        self.child_fare = _number("child", self.route, low=2, high=self.adult_fare - 1)
        self.bought: list[tuple[int, int]] = []
        self.booking = _number("booking", *task.values(), low=1000, high=9999)
        return (f"Buy train tickets from {self.origin} to {self.destination} for {self.adults} adults and "
                f"{self.children} children, then confirm the booking and the total paid.")

    def find_route(self, origin: str, destination: str) -> str:
        """Find the train route between two cities and its fares.

        Args:
            origin: the city the party leaves from, e.g. "Leeds"
            destination: the city the party travels to
        """
        if (origin, destination) != (self.origin, self.destination):
            raise ValueError(f"no route is planned from {origin!r} to {destination!r} for this party")
        return (f"Route {self.route} runs from {origin} to {destination}: {self.adult_fare} pounds an adult, "
                f"{self.child_fare} a child.")

    def buy(self, route: int, adults: int, children: int) -> str:
        """Buy tickets on a route.

        Args:
            route: the route's number
            adults: how many adult tickets
            children: how many child tickets
        """
        if route != self.route:
            raise ValueError(f"route {route} does not run from {self.origin} to {self.destination}")
        if adults < 0 or children < 0 or adults + children == 0:
            raise ValueError("buy at least one ticket, and no negative numbers")
        self.bought.append((adults, children))
        total = adults * self.adult_fare + children * self.child_fare
        return f"Bought {adults} adult and {children} child tickets: {total} pounds in all, booking {self.booking}."

    def confirm(self, booking: int, total: int) -> str:
        """Confirm the booking and the total paid; ends the task.

        Args:
            booking: the booking number
            total: the total paid, in pounds
        """
        self.done = True
        paid = sum(a * self.adult_fare + c * self.child_fare for a, c in self.bought)
        self.success = (self.bought == [(self.adults, self.children)] and booking == self.booking
                        and total == paid)
        self.reward = 1.0 if self.success else 0.0
        return "Have a good journey." if self.success else "That does not match what this party needed."


def tasks(split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Every (origin, destination, adults 1-4, children 0-3), a fifth of them held out as ``test``, seeded order."""
    chosen = []
    for (origin, destination), adults, children in itertools.product(itertools.permutations(CITIES, 2), range(1, 5),
                                                                     range(4)):
        task_id = f"tickets-{origin}-{destination}-{adults}-{children}"
        held_out = hashlib.sha256(task_id.encode()).digest()[0] % 5 == 0  # by content: never both splits
        if held_out == (split == "test"):
            chosen.append({"task_id": task_id, "origin": origin, "destination": destination, "adults": adults,
                           "children": children})
    random.Random(seed).shuffle(chosen)
    yield from chosen


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: find the route, buy the party's tickets on it, confirm what the purchase printed."""
    results = [m["content"] for m in messages if m["role"] == "tool"]
    route = next((found for result in results if (found := re.search(r"Route (\d+)", result))), None)
    if route is None:
        return tool_call_message("find_route", {"origin": task["origin"], "destination": task["destination"]})
    bought = re.search(r"(\d+) pounds in all, booking (\d+)", results[-1])
    if bought is None:
        return tool_call_message("buy", {"route": int(route.group(1)), "adults": task["adults"],
                                         "children": task["children"]})
    return tool_call_message("confirm", {"booking": int(bought.group(2)), "total": int(bought.group(1))})


SYSTEM_PROMPT = "You buy train tickets with the find_route, buy and confirm tools. Call one tool at a time."

# Three calls solve a task; one more turn leaves room for a mistake. The reference's episodes: up to about 550 tokens.
SPEC = EnvSpec(name="tickets", env_cls=Tickets, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=4, max_episode_tokens=640, max_new_tokens=48))
