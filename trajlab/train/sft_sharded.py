"""Sharded SFT (``sft.sharding: fsdp``): TRL's trainer over a policy sharded with FSDP2 (:mod:`trajlab.train.sharding`).

accelerate's FSDP plugin, the trainer's own route to FSDP, turns FSDP on for accelerator devices only; here the model
is sharded before the trainer sees it, marked as prepared so accelerate does not wrap it in DDP, and the trainer's
checkpoints hold each process's slices of the weights and AdamW's moments (PyTorch distributed checkpoints) beside
the gathered model, so the same code runs on gloo and NCCL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import set_seed
from transformers.trainer import SCHEDULER_NAME

from trajlab.config import SFTSettings
from trajlab.errors import UserError, require
from trajlab.train.checkpoints import save_final
from trajlab.train.lora import lora_config
from trajlab.train.sft import SlicedLossTrainer
from trajlab.train.sharding import load_sharded, save_sharded, shard


def sharded_policy(model: torch.nn.Module, settings: SFTSettings, processes: int, seed: int) -> torch.nn.Module:
    """``model`` with its LoRA adapter (when asked) sharded over the trainer processes; a bfloat16 model with
    ``master_weights`` is sharded in float32 and computes in bfloat16. The adapter is made as TRL's trainer makes
    it (seeded with the trainer's ``seed`` first), so it starts from the same random weights as unsharded.

    Raises:
        UserError: one process (nothing to shard over).
    """
    if processes < 2:
        raise UserError("sft.sharding: fsdp shards the model over the trainer processes, and this run has one: "
                        "launch several (accelerate launch --num_processes N -m trajlab.cli sft ...), or set "
                        "sft.sharding: none.")
    compute = None
    if next(model.parameters()).dtype == torch.bfloat16 and settings.master_weights:
        model, compute = model.float(), torch.bfloat16
    if settings.lora:
        peft = require("peft", feature="LoRA (--lora-r, lora: settings)", install="pip install 'trajlab[lora]'")
        set_seed(seed)
        model = peft.get_peft_model(model, lora_config(settings.lora))
    model = shard(model, compute_dtype=compute)
    model._is_accelerate_prepared = True  # accelerate's mark of a model it has prepared: no DDP over the slices
    return model


class ShardedSFTTrainer(SlicedLossTrainer):
    """:class:`SlicedLossTrainer` over a sharded model: checkpoints write the gathered model (LoRA merged) and each
    process's slices, and resuming reads the slices back (the gathered model is for people, not for resuming)."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every process takes part in gathering the weights; the main process writes them with the tokenizer."""
        folder = Path(output_dir or self.args.output_dir)
        save_final(self.model, self.processing_class, None, folder, lora=hasattr(self.model, "peft_config"),
                   accelerator=self.accelerator)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_sharded(self.model, self.optimizer.optimizer, Path(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing: the weights come back with the optimizer's state, from each process's slices."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_sharded(self.model, self.optimizer.optimizer, Path(checkpoint))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
