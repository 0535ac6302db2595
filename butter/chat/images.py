"""Images in chat messages, decoded (pure): the client's bytes become RGB pixels with a key
that names their content, within limits checked before and while decoding.

The pipeline decodes on its worker thread (prepare.py); the backend's projector turns the
pixels into the positions the model sees (Backend.tokenize_media).
"""

from __future__ import annotations

import hashlib

import attrs


@attrs.frozen
class DecodedImage:
    """An image's pixels, RGB, row by row; `key` names the picture (the same pixels from
    any file, the same key; any other picture, another key)."""

    key: str
    width: int
    height: int
    rgb: bytes = attrs.field(repr=False)


def content_key(width: int, height: int, rgb: bytes) -> str:
    """SHA-256 of the size and the pixels (not of the file: a PNG and a JPEG of the same
    pixels are the same picture to the model)."""
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(rgb)
    return digest.hexdigest()
