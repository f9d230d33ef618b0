"""Loading any Hugging Face causal LM or vision-language model (a local directory, or a name in the Hugging Face
cache: :mod:`trajlab.models.hub`), its tokenizer and its processor, on the device and in the dtype ``model.device`` /
``model.dtype`` name (:mod:`trajlab.models.devices`)."""

from __future__ import annotations

import inspect
from contextlib import suppress
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from trajlab.models.devices import AUTO, resolve_device, resolve_dtype
from trajlab.models.hub import resolve_model_dir
from trajlab.models.tiny import TINY_CHAT_TEMPLATE, TINY_RESPONSE_TEMPLATE


def _require_local(name_or_path: str | Path, what: str) -> str:
    """The local directory to load from: a directory, or a Hugging Face name's snapshot in the Hugging Face cache
    (:func:`~trajlab.models.hub.resolve_model_dir`); fails early, naming what was given and how to fix it."""
    return str(resolve_model_dir(name_or_path, what))


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer (a model directory or a cached Hugging Face name), ready for chat rendering and tool-call
    parsing.

    A missing `response_template` is filled in for the tiny template and for templates TRL knows (Qwen, Llama 3.1,
    ...); for other templates the tokenizer is returned without one and tool calls cannot be parsed by it.
    A missing pad token is set to the eos token: trajlab never infers padding from token ids.
    """
    path = _require_local(name_or_path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise OSError(f"cannot load tokenizer: {path} is not a tokenizer directory ({e})") from e
    return _complete_tokenizer(tokenizer)


def _complete_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Fill in what trajlab needs and a saved tokenizer may lack: a response template and a pad token."""
    if getattr(tokenizer, "response_template", None) is None:
        if tokenizer.chat_template == TINY_CHAT_TEMPLATE:
            tokenizer.response_template = TINY_RESPONSE_TEMPLATE
        else:
            from trl.chat_template_utils import add_response_schema  # trl brings datasets and pandas: a second

            with suppress(ValueError):  # unknown template: no parser, callers must bring their own
                add_response_schema(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def unwrapped_model(model: Any) -> Any:
    """The transformers model itself: for a PEFT model, the one it wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def forward_inputs(model: Any) -> frozenset[str]:
    """The keyword inputs ``model``'s forward takes (a PEFT model's: the wrapped model's), to pass it only those."""
    return _forward_parameters(type(unwrapped_model(model)))


@cache
def _forward_parameters(model_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def saved_dtype(name_or_path: str | Path) -> torch.dtype | None:
    """The dtype a model directory's weights were saved in (its config.json), None when it does not say."""
    return _config_dtype(AutoConfig.from_pretrained(_require_local(name_or_path, "model"), local_files_only=True))


def _config_dtype(config: PreTrainedConfig) -> torch.dtype | None:
    saved = config.dtype
    return getattr(torch, saved) if isinstance(saved, str) else saved


def _model_config(path: str, what: str) -> PreTrainedConfig:
    """A local model directory's config, with the errors a directory that is not a model deserves."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"cannot load {what}: {path} has no config.json, so it is not a model directory")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load {what}: {path}/config.json is not a config transformers knows ({e})") from e


def is_vision_language(config: PreTrainedConfig) -> bool:
    """Whether a config is an image-text-to-text model (Gemma 3, Qwen-VL, LLaVA, ...) rather than a text-only LM."""
    return type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


def load_model(
    name_or_path: str | Path, *, device: str | torch.device = AUTO, dtype: str | torch.dtype = AUTO
) -> PreTrainedModel:
    """Load any Hugging Face causal LM or vision-language model (a directory or a cached name) in eval mode on
    ``device`` in ``dtype`` (see :func:`resolve_device`, :func:`resolve_dtype`: by default the GPU when there is one,
    else the CPU in float32).

    A vision-language config loads through ``AutoModelForImageTextToText``, so the model takes ``pixel_values``
    (its processor: :func:`load_processor`); every other config through ``AutoModelForCausalLM``.
    """
    path = _require_local(name_or_path, "model")
    config = _model_config(path, "model")
    where = resolve_device(device)
    chosen = resolve_dtype(dtype, where, _config_dtype(config))
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    model = auto.from_pretrained(path, local_files_only=True, dtype=chosen)
    return model.to(where).eval()


def load_processor(name_or_path: str | Path) -> ProcessorMixin | None:
    """Load the processor (image processor, tokenizer, chat template) of a local vision-language model directory.

    Returns None for a text-only model, so a caller holding any model directory can branch on whether its policy
    sees images; the text side is :func:`load_tokenizer`'s either way. The processor's tokenizer gets the same
    fill-ins as :func:`load_tokenizer` (response template, pad token).

    Raises:
        FileNotFoundError, NotADirectoryError, ValueError: the path is not a model directory.
        OSError: a vision-language model directory without processor files.
        ImportError: the processor needs a package that is not installed (Qwen-VL processors need torchvision).
    """
    path = _require_local(name_or_path, "processor")
    if not is_vision_language(_model_config(path, "processor")):
        return None
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except ImportError as e:  # transformers' message names the package, over several lines
        raise ImportError(f"cannot load the processor of {path}: {' '.join(str(e).split())}") from e
    except (OSError, ValueError) as e:
        raise OSError(f"cannot load processor: {path} holds no processor transformers can load ({e})") from e
    _complete_tokenizer(processor.tokenizer)
    return processor
