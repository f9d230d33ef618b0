"""One RL step on the GPU: trajlab against TRL's ``GRPOTrainer``, the same model, env, tasks, batch and budgets.

The workers, counters and settings are ``benchmarks/rl_step_vs_trl.py``'s (its docstring says what each framework
runs and how both are counted); here they run on ``scale.device`` with the warm-started model in ``scale.dtype``,
TRL first, each in its own fresh interpreter, one warm-up step then ``scale.repeats`` timed steps, medians reported.
Peak memory is probed at the end of every step and reset after it, so a step's peak is its own.

The env is the arithmetic env with every tool call sleeping ``scale.step_tool_latency_s`` first (0.05 s at full
scale), as a sandbox or an API would. TRL calls a synchronous tool's calls one after another, across all the step's
rollouts; trajlab runs them concurrently. That difference is part of what is measured, so the latency is kept short
(64 rollouts x ~3 calls x 0.05 s = ~10 s of TRL's step) to leave the GPU work visible; the table says how much of
TRL's step the sleeping accounts for. ``async_rl`` measures the longer latency.

Measured on an H200 (2026-11-27, BENCHMARKS.md; qwen3-0.6b with Qwen3's tokenizer, 8 x 8 rollouts, up to 4 turns x
256 tokens, bf16): per worker ~20 s to start; a TRL step ~23 s (its warm-up 33 s), a trajlab step ~9 s (warm-up
26 s). ``WORKER_BUDGET_S`` lets each worker run its warm-up and 3 timed steps: TRL ~125 s, trajlab ~75 s, ~200 s in
all. The first run's budget (30 s) stopped each after one timed step.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

# benchmarks/, for rl_step_vs_trl: appended, so this folder's modules (async_rl) stay ahead of benchmarks/'s
sys.path.append(str(Path(__file__).resolve().parents[1]))
import rl_step_vs_trl as base  # noqa: E402
from common import Scale, peak_gb, progress, reset_peak, warm_started_model  # noqa: E402

LEARNING_RATE = 1e-5  # both frameworks; timing does not depend on it
SEED = 0
MICRO_BATCH_TOKENS = 2048  # trajlab's update: at ~1.25 MB of activations a token (0.6B, no checkpointing), ~2.6 GB
WORKER_BUDGET_S = {True: 30.0, False: 75.0}  # by scale.smoke: a framework's run stops after the first step past it
ORDER = ("trl", "trajlab")  # the peer first
COLUMNS = (  # (header, key, format) of base.summarize's rows
    ("framework", "framework", "{}"),
    ("timed steps", "steps", "{}"),
    ("s/step", "s_per_step", "{:.2f}"),
    ("rollout s", "rollout_s_per_step", "{:.2f}"),
    ("update+rest s", "rest_s_per_step", "{:.2f}"),
    ("peak GB", "peak_gb", "{:.2f}"),
    ("gen tok/step", "generated_per_step", "{:.0f}"),
    ("turns/episode", "turns_per_episode", "{:.2f}"),
    ("tool calls/step", "tool_calls_per_step", "{:.0f}"),
    ("prefill tok/step", "prefill_per_step", "{:.0f}"),
    ("reward", "reward", "{:.3f}"),
    ("flat groups", "flat_groups", "{:.0%}"),
    ("setup s", "setup_s", "{:.1f}"),
)
RATIOS = ("s_per_step", "rollout_s_per_step", "rest_s_per_step", "peak_gb", "generated_per_step",
          "prefill_per_step")


def shape_for(scale: Scale, steps: int, budget_s: float | None = None, tool_latency_s: float = 0.0) -> base.Shape:
    """What both frameworks agree on at ``scale``: ``steps`` timed steps after one warm-up step."""
    return base.Shape(steps=steps, tasks_per_step=scale.tasks_per_step, group_size=scale.group_size,
                      max_new_tokens=scale.max_new_tokens, max_turns=scale.max_turns, learning_rate=LEARNING_RATE,
                      seed=SEED, device=scale.device, dtype=scale.dtype, budget_s=budget_s,
                      tool_latency_s=tool_latency_s, micro_batch_tokens=MICRO_BATCH_TOKENS)


def cpu_threads(scale: Scale) -> int:
    """Torch threads of a worker: 1 on a CPU (the smoke run), where two threads of each process stall on each other
    and on the machine's other work (generation ran ~20x slower so); on a GPU torch's default (0)."""
    return 1 if scale.device == "cpu" else 0


def peak_since_last(device: str) -> dict[str, float]:
    """The peak memory since the previous step's end (base.Probe): each step's own peak on a GPU."""
    peak = peak_gb(device)
    reset_peak(device)
    return {"peak_gb": peak}


def measure(scale: Scale, work: Path) -> dict[str, Any]:
    """Each framework's steps in its own interpreter (this module's ``--worker``), then their medians."""
    model = warm_started_model(scale, work)
    shape = shape_for(scale, scale.repeats, WORKER_BUDGET_S[scale.smoke], scale.step_tool_latency_s)
    runs = {}
    for framework in ORDER:
        progress(f"rl_step: {framework}, up to {shape.total_steps} steps (1 warm-up; {shape.budget_s:g} s budget) of "
                 f"{shape.rollouts} rollouts")
        runs[framework] = base.run_worker(framework, shape, model, work / "rl_step" / framework,
                                          threads=cpu_threads(scale), script=Path(__file__))
    rows = []
    for framework in ORDER:
        row = base.summarize(framework, runs[framework], average=statistics.median)
        rows.append({**row, "turns_per_episode": row["model_turns_per_step"] / shape.rollouts})
    return {"shape": dataclasses.asdict(shape), "rows": rows, "runs": runs,
            "micro_batch": base.trajlab_settings(shape)[0].micro_batch_size}


def precision(dtype: str, device: str) -> str:
    """How both frameworks train: the same weights' dtype; TRL's bf16 flag adds autocast, which trajlab does not."""
    if dtype != "bfloat16":
        return f"Both load and train the weights in {dtype} on {device}."
    return (f"Both load and train the weights in bfloat16 on {device}, no float32 master copy: TRL with bf16=True "
            "(its forward passes under bfloat16 autocast), trajlab in the weights' dtype without autocast.")


def table(result: dict[str, Any]) -> str:
    """The medians, TRL / trajlab ratios against the target, and what the numbers are."""
    shape, rows = result["shape"], result["rows"]
    trl, ours = (next(row for row in rows if row["framework"] == name) for name in ORDER)
    faster, memory = trl["s_per_step"] / ours["s_per_step"], trl["peak_gb"] / ours["peak_gb"]
    return "\n".join([
        base.table(rows, COLUMNS, RATIOS), "",
        f"target: trajlab's step >= 2x faster than TRL's at no more peak memory: {faster:.2f}x "
        f"({'met' if faster >= 2 else 'not met'}) at {memory:.2f}x TRL's peak over trajlab's "
        f"({'met' if memory >= 1 else 'not met'}).", "",
        f"{shape['tasks_per_step']} tasks x {shape['group_size']} rollouts a step, up to {shape['max_turns']} turns "
        f"x {shape['max_new_tokens']} new tokens, lr {shape['learning_rate']:g}, temperature 1, no KL, GRPO loss; "
        "medians of the timed steps after 1 warm-up step (a run stops after the first step past "
        f"{shape['budget_s']:g} s); each framework in its own process, TRL first. "
        f"{precision(shape['dtype'], shape['device'])} TRL with its defaults otherwise: gradient checkpointing on, "
        f"all rollouts in one forward/backward (trajlab: micro-batches of at most {result['micro_batch']} rollouts "
        f"and {shape.get('micro_batch_tokens') or 'any number of'} padded tokens, no checkpointing). Peak: the "
        "highest memory torch allocated on the GPU in a timed step (on a CPU the "
        "process's peak RSS, meaningless as a ratio). Turns/episode: model turns "
        "(generated rows) per rollout; with no tool calls, 1 (trajlab answers a malformed call with an error note "
        "and goes on: a further turn). Every tool call sleeps "
        f"{shape['tool_latency_s']:g} s first; TRL runs a synchronous tool's calls one after another, so about "
        f"{trl['tool_calls_per_step'] * shape['tool_latency_s']:.1f} s of its step is sleeping (tool calls x "
        "latency; trajlab's calls run concurrently, about the longest episode's chain of calls).",
    ])


if __name__ == "__main__":  # a worker: python rl_step.py --worker trl|trajlab --shape ... (see base.run_worker)
    base.main(probe=peak_since_last)
