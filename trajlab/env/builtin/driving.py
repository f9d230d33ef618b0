"""Driving: a car heading toward pedestrians must brake or change lanes in time, and every decision costs time.

Why: the right action depends on numbers read from an observation (speed, distances, which lanes are free), and
the reward comes from a simulated outcome, a collision or a safety margin, not from matching a reference answer.

The model is deterministic one-dimensional kinematics; units are metres, seconds and m/s. The road is straight,
with 2 or 3 lanes numbered from 1 (leftmost). The car keeps its speed until it brakes. Pedestrians and parked cars
stand still at points ahead, one per lane; the car hits one when its front reaches that point in a lane it occupies.

- Every tool call first lets the car drive on for 0.5 s at its speed: deciding, observing included, takes time.
- ``emergency_stop()`` then brakes at 7 m/s^2 to a standstill, ``v^2 / 14`` m further. It ends the episode.
- ``lane_change(direction)`` then moves one lane over: the car straddles both lanes for 0.75 s (anything in either
  lane is hit), then is in the new lane. If that lane is clear ahead, the car drives past and the episode ends.
- After 6 tool calls without an ending, the car drives on in its lane.

Braking distance grows with ``v^2`` and swerving distance with ``v``: at the tasks' 16-30 m/s, a pedestrian
1.4-2.8 s ahead is often too close to stop for yet can be swerved around when a lane next to the car is free, and
some tasks have no free lane. Reward: 0 for any collision; a safe ending earns 0.5 plus up to 0.5 for the closest
approach to anything ahead in a lane the car occupied (full at 10 m or more).

Reference policies: the env's own observes, then takes the action with the largest predicted margin. The
``overconfident`` one (``collect.reference: overconfident``) believes the car brakes at 9 m/s^2: it brakes whenever
that belief leaves a metre, and otherwise acts as the env's own. On about a fifth of the tasks its stop is too late
where a lane change would have worked, so its successful demonstrations never show a swerve in that band; RL, whose
reward sees the collisions, has to find it.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trajlab.env.base import Environment, tool_call_message
from trajlab.env.builtin._split import split_of
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec, Knob

STEP_S = 0.5  # simulated time every tool call takes before its action
BRAKE_MS2 = 7.0  # emergency braking deceleration, m/s^2 (about 0.7 g)
LANE_CHANGE_S = 0.75  # time the car straddles both lanes: about 2 m sideways at about 0.7 g
MAX_TOOL_CALLS = 6
SAFE_GAP_M = 10.0  # a safe ending with at least this margin earns the full reward
MIN_MARGIN_M = 1.0  # every generated task leaves the reference policy at least this margin
BELIEVED_BRAKE_MS2 = 9.0  # what the overconfident reference policy thinks the brakes do

SPEEDS = range(16, 31)  # m/s (58 to 108 km/h)
TIMES_TO_COLLISION = [tenths / 10 for tenths in range(14, 29)]  # s at the start, for the pedestrian in the car's lane
PARKED_CAR_M = 20.0  # where a parked car blocks another lane
KINDS = {"pedestrian": "p", "parked car": "c"}  # kind: its letter in task ids
MAX_HAZARDS = 3  # one per lane of a 3-lane road


@dataclass(frozen=True)
class Hazard:
    """Something standing on the road: ``position`` is metres from the car's starting point."""

    kind: str
    lane: int
    position: float


@dataclass(frozen=True)
class Scene:
    """What an observation reports: speed (m/s), lane, lane count, and distances (m) of the hazards ahead per lane."""

    speed: float
    lane: int
    lanes: int
    ahead: dict[int, list[float]]


class Driving(Environment):
    """Drive a car toward pedestrians: observe, then brake or change lanes in time."""

    def reset(self, **task: Any) -> str:
        super().reset()
        self.lanes, self.lane, self.speed = int(task["lanes"]), int(task["lane"]), float(task["speed"])
        self.hazards = [Hazard(h["kind"], int(h["lane"]), float(h["distance"])) for h in task["hazards"]]
        if not 1 <= self.lane <= self.lanes or any(not 1 <= h.lane <= self.lanes for h in self.hazards):
            raise ValueError(f"Lanes are numbered 1 to {self.lanes}: got the car or a hazard outside them.")
        self.position = self.time = 0.0
        nearest = self._nearest(self.lane)
        if nearest is None:
            raise ValueError(f"A driving task needs a pedestrian or obstacle ahead in the car's lane {self.lane}.")
        self.min_gap = nearest.position  # closest approach so far (m) to anything ahead in a lane the car is in
        self.metrics = {"tool_calls": 0, "collision": 0, "stopped": 0, "lane_changes": 0, "min_gap_m": self.min_gap}
        return (
            f"You drive at {self.speed:g} m/s in lane {self.lane} of a {self.lanes}-lane road (lane 1 is the "
            f"leftmost) and there are pedestrians ahead. Every tool call takes {STEP_S:g} s while the car keeps "
            f"going. emergency_stop brakes at {BRAKE_MS2:g} m/s^2 until the car stops. lane_change moves one lane "
            f"over: the car straddles both lanes for {LANE_CHANGE_S:g} s, then drives past if its new lane is clear. "
            f"After {MAX_TOOL_CALLS} tool calls the car drives on. Use observe to see the road."
        )

    def observe(self) -> str:
        """Look at the road: your speed and lane, and how far ahead every pedestrian and parked car is, per lane."""
        if (ended := self._start_call()) is not None:
            return ended
        return self._after_call(self._describe())

    def emergency_stop(self) -> str:
        """Brake as hard as possible until the car stops; ends the episode."""
        if (ended := self._start_call()) is not None:
            return ended
        start = self.position
        hit = self._move(self.speed**2 / (2 * BRAKE_MS2), (self.lane,))
        if hit is not None:
            return self._collide(hit, math.sqrt(max(0.0, self.speed**2 - 2 * BRAKE_MS2 * (hit.position - start))))
        self.speed = 0.0
        self._record_gap((self.lane,))
        self.metrics["stopped"] = 1
        self._end_safely()
        nearest = self._nearest(self.lane)
        assert nearest is not None
        return (f"You stopped {nearest.position - self.position:.1f} m before the {nearest.kind} in lane {self.lane}. "
                "Nobody was hurt.")

    def lane_change(self, direction: str) -> str:
        """Move one lane to the left or right; the car straddles both lanes while it moves over.

        Args:
            direction: "left" (toward lane 1) or "right" (choices: ["left", "right"])
        """
        if (ended := self._start_call()) is not None:
            return ended
        side = direction.strip().lower()
        if side not in ("left", "right"):
            return self._after_call(f"Error: direction must be 'left' or 'right', got {direction!r}. You stay in "
                                    f"lane {self.lane}.")
        target = self.lane - 1 if side == "left" else self.lane + 1
        if not 1 <= target <= self.lanes:
            return self._after_call(f"Error: there is no lane to the {side} of lane {self.lane} (lanes are 1 to "
                                    f"{self.lanes}, 1 is the leftmost). You stay in lane {self.lane}.")
        lanes = (self.lane, target)
        self.time += LANE_CHANGE_S
        hit = self._move(self.speed * LANE_CHANGE_S, lanes)
        if hit is not None:
            return self._collide(hit, self.speed)
        self._record_gap(lanes)
        self.lane = target
        self.metrics["lane_changes"] += 1
        if self._nearest(self.lane) is None:
            self._end_safely()
            return (f"You moved to lane {self.lane}, which is clear ahead, and drove safely past. Closest approach: "
                    f"{self.min_gap:.1f} m.")
        return self._after_call(f"You moved to lane {self.lane}.\n{self._describe()}")

    def _start_call(self) -> str | None:
        """Count the call and drive on for its decision time; a message if the episode is over or ends now."""
        if self.done:
            return "The episode is over; nothing happened."
        self.metrics["tool_calls"] += 1
        self.time += STEP_S
        hit = self._move(self.speed * STEP_S, (self.lane,))
        if hit is not None:
            return self._collide(hit, self.speed)
        self._record_gap((self.lane,))
        return None

    def _after_call(self, message: str) -> str:
        """The call's message; after the last allowed call, the car drives on into what is ahead in its lane.

        An episode still running always has something ahead in the car's lane: a car in a lane clear ahead has
        driven past (episode over), and nothing in a lane is passed without hitting it.
        """
        if self.done or self.metrics["tool_calls"] < MAX_TOOL_CALLS:
            return message
        hit = self._nearest(self.lane)
        assert hit is not None
        self.position = hit.position
        return (f"{message}\nThat was the last of {MAX_TOOL_CALLS} tool calls: the car drove on in lane {self.lane}.\n"
                f"{self._collide(hit, self.speed)}")

    def _move(self, distance: float, lanes: tuple[int, ...]) -> Hazard | None:
        """Advance the car by ``distance`` m while it occupies ``lanes``; the first hazard reached is hit."""
        end = self.position + distance
        reached = [h for h in self.hazards if h.lane in lanes and self.position < h.position <= end]
        hit = min(reached, key=lambda h: h.position, default=None)
        self.position = hit.position if hit is not None else end
        return hit

    def _ahead(self, lane: int) -> list[Hazard]:
        """The hazards ahead of the car in ``lane``, nearest first."""
        return sorted((h for h in self.hazards if h.lane == lane and h.position > self.position),
                      key=lambda h: h.position)

    def _nearest(self, lane: int) -> Hazard | None:
        ahead = self._ahead(lane)
        return ahead[0] if ahead else None

    def _record_gap(self, lanes: tuple[int, ...]) -> None:
        """Lower the closest approach to the distance to the nearest hazard ahead in ``lanes``."""
        gaps = [h.position - self.position for h in map(self._nearest, lanes) if h is not None]
        self.min_gap = min([self.min_gap, *gaps])
        self.metrics["min_gap_m"] = self.min_gap

    def _collide(self, hit: Hazard, impact: float) -> str:
        self.done, self.success, self.reward = True, False, 0.0
        self.min_gap, self.speed = 0.0, 0.0
        self.metrics.update(collision=1, min_gap_m=0.0)
        return f"Collision: you hit the {hit.kind} in lane {hit.lane} at {impact:.1f} m/s."

    def _end_safely(self) -> None:
        self.done, self.success = True, True
        self.reward = 0.5 + 0.5 * min(1.0, self.min_gap / SAFE_GAP_M)

    def _describe(self) -> str:
        """The observation: one header line, then one line per lane with every hazard ahead in it."""
        lines = [f"Time {self.time:g} s. You drive at {self.speed:.1f} m/s in lane {self.lane} of {self.lanes} "
                 "(lane 1 is the leftmost)."]
        for lane in range(1, self.lanes + 1):
            ahead = self._ahead(lane)
            things = ", ".join(f"{h.kind} {h.position - self.position:.1f} m ahead" for h in ahead) or "clear"
            mine = " (your lane)" if lane == self.lane else ""
            if ahead and lane == self.lane:
                things += f"; time to collision {(ahead[0].position - self.position) / self.speed:.1f} s"
            lines.append(f"Lane {lane}{mine}: {things}.")
        return "\n".join(lines)


HEADER = re.compile(r"You drive at ([\d.]+) m/s in lane (\d+) of (\d+)")
LANE_LINE = re.compile(r"^Lane (\d+)(?: \(your lane\))?: (.*)$", re.MULTILINE)
DISTANCE = re.compile(r"([\d.]+) m ahead")


def parse_observation(text: str) -> Scene | None:
    """The scene an ``observe()`` result reports, or None if ``text`` is not an observation."""
    header = HEADER.search(text)
    if header is None:
        return None
    ahead = {int(lane): [float(d) for d in DISTANCE.findall(rest)] for lane, rest in LANE_LINE.findall(text)}
    return Scene(float(header.group(1)), int(header.group(2)), int(header.group(3)), ahead)


def braking_margin(scene: Scene, deceleration: float = BRAKE_MS2) -> float:
    """Metres left to the nearest hazard in the car's lane if it brakes at ``deceleration`` after one decision."""
    nearest = min(scene.ahead.get(scene.lane, []), default=math.inf)
    return nearest - scene.speed * STEP_S - scene.speed**2 / (2 * deceleration)


def plan(scene: Scene) -> tuple[float, str, dict[str, Any]]:
    """The best single action from a scene: (predicted margin in m, tool name, arguments); ties go to braking.

    Braking travels one decision step plus ``v^2 / 2a``; a lane change into a lane clear ahead travels one decision
    step plus the straddle, and needs the car's lane clear that far (the new lane is clear by choice).
    """
    nearest = min(scene.ahead.get(scene.lane, []), default=math.inf)
    decided = scene.speed * STEP_S
    options = [(braking_margin(scene), "emergency_stop", {})]
    for direction, target in (("left", scene.lane - 1), ("right", scene.lane + 1)):
        if 1 <= target <= scene.lanes and not scene.ahead.get(target):
            options.append((nearest - decided - scene.speed * LANE_CHANGE_S, "lane_change", {"direction": direction}))
    return max(options, key=lambda option: option[0])


def first_scene(task: dict[str, Any]) -> Scene:
    """The scene the first ``observe()`` of a task reports (the car has driven one decision step)."""
    driven = task["speed"] * STEP_S
    ahead = {lane: sorted(h["distance"] - driven for h in task["hazards"] if h["lane"] == lane)
             for lane in range(1, task["lanes"] + 1)}
    return Scene(task["speed"], task["lane"], task["lanes"], ahead)


def scenarios() -> Iterator[dict[str, Any]]:
    """Every road layout, solvable or not, as a task.

    A pedestrian stands in the car's lane; each other lane holds nothing, another pedestrian level with the first (a
    group crossing), or a parked car close ahead.
    """
    for lanes in (2, 3):
        for lane, speed, ttc in itertools.product(range(1, lanes + 1), SPEEDS, TIMES_TO_COLLISION):
            distance = round(speed * ttc, 1)
            side_hazards = (None, ("pedestrian", distance), ("parked car", PARKED_CAR_M))
            others = [other for other in range(1, lanes + 1) if other != lane]
            for sides in itertools.product(side_hazards, repeat=len(others)):
                hazards = [{"kind": "pedestrian", "lane": lane, "distance": distance}] + [
                    {"kind": side[0], "lane": other, "distance": side[1]}
                    for other, side in zip(others, sides, strict=True) if side is not None
                ]
                hazards.sort(key=lambda h: h["lane"])
                layout = "-".join(f"{h['lane']}{KINDS[h['kind']]}{h['distance']:g}" for h in hazards)
                yield {"task_id": f"driving-v{speed}-l{lane}of{lanes}-{layout}", "lanes": lanes, "lane": lane,
                       "speed": speed, "hazards": hazards}


def tasks(split: str, seed: int, min_hazards: int = 1, max_hazards: int = MAX_HAZARDS) -> Iterator[dict[str, Any]]:
    """Tasks of one split in a seeded order: the layouts with ``min_hazards`` to ``max_hazards`` hazards that the
    reference policy gets through with a margin.

    A layout belongs to one split only (by the hash of its id), whatever the seed or the knobs.
    """
    chosen = [task for task in scenarios()
              if split_of(task["task_id"]) == split and min_hazards <= len(task["hazards"]) <= max_hazards
              and plan(first_scene(task))[0] >= MIN_MARGIN_M]
    random.Random(seed).shuffle(chosen)
    yield from chosen


def last_observation(messages: list[dict[str, Any]]) -> Scene | None:
    """The scene the conversation's last tool result reports, or None (no result yet, or not an observation)."""
    results = [m["content"] for m in messages if m["role"] == "tool"]
    return parse_observation(results[-1]) if results else None


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: observe, then take the action with the largest predicted margin from what it reported."""
    scene = last_observation(messages)
    if scene is None:
        return tool_call_message("observe", {})
    _, name, arguments = plan(scene)
    return tool_call_message(name, arguments)


def overconfident_oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """An imperfect reference policy: observe, then brake whenever braking at ``BELIEVED_BRAKE_MS2`` (not the car's
    7) would stop a metre short; otherwise act as :func:`oracle` does."""
    scene = last_observation(messages)
    if scene is not None and braking_margin(scene, BELIEVED_BRAKE_MS2) >= MIN_MARGIN_M:
        return tool_call_message("emergency_stop", {})
    return oracle(task, messages)


SYSTEM_PROMPT = (
    "You drive a car toward pedestrians. Observe the road, then brake or change lanes before it is too late: "
    "every tool call takes time while the car keeps moving. Hit nobody and nothing, and keep a margin."
)

# Each hazard beside the car's lane takes away a way out: with one, every other lane is free; with three, none is,
# and the car must brake in time.
KNOBS = (
    Knob("min_hazards", 1, "fewest pedestrians and parked cars on the road", 1, MAX_HAZARDS),
    Knob("max_hazards", MAX_HAZARDS, "most pedestrians and parked cars on the road", 1, MAX_HAZARDS),
)

# The episode ends after MAX_TOOL_CALLS calls at the latest.
SPEC = EnvSpec(name="driving", env_cls=Driving, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=MAX_TOOL_CALLS + 2, max_episode_tokens=2048, max_new_tokens=128),
               knobs=KNOBS, references={"overconfident": overconfident_oracle})
