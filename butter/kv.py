"""KV cache choices (pure): cache types, their cost, and the sliding window.

`--kv-cache` names follow the seed's table: `raw` (f16), `affine8` / `affine4` (mapped to
llama.cpp's q8_0 / q4_0 K and V caches, which need flash attention for a quantized V, and
to mlx-lm's 8- / 4-bit affine-quantized caches on MLX),
and `aura` / `auraNvM` (AURA compression, which llama.cpp does not have: logged, raw used).
"""

from __future__ import annotations

import re

import attrs

KV_CACHE_CHOICES = ("raw", "affine8", "affine4", "aura", "auraNvM (e.g. aura4v2)")
AURA_DECODE_PATHS = ("compressed", "dequant-mirror")
_AURA = re.compile(r"^aura(\d+v\d+)?$")

# ggml type ids and bytes per element of the K/V caches llama.cpp supports here.
GGML_F16, GGML_Q4_0, GGML_Q8_0 = 1, 2, 8
_BYTES_PER_ELEMENT = {GGML_F16: 2.0, GGML_Q8_0: 34 / 32, GGML_Q4_0: 18 / 32}
_TYPE_NAMES = {GGML_F16: "f16", GGML_Q8_0: "q8_0", GGML_Q4_0: "q4_0"}


@attrs.frozen
class KvCacheType:
    requested: str  # what the operator asked for
    ggml_type: int  # what llama.cpp gets
    note: str | None = None  # why they differ, for the boot log
    label: str | None = None  # a backend's own name for it (MLX's affine caches)

    @property
    def name(self) -> str:
        return self.label or _TYPE_NAMES[self.ggml_type]

    @property
    def quantized(self) -> bool:
        return self.ggml_type != GGML_F16

    @property
    def bytes_per_element(self) -> float:
        return _BYTES_PER_ELEMENT[self.ggml_type]


def parse_kv_cache(value: str) -> KvCacheType:
    if value == "raw":
        return KvCacheType(value, GGML_F16)
    if value == "affine8":
        return KvCacheType(value, GGML_Q8_0)
    if value == "affine4":
        return KvCacheType(value, GGML_Q4_0)
    if _AURA.match(value):
        return KvCacheType(value, GGML_F16, note=(
            f"--kv-cache {value}: AURA KV compression is not available on the llama.cpp "
            "or MLX backends; using raw (f16)"))
    raise ValueError(
        f"--kv-cache {value!r} is not one of: {', '.join(KV_CACHE_CHOICES)}"
    )


def parse_aura_decode_path(value: str | None) -> str | None:
    if value is not None and value not in AURA_DECODE_PATHS:
        raise ValueError(
            f"--aura-decode-path {value!r} is not one of: {', '.join(AURA_DECODE_PATHS)}"
        )
    return value


@attrs.frozen
class KvWindow:
    """StreamingLLM-style window: keep the first `keep` positions (attention sinks) and
    the most recent ones, at most `size` in all."""

    size: int
    keep: int = 0

    def __attrs_post_init__(self) -> None:
        if self.size < 8:
            raise ValueError(f"--kv-window-size must be at least 8, got {self.size}")
        if not 0 <= self.keep < self.size // 2:
            raise ValueError(
                f"--kv-window-keep must be between 0 and half the window ({self.size // 2}), "
                f"got {self.keep}"
            )

    @property
    def drop(self) -> int:
        """Positions dropped per shift: a quarter of the movable part, so shifts are rare."""
        return max(1, (self.size - self.keep) // 4)

    def overflow(self, length: int, incoming: int) -> int:
        """How many positions to drop before `incoming` more fit (0 if they fit)."""
        if length + incoming <= self.size:
            return 0
        return max(self.drop, length + incoming - self.size)


def kv_window(size: int | None, keep: int | None) -> KvWindow | None:
    if size is None:
        if keep is not None:
            raise ValueError("--kv-window-keep requires --kv-window-size")
        return None
    return KvWindow(size=size, keep=keep or 0)
