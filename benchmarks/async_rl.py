"""Asynchronous RL (``rl.max_staleness: 1``) against synchronous RL, on an env whose tools take real time.

    python benchmarks/async_rl.py --model runs/quickstart/sft/final     # after `bash scripts/quickstart.sh`

Both runs start from the same model (by default the quickstart's SFT checkpoint), train the same number of steps
on the same tasks (so the same number of samples) with the quickstart's RL settings, one after the other in this
process, and are then evaluated greedily on the same held-out tasks. The env is ``arithmetic`` behind a latency
wrapper (``SlowTools``, named as such): every tool call sleeps ``--tool-latency`` seconds first, standing in for a
sandbox or an API. Reported: wall time, steps per hour, mean rollout and update time, the time the trainer waited
for rollouts, how much of the updates overlapped rollouts, and held-out success.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _latency import slow_tools

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.env.registry import load_env
from trajlab.models.loading import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("runs/quickstart/sft/final"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tool-latency", type=float, default=0.5, help="seconds each tool call sleeps first")
    parser.add_argument("--staleness", type=int, default=1, help="rl.max_staleness of the asynchronous run")
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-async-rl")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} is not a model directory: run `bash scripts/quickstart.sh` first, or pass "
                         "--model.")


    env = slow_tools(load_env("arithmetic"), args.tool_latency)
    tokenizer = load_tokenizer(args.model)
    rollout = RolloutSettings(max_turns=4, max_new_tokens=40, max_episode_tokens=512, concurrency=64)
    rows = []
    for name, staleness in (("sync", 0), (f"async K={args.staleness}", args.staleness)):
        out = args.work_dir / name.replace(" ", "_").replace("=", "")
        settings = RLSettings(steps=args.steps, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
                              credit="turn", rewards={"env": 1.0, "progress": 1.0}, learning_rate=3e-4,
                              warmup_steps=2, max_staleness=staleness)
        if (out / "metrics.jsonl").exists():
            (out / "metrics.jsonl").unlink()
        began = time.perf_counter()
        final = trajlab.rl(args.model, env, out, tokenizer=tokenizer, rollout=rollout, device="cpu",
                           **settings.model_dump())
        wall = time.perf_counter() - began
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        report = trajlab.evaluate("arithmetic", str(final), num_tasks=args.eval_tasks, temperature=0.0,
                              rollout={"max_turns": 4, "max_new_tokens": 40, "max_episode_tokens": 512,
                                       "concurrency": 64})
        rows.append((name, wall, steps, report.success_rate))
        print(f"{name}: {wall:.1f} s, held-out success {report.success_rate:.3f}", flush=True)

    samples = args.steps * args.tasks_per_step * args.group_size
    print(f"\narithmetic behind a {args.tool_latency} s latency wrapper on every tool; {args.steps} steps x "
          f"{args.tasks_per_step} tasks x {args.group_size} rollouts = {samples} samples each; held-out success on "
          f"{args.eval_tasks} test tasks, greedy")
    print("| run | wall s | steps/hour | rollout s/step | update s/step | waited for rollouts s/step | "
          "update overlapped by rollouts | staleness mean | dropped | held-out success |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, wall, steps, success in rows:
        def mean(key: str, steps: list[dict[str, Any]] = steps) -> float:
            return statistics.mean(s[key] for s in steps)

        overlapped = sum(s["perf/overlap_s"] for s in steps) / max(1e-9, sum(s["perf/update_s"] for s in steps))
        print(f"| {name} | {wall:.1f} | {3600 * len(steps) / wall:.0f} | {mean('perf/rollout_s'):.2f} | "
              f"{mean('perf/update_s'):.2f} | {mean('perf/rollout_wait_s'):.2f} | {overlapped:.0%} | "
              f"{mean('rollout/staleness_mean'):.2f} | {sum(s['rollout/dropped_stale'] for s in steps):.0f} | "
              f"{success:.3f} |")
    print(f"speed-up: {rows[0][1] / rows[1][1]:.2f}x steps per hour")


if __name__ == "__main__":
    main()
