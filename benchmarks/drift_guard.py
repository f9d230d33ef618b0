"""Cost of the token-drift guard: `check_token_drift` over 1000 real engine trajectories per env.

The trajectories are the envs' oracle episodes on the tiny model's tokenizer and chat template (the scripted policy
writes what the template renders, through the real engine: prompt, parsed turns, tool results). For scale, the same
trajectories' rollout time (scripted: no model forward, so far below a real rollout) is printed next to it.

    python benchmarks/drift_guard.py [--episodes 1000] [--envs arithmetic guess wordle]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from pathlib import Path

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template
from trajlab.env import load_env
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.loading import load_tokenizer
from trajlab.models.tiny import init_tiny_model
from trajlab.rollout.drift import check_token_drift
from trajlab.rollout.engine import make_engine
from trajlab.rollout.runner import Episode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--envs", nargs="+", default=["arithmetic", "guess", "wordle"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = Path(tempfile.gettempdir()) / "trajlab-drift-guard" / "tiny"
    if not (model / "config.json").exists():
        init_tiny_model(model, overwrite=True, seed=0)
    tokenizer = load_tokenizer(model)
    template = resolve_chat_template(tokenizer)
    tool_parser = get_parser("auto", tokenizer)
    print(f"| env | trajectories | mean turns | mean tokens | rollout s (scripted) | guard s (best of {args.repeats}) "
          "| guard ms / 1000 trajectories |")
    print("|---|---|---|---|---|---|---|")
    for name in args.envs:
        env = load_env(name)
        tasks = itertools.cycle(env.iter_tasks("train", 0))  # small envs repeat their tasks
        episodes = [Episode(f"{name}:{i}", next(tasks), split="train") for i in range(args.episodes)]
        engine = make_engine(env, ScriptedGenerator(env.oracle, tokenizer, template), tokenizer,
                             chat_template=template, parser=tool_parser, seed=0)
        started = time.perf_counter()
        with engine:
            trajectories = asyncio.run(engine.run(episodes, concurrency=64, retries=0, retry_backoff_s=1.0))
        rollout_s = time.perf_counter() - started
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            kept, drifts = check_token_drift(trajectories, tokenizer, template, tool_parser, max_drift=0.0)
            times.append(time.perf_counter() - started)
        assert not drifts and len(kept) == len(trajectories)
        turns = sum(t.metrics["turns"] for t in trajectories) / len(trajectories)
        tokens = sum(len(t.tokens.prompt_ids) + len(t.tokens.completion_ids) for t in trajectories) / len(trajectories)
        best = min(times)
        print(f"| {name} | {len(trajectories)} | {turns:.1f} | {tokens:.0f} | {rollout_s:.2f} | {best:.2f} | "
              f"{best * 1000 / len(trajectories) * 1000:.0f} |", flush=True)


if __name__ == "__main__":
    main()
