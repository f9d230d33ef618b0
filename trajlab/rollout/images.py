"""The images a trajectory's model saw, by content: PNG bytes named after their hash.

Why: an image is kept once, losslessly, beside the trajectory file (never as base64 in every JSON line), and the
sampler and every later forward pass decode the very same bytes, so SFT and RL see exactly the pixels the rollout
saw. Two episodes that saw the same image share its file.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

from trajlab.errors import require


def encode_png(image: Any) -> tuple[str, bytes]:
    """An RGB PIL image's id (``<sha256>.png``) and its PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    return f"{hashlib.sha256(data).hexdigest()}.png", data


def decode_png(data: bytes) -> Any:
    """The RGB PIL image of PNG bytes made by :func:`encode_png`."""
    image_module = require("PIL.Image", feature="images from tools", install="pip install 'trajlab[vision]'")
    with image_module.open(io.BytesIO(data)) as opened:
        return opened.convert("RGB")


def is_image_id(value: Any) -> bool:
    """Whether ``value`` names an image as :func:`encode_png` does."""
    return isinstance(value, str) and len(value) == 68 and value.endswith(".png") \
        and all(c in "0123456789abcdef" for c in value[:64])
