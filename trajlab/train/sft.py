"""SFT on trajectories with TRL's SFTTrainer, loss on the model's own tokens only; the recipe
(:mod:`trajlab.recipes.sft`) loads the model and shapes the dataset, :func:`train_sft` trains it.

The dataset carries the trajectory's exact tokens (``input_ids``) and its loss mask (``assistant_masks``); TRL turns
the mask into labels (-100 elsewhere), so system, user and tool tokens never carry loss, whatever the chat template.
Text-only rows (no tokens) fall back to TRL's conversational path, which needs ``{% generation %}`` markers.

The loss is computed from the final hidden states, the output head run on a bounded slice of the trained tokens at a
time (:class:`SlicedLossTrainer`): no (batch, length, vocabulary) tensor, so memory grows with the length alone.

Rows with images (an ``images`` column, see :func:`trajlab.data.datasets.sft_dataset`) train through
:class:`ImageCollator`: the same padding and labels, plus the image inputs the sampler gave the model for the same
placeholders, so SFT on a vision-language model is token- and pixel-exact.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PrinterCallback, Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from trajlab.config import SFTSettings
from trajlab.inference.pixels import image_inputs
from trajlab.models.devices import release_freed_memory
from trajlab.rollout.images import decode_png
from trajlab.tracking import Trackers
from trajlab.train.checkpoints import MetricsLog, save_final
from trajlab.train.logprobs import head_statistics, output_head
from trajlab.train.lora import lora_config
from trajlab.train.optim import MasterWeightAdamW, needs_master_weights
from trajlab.train.rates import with_learning_rate

logger = logging.getLogger(__name__)
# transformers 5.23 renamed TrainingArguments' gradient_checkpointing to activation_checkpointing (the old name is a
# deprecated alias there); before it, as in the vLLM lane's 5.19, only the old name exists.
CHECKPOINTING_ARGUMENT = ("activation_checkpointing" if "activation_checkpointing" in
                          {field.name for field in dataclasses.fields(SFTConfig)} else "gradient_checkpointing")

SFT_METRIC_NAMES = {
    "loss": "loss/sft", "mean_token_accuracy": "loss/token_accuracy", "entropy": "loss/entropy",
    "grad_norm": "optim/grad_norm", "learning_rate": "optim/lr", "epoch": "optim/epoch",
    "num_tokens": "perf/num_tokens", "train_runtime": "perf/train_runtime_s", "train_samples_per_second":
    "perf/samples_per_s", "train_steps_per_second": "perf/steps_per_s", "total_flos": "perf/total_flos",
    "train_loss": "loss/sft_mean",
}
"""What the transformers Trainer logs during SFT, by the names users see (docs/metrics.md); anything else it
logs becomes ``sft/<name>``."""


def named(logs: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a trainer log under the names users see (:data:`SFT_METRIC_NAMES`, else ``sft/<name>``)."""
    return {SFT_METRIC_NAMES.get(key, f"sft/{key}"): value for key, value in logs.items()
            if isinstance(value, int | float)}


class SFTMetrics(TrainerCallback):
    """Every log of the SFT trainer, under the names of :data:`SFT_METRIC_NAMES`, to ``metrics.jsonl`` (a
    :class:`MetricsLog`: resuming from ``checkpoint-N`` first drops its rows after step N) and the trackers."""

    def __init__(self, metrics: MetricsLog, trackers: Trackers) -> None:
        self.metrics, self.trackers = metrics, trackers

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step} | named(logs)
        self.metrics.write(record)
        self.trackers.log(record, step=state.global_step)


class StepProgress(TrainerCallback):
    """The trainer's progress as ``on_progress(step, max_steps)`` after every optimizer step, and each log as one
    line (the trainer's own bar and printed dicts are off)."""

    def __init__(self, on_progress: Callable[[int, int], None]) -> None:
        self.on_progress = on_progress

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.on_progress(state.global_step, state.max_steps)

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        if state.is_world_process_zero and logs:
            shown = " ".join(f"{name} {value:.4g}" for name, value in named(logs).items())
            logger.info("sft step %d/%d: %s", state.global_step, state.max_steps, shown)


class ImageCollator:
    """Batches rows of ``input_ids``, ``assistant_masks`` and ``images`` for a vision-language model.

    Padding and labels are TRL's for pre-tokenized rows (labels -100 outside ``assistant_masks``, then TRL's own
    collator pads on the right); the image inputs come from :func:`image_inputs`, the function the sampler calls,
    on the images decoded from their PNG bytes as the sampler decoded them. TRL's collator for image datasets would
    re-render each row from its messages instead.
    """

    def __init__(self, model: PreTrainedModel, processor: Any, pad_token_id: int) -> None:
        self.model, self.processor = model, processor
        self.pad = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.pad([{"input_ids": row["input_ids"], "labels": [
            token if bit else -100 for token, bit in zip(row["input_ids"], row["assistant_masks"], strict=True)]}
            for row in rows])  # input_ids, attention_mask, labels: (B, L)
        images = [decode_png(image["bytes"]) for row in rows for image in row["images"]]  # row-major, as placed
        return batch | image_inputs(self.model, self.processor, images, batch["input_ids"])


def sliced_sft_loss(model: torch.nn.Module, inputs: Mapping[str, Any],
                    num_items_in_batch: torch.Tensor | int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean negative log-likelihood of a batch's labelled tokens (``labels`` not -100), over
    ``num_items_in_batch`` when given (the tokens of the whole accumulated batch, as TRL divides) or the batch's own
    count; and the sums its metrics need (``entropy``, ``correct``: top-1 predictions, ``tokens``).

    The model returns its final hidden states; only the labelled positions go through the output head, a slice at a
    time (:func:`head_statistics`), so no (B, T, V) logits exist. Other inputs (image inputs) reach the model as given.
    """
    labels = inputs["labels"][:, 1:]  # (B, T - 1): position t predicts token t + 1
    kept = labels != -100
    forward = {name: value for name, value in inputs.items() if name not in ("labels", "use_cache")}
    hidden = model(**forward, use_cache=False, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
    logprobs, entropy, top1 = head_statistics(hidden[:, :-1][kept], output_head(model), labels[kept], 1.0)  # (N,)
    count = kept.sum() if num_items_in_batch is None else num_items_in_batch
    loss = -logprobs.sum() / torch.as_tensor(count, device=logprobs.device).clamp(min=1)
    return loss, {"entropy": entropy.sum(), "correct": top1.sum(), "tokens": kept.sum()}


class SlicedLossTrainer(SFTTrainer):
    """TRL's SFTTrainer with its negative log-likelihood computed by :func:`sliced_sft_loss`: the same loss, the same
    normalisation and metrics, from bounded slices of the labelled tokens.

    TRL's own fused head scores every position (on a CPU, in tiles of 4,096 tokens x 32,768 vocabulary entries, half
    a gigabyte each in float32); this scores only the labelled ones, 128 tokens at a time. Losses this does not
    compute (label smoothing, DFT, a custom loss function, a mixture of experts' auxiliary loss, outputs asked for
    in evaluation) stay TRL's.
    """

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        own = (self.args.loss_type == "nll" and self.compute_loss_func is None and self.label_smoother is None
               and not self.aux_loss_enabled and not return_outputs)
        if not own:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.accelerator.autocast():  # mixed precision runs only the forward under autocast: the head here too
            loss, sums = sliced_sft_loss(model, inputs, num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:  # as TRL: DDP averages
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        mode = "train" if self.model.training else "eval"
        gathered = {name: self.accelerator.gather_for_metrics(value.detach()).sum() for name, value in sums.items()}
        tokens = gathered["tokens"].clamp(min=1)
        self._metrics[mode]["entropy"].append((gathered["entropy"] / tokens).item())
        self._metrics[mode]["mean_token_accuracy"].append((gathered["correct"] / tokens).item())
        if mode == "train":  # tokens seen: a padded batch's attention mask, a padding-free row's length
            mine = (inputs["attention_mask"].sum() if "attention_mask" in inputs
                    else torch.tensor(inputs["input_ids"].shape[1], device=inputs["input_ids"].device))
            self._total_train_tokens += self.accelerator.gather_for_metrics(mine).sum().item() // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return loss

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """TRL's forward and backward pass, then the pages they freed back to the system before the optimizer step
        allocates (:func:`release_freed_memory`)."""
        loss = super().training_step(*args, **kwargs)
        release_freed_memory()
        return loss


def training_columns(dataset: Dataset) -> Dataset:
    """Keep what TRL trains on: token columns (and images, as undecoded PNG bytes) when present, else the
    conversation.

    Raises:
        ValueError: images without token rows (the conversational path cannot place them).
    """
    if "input_ids" in dataset.column_names:
        if "images" not in dataset.column_names:
            return dataset.select_columns(["input_ids", "assistant_masks"])
        kept = dataset.select_columns(["input_ids", "assistant_masks", "images"])
        return kept.cast_column("images", datasets.List(datasets.Image(decode=False)))
    if "images" in dataset.column_names:
        raise ValueError("The SFT dataset has images but no input_ids: image trajectories train on their token "
                         "record only (some trajectory lacks one).")
    from trajlab.data.datasets import conversational

    return conversational(dataset).select_columns(["messages", "tools"])


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Dataset,
    out_dir: Path,
    settings: SFTSettings,
    *,
    seed: int,
    resume: bool,
    device: torch.device,
    report_to: Sequence[str],
    on_progress: Callable[[int, int], None] | None,
    processor: Any,
) -> Path:
    """Fine-tune ``model`` (loaded on ``device``, where training runs) on ``dataset``; returns ``out_dir/final`` (a
    plain model directory, LoRA merged, with the tokenizer and, for a vision-language model, ``processor``).

    Checkpoints go to ``out_dir/checkpoint-*``; with ``resume`` training continues from the newest one. On a GPU
    with bfloat16 the trainer computes in bfloat16 autocast; a model in bfloat16 trains with float32 master weights and
    AdamW moments (``settings.master_weights``, :mod:`trajlab.train.optim`). Every log (``SFT_METRIC_NAMES``) goes to
    ``out_dir/metrics.jsonl`` and the trackers of ``report_to`` (:mod:`trajlab.tracking`). ``on_progress(step,
    max_steps)`` replaces the trainer's progress bar and printed logs (:class:`StepProgress`). ``processor``
    (:func:`trajlab.models.loading.load_processor`) is required when ``dataset`` has images (:class:`ImageCollator`).
    """
    if len(dataset) == 0:
        raise ValueError("The SFT dataset is empty: collect successful demonstrations first.")
    images = "images" in dataset.column_names
    if images and processor is None:
        raise ValueError("The SFT dataset has images: pass the vision-language model's processor "
                         "(trajlab.models.loading.load_processor).")
    if images and settings.padding_free:
        raise ValueError("The SFT dataset has images, which train in padded batches: set sft.padding_free: false.")
    settings = with_learning_rate(settings, model, "sft")
    model.train()
    arguments = _trainer_arguments(out_dir, settings, seed=seed, device=device, images=images,
                                   conversational="input_ids" not in dataset.column_names, bar=on_progress is None)
    trainer_class, peft_config = SlicedLossTrainer, lora_config(settings.lora) if settings.lora else None
    if settings.sharding == "fsdp":  # the arguments started the process group; LoRA goes in before sharding
        from trajlab.train.sft_sharded import ShardedSFTTrainer, sharded_policy

        model = sharded_policy(model, settings, arguments.world_size, arguments.seed)
        trainer_class, peft_config = ShardedSFTTrainer, None
    trainer = trainer_class(
        model=model,
        args=arguments,
        optimizer_cls_and_kwargs=_master_weight_optimizer(arguments, model, settings),
        data_collator=ImageCollator(model, processor, tokenizer.pad_token_id) if images else None,
        train_dataset=training_columns(dataset),
        # A processor tells TRL the model is a VLM (unused vision weights under DDP) and goes into each checkpoint.
        processing_class=tokenizer if processor is None else processor,
        peft_config=peft_config,
    )
    if on_progress is not None:
        trainer.remove_callback(PrinterCallback)  # what disable_tqdm puts in the bar's place: a dict per log
        trainer.add_callback(StepProgress(on_progress))
    checkpoint = get_last_checkpoint(str(out_dir)) if resume and out_dir.is_dir() else None
    if resume and checkpoint is None:
        logger.info("No checkpoint in %s: starting SFT from the beginning.", out_dir)
    main = trainer.accelerator.is_main_process
    with Trackers(report_to, out_dir.parent, out_dir.name, enabled=main,
                  config={"sft": settings.model_dump(mode="json"), "seed": seed}) as trackers:
        if main:
            resumed_at = int(Path(checkpoint).name.rpartition("-")[2]) if checkpoint else None
            trainer.add_callback(SFTMetrics(MetricsLog(out_dir / "metrics.jsonl", resumed_at), trackers))
        trainer.train(resume_from_checkpoint=checkpoint)
    return save_final(trainer.model, tokenizer, processor, out_dir / "final", lora=bool(settings.lora),
                      accelerator=trainer.accelerator)


def _master_weight_optimizer(arguments: SFTConfig, model: Any, settings: SFTSettings) -> tuple[type, dict] | None:
    """The trainer's own AdamW and arguments with float32 master weights (:mod:`trajlab.train.optim`), for a model
    in bfloat16 with ``master_weights``; None: the trainer's optimizer as it is."""
    if not settings.master_weights or not needs_master_weights(model.parameters()):
        return None
    kind, kwargs = Trainer.get_optimizer_cls_and_kwargs(arguments, model)
    if not issubclass(kind, torch.optim.AdamW):
        raise ValueError(f"master weights wrap AdamW; the trainer's optimizer is {kind.__name__}")
    return MasterWeightAdamW, kwargs


def _trainer_arguments(out_dir: Path, settings: SFTSettings, *, seed: int, device: torch.device, images: bool,
                       conversational: bool, bar: bool) -> SFTConfig:
    """TRL's arguments for the settings: checkpoints in ``out_dir``, logs to trajlab's callbacks only."""
    return SFTConfig(
        output_dir=str(out_dir),
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        learning_rate=settings.learning_rate,
        per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        warmup_steps=settings.warmup_steps,
        lr_scheduler_type=settings.lr_scheduler,
        weight_decay=settings.weight_decay,
        **{CHECKPOINTING_ARGUMENT: settings.gradient_checkpointing},
        logging_steps=settings.logging_steps,
        save_steps=settings.save_steps,
        save_total_limit=2,
        report_to="none",  # SFTMetrics sends the logs to metrics.jsonl and the trackers, under trajlab's names
        seed=seed,
        max_length=None,
        assistant_only_loss=conversational,
        dataloader_num_workers=0,
        padding_free=settings.padding_free,  # TRL flattens each batch into one row with restarting position ids
        # An image dataset makes TRL keep only its own vision columns, input_ids and assistant_masks not among them;
        # training_columns already chose the columns.
        remove_unused_columns=not images,
        dataloader_pin_memory=not images,  # ImageCollator's image inputs are on the model's device already
        disable_tqdm=not bar,
        # TRL defaults to bf16 autocast, which CPUs here cannot train in: use it only where a GPU supports it.
        use_cpu=device.type == "cpu",
        bf16=device.type == "cuda" and torch.cuda.is_bf16_supported(),
    )
