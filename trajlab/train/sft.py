"""SFT on trajectories with TRL's SFTTrainer, loss on the model's own tokens only.

The dataset carries the trajectory's exact tokens (``input_ids``) and its loss mask (``assistant_masks``); TRL turns
the mask into labels (-100 elsewhere), so system, user and tool tokens never carry loss, whatever the chat template.
Text-only rows (no tokens) fall back to TRL's conversational path, which needs ``{% generation %}`` markers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTConfig, SFTTrainer

from trajlab.config import SFTSettings
from trajlab.models import load_model
from trajlab.train.lora import lora_config
from trajlab.train.placement import check_trainable, training_device

logger = logging.getLogger(__name__)


def training_columns(dataset: Dataset) -> Dataset:
    """Keep what TRL trains on: token columns when present, else the conversation."""
    if "input_ids" in dataset.column_names:
        return dataset.select_columns(["input_ids", "assistant_masks"])
    from trajlab.data.datasets import conversational

    return conversational(dataset).select_columns(["messages", "tools"])


def run_sft(
    model_dir: str | Path | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Dataset,
    out_dir: str | Path,
    settings: SFTSettings,
    *,
    seed: int = 0,
    resume: bool = False,
    device: str = "auto",
    dtype: str = "auto",
) -> Path:
    """Fine-tune ``model_dir`` (a directory or a loaded model) on ``dataset``; returns ``out_dir/final`` (a plain
    model directory, LoRA merged).

    Checkpoints go to ``out_dir/checkpoint-*``; with ``resume`` training continues from the newest one. ``device``
    and ``dtype`` are ``model.device`` / ``model.dtype`` (a directory is loaded in that dtype; on a GPU with
    bfloat16 the trainer computes in bfloat16 autocast).
    """
    out_dir = Path(out_dir)
    if len(dataset) == 0:
        raise ValueError("The SFT dataset is empty: collect successful demonstrations first.")
    where = training_device(device)
    conversational_rows = "input_ids" not in dataset.column_names
    args = SFTConfig(
        output_dir=str(out_dir),
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        learning_rate=settings.learning_rate,
        per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        warmup_steps=settings.warmup_steps,
        lr_scheduler_type=settings.lr_scheduler,
        weight_decay=settings.weight_decay,
        gradient_checkpointing=settings.gradient_checkpointing,
        logging_steps=settings.logging_steps,
        save_steps=settings.save_steps,
        save_total_limit=2,
        report_to="none",  # the loss history is kept in checkpoint-*/trainer_state.json
        seed=seed,
        max_length=None,
        assistant_only_loss=conversational_rows,
        dataloader_num_workers=0,
        disable_tqdm=False,
        # TRL defaults to bf16 autocast, which CPUs here cannot train in: use it only where a GPU supports it.
        use_cpu=where.type == "cpu",
        bf16=where.type == "cuda" and torch.cuda.is_bf16_supported(),
    )
    model = load_model(model_dir, device=where, dtype=dtype) if isinstance(model_dir, str | Path) else model_dir
    check_trainable(model)
    model.train()
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=training_columns(dataset),
        processing_class=tokenizer,
        peft_config=lora_config(settings.lora) if settings.lora else None,
    )
    checkpoint = get_last_checkpoint(str(out_dir)) if resume and out_dir.is_dir() else None
    if resume and checkpoint is None:
        logger.info("No checkpoint in %s: starting SFT from the beginning.", out_dir)
    trainer.train(resume_from_checkpoint=checkpoint)
    trained = trainer.model
    if settings.lora:
        trained = trained.merge_and_unload()
    final = out_dir / "final"
    if trainer.accelerator.is_main_process:  # under accelerate launch, one process writes
        trained.save_pretrained(final)
        tokenizer.save_pretrained(final)
    trainer.accelerator.wait_for_everyone()
    return final
