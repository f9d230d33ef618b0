"""Wordle: find a secret five-letter word in six guesses from per-letter green/yellow/gray feedback.

A multi-turn task with real state: every guess should use what all earlier feedback revealed, and the reward pays
for solving and for solving sooner (1.0 on the first guess down to 0.5 on the last allowed one, 0 when the guesses
run out). The word list ships inside the package, so tasks need no download (no NLTK) and are the same everywhere.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterator
from functools import cache
from importlib import resources
from typing import Any

from trajlab.env.base import Environment, tool_call_message
from trajlab.env.builtin._split import split_of
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec, Knob

WORD_LENGTH = 5
MAX_GUESSES = 6
WORDS: tuple[str, ...] = tuple(
    resources.files("trajlab.env.builtin").joinpath("data/wordle_words.txt").read_text().split()
)
WORD_SET = frozenset(WORDS)
FIRST_GUESS = "slate"  # the oracle's opening: common letters in common spots

GREEN, YELLOW, GRAY = "G", "Y", "."
FEEDBACK_LINE = re.compile(r"^[A-Z]{5} -> ([GY.](?: [GY.]){4})$", re.MULTILINE)  # e.g. "CRANE -> G Y . . G"


def feedback(secret: str, guess: str) -> str:
    """One mark per letter of ``guess``: G right spot, Y in the word elsewhere, . not in the word (or no copy left).

    Greens are marked first; each yellow then uses up one of the secret's copies of that letter not already matched,
    so a letter never gets more G and Y marks than the secret has copies of it: secret "apple", guess "eerie" gives
    "....G", as the last e matches the only e and the first two get nothing.
    """
    marks = [GREEN if g == s else GRAY for g, s in zip(guess, secret, strict=True)]
    unmatched = Counter(s for s, mark in zip(secret, marks, strict=True) if mark != GREEN)
    for i, letter in enumerate(guess):
        if marks[i] == GRAY and unmatched[letter] > 0:
            marks[i] = YELLOW
            unmatched[letter] -= 1
    return "".join(marks)


def explain(guess: str, marks: str) -> str:
    """The marks in plain words, e.g. ``Right spot: A, E. Wrong spot: L. Not in the word: S, T.``"""
    def letters(mark: str) -> list[str]:
        return list(dict.fromkeys(g.upper() for g, m in zip(guess, marks, strict=True) if m == mark))

    found = set(letters(GREEN) + letters(YELLOW))
    groups = [
        ("Right spot", letters(GREEN)),
        ("Wrong spot", letters(YELLOW)),
        ("Not in the word", [c for c in letters(GRAY) if c not in found]),
        ("No more copies of", [c for c in letters(GRAY) if c in found]),
    ]
    return " ".join(f"{label}: {', '.join(group)}." for label, group in groups if group)


def _guesses(n: int) -> str:
    return "1 guess" if n == 1 else f"{n} guesses"


class Wordle(Environment):
    """Guess a secret five-letter English word; each guess gets per-letter feedback."""

    def reset(self, **task: Any) -> str:
        super().reset()
        self.secret = str(task["secret"]).lower()
        if len(self.secret) != WORD_LENGTH or not (self.secret.isascii() and self.secret.isalpha()):
            raise ValueError(f"A Wordle secret is a {WORD_LENGTH}-letter word, got {task['secret']!r}.")
        self.max_guesses = int(task.get("max_guesses", MAX_GUESSES))
        self.turn_rewards = []
        self.metrics = {"guesses": 0, "invalid_guesses": 0, "best_greens": 0}
        return (
            f"I picked a secret {WORD_LENGTH}-letter English word. Find it with the guess tool in at most "
            f"{self.max_guesses} guesses. Each guess gets one mark per letter: G = right letter in the right spot, "
            "Y = in the word but in another spot, . = not in the word (or no more copies of it)."
        )

    def guess(self, word: str) -> str:
        """Guess the secret word; returns one mark per letter (G right spot, Y wrong spot, . not in the word).

        Args:
            word: a 5-letter English word from the game's word list
        """
        reward_before = self.reward
        reply = self._play(word.strip().lower())
        self.turn_rewards.append(self.reward - reward_before)
        return reply

    def _play(self, word: str) -> str:
        if self.done:
            return "The game is over; this guess was not played."
        if len(word) != WORD_LENGTH or not (word.isascii() and word.isalpha()):
            return self._invalid(f"{word!r} is not a single word of exactly {WORD_LENGTH} letters a-z")
        if word not in WORD_SET and word != self.secret:
            return self._invalid(f"{word!r} is not in the word list")
        self.metrics["guesses"] += 1
        marks = feedback(self.secret, word)
        self.metrics["best_greens"] = max(self.metrics["best_greens"], marks.count(GREEN))
        lines = [f"{word.upper()} -> {' '.join(marks)}"]
        used, left = self.metrics["guesses"], self.max_guesses - self.metrics["guesses"]
        if word == self.secret:
            self.done, self.success = True, True
            # Fewer guesses, more reward: 1.0 for a first-try hit, down to 0.5 at the limit.
            self.reward = 1.0 - 0.5 * (used - 1) / max(1, self.max_guesses - 1)
            lines.append(f"Solved in {_guesses(used)}!")
        elif left <= 0:
            self.done, self.success, self.reward = True, False, 0.0
            lines += [explain(word, marks), f"Out of guesses. The word was {self.secret.upper()}."]
        else:
            lines += [explain(word, marks), f"{_guesses(left)} left."]
        return "\n".join(lines)

    def _invalid(self, problem: str) -> str:
        self.metrics["invalid_guesses"] += 1
        left = self.max_guesses - self.metrics["guesses"]
        return f"Invalid guess: {problem}. It did not count; {_guesses(left)} left."


def tasks(split: str, seed: int, max_guesses: int = MAX_GUESSES) -> Iterator[dict[str, Any]]:
    """Tasks of one split in a seeded order; a secret belongs to one split only, whatever the seed or the guesses
    allowed (a task with fewer guesses is another task, with its own id)."""
    order = list(WORDS)
    random.Random(seed).shuffle(order)
    for secret in order:
        task_id = f"wordle-{secret}"
        if split_of(task_id) == split:
            suffix = "" if max_guesses == MAX_GUESSES else f"-g{max_guesses}"
            yield {"task_id": task_id + suffix, "secret": secret, "max_guesses": max_guesses}


@cache
def candidates(history: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """The words consistent with every (guess, marks) pair of ``history``."""
    if not history:
        return WORDS
    guess, marks = history[-1]
    return tuple(w for w in candidates(history[:-1]) if feedback(w, guess) == marks)


@cache
def best_guess(history: tuple[tuple[str, str], ...]) -> str:
    """The candidate whose feedback splits the remaining candidates into the most groups (ties: first in order)."""
    if not history:
        return FIRST_GUESS
    pool = candidates(history)
    if len(pool) <= 2:
        return pool[0] if pool else FIRST_GUESS  # no candidate left only if the secret is outside the word list
    return max(pool, key=lambda w: len({feedback(secret, w) for secret in pool}))


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: reads its guesses and their marks back from the conversation, guesses a consistent word."""
    guesses = [m["tool_calls"][0]["function"]["arguments"]["word"].lower() for m in messages if m.get("tool_calls")]
    replies = [m["content"] for m in messages if m["role"] == "tool"]
    history = tuple(
        (word, match.group(1).replace(" ", ""))
        for word, reply in zip(guesses, replies, strict=False)
        if (match := FEEDBACK_LINE.search(reply))
    )
    return tool_call_message("guess", {"word": best_guess(history)})


SYSTEM_PROMPT = (
    "You play Wordle. Find the secret 5-letter word with the guess tool; after each guess, read the marks and "
    "only guess words that fit all the feedback so far."
)

# The word list holds five-letter words only, so the difficulty is the guess budget: fewer guesses leave less room
# to learn from feedback (the reference policy needs up to 6). Never more than 6, which the turn limit allows.
KNOBS = (Knob("max_guesses", MAX_GUESSES, "guesses allowed per word", 1, MAX_GUESSES),)

# Six guesses, plus room for a malformed call or two.
SPEC = EnvSpec(name="wordle", env_cls=Wordle, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               limits=EpisodeLimits(max_turns=MAX_GUESSES + 2, max_episode_tokens=2048, max_new_tokens=128),
               knobs=KNOBS)
