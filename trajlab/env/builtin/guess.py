"""Number guessing with higher/lower feedback: the classic multi-turn toy task.

Besides its own reference policy (binary search) it has an imperfect one, ``impatient`` (``collect.reference:
impatient``): after four wrong guesses it gives up on three episodes in four, so its demonstrations teach a quitting
the reward sees (a game given up is lost), where binary search would have gone on to find the number.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from trajlab.env.base import Environment, tool_call_message
from trajlab.env.builtin._split import split_of
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec, Knob

RANGES = (4, 8, 16, 32, 64, 100)
"""The ranges' upper ends a task may have (from 1): the knobs pick those between ``min_high`` and ``max_high``."""
MIN_HIGH, MAX_HIGH = 16, 100


class GuessNumber(Environment):
    """Find a secret integer in a range with as few guesses as possible."""

    def reset(self, **task: Any) -> str:
        super().reset()
        self.secret, self.low, self.high = int(task["secret"]), int(task["low"]), int(task["high"])
        self.max_guesses = int(task["max_guesses"])
        self.metrics = {"guesses": 0}
        return (
            f"I picked an integer between {self.low} and {self.high}. "
            f"Find it with the guess tool in at most {self.max_guesses} guesses."
        )

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: the number to try
        """
        self.metrics["guesses"] += 1
        if n == self.secret:
            self.done, self.success = True, True
            # Fewer guesses, more reward: 1.0 for a first-try hit, down to 0.5 at the limit.
            self.reward = 1.0 - 0.5 * (self.metrics["guesses"] - 1) / max(1, self.max_guesses - 1)
            return "Correct!"
        if self.metrics["guesses"] >= self.max_guesses:
            self.done, self.success, self.reward = True, False, 0.0
            return f"Wrong, and that was the last guess. The number was {self.secret}."
        return "Higher." if n < self.secret else "Lower."


def tasks(split: str, seed: int, min_high: int = MIN_HIGH, max_high: int = MAX_HIGH) -> Iterator[dict[str, Any]]:
    """Tasks of one split, ranges from 1 to each of ``RANGES`` between ``min_high`` and ``max_high``; a (range,
    secret) pair belongs to one split only, whatever the seed or the knobs."""
    highs = tuple(high for high in RANGES if min_high <= high <= max_high)
    if not highs:
        raise ValueError(f"guess: no range ends between min_high {min_high} and max_high {max_high}; ranges end at "
                         f"{', '.join(map(str, RANGES))}.")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    total = sum(highs)
    while len(seen) < total:
        high = rng.choice(highs)
        secret = rng.randint(1, high)
        if (high, secret) in seen:
            continue
        seen.add((high, secret))
        if split_of(f"guess-{high}-{secret}") == split:
            max_guesses = high.bit_length() + 1
            yield {"task_id": f"guess-{high}-{secret}", "low": 1, "high": high, "secret": secret,
                   "max_guesses": max_guesses}


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: binary search over the feedback read back from the conversation."""
    low, high = int(task["low"]), int(task["high"])
    guesses = [m["tool_calls"][0]["function"]["arguments"]["n"] for m in messages if m.get("tool_calls")]
    feedback = [m["content"] for m in messages if m["role"] == "tool"]
    for n, answer in zip(guesses, feedback, strict=False):
        if answer.startswith("Higher"):
            low = n + 1
        elif answer.startswith("Lower"):
            high = n - 1
    return tool_call_message("guess", {"n": (low + high) // 2})


GIVE_UP_AFTER = 4  # wrong guesses after which the impatient reference may give up
GIVE_UP_SHARE = 0.75  # of the episodes that get that far, the share it gives up on
GIVE_UP_MESSAGE = "I give up."


def impatient_oracle(task: dict[str, Any], messages: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    """An imperfect reference policy that binary-searches like :func:`oracle`, but after ``GIVE_UP_AFTER`` wrong
    guesses answers ``GIVE_UP_MESSAGE`` instead of guessing again, which ends the game lost, in a share
    ``GIVE_UP_SHARE`` of its episodes. It draws that with ``rng``, per episode (see
    :mod:`trajlab.inference.scripted`), not per task: each of guess's 162 train tasks is demonstrated a dozen times,
    so every task's whole search is still shown in some of its episodes, and the habit is a majority that greedy
    decoding copies, with exceptions the model keeps sampling, which RL can reinforce. Binary search needs more than
    four guesses for all but 15 numbers of a range, so about half of its demonstrations are given up."""
    misses = sum(message["role"] == "tool" for message in messages)
    if misses == GIVE_UP_AFTER and rng.random() < GIVE_UP_SHARE:
        return {"role": "assistant", "content": GIVE_UP_MESSAGE}
    return oracle(task, messages)


SYSTEM_PROMPT = "You play a guessing game. Use the guess tool; read each hint and narrow the range."

# A wider range needs more guesses, each read from the last hint (the guess budget grows with it by one per doubling).
KNOBS = (
    Knob("min_high", MIN_HIGH, f"smallest upper end of a task's range (ends: {', '.join(map(str, RANGES))})",
         RANGES[0], RANGES[-1]),
    Knob("max_high", MAX_HIGH, "largest upper end of a task's range", RANGES[0], RANGES[-1]),
)

# At most 8 guesses (a range up to 100), plus room for a malformed call or two.
SPEC = EnvSpec(name="guess", env_cls=GuessNumber, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=10, max_episode_tokens=2048, max_new_tokens=128), knobs=KNOBS,
               references={"impatient": impatient_oracle})
