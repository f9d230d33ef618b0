"""What a tool returned, as message content: text, or a list of text and image parts.

Why: a tool may answer with an image (a camera frame, a screenshot, a plot) for a vision-language model to read.
Tools return what is natural to them (a ``str``, a PIL image, encoded image ``bytes``, an ``(H, W[, C])`` uint8 array,
or a list of those and ``{"type": "text" | "image", ...}`` parts); the engine gets one form: a ``str``, or OpenAI-style
parts whose images are RGB PIL images. Anything else is shown as its ``str()``, as before images existed.
"""

from __future__ import annotations

import io
from typing import Any

from trajlab.errors import require

Content = str | list[dict[str, Any]]
"""A message's content: text, or ``[{"type": "text", "text": ...}, {"type": "image", "image": <PIL image>}, ...]``."""


def tool_content(value: Any) -> Content:
    """``value`` as message content (see the module doc): parts where it holds an image (an image alone becomes a
    one-part list), else text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        parts = [_part(item) for item in value]
        return parts if any(part["type"] == "image" for part in parts) else str(value)
    if (image := as_image(value)) is not None:
        return [{"type": "image", "image": image}]
    return str(value)


def _part(item: Any) -> dict[str, Any]:
    if isinstance(item, str):
        return {"type": "text", "text": item}
    if isinstance(item, dict) and item.get("type") == "text":
        return {"type": "text", "text": str(item.get("text", ""))}
    if isinstance(item, dict) and item.get("type") == "image":
        if (image := as_image(item.get("image"))) is None:
            raise TypeError(f"an image part's 'image' must be a PIL image, encoded image bytes or an array, not "
                            f"{type(item.get('image')).__name__}")
        return {"type": "image", "image": image}
    if (image := as_image(item)) is not None:
        return {"type": "image", "image": image}
    return {"type": "text", "text": str(item)}


def as_image(value: Any) -> Any | None:
    """``value`` as an RGB PIL image when it is one (a PIL image, encoded image bytes, a uint8 array), else None."""
    if type(value).__module__.startswith("PIL.") and hasattr(value, "convert"):
        return value.convert("RGB")
    if isinstance(value, bytes | bytearray):
        image_module = _pil()
        try:
            with image_module.open(io.BytesIO(value)) as opened:
                return opened.convert("RGB")
        except (image_module.UnidentifiedImageError, OSError):
            return None  # plain bytes: shown as text, as any other value
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and str(value.dtype) == "uint8" \
            and getattr(value, "ndim", 0) in (2, 3):
        return _pil().fromarray(value).convert("RGB")
    return None


def has_images(content: Any) -> bool:
    """Whether message content holds image parts."""
    return isinstance(content, list) and any(isinstance(part, dict) and part.get("type") == "image"
                                             for part in content)


def _pil() -> Any:
    return require("PIL.Image", feature="images from tools", install="pip install 'trajlab[vision]'")
