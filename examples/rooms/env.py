"""A third env of one's own, written from docs/own-env.md after the default RL recipe was chosen: book a meeting room.

Why it is here: the default RL recipe (BENCHMARKS.md, issue 45) was chosen on ``arithmetic`` and
``examples/inventory``, and ``examples/tickets`` checked it on an env it was not chosen on. This one checks it on
another shape: what the calls copy are mostly words (a room's name and a time read from a tool result, a meeting's
title from the task), then one number, the booking's. Like tickets it has no per-call rewards, so RL learns from the
outcome alone.

``find_room(day, people)`` prints the room that is free that day for that many people and when,
``book(room, day, time, title)`` books it for the meeting and prints a booking number, ``invite(room, time,
booking)`` sends the invitation and ends the task. Success: the right room booked once for the right meeting, and
the invitation's three fields right.

Its first version (``git show f7b5960:examples/rooms/env.py``) booked without the title and ended with
``invite(title, room, time, code)``, a four-character code of capitals and digits: SFT on its noisy demonstrations
copied no code right and the title on a fifth of the tasks (0.000 held-out on seeds 0-2), so RL had nothing to start
from (BENCHMARKS.md).

Run it with ``PYTHONPATH=. trajlab run examples/rooms/config-noisy.yaml`` from the repository root.
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

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
TITLES = ("budget review", "team lunch", "design sync", "sales call", "hiring panel", "code review", "board prep",
          "sprint demo", "vendor pitch", "safety drill", "press brief", "audit kickoff", "launch plan",
          "client visit", "staff survey", "yearly review")
ROOMS = ("Cedar", "Maple", "Birch", "Aspen", "Rowan", "Hazel", "Alder", "Larch")
TIMES = ("09:00", "09:30", "10:00", "11:30", "13:00", "14:00", "15:30", "16:00")


def _number(*parts: object, low: int, high: int) -> int:
    """A number from ``low`` to ``high`` fixed by ``parts``: the same request always gets the same room, time and
    booking number."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return low + int.from_bytes(digest[:4], "big") % (high - low + 1)


class Rooms(Environment):
    """Book a meeting room for a meeting: find a free room, book it, send the invitation."""

    def reset(self, **task: Any) -> str:
        super().reset()  # reward 0, not done, no metrics
        self.title, self.day, self.people = task["title"], task["day"], int(task["people"])
        self.room = ROOMS[_number("room", self.day, self.people, low=0, high=len(ROOMS) - 1)]
        self.time = TIMES[_number("time", self.day, self.people, self.title, low=0, high=len(TIMES) - 1)]
        self.booking = _number("booking", *task.values(), low=1000, high=9999)
        self.booked: list[tuple[str, str, str, str]] = []
        return (f"Book a meeting room for the {self.title} on {self.day} for {self.people} people, then send the "
                f"invitation with the room, the time and the booking number.")

    def find_room(self, day: str, people: int) -> str:
        """Find the meeting room that is free on a day for a number of people, and when.

        Args:
            day: the day of the meeting, e.g. "Monday"
            people: how many people the room must hold
        """
        if (day, people) != (self.day, self.people):
            raise ValueError(f"no meeting is planned on {day!r} for {people} people")
        return f"Room {self.room} is free on {day} at {self.time} for up to {self.people + 2} people."

    def book(self, room: str, day: str, time: str, title: str) -> str:
        """Book a meeting room for a meeting.

        Args:
            room: the room's name
            day: the day, e.g. "Monday"
            time: the start time, e.g. "09:30"
            title: the meeting's title
        """
        if (room, day, time) != (self.room, self.day, self.time):
            raise ValueError(f"room {room!r} is not free on {day!r} at {time!r}")
        self.booked.append((room, day, time, title))
        return f"Booked {room} on {day} at {time} for the {title}: booking number {self.booking}."

    def invite(self, room: str, time: str, booking: int) -> str:
        """Send the meeting's invitation; ends the task.

        Args:
            room: the booked room's name
            time: the start time
            booking: the booking number
        """
        self.done = True
        self.success = (self.booked == [(self.room, self.day, self.time, self.title)]
                        and (room, time, booking) == (self.room, self.time, self.booking))
        self.reward = 1.0 if self.success else 0.0
        return "Invitation sent." if self.success else "That invitation does not match the booking."


def tasks(split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Every (title, day, people 2-21), a fifth of them held out as ``test``, in a seeded order."""
    chosen = []
    for title, day, people in itertools.product(TITLES, DAYS, range(2, 22)):
        task_id = f"rooms-{title.replace(' ', '-')}-{day}-{people}"
        held_out = hashlib.sha256(task_id.encode()).digest()[0] % 5 == 0  # by content: never both splits
        if held_out == (split == "test"):
            chosen.append({"task_id": task_id, "title": title, "day": day, "people": people})
    random.Random(seed).shuffle(chosen)
    yield from chosen


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: find the room, book it as found for the meeting, invite with what the booking printed."""
    results = [m["content"] for m in messages if m["role"] == "tool"]
    found = next((match for result in results if (match := re.search(r"Room (\w+) is free on \w+ at ([\d:]+)",
                                                                       result))), None)
    if found is None:
        return tool_call_message("find_room", {"day": task["day"], "people": task["people"]})
    room, time = found.groups()
    booked = re.search(r"booking number (\d+)\.", results[-1])
    if booked is None:
        return tool_call_message("book", {"room": room, "day": task["day"], "time": time, "title": task["title"]})
    return tool_call_message("invite", {"room": room, "time": time, "booking": int(booked.group(1))})


SYSTEM_PROMPT = "You book meeting rooms with the find_room, book and invite tools. Call one tool at a time."

# Three calls solve a task; one more turn leaves room for a mistake. The reference's episodes: up to about 540 tokens
# (700 when it errs); its longest call, book's, about 60.
SPEC = EnvSpec(name="rooms", env_cls=Rooms, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=4, max_episode_tokens=768, max_new_tokens=80))
