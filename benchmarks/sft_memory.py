"""Peak memory of one SFT step on a real-width Qwen3-0.6B: trajlab's sliced loss against TRL's SFTTrainer defaults.

    python benchmarks/sft_memory.py                        # 1,024, 4,096 and 16,384 tokens, CPU, float32
    python benchmarks/sft_memory.py --sides trl trajlab trajlab-own-defaults   # and checkpointing off
    python benchmarks/sft_memory.py --lengths 256 --sides trl trajlab   # a smoke check
    python benchmarks/sft_memory.py --device cuda          # the same on a GPU (still float32)

The model is Qwen3-0.6B's published configuration (hidden 1,024, intermediate 3,072, 16 heads, 8 key/value heads,
head dimension 128, vocabulary 151,936, tied embeddings) at 2 layers, randomly initialised
(``benchmarks/gpu/common.py``'s ``build_random_model``, saved in bfloat16, loaded in float32 by both sides). One row
of L random token ids over the whole vocabulary, its first quarter masked out of the loss (a prompt), trains for one
optimizer step (batch 1, AdamW):

- ``trl``: TRL's ``SFTTrainer`` with its defaults (activation checkpointing on, its fused, tiled output head), given
  only what it needs to run here: ``max_length=None`` (its default, 1,024, would cut the row), float32 and the CPU;
- ``trajlab``: ``trajlab.sft`` on the same row, activation checkpointing on as TRL's default has it;
- ``trajlab-own-defaults``: the same with trajlab's default, checkpointing off (more memory, no recomputation).

Each side and length runs in its own fresh interpreter, ``trl`` first. The peak is the process's ``ru_maxrss``
(interpreter, torch, model, gradients, AdamW's states, the step); at short lengths it is the first optimizer step's
(weights, gradients and AdamW's two new states: the same on both sides), so the forward and backward passes' own
peak (``VmHWM``, reset before training, read when backward ends) is reported too, and each side's growth per token
is taken from it. "before" is the resident memory after the model is loaded, before the trainer is built; both sides
have imported the same modules by then (trajlab's SFT recipe and TRL), so the interpreter's share is the same. On
CUDA ``torch.cuda.max_memory_allocated`` is reported too. Each run stops after its optimizer step, before any
checkpoint or final save.

Agreement: every side records its loss and, from post-accumulate gradient hooks (before clipping), each parameter's
gradient norm and 100,000 of its entries at fixed random positions; each side is compared with ``trl``'s at the same
length: the largest absolute difference of the loss and of the recorded gradient entries.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from common import QWEN3, Scale, build_random_model, spawn_worker, worker_main  # noqa: E402

SIDES = ("trl", "trajlab", "trajlab-own-defaults")
SAMPLED = 100_000  # gradient entries recorded per parameter


class Finished(Exception):
    """Raised after the optimizer step: ends training before any checkpoint or final save."""


def scale_for(device: str) -> Scale:
    """Qwen3-0.6B's shape at 2 layers with its vocabulary, on ``device``."""
    shape = QWEN3["qwen3-0.6b"] | {"num_hidden_layers": 2}
    return dataclasses.replace(Scale.full(), device=device, arch="qwen3-0.6b-2-layers", shape=shape)


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status: VmRSS (resident now), VmHWM (its peak since the last reset)."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(f"{field}:")).split()[1]) * 1024


def training_row(length: int, vocab: int, seed: int = 0) -> Any:
    """One row of ``length`` random ids, the first quarter without loss, as trajlab's SFT dataset has it."""
    import torch
    from datasets import Dataset

    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [0] * (length // 4) + [1] * (length - length // 4)
    return Dataset.from_dict({"input_ids": [ids], "assistant_masks": [mask]})


def record_gradients(model: Any, store: dict[str, Any]) -> None:
    """After each backward pass, each parameter's gradient norm and entries at fixed random positions to ``store``."""
    import torch

    generator = torch.Generator().manual_seed(0)
    for name, parameter in model.named_parameters():
        picked = torch.randint(0, parameter.numel(), (min(SAMPLED, parameter.numel()),), generator=generator)

        def hook(tensor: Any, name: str = name, picked: Any = picked) -> None:
            grad = tensor.grad.detach().flatten()
            store[name] = (float(grad.float().norm()), grad[picked.to(grad.device)].float().cpu())

        parameter.register_post_accumulate_grad_hook(hook)


def run_trl(model: Any, tokenizer: Any, dataset: Any, out: Path, device: str) -> None:
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Stop(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            raise Finished

    config = SFTConfig(
        output_dir=str(out),
        max_length=None,
        per_device_train_batch_size=1,
        max_steps=1,
        use_cpu=device == "cpu",
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Stop()]
    )
    trainer.train()


def run_trajlab(model: Any, tokenizer: Any, dataset: Any, out: Path, device: str, checkpointing: bool) -> None:
    import trajlab

    def stop(step: int, total: int) -> None:
        raise Finished

    trajlab.sft(
        model,
        dataset,
        out,
        tokenizer=tokenizer,
        device=device,
        dtype="float32",
        max_steps=1,
        batch_size=1,
        warmup_steps=0,
        learning_rate=2e-5,
        gradient_checkpointing=checkpointing,
        on_progress=stop,
    )


def worker(key: str, scale: Scale, work: Path) -> dict[str, Any]:
    """One side at one length in this fresh interpreter: peak memory, time, loss and recorded gradients."""
    import torch
    import trl

    import trajlab.recipes.sft  # noqa: F401  (imported by both sides: the same interpreter before the step)
    from trajlab.models.loading import load_model, load_tokenizer

    side, length = key.split(":")
    model_dir = work / scale.arch
    model = load_model(model_dir, device=scale.device, dtype="float32").train()
    tokenizer = load_tokenizer(model_dir)
    dataset = training_row(int(length), model.config.vocab_size)
    losses: list[float] = []
    backward_peaks: list[int] = []
    step = trl.SFTTrainer.training_step  # every side's trainer is an SFTTrainer: forward and backward, no update

    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        loss = step(self, *args, **kwargs)
        losses.append(float(loss))
        backward_peaks.append(status_bytes("VmHWM"))  # the peak up to the end of backward, before the update
        return loss

    trl.SFTTrainer.training_step = training_step
    gradients: dict[str, Any] = {}
    record_gradients(model, gradients)
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on: the forward and backward passes' peak
    if scale.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix=f"sft-memory-{side}-", dir=work))
    try:
        if side == "trl":
            run_trl(model, tokenizer, dataset, out, scale.device)
        else:
            run_trajlab(model, tokenizer, dataset, out, scale.device, checkpointing=side == "trajlab")
    except Finished:
        pass
    seconds = time.perf_counter() - began
    cuda = torch.cuda.max_memory_allocated() if scale.device.startswith("cuda") else None
    saved = work / f"gradients-{side}-{length}.pt"
    torch.save(gradients, saved)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "peak": peak,
        "before": before,
        "cuda": cuda,
        "seconds": seconds,
        "loss": losses[-1],
        "backward_peak": backward_peaks[-1],
        "gradients": str(saved),
    }


def agreement(result: dict[str, Any], peer: dict[str, Any]) -> tuple[float, float, float]:
    """Largest absolute differences from the peer: loss, recorded gradient entries; and the largest entry."""
    import torch

    mine, theirs = torch.load(result["gradients"]), torch.load(peer["gradients"])
    differences = [float((mine[name][1] - theirs[name][1]).abs().max()) for name in theirs]
    largest = max(float(entries.abs().max()) for _, entries in theirs.values())
    return abs(result["loss"] - peer["loss"]), max(differences), largest


def gb(value: float) -> str:
    return f"{value / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=["trl", "trajlab"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-sft-memory")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one side at one length may take")
    args = parser.parse_args()
    scale = scale_for(args.device)
    build_random_model(scale, args.work / scale.arch)
    print(
        f"SFT step: Qwen3-0.6B shape at 2 layers, vocabulary {scale.vocab_size}, float32 on {args.device}, "
        "one row, batch 1, AdamW"
    )
    print(
        "| tokens | side | peak RSS GB | forward+backward peak GB | before GB | CUDA peak GB | step s | loss | "
        "loss diff vs trl | grad diff vs trl (largest entry) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    peaks: dict[str, dict[int, float]] = {side: {} for side in args.sides}
    for length in args.lengths:
        results: dict[str, dict[str, Any]] = {}
        for side in args.sides:  # SIDES order: the peer first
            r = results[side] = spawn_worker(__file__, f"{side}:{length}", scale, args.work, args.timeout)
            if "error" in r:
                print(f"| {length} | {side} | {r['error']} | | | | | | | |", flush=True)
                continue
            peaks[side][length] = r["backward_peak"]
            cuda = gb(r["cuda"]) if r["cuda"] is not None else "-"
            differences = "-", "-"
            if side != "trl" and "error" not in results.get("trl", {"error": ""}):
                loss, grad, largest = agreement(r, results["trl"])
                differences = f"{loss:.1e}", f"{grad:.1e} ({largest:.1e})"
            print(
                f"| {length} | {side} | {gb(r['peak'])} | {gb(r['backward_peak'])} | {gb(r['before'])} | "
                f"{cuda} | {r['seconds']:.1f} | {r['loss']:.4f} | {differences[0]} | {differences[1]} |",
                flush=True,
            )
    for side, by_length in peaks.items():
        lengths = sorted(by_length)
        if len(lengths) >= 2:
            growth = (by_length[lengths[-1]] - by_length[lengths[0]]) / (lengths[-1] - lengths[0])
            print(
                f"{side}: the forward+backward peak grows by {growth / 1024:.0f} KB per token from {lengths[0]} to "
                f"{lengths[-1]} "
                f"(a float32 row of logits is {scale.vocab_size * 4 / 1024:.0f} KB)"
            )


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_main(worker)
    else:
        main()
