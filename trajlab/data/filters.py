"""Small named filters over trajectories: which episodes become training data.

Every filter takes a list of trajectories and returns a new list in the input order, so filters compose and a
dataset built from a file lists its rows in the order they were collected. Episodes that ended in ``error`` (the
episode itself broke: an env crash, a backend failure) are neither successes nor failures: they say nothing about
the policy and are never training data.
"""

from __future__ import annotations

from collections.abc import Iterable

from trajlab.rollout.types import Trajectory, task_key


def successes(ts: Iterable[Trajectory]) -> list[Trajectory]:
    """Episodes the env judged solved (``status == "success"``)."""
    return [t for t in ts if t.status == "success"]


def failures(ts: Iterable[Trajectory]) -> list[Trajectory]:
    """Episodes the policy did not solve: ``failure`` and ``truncated``, never ``error`` (see the module docstring)."""
    return [t for t in ts if t.status not in ("success", "error")]


def total_tokens(t: Trajectory) -> int | None:
    """``len(prompt_ids) + len(completion_ids)``, or None for a text-only trajectory (no token record); for one kept
    a sample per turn, its longest sample (what must fit the model's context)."""
    if t.branches is not None:
        return max((len(b.prompt_ids) + len(b.completion_ids) for b in t.branches), default=0)
    if t.tokens is None:
        return None
    return len(t.tokens.prompt_ids) + len(t.tokens.completion_ids)


def turns(t: Trajectory) -> int:
    """Model turns, counted from the conversation itself so text-only trajectories are measured the same way."""
    return sum(message.get("role") == "assistant" for message in t.messages)


def within_tokens(ts: Iterable[Trajectory], max_tokens: int) -> list[Trajectory]:
    """Trajectories whose whole token sequence fits in ``max_tokens``.

    Text-only trajectories (``tokens is None``) are kept unchecked: their length in tokens is unknown, and an
    estimate from text would be a guess about a tokenizer, which trajlab never makes. Filter them out explicitly
    (``[t for t in ts if t.tokens is not None]``) when a hard bound matters.
    """
    kept = []
    for t in ts:
        n = total_tokens(t)
        if n is None or n <= max_tokens:
            kept.append(t)
    return kept


def shortest_success_per_task(ts: Iterable[Trajectory]) -> list[Trajectory]:
    """For each task (``(env, task_id)``), the success with the fewest tokens: the most direct demonstration.

    Length is the total token count when every success of the task has a token record, else the number of model
    turns (a token count and a turn count cannot be compared). Ties go to the earliest. The result keeps the input
    order.
    """
    by_task: dict[tuple[str, str], list[tuple[int, Trajectory]]] = {}
    for position, t in enumerate(successes(ts)):
        by_task.setdefault(task_key(t.env, t.task), []).append((position, t))
    chosen: list[tuple[int, Trajectory]] = []
    for candidates in by_task.values():
        measured = [total_tokens(t) for _, t in candidates]
        lengths = measured if all(n is not None for n in measured) else [turns(t) for _, t in candidates]
        best = min(range(len(candidates)), key=lambda i: (lengths[i], candidates[i][0]))
        chosen.append(candidates[best])
    return [t for _, t in sorted(chosen, key=lambda pair: pair[0])]
