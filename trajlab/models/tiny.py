"""The tiny offline default model: a byte-level BPE tokenizer trained in memory on synthetic tool-calling chats
(:mod:`trajlab.models.offline_tokenizer`) and a randomly initialised Qwen3-architecture model, built in seconds.

No model hub is reachable where trajlab runs, so the default model is made here from nothing; every other model
goes through the same loading path (:mod:`trajlab.models.loading`) with a different directory.
"""

from __future__ import annotations

import os
import shutil
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from trajlab.models.offline_tokenizer import build_offline_tokenizer

TINY_CHAT_TEMPLATE: str = files("trajlab.chat").joinpath("templates/tiny.jinja").read_text(encoding="utf-8")

# How `tokenizer.parse_response` (transformers >= 5.13) reads an assistant turn rendered by TINY_CHAT_TEMPLATE:
# free text, then any number of `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, then <|im_end|>.
TINY_RESPONSE_TEMPLATE: dict = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>\s*", "content": "text"},
    },
}

# Special tokens are skipped by `decode(skip_special_tokens=True)`; the tool markers are plain added tokens (as in
# Qwen2.5), so text decoded either way still carries the tool calls a parser needs.
TINY_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

TINY_ADDED_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# About 3M parameters: generates in well under a second on two CPU cores, yet has the real architecture (GQA,
# q/k norms, RoPE, tied embeddings) so every code path a real Qwen3 model takes is exercised.
TINY_VOCAB_SIZE = 1536

TINY_MODEL_CONFIG: dict = {
    "hidden_size": 192,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 32768,  # RoPE: long multi-turn rollouts cost no parameters
    "tie_word_embeddings": True,
    # Weights drawn at std 0.1, not Qwen3's 0.02 (about 1/sqrt(width) for its 2048-4096-wide layers; here 1/sqrt(192)
    # is 0.072). At 0.02 the tiny model starts with near-silent layers, and when SFT learns to copy a number from its
    # context into a call depends on the seed: the quickstart's 600 steps reached 0.21-0.94 held-out success on 3
    # seeds. At 0.1, with the same constant SFT rate, they reach 0.945-1.000 on each of 5 (BENCHMARKS.md, "Why SFT
    # depended on the seed"; with the rate decayed, SFT on the optimal reference reaches 0.987-0.999).
    "initializer_range": 0.1,
}


@cache
def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer does not depend on the seed: train it once per process. It never leaves this module."""
    tokenizer = build_offline_tokenizer(
        TINY_CHAT_TEMPLATE,
        list(TINY_SPECIAL_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        vocab_size=TINY_VOCAB_SIZE,
        added_tokens=TINY_ADDED_TOKENS,
    )
    tokenizer.response_template = TINY_RESPONSE_TEMPLATE
    tokenizer.model_max_length = TINY_MODEL_CONFIG["max_position_embeddings"]
    return tokenizer


def prepare_model_dir(out_dir: str | Path, *, overwrite: bool) -> Path:
    """The directory a model builder writes to: empty or new, or an old model directory removed when `overwrite`.

    Refuses to delete a non-empty directory that holds no `config.json`, so a mistyped path never costs data.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} already exists and is not empty; replace it with --overwrite "
                                  "(overwrite=True in Python)")
        if not (out / "config.json").is_file():
            raise FileExistsError(f"{out} holds no config.json: refusing to delete a directory that is not a model")
        shutil.rmtree(out)
    return out


def init_tiny_model(out_dir: str | Path, *, seed: int, overwrite: bool = False) -> Path:
    """Write the tiny offline default model, tokenizer and generation config to `out_dir`.

    The tokenizer is the same for every seed (its corpus is fixed); `seed` only sets the weights, so models built
    with different seeds share token ids. `overwrite` replaces an existing model directory, and refuses to delete
    a non-empty directory that holds no `config.json`.

    Returns:
        The output directory, loadable with `load_model` / `load_tokenizer` or plain `from_pretrained`.
    """
    out = prepare_model_dir(out_dir, overwrite=overwrite)
    tokenizer = _tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **TINY_MODEL_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return save_tiny_model(model, tokenizer, tokenizer, out)


def init_tiny(out_dir: str | Path, *, seed: int, vision: bool, overwrite: bool = False) -> tuple[Path, str]:
    """The tiny text model, or with ``vision`` the tiny vision-language one, written to ``out_dir``; returns the
    directory and what it holds in words (for the caller's log line)."""
    if vision:
        from trajlab.models.tiny_vision import init_tiny_vision_model  # imports this module: not at the top

        return init_tiny_vision_model(out_dir, seed=seed, overwrite=overwrite), "tiny vision-language model"
    return init_tiny_model(out_dir, seed=seed, overwrite=overwrite), "tiny model"


def save_tiny_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, files: Any, out: Path) -> Path:
    """Write a tiny model to ``out`` with ``files`` (its tokenizer, or a processor holding it), generating until
    ``tokenizer``'s end of turn, padding with its pad token, no beginning-of-sequence token."""
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(out)
    files.save_pretrained(out)
    return out


def default_model_dir() -> Path:
    """Where the tiny offline default model lives (``$TRAJLAB_HOME/tiny-model``, else under ``~/.cache/trajlab``)."""
    return Path(os.environ.get("TRAJLAB_HOME", Path.home() / ".cache" / "trajlab")) / "tiny-model"

DEFAULT_MODEL_SEED = 0
"""The default model's weight seed: what matters of it is its tokenizer, the same for every seed."""


def ensure_default_model() -> Path:
    """The default model's directory, built on first use: what a command without a model (the oracle's tokens,
    ``trajlab.check_env``) renders its tokens with."""
    path = default_model_dir()
    if not (path / "config.json").exists():
        init_tiny_model(path, seed=DEFAULT_MODEL_SEED, overwrite=True)
    return path
