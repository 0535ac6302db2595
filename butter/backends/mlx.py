"""HuggingFace / MLX checkpoints through mlx-lm (Apple Silicon; Linux CPU via mlx[cpu]).

Same contract as the llama.cpp backend: the engine's plans in, sampled tokens out. Each
session owns an mlx-lm prompt cache; prefix reuse trims it (`trim_prompt_cache`) and
sharing copies a donor's cache state. Sessions run one forward pass each per step (mlx-lm's
batched caches need equal-length left padding, which the engine's mixed steps do not give):
concurrent requests are bounded independent sessions sharing one engine and admission.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from butter.backends.base import (
    BackendError,
    CopyPrefix,
    KvOp,
    ModelInfo,
    RemoveTokens,
    Sampled,
    SeqWork,
    ShiftPositions,
)
from butter.errors import ModelLoadError
from butter.kv import KvCacheType, parse_kv_cache
from butter.sampling import SamplingParams


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


class MlxBackend:
    def __init__(self, path: Path, *, n_cells: int, n_seq: int,
                 kv_type: KvCacheType | None = None) -> None:
        try:
            import mlx.core as mx
            from mlx_lm import load
            from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
        except ImportError:
            raise ModelLoadError(
                f"{path} is an MLX / HuggingFace checkpoint, which needs the mlx extra: "
                "pip install 'butter-serve[mlx]'") from None
        self._mx, self._make_cache, self._trim = mx, make_prompt_cache, trim_prompt_cache
        try:
            loaded = load(str(path))
            self._model, self._tokenizer = loaded[0], loaded[1]
        except Exception as exc:  # mlx-lm raises many kinds; all mean "cannot load this"
            raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from None
        self._config = json.loads((path / "config.json").read_text())
        self.kv_type = kv_type or parse_kv_cache("raw")
        self.info = self._read_info(path)
        self.n_cells = n_cells
        self.n_seq = n_seq
        self.can_shift = False
        self._caches: dict[int, list[Any]] = {}
        self._samplers: dict[int, tuple[SamplingParams, Any]] = {}
        self._eog = set(self._tokenizer.eos_token_ids)
        self._special = set(self._tokenizer.all_special_ids)
        self._closed = False

    def _read_info(self, path: Path) -> ModelInfo:
        tokenizer, config = self._tokenizer, self._config
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
        )

    @property
    def kv_bytes_per_token(self) -> float:
        config = self._config
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        return float(config["num_hidden_layers"] * heads * head_dim * 2 * 2)

    def check_sampling(self, params: SamplingParams) -> None:
        """Refuse (ValueError) what this backend cannot honour, before admission."""
        if params.grammar is not None:
            raise ValueError("grammar-constrained output (tool_choice required/named, "
                             "response_format) is not available on the MLX backend yet")
        if params.uses_penalties:
            raise ValueError("repeat/presence/frequency penalties are not available on the "
                             "MLX backend yet")

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        if self._closed:
            raise BackendError("the model was unloaded")
        tokens: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        bos = self._tokenizer.bos_token_id
        return [bos, *tokens] if add_bos and bos is not None else tokens

    def _piece(self, token: int) -> bytes:
        if token in self._special:
            return b""  # control tokens render empty, as llama.cpp does
        text = self._tokenizer.convert_ids_to_tokens(token)
        if all(char in _UNICODE_TO_BYTE for char in text):
            return bytes(_UNICODE_TO_BYTE[char] for char in text)
        return str(text).replace("\u2581", " ").encode()  # SentencePiece-style vocabularies

    # ------------------------------------------------------------------ stepping

    def step(self, ops: list[KvOp], works: list[SeqWork]) -> list[Sampled]:
        if self._closed:
            raise BackendError("the model was unloaded")
        for op in ops:
            self._apply(op)
        sampled = []
        for work in works:
            logits = self._forward(work)
            if work.sample:
                sampled.append(self._sample(work.seq, logits))
        return sampled

    def _apply(self, op: KvOp) -> None:
        if isinstance(op, RemoveTokens):
            cache = self._caches.get(op.seq)
            if cache is None or op.start <= 0:
                self._caches[op.seq] = self._make_cache(self._model)
            else:
                end = self._offset(cache) if op.end < 0 else op.end
                if end != self._offset(cache):
                    raise BackendError("MLX caches can only drop their most recent positions")
                self._trim(cache, end - op.start)
        elif isinstance(op, CopyPrefix):
            self._caches[op.dst] = self._copy(self._caches[op.src], op.length)
        elif isinstance(op, ShiftPositions):
            raise BackendError("MLX caches cannot shift positions")
        else:
            key = self._mx.random.key(op.params.seed)
            self._samplers[op.seq] = (op.params, key)

    @staticmethod
    def _offset(cache: list[Any]) -> int:
        return int(cache[0].offset)

    def _copy(self, donor: list[Any], length: int) -> list[Any]:
        fresh = self._make_cache(self._model)
        for target, source in zip(fresh, donor, strict=True):
            keys, values = source.keys_and_values()
            target.state = (keys[..., :length, :], values[..., :length, :], length)
        return fresh

    def _forward(self, work: SeqWork) -> Any:
        cache = self._caches.setdefault(work.seq, self._make_cache(self._model))
        if self._offset(cache) != work.start:
            raise BackendError(f"seq {work.seq} is at {self._offset(cache)}, not {work.start}")
        inputs = self._mx.array([list(work.tokens)])
        logits = self._model(inputs, cache=cache)[0, -1]
        self._mx.eval(logits, [c.keys_and_values() for c in cache])
        return logits

    def _sample(self, seq: int, logits: Any) -> Sampled:
        mx = self._mx
        params, key = self._samplers[seq]
        if params.greedy:
            token = int(mx.argmax(logits).item())
        else:
            key, draw = mx.random.split(key)
            self._samplers[seq] = (params, key)
            token = int(mx.random.categorical(self._filtered(logits, params), key=draw).item())
        return Sampled(seq=seq, token=token, piece=self._piece(token),
                       end_of_generation=token in self._eog)

    def _filtered(self, logits: Any, params: SamplingParams) -> Any:
        """Temperature, then top-k, top-p and min-p masks (llama.cpp's order of effect)."""
        mx = self._mx
        scaled = logits.astype(mx.float32) / params.temperature
        if 0 < params.top_k < scaled.shape[-1]:
            kth = mx.sort(scaled)[-params.top_k]
            scaled = mx.where(scaled < kth, -mx.inf, scaled)
        probs = mx.softmax(scaled)
        if params.top_p < 1.0:
            order = mx.argsort(-probs)
            cumulative = mx.cumsum(probs[order])
            keep_sorted = (cumulative - probs[order]) < params.top_p
            keep = mx.zeros_like(keep_sorted).at[order].add(keep_sorted)
            scaled = mx.where(keep, scaled, -mx.inf)
        if params.min_p > 0.0:
            scaled = mx.where(probs < params.min_p * probs.max(), -mx.inf, scaled)
        return scaled

    def close(self) -> None:
        self._closed = True
        self._caches.clear()
        self._samplers.clear()
        self._model = None  # drop the weights now, not whenever this object goes
