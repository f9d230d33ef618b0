"""What a training recipe starts from: a model directory, read here and nowhere else in training, or objects the
caller built (a loaded model with its tokenizer)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trajlab.errors import UserError
from trajlab.models.loading import load_model, load_processor, load_tokenizer
from trajlab.train.placement import check_trainable


def tokenizer_of(model: str | Path | Any, tokenizer: Any) -> PreTrainedTokenizerBase:
    """The tokenizer given (or read from the directory given), else the model directory's own.

    Raises:
        UserError: a loaded model without a tokenizer.
    """
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if tokenizer is None and not isinstance(model, str | Path):
        raise UserError("a loaded model needs tokenizer=: its tokenizer or the directory holding it.")
    return load_tokenizer(tokenizer or model)


def processor_of(model: str | Path | Any, processor: Any) -> Any:
    """The processor given, else a model directory's own (None for a text model or a loaded model)."""
    if processor is not None or not isinstance(model, str | Path):
        return processor
    return load_processor(model)


def trainable_model(model: str | Path | PreTrainedModel, *, device: torch.device, dtype: str) -> PreTrainedModel:
    """The model to train: a directory loaded on ``device`` in ``dtype`` (``model.dtype``), or the loaded one.

    Raises:
        UserError: float16 weights (see :func:`check_trainable`).
    """
    loaded = load_model(model, device=device, dtype=dtype) if isinstance(model, str | Path) else model
    check_trainable(loaded)
    return loaded


def frozen_copy(model: str | Path | PreTrainedModel, *, device: torch.device,
                dtype: torch.dtype | str) -> PreTrainedModel:
    """The starting weights again, for a KL term's reference or a sampler's own copy: the directory loaded once more
    (``dtype``: a ``model.dtype`` name or a dtype), or a loaded model copied (before any training touched it)."""
    if isinstance(model, str | Path):
        return load_model(model, device=device, dtype=dtype)
    return copy.deepcopy(model)
