"""Multi-turn rollouts on the vllm backend: lockstep batches against continuous batching, side by side in one run.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py                        # the tiny model, CPU build of vLLM
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --episodes 64 --latency-s 0.5
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --total 128      # a stream: 128 episodes, 32 at a time

The env has long-tailed episodes: each task asks for 1 to 10 user turns (three in four episodes take 1-3 turns, the
rest up to 10), and every user turn after the first arrives ``--latency-s`` after the model's answer, standing in
for a tool or a user simulator. The model is the tiny offline model (random weights: each turn runs to
``--max-new-tokens``), sampled at temperature 1 with the same per-turn seeds on both sides. Both sides roll out the
same episodes with the same concurrency on their own engine: ``--episodes`` at once, all started together, or with
``--total`` a stream of that many, each finished episode's slot taken by the next, as a collection runs. An untrained
model never writes its end-of-turn token, and a turn cut by the token limit ends the episode, so turns also stop at
any of ``--stop-ids`` ordinary tokens (chosen once, the same on both sides): turn lengths are then geometric,
long-tailed, as a trained model's are. Each side runs on its own engine (each built in this process; the lockstep
one first):

- ``lockstep``: ``VLLMGenerator(batching="lockstep")``, every batch one ``LLM.generate`` call that returns when its
  slowest request is done;
- ``continuous``: ``VLLMGenerator()`` (the default), each request joining and leaving vLLM's engine on its own.

Printed: episodes per second (the median of ``--reps`` repetitions after one warm-up), the ratio, and the prompt
tokens each side prefilled per turn (those vLLM's prefix cache did not hold).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template, stop_token_ids
from trajlab.env.base import Environment
from trajlab.env.registry import EnvSpec
from trajlab.inference.base import SamplingParams
from trajlab.inference.vllm import VLLMGenerator
from trajlab.models.loading import load_tokenizer
from trajlab.models.tiny import init_tiny_model
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


class LongTail(Environment):
    """A conversation of ``turns`` user turns; each after the first comes ``latency_s`` after the model's answer."""

    latency_s = 0.0

    def reset(self, **task: Any) -> str:
        super().reset()
        self.left = int(task["turns"]) - 1
        return "Tell me a story."

    def next_user_message(self, answer: str | None) -> str | None:
        if self.left <= 0:
            self.done, self.reward = True, 1.0
            return None
        time.sleep(self.latency_s)
        self.left -= 1
        return "Go on."


def long_tail_tasks(split: str, seed: int = 0):
    rng = random.Random(f"{split}-{seed}")
    for index in range(100_000):
        turns = rng.randint(1, 3) if rng.random() < 0.75 else rng.randint(4, 10)
        yield {"task_id": f"{split}-{index}", "turns": turns}


SPEC = EnvSpec(name="long_tail", env_cls=LongTail, tasks=long_tail_tasks)


def rollout_seconds(generator: VLLMGenerator, tokenizer: Any, template: str, episodes: list[Episode],
                    max_new_tokens: int, stops: tuple[int, ...], slots: int) -> tuple[float, int]:
    """Wall seconds to roll out ``episodes``, ``slots`` at a time, and the model turns they took."""
    engine = RolloutEngine(SPEC, generator, tokenizer, chat_template=template, parser=get_parser("auto", tokenizer),
                           sampling=SamplingParams(temperature=1.0, stop_token_ids=stops),
                           limits={"max_turns": 10, "max_new_tokens": max_new_tokens, "max_episode_tokens": 4096},
                           seed=0)

    async def run() -> list:
        free = asyncio.Semaphore(slots)

        async def one(episode: Episode) -> Any:
            async with free:
                return await engine.run_episode(episode)

        return await asyncio.gather(*(one(e) for e in episodes))

    start = time.perf_counter()
    try:
        trajectories = asyncio.run(run())
    finally:
        engine.close()
    seconds = time.perf_counter() - start
    failed = [t for t in trajectories if t.status == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, e.g. {failed[0].error}")
    return seconds, sum(int(t.metrics["turns"]) for t in trajectories)


def measure(batching: str, model: Path, args: argparse.Namespace, episodes: list[Episode]) -> dict[str, float]:
    tokenizer = load_tokenizer(model)
    template = resolve_chat_template(tokenizer)
    generator = VLLMGenerator(model, max_batch_size=args.episodes, batching=batching, seed=0)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    stops = (*stop_token_ids(tokenizer), *random.Random(0).sample(vocab, args.stop_ids))
    rollout_seconds(generator, tokenizer, template, episodes[: max(2, args.episodes // 4)], args.max_new_tokens,
                    stops, args.episodes)
    before = (generator.prompt_tokens, generator.cached_prompt_tokens)
    runs = [rollout_seconds(generator, tokenizer, template, episodes, args.max_new_tokens, stops, args.episodes)
            for _ in range(args.reps)]
    prompt = generator.prompt_tokens - before[0]
    turns = sum(turns for _, turns in runs)
    median = statistics.median(seconds for seconds, _ in runs)
    return {"seconds": median, "episodes_per_s": len(episodes) / median,
            "prompt_per_turn": prompt / turns,
            "prefilled_per_turn": (prompt - generator.cached_prompt_tokens + before[1]) / turns,
            "turns_per_episode": turns / len(episodes) / args.reps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32, help="episodes rolled out at once")
    parser.add_argument("--total", type=int, help="a stream of this many episodes, --episodes at a time (default: "
                                                  "--episodes, all started together)")
    parser.add_argument("--latency-s", type=float, default=0.2, help="seconds before each user turn after the first")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--stop-ids", type=int, default=128, help="ordinary tokens that also end a turn")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-vllm-throughput")
    args = parser.parse_args()
    LongTail.latency_s = args.latency_s
    model = args.work / "tiny"
    if not (model / "config.json").is_file():
        init_tiny_model(model, seed=0)
    tasks = SPEC.iter_tasks("train", 0)
    total = args.total or args.episodes
    if total < args.episodes:
        parser.error(f"--total {total} is below --episodes {args.episodes}: a stream has at least one slot's worth")
    episodes = [Episode(f"bench:{i}", next(tasks), split="train") for i in range(total)]
    turns = sum(e.task["turns"] for e in episodes)
    print(f"{total} episodes, {args.episodes} at a time, {turns} user turns in all (1-10 each), latency "
          f"{args.latency_s} s, "
          f"{args.max_new_tokens} new tokens a turn, median of {args.reps} after a warm-up")
    rows = {side: measure(side, model, args, episodes) for side in ("lockstep", "continuous")}
    print("| batching | seconds | episodes/s | model turns an episode | prompt tokens a turn | prefilled a turn "
          "(not in the prefix cache) |")
    print("|---|---|---|---|---|---|")
    for side, row in rows.items():
        print(f"| {side} | {row['seconds']:.2f} | {row['episodes_per_s']:.2f} | {row['turns_per_episode']:.2f} | "
              f"{row['prompt_per_turn']:.0f} | {row['prefilled_per_turn']:.0f} |")
    print(f"continuous / lockstep, episodes per second: "
          f"{rows['continuous']['episodes_per_s'] / rows['lockstep']['episodes_per_s']:.2f}x")


if __name__ == "__main__":
    main()
