"""An MLX / HuggingFace checkpoint loaded through mlx-lm: the model, its tokenizer and
config, what it is, the KV cache it gets, and its text (tokens to bytes and back)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from butter.backends.base import ModelInfo
from butter.errors import ModelLoadError
from butter.kv import GGML_Q4_0, GGML_Q8_0, KvCacheType, parse_kv_cache

log = logging.getLogger("butter")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table, used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in _bytes_to_unicode().items()}


def _quantized_kv(kv_type: KvCacheType) -> int | None:
    """Bits of mlx-lm's affine-quantized KV cache for this choice; None: raw."""
    return {GGML_Q8_0: 8, GGML_Q4_0: 4}.get(kv_type.ggml_type)


# Fill-in-the-middle token names (prefix, suffix, middle): Qwen2.5-Coder / StarCoder, CodeGemma.
FIM_TOKEN_NAMES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_begin|>", "<|fim_hole|>", "<|fim_end|>"),
)


class MlxModel:
    """mlx-lm's model and tokenizer for one checkpoint, and the caches it gets."""

    def __init__(self, path: Path, *, n_cells: int | Callable[[int], int],
                 kv_type: KvCacheType | None) -> None:
        """`n_cells` may be a function of the trained context (known only from the config)."""
        try:
            import mlx.core as mx
            from mlx_lm import load
            from mlx_lm.models.cache import (
                KVCache,
                QuantizedKVCache,
                make_prompt_cache,
                trim_prompt_cache,
            )
        except ImportError:
            raise ModelLoadError(
                f"{path} is an MLX / HuggingFace checkpoint, which needs the mlx extra: "
                "pip install 'butter-serve[mlx]'") from None
        self.mx: Any = mx
        self._make_cache = make_prompt_cache
        self.trim: Any = trim_prompt_cache  # -> positions actually cut
        self._kv_cache_class, self.quantized_cache_class = KVCache, QuantizedKVCache
        try:
            loaded = load(str(path))
            self.model, self.tokenizer = loaded[0], loaded[1]
        except Exception as exc:  # mlx-lm raises many kinds; all mean "cannot load this"
            raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from None
        raw_config = json.loads((path / "config.json").read_text())
        # Multimodal checkpoints (e.g. Qwen3.5) nest the language model's under text_config.
        self._config = {**raw_config, **raw_config.get("text_config", {})}
        self.kv_type = self._choose_kv(kv_type or parse_kv_cache("raw"))
        fresh = self._make_cache(self.model)
        # Recurrent layers (mlx-lm's ArraysCache, e.g. Qwen3.5's linear attention) hold a
        # state that cannot be cut back at all; sliding-window caches rotate once full and
        # cannot be cut from then on.
        self.recurrent = any(not layer.is_trimmable() for layer in fresh)
        windows = [int(layer.max_size) for layer in fresh if hasattr(layer, "max_size")]
        self.rewind_limit = 1 if self.recurrent else min(windows) if windows else None
        self.info = attrs.evolve(self._read_info(path), is_recurrent=self.recurrent)
        self.n_cells = n_cells(self.info.n_ctx_train) if callable(n_cells) else n_cells
        self.can_batch = not self.recurrent and all(
            isinstance(layer, QuantizedKVCache) or hasattr(layer, "merge")
            for layer in self.new_cache())
        self.end_of_generation = set(self.tokenizer.eos_token_ids)
        self._special = set(self.tokenizer.all_special_ids)
        self._written_out: dict[int, bytes] = {}  # special tokens shown as their text
        self._encoding = threading.Lock()

    def _read_info(self, path: Path) -> ModelInfo:
        tokenizer, config = self.tokenizer, self._config
        return ModelInfo(
            path=str(path), architecture=str(config.get("model_type", "unknown")),
            description=f"{config.get('model_type', 'unknown')} (MLX)",
            n_ctx_train=int(config.get("max_position_embeddings") or 0),
            n_vocab=int(config.get("vocab_size") or len(tokenizer.vocab)),
            embedded_chat_template=tokenizer.chat_template,
            bos_text=tokenizer.bos_token or "", eos_text=tokenizer.eos_token or "",
            add_bos=False,  # HF chat templates render their own BOS
            is_recurrent=False,
            size_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
            fim_tokens=self._fim_tokens(),
        )

    def _fim_tokens(self) -> tuple[int, int, int] | None:
        """The vocabulary's fill-in-the-middle tokens, by the names models use for them."""
        vocab = self.tokenizer.get_vocab()
        for names in FIM_TOKEN_NAMES:
            if all(name in vocab for name in names):
                prefix, suffix, middle = (int(vocab[name]) for name in names)
                return prefix, suffix, middle
        return None

    # ------------------------------------------------------------------ the KV cache

    def _choose_kv(self, kv_type: KvCacheType) -> KvCacheType:
        """Sets the quantized cache's bits and group (bits None: raw), described."""
        self._kv_bits = _quantized_kv(kv_type)
        group = self._quantization_group()
        if self._kv_bits is not None and group is None:
            log.warning("--kv-cache %s: head size %d is not a multiple of 32, which mlx's "
                        "quantization needs; using raw", kv_type.requested, self._head_dim)
            self._kv_bits, kv_type = None, parse_kv_cache("raw")
        self._kv_group = group or 64
        if self._kv_bits is None:
            return kv_type
        return attrs.evolve(kv_type, label=f"mlx affine {self._kv_bits}-bit / {self._kv_group}")

    @property
    def _head_dim(self) -> int:
        config = self._config
        return int(config.get("head_dim")
                   or config["hidden_size"] // config["num_attention_heads"])

    def _quantization_group(self) -> int | None:
        """mlx quantizes in groups of 32, 64 or 128 elements along the head dimension; 64
        (mlx-lm's default) when it divides the head size, else 32."""
        return next((group for group in (64, 32) if self._head_dim % group == 0), None)

    @property
    def kv_bytes_per_token(self) -> float:
        config = self._config
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        elements = config["num_hidden_layers"] * heads * self._head_dim * 2  # K and V
        if self._kv_bits is None:
            return float(elements * 2)
        return float(elements * (self._kv_bits / 8 + 2 * 2 / self._kv_group))  # + scale, bias

    def new_cache(self) -> list[Any]:
        """An empty cache for one session, quantized where the choice says so."""
        cache = self._make_cache(self.model)
        if self._kv_bits is None:
            return cache
        return [self.quantized_cache_class(group_size=self._kv_group, bits=self._kv_bits)
                if type(layer) is self._kv_cache_class else layer for layer in cache]

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        # transformers may reset the Rust tokenizer's truncation/padding inside encode, which
        # raises "Already borrowed" if two prepare threads do it at once.
        with self._encoding:
            tokens: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        return [bos, *tokens] if add_bos and bos is not None else tokens

    def write_out(self, texts: Iterable[str]) -> None:
        """Generated special tokens whose text is one of `texts` come out as that text
        (a model family's tool-call markers, for the parser)."""
        for text in texts:
            tokens = self.tokenize(text, add_bos=False)
            if len(tokens) == 1 and tokens[0] in self._special:
                self._written_out[tokens[0]] = text.encode()

    def piece(self, token: int) -> bytes:
        if token in self._special:
            # Control tokens render empty, as llama.cpp does, but for those written out.
            return self._written_out.get(token, b"")
        text = self.tokenizer.convert_ids_to_tokens(token)
        if all(char in _UNICODE_TO_BYTE for char in text):
            return bytes(_UNICODE_TO_BYTE[char] for char in text)
        return str(text).replace("\u2581", " ").encode()  # SentencePiece-style vocabularies

    def free(self) -> None:
        self.model = None  # drop the weights now, not whenever this object goes
