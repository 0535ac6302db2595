"""Server-sent events framing (pure)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def encode_json(payload: Any) -> str:
    # Compact and non-ASCII as-is: smaller frames, and clients decode UTF-8 anyway.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def data_event(payload: Any) -> bytes:
    return f"data: {encode_json(payload)}\n\n".encode()


def named_event(event: str, payload: Any) -> bytes:
    return f"event: {event}\ndata: {encode_json(payload)}\n\n".encode()
