"""BFCL env steps per second: the ground truth of every entry replayed through the env, without a model.

An env step is what the rollout engine asks of the env: a tool call (argument validation, then the call on the
episode's own backend) or the end of a user turn (the ground-truth calls run on their own backends, then BFCL's
state and response checks). Episodes run one after another on one thread, as one engine worker would run them;
``reset`` (two fresh sets of backends loaded with the entry's state) is timed on its own and included in the total.

    .venv/bin/python benchmarks/bfcl_env_steps.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections import defaultdict

from trajlab.env.base import bind_tool
from trajlab.env.builtin.bfcl import BFCL, ground_truth_steps
from trajlab.env.builtin.bfcl_data import CATEGORIES, entries


def replay_timed(entry, totals: dict[str, float]) -> None:
    """One ground-truth episode, adding its phase times (seconds) and counts to ``totals``."""
    env = BFCL()
    started = time.perf_counter()
    env.reset(task_id=entry.id, category=entry.category)
    totals["reset_s"] += time.perf_counter() - started
    for steps in ground_truth_steps(entry.id):
        for step in steps:
            started = time.perf_counter()
            for call in step:
                bind_tool(env, call.name)(**call.arguments)
            env.next_user_message(None)
            totals["calls_s"] += time.perf_counter() - started
            totals["calls"] += len(step)
        started = time.perf_counter()
        env.next_user_message("Done.")
        totals["scoring_s"] += time.perf_counter() - started
        totals["turns"] += 1
    if env.reward != 1.0:
        raise RuntimeError(f"{entry.id}: the ground truth scored {env.reward}, not 1.0")
    totals["episodes"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="passes over the entries (the best pass is kept)")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    args = parser.parse_args()
    categories = args.categories.split(",")

    print(f"command: {shlex.join([sys.executable.replace(os.getcwd() + '/', ''), *sys.argv])}")
    print(f"machine: {len(os.sched_getaffinity(0))} cores usable, {platform.platform()}, "
          f"Python {platform.python_version()}; {args.repeats} pass(es), best kept")
    for category in categories:  # load the data before timing
        entries(category)
        ground_truth_steps(entries(category)[0].id)

    header = (f"{'category':<13} {'episodes':>8} {'calls':>6} {'turns':>6} {'reset ms':>9} {'calls/s':>9} "
              f"{'turn ends/s':>11} {'env steps/s':>11} {'episodes/s':>10}")
    print(header)
    print("-" * len(header))
    overall: dict[str, float] = defaultdict(float)
    for category in categories:
        best: dict[str, float] | None = None
        for _ in range(args.repeats):
            totals: dict[str, float] = defaultdict(float)
            for entry in entries(category):
                replay_timed(entry, totals)
            if best is None or _total_s(totals) < _total_s(best):
                best = totals
        assert best is not None
        for key, value in best.items():
            overall[key] += value
        print(_row(category, best))
    print(_row("all", overall))


def _total_s(totals: dict[str, float]) -> float:
    return totals["reset_s"] + totals["calls_s"] + totals["scoring_s"]


def _row(name: str, totals: dict[str, float]) -> str:
    steps = totals["calls"] + totals["turns"]
    return (f"{name:<13} {totals['episodes']:>8.0f} {totals['calls']:>6.0f} {totals['turns']:>6.0f} "
            f"{1000 * totals['reset_s'] / totals['episodes']:>9.2f} {totals['calls'] / totals['calls_s']:>9.0f} "
            f"{totals['turns'] / totals['scoring_s']:>11.0f} {steps / _total_s(totals):>11.0f} "
            f"{totals['episodes'] / _total_s(totals):>10.1f}")


if __name__ == "__main__":
    main()
