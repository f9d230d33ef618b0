"""The tiny offline vision-language model: Gemma 3 architecture, random weights, built in seconds.

What `trajlab model init --vision` writes, so that images from tools can be tested end to end with no model hub: a
Gemma 3 model (SigLIP vision tower, average-pooling projector, Gemma 3 text decoder) at the text size of the tiny
model, its processor (image processor configured here, tokenizer, chat template) and generation config.

Why Gemma 3 and not Qwen-VL: every Qwen-VL processor in transformers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) holds
a video processor, and transformers' video processors need torchvision, which trajlab does not depend on (no
torchvision build matches the CPU torch it installs). Gemma 3's processor is an image processor (with a PIL backend)
and a tokenizer, so `AutoProcessor.from_pretrained` works on any machine trajlab runs on. The Qwen3-VL model itself
runs on the CPU; `load_model` loads such a directory, and `load_processor` names torchvision when it is missing.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from pathlib import Path

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    PreTrainedTokenizerFast,
)

from trajlab.errors import require
from trajlab.models.offline_tokenizer import build_offline_tokenizer
from trajlab.models.tiny import (
    DEFAULT_MODEL_SEED,
    TINY_ADDED_TOKENS,
    TINY_MODEL_CONFIG,
    TINY_RESPONSE_TEMPLATE,
    TINY_SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    default_model_dir,
    prepare_model_dir,
    save_tiny_model,
)

TINY_VL_CHAT_TEMPLATE: str = files("trajlab.chat").joinpath("templates/tiny_vl.jinja").read_text(encoding="utf-8")

# Gemma 3's image tokens, by the names its processor reads them (`tokenizer.boi_token`, ...). The chat template writes
# one <start_of_image> per image; the processor expands it to "\n\n<start_of_image>", TINY_VL_TOKENS_PER_IMAGE
# <image_soft_token> (where the model puts the image's embeddings) and "<end_of_image>\n\n".
TINY_VL_IMAGE_TOKENS: dict[str, str] = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}

# Every image is resized to 64x64 pixels: 16 patches of 16x16, average-pooled 2x2 into 4 image tokens.
TINY_VL_IMAGE_SIZE = 64
TINY_VL_TOKENS_PER_IMAGE = 4

# The tiny text model's sizes with Gemma 3's attention: sliding-window layers and a global one (real Gemma 3 has
# five local layers to one global, with a 1024-token window; four layers keep three and one).
TINY_VL_TEXT_CONFIG: dict = {
    **{k: v for k, v in TINY_MODEL_CONFIG.items() if k != "tie_word_embeddings"},
    "query_pre_attn_scalar": TINY_MODEL_CONFIG["head_dim"],
    "sliding_window": 1024,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
}
TINY_VL_VISION_CONFIG: dict = {
    "model_type": "siglip_vision_model",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": TINY_VL_IMAGE_SIZE,
    "patch_size": 16,
    "vision_use_head": False,  # Gemma 3 reads the patch embeddings, not SigLIP's pooled head
}


@cache
def _tiny_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer's corpus and merges plus the image tokens; like it, trained once per process."""
    tokenizer = build_offline_tokenizer(
        TINY_VL_CHAT_TEMPLATE,
        [*TINY_SPECIAL_TOKENS, *TINY_VL_IMAGE_TOKENS.values()],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        vocab_size=TINY_VOCAB_SIZE + len(TINY_VL_IMAGE_TOKENS),
        added_tokens=TINY_ADDED_TOKENS,
        named_tokens=TINY_VL_IMAGE_TOKENS,
    )
    tokenizer.response_template = TINY_RESPONSE_TEMPLATE  # the assistant turns are tiny.jinja's
    tokenizer.model_max_length = TINY_VL_TEXT_CONFIG["max_position_embeddings"]
    return tokenizer


def _tiny_vl_processor() -> Gemma3Processor:
    """The tiny vision-language model's processor, configured in code: no file is read or downloaded."""
    image_processor = Gemma3ImageProcessorPil(
        size={"height": TINY_VL_IMAGE_SIZE, "width": TINY_VL_IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],  # Gemma 3's normalisation
        image_std=[0.5, 0.5, 0.5],
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=_tiny_vl_tokenizer(),
        chat_template=TINY_VL_CHAT_TEMPLATE,
        image_seq_length=TINY_VL_TOKENS_PER_IMAGE,
    )


def init_tiny_vision_model(out_dir: str | Path, *, seed: int, overwrite: bool = False) -> Path:
    """Write the tiny offline vision-language model, its processor and generation config to `out_dir`.

    As with `init_tiny_model`, the tokenizer and processor are the same for every seed; `seed` only sets the
    weights. `overwrite` replaces an existing model directory, and refuses to delete a non-empty directory that
    holds no `config.json`.

    Returns:
        The output directory, loadable with `load_model` / `load_processor` / `load_tokenizer` or plain
        `AutoModelForImageTextToText` / `AutoProcessor.from_pretrained`.
    """
    require("PIL", feature="the tiny vision-language model", install="pip install 'trajlab[vision]'")
    out = prepare_model_dir(out_dir, overwrite=overwrite)
    processor = _tiny_vl_processor()
    tokenizer = processor.tokenizer
    image_ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in TINY_VL_IMAGE_TOKENS.items()}
    config = Gemma3Config(
        text_config={
            **TINY_VL_TEXT_CONFIG,
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
        },
        vision_config=TINY_VL_VISION_CONFIG,
        mm_tokens_per_image=TINY_VL_TOKENS_PER_IMAGE,
        boi_token_index=image_ids["boi_token"],
        eoi_token_index=image_ids["eoi_token"],
        image_token_index=image_ids["image_token"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config)
        # transformers starts Gemma 3's image projection at zero (training then begins from the text model), which
        # would leave every image embedding zero: a random one lets pixels reach the logits, as in a trained model.
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight,
                              std=config.initializer_range)
    return save_tiny_model(model, tokenizer, processor, out)


def default_vision_model_dir() -> Path:
    """Where the tiny offline vision-language model lives: beside the default text model."""
    return default_model_dir().with_name("tiny-vision-model")


def ensure_default_vision_model() -> Path:
    """The default vision-language model's directory, built on first use: what the reference policy of an env whose
    tools return images writes its tokens with when no tokenizer is given."""
    path = default_vision_model_dir()
    if not (path / "config.json").exists():
        init_tiny_vision_model(path, seed=DEFAULT_MODEL_SEED, overwrite=True)
    return path
