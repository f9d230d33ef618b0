"""Padding-free batches against right-padded ones: one forward and backward pass of the RL loss
(``rl.padding_free``) and of the SFT loss (``sft.padding_free``, TRL's padding-free collator) over the same rows,
whose lengths vary tenfold, on the CPU.

    python benchmarks/packing.py                          # the tiny model and Qwen3-0.6B's widths at 2 layers

Each side runs the same rows (random tokens; lengths evenly spread from ``--min`` to ``--max``; the first 30% of
each a prompt, the rest a completion with a tool result in its middle), one warm-up pass each, then ``--reps``
passes alternating padded and packed; the table gives the median seconds, real tokens (no padding) per second, and
the largest difference between the two sides' losses (they must agree to 1e-5). On a CPU the model's attention is
PyTorch's sdpa with the block-diagonal mask transformers builds from the position ids: packing saves every
per-token cost of the padding (projections, MLP, output head) but runs attention over the whole packed row; with
flash attention on a GPU the rows run as variable-length sequences and attention saves too.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from trajlab.config import RLSettings
from trajlab.models.archs import arch_config
from trajlab.models.loading import load_model
from trajlab.models.tiny import init_tiny_model
from trajlab.rollout.types import TokenRecord, Trajectory
from trajlab.train.batches import packed_batch, padded_batch
from trajlab.train.loss import policy_loss
from trajlab.train.sft import sliced_sft_loss


def model_of(name: str, layers: int) -> torch.nn.Module:
    """The tiny offline model, or a randomly initialised architecture twin at ``layers`` layers, in float32."""
    if name == "tiny":
        return load_model(init_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0), device="cpu")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(arch_config(name, layers), dtype=torch.float32).train()


def rollouts(lengths: list[int], vocab: int, seed: int = 0) -> list[Trajectory]:
    """Rollouts of random tokens at ``lengths``, 30% prompt, a tool result (no loss) in the middle of each completion,
    logprobs of -1 (the loss needs some; their values change nothing here)."""
    draw = random.Random(seed)
    made = []
    for n, length in enumerate(lengths):
        ids = [draw.randrange(5, vocab) for _ in range(length)]
        prompt = int(length * 0.3)
        completion = length - prompt
        mask = [0 if completion // 3 <= i < completion // 2 else 1 for i in range(completion)]
        tokens = TokenRecord(prompt_ids=ids[:prompt], completion_ids=ids[prompt:], loss_mask=mask,
                             logprobs=[-1.0 if bit else None for bit in mask])
        made.append(Trajectory(id=f"r{n}", env="bench", task={}, messages=[], tools=[], reward=1.0,
                               status="success", tokens=tokens))
    return made


def rl_pass(model: torch.nn.Module, batch: dict) -> float:
    model.zero_grad(set_to_none=True)
    loss = policy_loss(model, None, batch, RLSettings(), normaliser=8.0)["loss_tensor"]
    loss.backward()
    return loss.item()


def sft_pass(model: torch.nn.Module, batch: dict) -> float:
    model.zero_grad(set_to_none=True)
    loss, _ = sliced_sft_loss(model, batch, None)
    loss.backward()
    return loss.item()


def timed(passes: dict[str, Callable[[], float]], reps: int) -> dict[str, tuple[float, float]]:
    """Each side's median seconds over ``reps`` alternating passes after one warm-up, and its loss."""
    losses = {side: run() for side, run in passes.items()}  # warm-up
    seconds: dict[str, list[float]] = {side: [] for side in passes}
    for _ in range(reps):
        for side, run in passes.items():
            began = time.perf_counter()
            run()
            seconds[side].append(time.perf_counter() - began)
    return {side: (statistics.median(seconds[side]), losses[side]) for side in passes}


def measure(name: str, layers: int, rows: int, shortest: int, longest: int, reps: int) -> list[str]:
    model = model_of(name, layers)
    lengths = [round(shortest + (longest - shortest) * i / (rows - 1)) for i in range(rows)]
    made = rollouts(lengths, min(model.config.vocab_size, 1500))
    advantages = [[0.5 if n % 2 else -0.5] * len(t.tokens.completion_ids) for n, t in enumerate(made)]
    cpu = torch.device("cpu")
    padded, packed = padded_batch(made, advantages, 0, cpu), packed_batch(made, advantages, cpu)
    examples = [{"input_ids": t.tokens.prompt_ids + t.tokens.completion_ids,
                 "assistant_masks": [0] * len(t.tokens.prompt_ids) + t.tokens.loss_mask} for t in made]
    sft_padded = DataCollatorForLanguageModeling(pad_token_id=0)(examples)
    sft_packed = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    tokens = sum(lengths)
    out = []
    for loss, (pad_batch, pack_batch) in (("rl", (padded, packed)), ("sft", (sft_padded, sft_packed))):
        step = rl_pass if loss == "rl" else sft_pass
        result = timed({"padded": lambda b=pad_batch, f=step: f(model, b),
                        "packed": lambda b=pack_batch, f=step: f(model, b)}, reps)
        (pad_s, pad_loss), (pack_s, pack_loss) = result["padded"], result["packed"]
        out.append(f"| {name} x{layers if name != 'tiny' else ''} | {loss} | {rows} x {shortest}-{longest} "
                   f"({tokens} tokens, {rows * longest} padded) | {pad_s:.3f} | {pack_s:.3f} | {tokens / pad_s:.0f} | "
                   f"{tokens / pack_s:.0f} | {pad_s / pack_s:.2f}x | {abs(pad_loss - pack_loss):.1e} |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.6b"])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of an architecture twin")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--min", type=int, default=100, help="the shortest row's tokens")
    parser.add_argument("--max", type=int, default=1000, help="the longest row's tokens")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | loss | rows x tokens | padded s | packed s | padded tok/s | packed tok/s | speed-up | "
          "loss diff |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.models:
        measure(name, args.layers, args.rows, args.min, args.max, args.reps)


if __name__ == "__main__":
    main()
