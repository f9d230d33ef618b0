"""Memory per trainer process, data-parallel against sharded (``rl.sharding: fsdp``): the RL update of a randomly
initialised Qwen3-1.7B twin (its real widths and vocabulary, ``--layers`` layers, float32) in two CPU processes.

    python benchmarks/fsdp_memory.py              # Qwen3-1.7B widths at 2 layers, 2 processes, 2 optimizer steps

Each layout runs in its own ``accelerate launch`` (two processes over gloo, one after the other, so peaks never mix):
the policy as the RL recipe builds it (``accelerator.prepare`` with AdamW for data parallelism; ``shard`` and AdamW
over the slices for FSDP2), then ``--steps`` RL updates (``PolicyUpdate``, GRPO, no KL) on the same synthetic rollouts
(``--rollouts`` of ``--tokens`` tokens, half of them completion, advantages of both signs). Reported per layout:
each process's peak resident memory (``ru_maxrss``: interpreter, torch, model, gradients, AdamW, the passes),
the memory the process held before the model was loaded, the median update's seconds, and the update's loss (both
layouts must agree). On GPUs the same split holds for ``torch.cuda.max_memory_allocated``; what a GPU adds is
measured by the GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from trajlab.config import RLSettings
from trajlab.models.archs import init_arch_model
from trajlab.models.loading import load_model
from trajlab.rollout.types import TokenRecord, Trajectory
from trajlab.train.sharding import shard
from trajlab.train.update import PolicyUpdate


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic(count: int, tokens: int, vocab: int) -> tuple[list[Trajectory], list[list[float]]]:
    """``count`` rollouts of ``tokens`` random tokens (half prompt), every completion token trained."""
    generator = torch.Generator().manual_seed(0)
    made, advantages = [], []
    for n in range(count):
        ids = torch.randint(5, vocab, (tokens,), generator=generator).tolist()
        half = tokens // 2
        record = TokenRecord(prompt_ids=ids[:half], completion_ids=ids[half:], loss_mask=[1] * (tokens - half),
                             logprobs=[-10.0] * (tokens - half))
        made.append(Trajectory(id=f"r{n}", env="bench", task={}, messages=[], tools=[], reward=1.0,
                               status="success", tokens=record))
        advantages.append([0.5 if n % 2 else -0.5] * (tokens - half))
    return made, advantages


def worker(args: argparse.Namespace) -> None:
    """One process of one layout: build, update ``--steps`` times, report (the main process prints JSON)."""
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    before = peak_mb()
    settings = RLSettings(sharding=args.layout, micro_batch_size=args.micro, learning_rate=1e-5)
    policy = load_model(args.model, device="cpu", dtype="float32").train()
    if args.layout == "fsdp":
        policy = shard(policy, compute_dtype=None)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.learning_rate)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    else:
        optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.learning_rate)
        policy, optimizer = accelerator.prepare(policy, optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    update = PolicyUpdate(policy, None, optimizer, scheduler, accelerator, settings, args.tokens, 0)
    rollouts, advantages = synthetic(args.rollouts, args.tokens, 150_000)
    seconds, losses = [], []
    for step in range(args.steps):
        began = time.perf_counter()
        stats, _ = update(rollouts, advantages, correct=False, shuffle_seed=step)
        seconds.append(time.perf_counter() - began)
        losses.append(stats["loss"])
    peaks = accelerator.gather(torch.tensor([peak_mb()])).tolist()
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({"layout": args.layout, "peak_mb": peaks, "before_mb": before,
                                      "update_s": statistics.median(seconds), "losses": losses}), flush=True)


def launch(layout: str, model: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--worker",
               "--layout", layout, "--model", str(model), "--steps", str(args.steps), "--rollouts",
               str(args.rollouts), "--tokens", str(args.tokens), "--micro", str(args.micro)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{layout} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[0].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro", type=int, default=2, help="rollouts per forward/backward pass")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=["none", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    model = init_arch_model(args.arch, Path(tempfile.mkdtemp()) / "model", layers=args.layers, seed=0)
    params = sum(p.numel() for p in load_model(model, device="cpu", dtype="float32").parameters())
    print(f"{args.arch} widths, {args.layers} layers: {params / 1e6:.0f}M parameters, float32; 2 processes; "
          f"{args.rollouts} rollouts x {args.tokens} tokens, micro-batches of {args.micro}, {args.steps} steps")
    print("| layout | peak per process (MB) | before the model (MB) | update s (median) | losses |")
    print("|---|---|---|---|---|")
    for layout in ("none", "fsdp"):
        result = launch(layout, model, args)
        peaks = " / ".join(f"{peak:.0f}" for peak in result["peak_mb"])
        losses = ", ".join(f"{loss:.6f}" for loss in result["losses"])
        name = "data parallel (DDP)" if layout == "none" else "sharded (FSDP2)"
        print(f"| {name} | {peaks} | {result['before_mb']:.0f} | {result['update_s']:.2f} | {losses} |", flush=True)


if __name__ == "__main__":
    main()
