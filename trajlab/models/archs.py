"""Real architectures at real widths: randomly initialised twins of public models, with their real tokenizers.

A twin has the published model's configuration (hidden size, heads, key/value heads, head size, MLP width,
vocabulary, RoPE settings, tied embeddings, special token ids) at a depth of your choice, and the family's real
tokenizer files and licenses from :mod:`trajlab.models.families`. Its weights are random: it writes nonsense, but
every shape, kernel, memory cost and token id a run meets is the real model's, offline, in seconds at 1-2 layers.

Source of every value below: the model's public ``config.json`` and ``generation_config.json`` on the Hugging Face
Hub (Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B, Qwen/Qwen2.5-0.5B-Instruct, meta-llama/Llama-3.2-1B-Instruct), copied key for
key; the fields left out (architectures, model_type, torch_dtype, transformers_version, use_cache) are what the
config class and ``save_pretrained`` write themselves.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from trajlab.models.families import export_family
from trajlab.models.tiny import prepare_model_dir

_QWEN3 = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
          "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
          "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
          "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
          "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
# generation_config.json of Qwen3 and Qwen2.5-Instruct: ends at <|im_end|> or <|endoftext|>, pads with <|endoftext|>
_QWEN_GENERATION = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}


@dataclass(frozen=True)
class Arch:
    """A public model's architecture: its config.json values, stop tokens and tokenizer family."""

    source: str
    """The Hugging Face repository the values are copied from."""
    model_type: str
    family: str
    """The tokenizer family (:func:`trajlab.models.families.family_names`) shipped with trajlab."""
    config: dict[str, Any]
    generation: dict[str, Any] = field(default_factory=dict)
    """generation_config.json's token ids (its sampling defaults are left out: trajlab's settings decide those)."""


ARCHS: dict[str, Arch] = {
    "qwen3-0.6b": Arch("Qwen/Qwen3-0.6B", "qwen3", "qwen3", _QWEN3 | {
        "hidden_size": 1024, "intermediate_size": 3072}, _QWEN_GENERATION),
    "qwen3-1.7b": Arch("Qwen/Qwen3-1.7B", "qwen3", "qwen3", _QWEN3 | {
        "hidden_size": 2048, "intermediate_size": 6144}, _QWEN_GENERATION),
    "qwen2.5-0.5b": Arch("Qwen/Qwen2.5-0.5B-Instruct", "qwen2", "qwen2.5", {
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936}, _QWEN_GENERATION),
    "llama-3.2-1b": Arch("meta-llama/Llama-3.2-1B-Instruct", "llama", "llama3.2", {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256},
        {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}),
}
"""Every architecture ``trajlab model init --arch`` builds; the real checkpoints are all saved in bfloat16."""


def arch_names() -> list[str]:
    return sorted(ARCHS)


def arch(name: str) -> Arch:
    """The architecture called ``name``.

    Raises:
        ValueError: an unknown name, with the known ones and the closest.
    """
    if name not in ARCHS:
        close = difflib.get_close_matches(name, arch_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown architecture {name!r}{hint}; trajlab builds: {', '.join(arch_names())}")
    return ARCHS[name]


def arch_config(name: str, layers: int | None = None) -> Any:
    """The transformers config of architecture ``name`` at ``layers`` decoder layers (None: the real depth)."""
    chosen = arch(name)
    values = dict(chosen.config)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        values["num_hidden_layers"] = layers
    config = AutoConfig.for_model(chosen.model_type, **values)
    config.dtype = torch.bfloat16  # the published checkpoints' dtype, so `dtype: auto` treats a twin as the real one
    return config


def init_arch_model(name: str, out_dir: str | Path, *, layers: int | None = None, seed: int,
                    overwrite: bool = False) -> Path:
    """Write a randomly initialised model of architecture ``name`` (see :data:`ARCHS`) to ``out_dir``: config,
    bfloat16 safetensors, generation config with the model's stop tokens, and its family's real tokenizer files and
    license texts.

    Args:
        layers: decoder layers (None: the real model's depth); every other size is the real model's.
        seed: the weights' seed.
        overwrite: replace an existing model directory (never a non-empty directory without config.json).

    Returns:
        The output directory, loadable with ``load_model`` / ``load_tokenizer`` or plain ``from_pretrained``.
    """
    chosen = arch(name)
    config = arch_config(name, layers)
    out = prepare_model_dir(out_dir, overwrite=overwrite)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(**chosen.generation)
    model.save_pretrained(out)
    export_family(chosen.family, out)
    return out
