"""Images in chat requests: OpenAI ``image_url`` parts with inline data URLs in, image ids out.

Only data URLs are taken: the server fetches nothing (it must not be made to reach arbitrary addresses, and here
it could not), and a recording must hold the very pixels the model saw. Each image is decoded to RGB and kept as
lossless PNG bytes named by their hash (:func:`trajlab.rollout.images.encode_png`), as images from tools are; the
request then names it by that id. Why ids: an agent re-sends every image of its conversation with each call, so a
session file holding base64 would grow with the square of its length; the bytes are stored once, beside it.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Callable
from typing import Any

from trajlab.errors import require
from trajlab.proxy.errors import bad_request
from trajlab.rollout.images import encode_png

DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,(.*)", re.DOTALL)
MAX_IMAGE_PIXELS = 1 << 25
"""Larger images (32 Mpx, ~100 MB decoded) are refused before they are decoded: a small PNG can hold a huge one."""


def inline_images(messages: list[Any]) -> tuple[list[Any], dict[str, bytes]]:
    """``messages`` with each ``image_url`` part's data URL replaced by its image id, and each image's PNG bytes.

    The messages are copied where they change, never changed in place (the caller's body may be recorded as is).

    Raises:
        APIError: 400 for an image that is not an inline base64 data URL, does not decode, or is too large.
    """
    images: dict[str, bytes] = {}
    return _with_image_parts(messages, lambda part, where: _inlined(part, where, images)), images


def has_image_parts(messages: list[Any]) -> bool:
    """Whether any message holds an ``image_url`` part."""
    return any(isinstance(message, dict) and isinstance(message.get("content"), list)
               and any(_is_image_url(part) for part in message["content"]) for message in messages)


def without_image_data(messages: list[Any]) -> list[Any]:
    """``messages`` with each ``image_url`` part's URL replaced by a line saying what it held (its first 30
    characters and its length): the record of a call refused before its images were decoded, which keeps no bytes,
    as no model saw them."""
    return _with_image_parts(messages, lambda part, where: _described(part))


def _with_image_parts(messages: list[Any], replaced: Callable[[dict[str, Any], str], dict[str, Any]]) -> list[Any]:
    """``messages`` with each ``image_url`` part replaced by ``replaced(part, where)``; a message is copied only
    where it changes, never changed in place."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(_is_image_url(part) for part in content):
            message = {**message, "content": [replaced(part, f"messages[{i}].content[{j}]") if _is_image_url(part)
                                              else part for j, part in enumerate(content)]}
        out.append(message)
    return out


def _described(part: dict[str, Any]) -> dict[str, Any]:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    said = f"not kept: {url[:30]}... ({len(url)} characters)" if isinstance(url, str) else "not kept"
    return {**part, "image_url": {**spec, "url": said} if isinstance(spec, dict) else said}


def _is_image_url(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _inlined(part: dict[str, Any], where: str, images: dict[str, bytes]) -> dict[str, Any]:
    """The part with its URL replaced by the image's id (other fields, such as ``detail``, kept)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(url, str):
        raise bad_request(f'{where} must be {{"type": "image_url", "image_url": {{"url": '
                          '"data:image/png;base64,..."}}', param=where)
    image_id, data = _decode(url, where)
    images[image_id] = data
    return {**part, "image_url": {**spec, "url": image_id}}


def _decode(url: str, where: str) -> tuple[str, bytes]:
    """A data URL's image as (id, PNG bytes)."""
    found = DATA_URL.fullmatch(url)
    if found is None:
        kind = "an http(s) URL" if url.lower().startswith(("http://", "https://")) else "not a base64 image data URL"
        raise bad_request(f"{where}: the image_url is {kind} ({url[:40]!r}); this server fetches no URLs: send the "
                          "image inline as a data URL, data:image/png;base64,... (png, jpeg or webp)", param=where,
                          code="invalid_image_url")
    try:
        raw = base64.b64decode(found.group(1), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{where}: the image's data URL is not valid base64: {exc}", param=where,
                          code="invalid_image") from exc
    pil = require("PIL.Image", feature="images in chat requests", install="pip install 'trajlab[vision]'")
    try:
        with pil.open(io.BytesIO(raw)) as opened:
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise bad_request(f"{where}: the image is {opened.width}x{opened.height} pixels; at most "
                                  f"{MAX_IMAGE_PIXELS} pixels are taken", param=where, code="invalid_image")
            return encode_png(opened.convert("RGB"))
    except (pil.UnidentifiedImageError, pil.DecompressionBombError, OSError, ValueError) as exc:
        raise bad_request(f"{where}: the data URL holds no image this server can read ({exc})", param=where,
                          code="invalid_image") from exc
