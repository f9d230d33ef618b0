"""Synchronous against asynchronous RL on the GPU (``max_staleness`` 0, 1 and 2), in steps per hour, on an env whose
tools take real time.

The env is ``latency_env(scale.tool_latency_s)`` (every tool sleeps first, as a sandbox or an API would); the model
the warm-started one in ``scale.dtype`` on ``scale.device``; the settings ``rl_step``'s (``rl_step_vs_trl``'s
``trajlab_settings``), the same tasks for every run, up to ``scale.async_steps`` steps each. Each run is a fresh
interpreter, so none inherits another's memory or CUDA state. The rate counts from the loop's start (after loading,
when the first rollouts begin) to the last step's end: not from the first step's end, since rollouts that run ahead
during the first update's one-time costs would then count as free. Asynchronous RL only overlaps the update with the
next rollouts, so its gain is bounded by (rollout + update) / the longer of the two, and a short run pays the first
rollouts, which nothing overlaps, in full.

The synchronous run goes first and stops after the first step its loop ends past ``SYNC_BUDGET_S`` (keeping 2);
the asynchronous runs then take as many steps, so all three train the same number of steps.

Time on an H100 at full scale (qwen3-0.6b, up to 6 steps of 8 x 8 rollouts, 0.5 s tools), estimated, not
measured: per run ~15 s to start and load; a synchronous step ~3 turns x (~0.5 s of generation + 0.5 s of tools) +
~0.5 s of update, ~4-5 s, so ~5 steps within the budget; the asynchronous runs a little faster: ~15 + 22 + 2 x (15
+ 20) = ~110 s. Should rows ramble to 256 tokens a turn (~20 s a step), every run does 2 steps: ~150 s.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

from common import Scale, latency_env, progress, spawn_worker, warm_started_model, worker_main
from rl_step import base, cpu_threads, shape_for

STALENESS = (0, 1, 2)  # rl.max_staleness of each run; 0 is the synchronous loop
SYNC_BUDGET_S = 20.0  # the synchronous run stops after the first step its loop ends past this; the others run as many
FINAL_STEPS = 2  # the reward reported is the mean of the last this many steps
KEPT = ("perf/rollout_s", "perf/update_s", "perf/rollout_wait_s", "perf/overlap_s", "reward/mean",
        "rollout/staleness_mean", "rollout/dropped_stale", "rollout/mean_turns")


def run(plan: dict[str, Any], scale: Scale, model: Path, out: Path) -> dict[str, Any]:
    """One ``trajlab.rl`` run (inside a worker process) of ``plan``'s ``staleness`` and ``steps``, stopped early
    past ``budget_s`` (only given a synchronous run, where stopping leaves no rollouts in flight): its wall time, when
    its loop started, and each step's numbers and end time."""
    import torch

    import trajlab
    from trajlab.train import rl as loop

    if cpu_threads(scale):
        torch.set_num_threads(cpu_threads(scale))
    settings, rollout = base.trajlab_settings(shape_for(scale, steps=0), steps=plan["steps"],
                                              max_staleness=plan["staleness"])
    steps, started = [], []

    class ClockedFeed(loop.RolloutFeed):  # instrumentation only: when the loop starts, after loading
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started.append(time.perf_counter())
            super().__init__(*args, **kwargs)

    def on_step(record: dict[str, float]) -> None:
        steps.append({"end": time.perf_counter(), **{key: record[key] for key in KEPT}})
        if base.over_budget(plan["budget_s"], started[0], len(steps)):
            raise base.OutOfTime

    loop.RolloutFeed = ClockedFeed
    began = time.perf_counter()
    with contextlib.suppress(base.OutOfTime):
        trajlab.rl(model, latency_env(scale.tool_latency_s), out, rollout=rollout, seed=0, on_step=on_step,
                   device=scale.device, dtype=scale.dtype, **settings.model_dump())
    return {**plan, "wall_s": time.perf_counter() - began, "loop_s": steps[-1]["end"] - started[0], "steps": steps}


def run_plan(plan_json: str, scale: Scale, work: Path) -> dict[str, Any]:
    """A worker's interpreter (``common.worker_main``): :func:`run` of one plan, in its own run directory."""
    plan = json.loads(plan_json)
    out = work / "async_rl" / f"staleness{plan['staleness']}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)  # trajlab.rl appends to a previous run's
    return run(plan, scale, warm_started_model(scale, work), out)


def spawn(plan: dict[str, Any], scale: Scale, work: Path) -> dict[str, Any]:
    """:func:`run_plan` in a fresh interpreter; its result."""
    result = spawn_worker(__file__, json.dumps(plan), scale, work)
    if "error" in result:
        raise RuntimeError(f"async_rl, max_staleness {plan['staleness']}: {result['error']}")
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Steps per hour of the loop and the per-step means (see the module docstring)."""
    steps = result["steps"]

    def mean(key: str) -> float:
        return statistics.mean(step[key] for step in steps)

    return {
        "staleness": result["staleness"], "steps": len(steps), "wall_s": result["wall_s"],
        "loop_s": result["loop_s"], "steps_per_hour": 3600 * len(steps) / result["loop_s"],
        "rollout_s": mean("perf/rollout_s"), "update_s": mean("perf/update_s"),
        "waited_s": mean("perf/rollout_wait_s"),
        "overlapped": sum(s["perf/overlap_s"] for s in steps) / max(1e-9, sum(s["perf/update_s"] for s in steps)),
        "staleness_mean": mean("rollout/staleness_mean"), "dropped": sum(s["rollout/dropped_stale"] for s in steps),
        "turns": mean("rollout/mean_turns"),
        "final_reward": statistics.mean(step["reward/mean"] for step in steps[-FINAL_STEPS:]),
    }


def measure(scale: Scale, work: Path) -> dict[str, Any]:
    """The runs one after the other: the synchronous one first, up to ``scale.async_steps`` steps within
    ``SYNC_BUDGET_S``, then the asynchronous ones as many steps."""
    warm_started_model(scale, work)  # prepared here once, not in each run's interpreter
    rows, steps = [], scale.async_steps
    for staleness in STALENESS:
        progress(f"async_rl: max_staleness {staleness}, {steps} steps")
        plan = {"staleness": staleness, "steps": steps, "budget_s": None if staleness else SYNC_BUDGET_S}
        rows.append(summary(spawn(plan, scale, work)))
        steps = rows[0]["steps"]
    sync = rows[0]["steps_per_hour"]
    for row in rows:
        row["speed_up"] = row["steps_per_hour"] / sync
    return {"rows": rows, "tool_latency_s": scale.tool_latency_s, "rollouts": scale.tasks_per_step * scale.group_size,
            "sync_budget_s": SYNC_BUDGET_S}


def table(result: dict[str, Any]) -> str:
    """One row a run, the target, and what the numbers are."""
    one = next(row["speed_up"] for row in result["rows"] if row["staleness"] == 1)
    lines = ["| max_staleness | steps | wall s | loop s | steps/hour | speed-up | rollout s | update s | waited s | "
             "update overlapped | staleness | dropped | turns/episode | final reward |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['staleness']}{' (sync)' if row['staleness'] == 0 else ''} | {row['steps']} | "
                     f"{row['wall_s']:.1f} | {row['loop_s']:.1f} | {row['steps_per_hour']:.0f} | "
                     f"{row['speed_up']:.2f}x | "
                     f"{row['rollout_s']:.2f} | {row['update_s']:.2f} | {row['waited_s']:.2f} | "
                     f"{row['overlapped']:.0%} | {row['staleness_mean']:.2f} | {row['dropped']:.0f} | "
                     f"{row['turns']:.2f} | {row['final_reward']:.3f} |")
    return "\n".join([*lines, "", f"target: max_staleness 1 >= 1.5x the synchronous steps/hour: {one:.2f}x "
                       f"({'met' if one >= 1.5 else 'not met'}).", "", (
        f"latency env: every tool sleeps {result['tool_latency_s']:g} s first; {result['rollouts']} rollouts a step, "
        "the same tasks and settings in every run (rl_step's), each run in a fresh process; the synchronous run "
        f"stops after the first step past {result['sync_budget_s']:g} s and the others take as many steps. Wall s: "
        "the whole trajlab.rl call (loading, every step, the final save, which a run cut short skips); loop s: from "
        "the first rollouts' start to the last step's end, which steps/hour counts over. Per-step means: rollout, "
        "update, the trainer's wait for rollouts. Speed-up: steps/hour over the synchronous run's. Final reward: "
        f"the mean of the last {FINAL_STEPS} steps' mean reward.")])


if __name__ == "__main__":
    worker_main(run_plan)
