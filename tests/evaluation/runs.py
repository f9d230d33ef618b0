"""Hand-built runs with known numbers, shared by the evaluation tests."""

from __future__ import annotations

from trajlab.rollout.types import Trajectory


def episode(env, task, status, reward, *, turns, calls=0, tool_errors=0, parse_errors=0, **extra) -> Trajectory:
    episode.count += 1
    metrics = {"turns": turns, "tool_calls": calls, "tool_errors": tool_errors, "parse_errors": parse_errors,
               "model_tokens": 10.0 * turns, **extra}
    return Trajectory(id=f"ep{episode.count}", env=env, task=task, messages=[], tools=[], reward=reward,
                      status=status, metrics=metrics, error="boom" if status == "error" else None)


episode.count = 0
A1, A2, A3 = {"task_id": "a1", "x": 1}, {"task_id": "a2", "x": 2}, {"task_id": "a3", "x": 3}
GUESS = {"secret": 7, "high": 10}  # no task_id: identified by a hash of its content
GUESS_REORDERED = {"high": 10, "secret": 7}


def run_a() -> list[Trajectory]:
    """9 episodes, 3 tasks with unequal sample counts (3, 2, 4), every status, two envs."""
    return [
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2, **{"reward/format": 1.0, "env/steps": 9.0}),
        episode("arithmetic", A1, "failure", 0.0, turns=3, calls=3, tool_errors=1, parse_errors=1,
                **{"reward/format": 0.5}),
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2, **{"reward/format": 1.0}),
        episode("arithmetic", A2, "error", 0.0, turns=1),
        episode("arithmetic", A2, "truncated", 0.5, turns=4, calls=4, tool_errors=2, parse_errors=1),
        episode("guess", GUESS, "success", 1.0, turns=1, calls=1),
        *(episode("guess", GUESS_REORDERED if i else GUESS, "failure", 0.0, turns=5, calls=4, tool_errors=1,
                  parse_errors=1) for i in range(3)),
    ]


def run_b() -> list[Trajectory]:
    """5 episodes: a1 now always solved, a2 still never, a3 new, the guess task gone."""
    return [
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2),
        episode("arithmetic", A1, "success", 1.0, turns=2, calls=2),
        episode("arithmetic", A2, "failure", 0.0, turns=3, calls=3),
        episode("arithmetic", A2, "failure", 0.0, turns=3, calls=3, tool_errors=3),
        episode("arithmetic", A3, "success", 1.0, turns=1, calls=1),
    ]
