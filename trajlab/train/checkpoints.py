"""Checkpoints and what a trainer writes, shared by SFT and RL: the final model directory, the metrics log that a
resumed run continues without repeating steps, and RL's own checkpoint (SFT's are the transformers Trainer's).

A crash (even ``kill -9``) never destroys the last checkpoint: RL writes a new one beside it and swaps it in. A run
resumed from step N drops the metrics rows logged after N, which it logs again.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from trajlab.train.sharding import gathered_state, is_sharded, load_sharded, save_sharded

logger = logging.getLogger(__name__)
CHECKPOINT = "checkpoint"
"""RL's checkpoint directory in its output directory (accelerate's state plus ``trajlab_state.json``)."""
STATE_FILE = "trajlab_state.json"


def save_checkpoint(accelerator: Accelerator, out_dir: Path, step: int, extra: dict[str, Any],
                    sharded: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None) -> None:
    """Write the state after ``step`` steps (with ``extra``, e.g. the curriculum's) to a temp dir, then swap it in.
    ``sharded``: a sharded model and its optimizer, whose slices each process writes (accelerate's state holds the
    rest: scheduler, random states)."""
    final, partial = out_dir / CHECKPOINT, out_dir / f"{CHECKPOINT}.partial"
    accelerator.save_state(str(partial))
    if sharded is not None:
        save_sharded(*sharded, partial)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (partial / STATE_FILE).write_text(json.dumps({"step": step} | extra))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator: Accelerator, out_dir: Path,
                    sharded: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None) -> tuple[int, dict[str, Any]]:
    """The steps a checkpoint holds (its weights and optimizer loaded, or ``sharded``'s slices) and its saved state;
    none: (0, {})."""
    checkpoint = out_dir / CHECKPOINT
    if not (checkpoint / STATE_FILE).exists():
        logger.info("No RL checkpoint in %s: starting from step 0.", out_dir)
        return 0, {}
    accelerator.load_state(str(checkpoint))
    if sharded is not None:
        load_sharded(*sharded, checkpoint)
    state = json.loads((checkpoint / STATE_FILE).read_text())
    return state["step"], state


class MetricsLog:
    """``metrics.jsonl``: one JSON record per logged step (``{"step": N, ...}``), written as it comes.

    Args:
        path: the file.
        resumed_at: the step a resumed run continues after: rows logged past it are dropped (the run logs those
            steps again). None: a fresh run, which starts the file anew.
    """

    def __init__(self, path: Path, resumed_at: int | None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and resumed_at is not None:
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resumed_at]
            path.write_text("".join(f"{line}\n" for line in kept))
        elif path.exists():
            path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


def save_final(model: Any, tokenizer: Any, processor: Any, final: Path, *, lora: bool,
               accelerator: Accelerator) -> Path:
    """The trained model as a plain model directory (LoRA merged), with the tokenizer it trained with and, for a
    vision-language model, its processor; written by the main process (a sharded model's weights gathered to it a
    layer at a time first)."""
    if is_sharded(model):
        weights = gathered_state(model, keep=accelerator.is_main_process)
        if accelerator.is_main_process:
            base = model.get_base_model() if lora else model
            base.save_pretrained(final, state_dict=weights)
            # the weights come in the dtype the model computes in (a bfloat16 model's float32 masters rounded)
            config = type(base.config).from_pretrained(final)
            config.dtype = next(iter(weights.values())).dtype
            config.save_pretrained(final)
    elif accelerator.is_main_process:
        trained = model.merge_and_unload() if lora else model
        trained.save_pretrained(final)
    if accelerator.is_main_process:
        if processor is not None:  # so that final loads as a vision-language model again
            processor.save_pretrained(final)
        tokenizer.save_pretrained(final)  # last: the tokenizer's files are those it trained with
    accelerator.wait_for_everyone()
    return final
