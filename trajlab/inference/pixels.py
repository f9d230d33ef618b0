"""A vision-language model's image inputs for token ids that hold image placeholders.

Why: the sampler and the trainer must give the model the same image inputs for the same tokens, or the logprobs the
rollout recorded are not those the update computes. Both call :func:`image_inputs`: the processor's image processor
on the PIL images (decoded from the trajectory's PNG bytes), and, for models that attend within an image both ways
(Gemma 3), ``token_type_ids`` marking the image tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trajlab.models.loading import forward_inputs, unwrapped_model


def image_inputs(model: Any, processor: Any, images: Sequence[Any], input_ids: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for ``model`` (its forward or generate) beside ``input_ids`` (B, L), whose placeholders are
    those of ``images`` in row-major order; none without images."""
    if not images:
        return {}
    if processor is None:
        raise ValueError(f"{len(images)} image(s) for a model without an image processor (a text model)")
    base, accepted = unwrapped_model(model), forward_inputs(model)
    processed = processor.image_processor(images=list(images), return_tensors="pt")
    inputs = {name: value.to(model.device) for name, value in processed.items()
              if name in accepted and isinstance(value, torch.Tensor)}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    # The token the model puts image embeddings at (the processor's own image_token_id may name another, e.g.
    # Gemma 3's <start_of_image>).
    image_token_id = getattr(base.config, "image_token_id", None)
    if "token_type_ids" in accepted and image_token_id is not None:
        inputs["token_type_ids"] = (input_ids == image_token_id).long().to(model.device)
    return inputs
