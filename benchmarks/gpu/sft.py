"""SFT tokens per second and peak GPU memory: ``trajlab.sft`` against TRL's ``SFTTrainer``, which it runs.

trajlab's SFT on token rows runs TRL's SFTTrainer (``trajlab/train/sft.py``) on the same pre-tokenized rows
(``input_ids`` with ``assistant_masks``, which TRL turns into labels) with TRL's default collator, but computes the
loss itself (``SlicedLossTrainer``: the same negative log-likelihood from the hidden states, 128 labelled tokens at
a time, where TRL's fused head scores every position). trajlab adds configuration and callbacks too: no truncation
(``max_length=None``), its learning-rate schedule, activation checkpointing off by default (TRL's default: on), its
metrics and progress callbacks. So the rows measure those choices and the loss:

- ``trl``: SFTTrainer with its defaults, given only what both sides share: the rows, batch size, learning rate, step
  count, the weights' dtype (``model_init_kwargs``; TRL's own default is float32) and ``max_length=None`` (TRL's
  default, 1,024, would cut the rows);
- ``trajlab``: ``trajlab.sft(...)`` on the same rows with activation checkpointing on, as TRL's default has it;
- ``trajlab, own defaults``: the same with trajlab's default, checkpointing off: more memory, no recomputation.

Rows: ``ROWS_PER_STEP`` x ``scale.sft_tokens`` random ids below the tokenizer's size, the first quarter of each
masked out of the loss. Each side runs in its own interpreter (its peak memory is its own) for ``1 + scale.repeats``
optimizer steps: the first is the warm-up; a step's time runs from the end of the step before to its own end (the
device synchronised), the median is reported, and the peak memory is that of the timed steps. Each run stops at the
end of its last step, before the checkpoint and final save, which are not measured.

H100 estimate (0.6B, bfloat16, 2 x 4,096 tokens a step, 3 sides): per side ~8 s of imports, ~3 s to load the model
and build the trainer, ~2 s for the first step (TRL's Triton LM-head kernels compile in the first side's, then come
from the disk cache), 3 steps of 0.2-0.4 s: ~15 s; ~45 s in all.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Scale,
    build_random_model,
    peak_gb,
    progress,
    reset_peak,
    spawn_worker,
    synchronize,
    worker_main,
)

ROWS_PER_STEP = 2  # 2 x 4,096 tokens: the no-checkpointing side keeps ~3.5 MB of activations a token (~30 GB)
LEARNING_RATE = 2e-5  # TRL's default
SIDES = {"trl": "trl", "trajlab": "trajlab", "trajlab-own-defaults": "trajlab, own defaults"}


class Finished(Exception):
    """Raised from a step callback after the last timed step: ends training before its checkpoint and final save."""


class StepClock:
    """The end time of every optimizer step; after the warm-up it resets the peak memory, after the last it stops."""

    def __init__(self, device: str, steps: int) -> None:
        self.device, self.steps = device, steps
        self.ends: list[float] = []
        self.peak_with_warmup_gb = 0.0

    def __call__(self, step: int, max_steps: int = 0) -> None:
        synchronize(self.device)
        self.ends.append(time.perf_counter())
        if step == 1:
            self.peak_with_warmup_gb = peak_gb(self.device)
            reset_peak(self.device)
        if step >= self.steps:
            raise Finished


def training_rows(scale: Scale, vocabulary: int) -> list[dict[str, list[int]]]:
    """Every step's rows: random ids below ``vocabulary``, the first quarter of each out of the loss."""
    import torch

    generator = torch.Generator().manual_seed(0)
    prompt = scale.sft_tokens // 4
    mask = [0] * prompt + [1] * (scale.sft_tokens - prompt)
    ids = torch.randint(0, vocabulary, (ROWS_PER_STEP * (1 + scale.repeats), scale.sft_tokens), generator=generator)
    return [{"input_ids": row, "assistant_masks": mask} for row in ids.tolist()]


def run_trl(scale: Scale, model_dir: Path, rows: list[dict[str, Any]], out: Path, clock: StepClock) -> dict[str, Any]:
    """TRL's SFTTrainer with its defaults but for what both sides share; returns what it actually ran with."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from trajlab.models.loading import load_tokenizer

    seen: dict[str, Any] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            seen.update(checkpointing=any(getattr(m, "gradient_checkpointing", False) for m in model.modules()),
                        dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
            clock(state.global_step)

    config = SFTConfig(output_dir=str(out), max_steps=clock.steps, per_device_train_batch_size=ROWS_PER_STEP,
                       learning_rate=LEARNING_RATE, max_length=None, model_init_kwargs={"dtype": scale.dtype},
                       report_to="none", disable_tqdm=True,
                       **({"use_cpu": True, "bf16": False} if scale.device == "cpu" else {}))
    trainer = SFTTrainer(model=str(model_dir), args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=load_tokenizer(model_dir), callbacks=[Clock()])
    with contextlib.suppress(Finished):
        trainer.train()
    return seen


def run_trajlab(scale: Scale, model_dir: Path, rows: list[dict[str, Any]], out: Path, clock: StepClock,
                checkpointing: bool) -> dict[str, Any]:
    """``trajlab.sft`` on the same rows, timed by its ``on_progress`` hook (called after every optimizer step)."""
    from datasets import Dataset

    import trajlab

    with contextlib.suppress(Finished):
        trajlab.sft(str(model_dir), Dataset.from_list(rows), out, device=scale.device, dtype=scale.dtype,
                    max_steps=clock.steps, batch_size=ROWS_PER_STEP, learning_rate=LEARNING_RATE,
                    gradient_checkpointing=checkpointing, on_progress=clock)
    return {"checkpointing": checkpointing, "dtype": scale.dtype}


def worker(side: str, scale: Scale, work: Path) -> dict[str, Any]:
    """One side's steps in this interpreter: the median step, tokens per second and peak memory."""
    from trajlab.models.loading import load_tokenizer

    model_dir = build_random_model(scale, work / f"{scale.arch}-random")
    rows = training_rows(scale, len(load_tokenizer(model_dir)))
    clock = StepClock(scale.device, 1 + scale.repeats)
    out = work / f"sft-{side}"
    if side == "trl":
        ran = run_trl(scale, model_dir, rows, out, clock)
    else:
        ran = run_trajlab(scale, model_dir, rows, out, clock, checkpointing=side == "trajlab")
    if len(clock.ends) != clock.steps:
        raise RuntimeError(f"{side}: {len(clock.ends)} optimizer steps ran, not {clock.steps}")
    steps = [end - before for before, end in zip(clock.ends, clock.ends[1:], strict=False)]
    median = statistics.median(steps)
    tokens = ROWS_PER_STEP * scale.sft_tokens
    loss_tokens = ROWS_PER_STEP * (scale.sft_tokens - scale.sft_tokens // 4)
    progress(f"sft {side}: steps " + " ".join(f"{s:.3f}" for s in steps) + f" s, {tokens / median:,.0f} tokens/s")
    return {**ran, "step_s": steps, "median_step_s": median, "tokens_per_step": tokens, "tokens_per_s": tokens / median,
            "loss_tokens_per_s": loss_tokens / median, "peak_gb": peak_gb(scale.device),
            "peak_with_warmup_gb": clock.peak_with_warmup_gb}


def run_side(side: str, scale: Scale, work: Path) -> dict[str, Any]:
    """``side`` in a fresh interpreter, timed whole; its result, or its error."""
    began = time.perf_counter()
    result = spawn_worker(__file__, side, scale, work)
    return result | {"seconds": time.perf_counter() - began}


def measure(scale: Scale, work: Path) -> dict[str, Any]:
    """Every side, the peer first, each in its own interpreter."""
    sides = {}
    for side in SIDES:
        progress(f"sft: {side}")
        sides[side] = run_side(side, scale, work)
    if all("error" in result for result in sides.values()):
        raise RuntimeError("every SFT side failed: " + "; ".join(r["error"] for r in sides.values()))
    return {"rows_per_step": ROWS_PER_STEP, "tokens_per_row": scale.sft_tokens, "learning_rate": LEARNING_RATE,
            "steps": 1 + scale.repeats, "sides": sides}


def table(result: dict[str, Any]) -> str:
    """The sides as a Markdown table, TRL's tokens per second the reference."""
    sides = result["sides"]
    reference = sides["trl"].get("tokens_per_s")
    lines = [f"SFT, {result['rows_per_step']} rows x {result['tokens_per_row']:,} tokens a step (a quarter of each "
             f"without loss), lr {result['learning_rate']:g}; median of {result['steps'] - 1} steps after a warm-up",
             "", "| side | activation checkpointing | weights | step s (median) | tokens/s | vs TRL | "
             "peak GB (timed steps) | peak GB (with load, warm-up) | process s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for side, label in SIDES.items():
        r = sides[side]
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | | | | | {r['seconds']:.0f} |")
            continue
        versus = f"{r['tokens_per_s'] / reference:.2f}x" if reference else "n/a"
        lines.append(f"| {label} | {'on' if r['checkpointing'] else 'off'} | {r['dtype']} | {r['median_step_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {versus} | {r['peak_gb']:.2f} | {r['peak_with_warmup_gb']:.2f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", "trajlab's SFT on token rows is TRL's SFTTrainer with trajlab's configuration, callbacks and loss "
              "(the same collator; the same loss computed from the hidden states in slices of 128 labelled tokens): "
              "the `trajlab` row matches TRL's activation checkpointing, so the gap is the loss and trajlab's "
              "overhead; `own defaults` shows what trajlab's default (checkpointing off) trades. "
              "On a CPU the peaks are the process's peak RSS."]
    return "\n".join(lines)


if __name__ == "__main__":
    worker_main(worker)
