"""The SFT recipe, :func:`trajlab.sft`: the model read from its directory, the trajectories through the drift guard
into an SFT dataset, then TRL's SFTTrainer on the model's own tokens (:func:`trajlab.train.sft.train_sft`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedModel

from trajlab.config import DatasetSettings, RolloutSettings, SFTSettings
from trajlab.data.datasets import sft_dataset
from trajlab.recipes.arguments import Progress, given_or_default, model_settings, run_seed, settings_of
from trajlab.recipes.loading import processor_of, tokenizer_of, trainable_model
from trajlab.rollout.drift import without_drift
from trajlab.rollout.types import Trajectory
from trajlab.tracking import require_trackers
from trajlab.train.placement import training_device
from trajlab.train.sft import train_sft


def sft(
    model: str | Path | PreTrainedModel,
    data: Iterable[Trajectory] | datasets.Dataset,
    out: str | Path,
    *,
    tokenizer: Any = None,
    processor: Any = None,
    seed: int | None = None,
    resume: bool = False,
    dataset: DatasetSettings | Mapping[str, Any] | None = None,
    parser: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    report_to: Sequence[str] = (),
    on_progress: Progress | None = None,
    **settings: Any,
) -> Path:
    """Fine-tune ``model`` on trajectories (the model's own tokens only); returns ``out/final``.

    Args:
        model: a model directory or a loaded transformers model (then ``tokenizer`` is required).
        data: trajectories (successes are kept unless ``dataset={"include_failures": True}``), or a Hugging Face
            dataset from :func:`trajlab.data.datasets.sft_dataset`. Trajectories pass the drift guard first
            (:func:`without_drift`, ``max_drift`` in ``settings``).
        out: checkpoints, then ``out/final`` (LoRA merged).
        processor: a loaded vision-language model's processor; a model directory's own is loaded (none for a text
            model). Needed when ``data`` holds images.
        seed: the data order and initialisation seed (None: the config's ``seed``).
        dataset: ``DatasetSettings`` applied when ``data`` is trajectories.
        parser: the tool-call parser the trajectories were rolled out with (``rollout.parser``; None: its default),
            for the guard.
        device, dtype: where training runs and the dtype a model directory is loaded in (``ModelSettings``).
        report_to: experiment trackers that also get the training logs (``out/metrics.jsonl``).
        on_progress: called with (optimizer steps done, total) after each step, instead of the trainer's own bar.
        **settings: ``SFTSettings`` fields (``epochs``, ``max_steps``, ``learning_rate``, ``lora``...).
    """
    require_trackers(report_to)
    chosen, placed = settings_of(SFTSettings, settings), model_settings(device, dtype, None)
    tokenizer, processor = tokenizer_of(model, tokenizer), processor_of(model, processor)
    if not isinstance(data, datasets.Dataset):
        shaping = settings_of(DatasetSettings, dataset)
        checked = without_drift(data, tokenizer, parser=given_or_default(parser, RolloutSettings, "parser"),
                                max_drift=chosen.max_drift, processor=processor)
        data = sft_dataset(checked, include_failures=shaping.include_failures,
                           shortest_per_task=shaping.shortest_per_task, max_tokens=shaping.max_tokens)
    where = training_device(placed.device)
    return train_sft(trainable_model(model, device=where, dtype=placed.dtype), tokenizer, data, Path(out), chosen,
                     seed=run_seed(seed), resume=resume, device=where, report_to=report_to, on_progress=on_progress,
                     processor=processor)
