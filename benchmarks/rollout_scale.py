"""The rollout machinery's own cost: episodes per second with a scripted generator, in-process and on Ray workers.

    python benchmarks/rollout_scale.py                          # 1,000 and 10,000 concurrent episodes; 1 and 2 workers
    python benchmarks/rollout_scale.py --episodes 200 --workers 1   # quick

The generator is the arithmetic env's reference policy replayed as tokens (``ScriptedGenerator``: no model, named as
such), so every second measured is trajlab's: scheduling the episodes, rendering each turn with the chat template,
parsing the tool calls, running the env's tools in threads, assembling token ids and loss masks. Each run rolls out
``--episodes`` episodes at once (concurrency = episodes). Ray workers start on a local cluster (started and shut
down by the runner); their start-up is timed apart from the rollouts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import tempfile
import time
from pathlib import Path

from trajlab.chat.parsers import get_parser
from trajlab.env.registry import load_env
from trajlab.inference.policy import load_policy
from trajlab.models.tiny import init_tiny_model
from trajlab.rollout.engine import make_engine
from trajlab.rollout.runner import Episode


def episodes(env_name: str, count: int) -> list[Episode]:
    env = load_env(env_name)
    tasks = itertools.cycle(list(env.iter_tasks("train", 0)))  # more episodes than tasks: tasks repeat
    return [Episode(f"bench:{i}", next(tasks), split="train") for i in range(count)]


def in_process(env_name: str, model_dir: Path, count: int) -> tuple[float, float, int]:
    """Wall seconds, turns per episode and status counts of ``count`` concurrent episodes in this process."""
    env = load_env(env_name)
    policy = load_policy("oracle", tokenizer=model_dir, oracle=env.oracle, device="auto", dtype="auto", backend="hf",
                         max_batch_size=32)
    engine = make_engine(env, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                         parser=get_parser("auto", policy.tokenizer), seed=0)
    planned = episodes(env_name, count)
    began = time.perf_counter()
    done = asyncio.run(engine.run(planned, concurrency=count, retries=0, retry_backoff_s=1.0))
    wall = time.perf_counter() - began
    engine.close()
    return wall, sum(t.metrics.get("turns", 0.0) for t in done) / len(done), sum(t.status == "success" for t in done)


def on_workers(env_name: str, model_dir: Path, count: int, workers: int, run_dir: Path) -> tuple[float, float, int]:
    """As :func:`in_process` on ``workers`` Ray actors; returns (start-up s, rollout s, successes)."""
    from trajlab.collection.workers import RayRolloutRunner, WorkerSpec
    from trajlab.config import ModelSettings, RolloutSettings

    env = load_env(env_name)
    rollout = RolloutSettings(workers=workers, ray_address="local", concurrency=count)
    spec = WorkerSpec(env=env, policy="oracle", tokenizer=str(model_dir), model=ModelSettings(), rollout=rollout,
                      temperature=1.0, seed=0)
    began = time.perf_counter()
    runner = RayRolloutRunner(spec, run_dir=run_dir)
    started = time.perf_counter()
    try:
        done = asyncio.run(runner.run(episodes(env_name, count), concurrency=count, retries=0, retry_backoff_s=1.0))
    finally:
        ended = time.perf_counter()
        runner.close()
    return started - began, ended - started, sum(t.status == "success" for t in done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="arithmetic")
    parser.add_argument("--episodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--worker-episodes", type=int, default=1000, help="episodes per Ray run")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-rollout-scale")
    args = parser.parse_args()
    model_dir = args.work_dir / "tiny"
    if not (model_dir / "config.json").exists():
        init_tiny_model(model_dir, seed=0, overwrite=True)

    print(f"env {args.env}, scripted generator (the env's reference policy as tokens), concurrency = episodes")
    print("| runner | episodes | start-up s | rollout s | episodes/s | ms per episode | ms per turn | successes |")
    print("|---|---|---|---|---|---|---|---|")
    for count in args.episodes:
        wall, turns, successes = in_process(args.env, model_dir, count)
        print(f"| in-process | {count} | 0 | {wall:.2f} | {count / wall:.0f} | {1000 * wall / count:.2f} | "
              f"{1000 * wall / (count * turns):.2f} | {successes} |", flush=True)
    for workers in args.workers:
        count = args.worker_episodes
        start, wall, successes = on_workers(args.env, model_dir, count, workers, args.work_dir / f"ray{workers}")
        print(f"| {workers} Ray worker{'s' if workers > 1 else ''} | {count} | {start:.1f} | {wall:.2f} | "
              f"{count / wall:.0f} | {1000 * wall / count:.2f} | | {successes} |", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS of this process: {peak:.2f} GB")


if __name__ == "__main__":
    main()
