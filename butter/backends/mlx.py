"""HuggingFace / MLX checkpoints through mlx-lm (Apple Silicon; Linux CPU via mlx[cpu]).

Same contract as the llama.cpp backend: the engine's plans in, sampled tokens out. Each
session owns an mlx-lm prompt cache; prefix reuse trims it (`trim_prompt_cache`) and
sharing copies a donor's cache state.

Batching: the sessions that decode in a step share one forward pass. Their caches are
merged into mlx-lm's batched caches (`BatchKVCache`, the structure its BatchGenerator
decodes with: rows left-padded to a common length, masked), and stay merged while they keep
decoding; a session leaves the batch (`extract`) when it stops decoding or the engine edits
its cache. Only sessions of similar lengths batch (backends/batching.py: padding at most
doubles their KV). Prompt chunks run per session (their lengths and starting positions
differ), and so do models with recurrent layers.

`--kv-cache affine8|affine4` use mlx-lm's `QuantizedKVCache` (affine quantization, 8 or 4
bits) for every layer whose cache is a plain KV cache, batched through butter's own
BatchQuantizedKVCache (backends/mlx_batch.py). Every call into mlx runs on one thread
owned by the backend.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np

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
from butter.backends.batching import choose_batch
from butter.chat.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from butter.errors import ModelLoadError
from butter.kv import GGML_Q4_0, GGML_Q8_0, KvCacheType, parse_kv_cache
from butter.sampling import SamplingParams

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


@attrs.define
class _DecodeBatch:
    """Decoding sessions whose caches are merged into mlx-lm's batched caches, row i = seqs[i]."""

    seqs: list[int]
    cache: list[Any]


@attrs.define
class _Sampler:
    """A request's sampling state: its parameters, its random key, the tokens it generated
    (as many as its penalties look back on)."""

    params: SamplingParams
    key: Any
    matcher: Any = None  # llguidance's LLMatcher when the request has a grammar
    recent: deque[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        last_n = self.params.penalty_last_n
        self.recent = deque(maxlen=None if last_n < 0 else last_n)


def penalize(mx: Any, logits: Any, recent: Iterable[int], params: SamplingParams) -> Any:
    """llama.cpp's penalties over `recent` (the tokens the request generated, its last n):
    repeat divides a positive logit and multiplies a negative one, frequency subtracts per
    occurrence, presence once per token."""
    counts = Counter(recent)
    if not counts:
        return logits
    ids = mx.array(list(counts))
    seen = logits[ids].astype(mx.float32)
    seen = mx.where(seen <= 0, seen * params.repeat_penalty, seen / params.repeat_penalty)
    seen = (seen - mx.array(list(counts.values()), dtype=mx.float32)
            * params.frequency_penalty - params.presence_penalty)
    penalized = logits.astype(mx.float32)
    penalized[ids] = seen
    return penalized


GRAMMAR_CACHE_SIZE = 32  # compiled grammars kept (agents resend the same tools each turn)


def _quantized_kv(kv_type: KvCacheType) -> int | None:
    """Bits of mlx-lm's affine-quantized KV cache for this choice; None: raw."""
    return {GGML_Q8_0: 8, GGML_Q4_0: 4}.get(kv_type.ggml_type)


class MlxBackend:
    def __init__(self, path: Path, *, n_cells: int | Callable[[int], int], n_seq: int,
                 kv_type: KvCacheType | None = None) -> None:
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
        self._mx, self._make_cache = mx, make_prompt_cache
        self._trim: Any = trim_prompt_cache  # -> positions actually cut
        self._kv_cache_class, self._quantized_cache_class = KVCache, QuantizedKVCache
        try:
            loaded = load(str(path))
            self._model, self._tokenizer = loaded[0], loaded[1]
        except Exception as exc:  # mlx-lm raises many kinds; all mean "cannot load this"
            raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from None
        raw_config = json.loads((path / "config.json").read_text())
        # Multimodal checkpoints (e.g. Qwen3.5) nest the language model's under text_config.
        self._config = {**raw_config, **raw_config.get("text_config", {})}
        kv_type = kv_type or parse_kv_cache("raw")
        self._kv_bits = _quantized_kv(kv_type)
        group = self._quantization_group()
        if self._kv_bits is not None and group is None:
            log.warning("--kv-cache %s: head size %d is not a multiple of 32, which mlx's "
                        "quantization needs; using raw", kv_type.requested, self._head_dim)
            self._kv_bits, kv_type = None, parse_kv_cache("raw")
        self._kv_group = group or 64
        self.kv_type = self._describe_kv(kv_type)
        self.info = self._read_info(path)
        self.n_cells = n_cells(self.info.n_ctx_train) if callable(n_cells) else n_cells
        self.n_seq = n_seq
        self.can_shift = False
        fresh = self._make_cache(self._model)
        # Recurrent layers (mlx-lm's ArraysCache, e.g. Qwen3.5's linear attention) hold a
        # state that cannot be cut back at all; sliding-window caches rotate once full and
        # cannot be cut from then on.
        self._recurrent = any(not layer.is_trimmable() for layer in fresh)
        windows = [int(layer.max_size) for layer in fresh if hasattr(layer, "max_size")]
        self.rewind_limit = 1 if self._recurrent else min(windows) if windows else None
        self.info = attrs.evolve(self.info, is_recurrent=self._recurrent)
        self._caches: dict[int, list[Any]] = {}
        self._lengths: dict[int, int] = {}  # positions each session's cache holds
        self._batch: _DecodeBatch | None = None
        self._can_batch = not self._recurrent and all(
            isinstance(layer, QuantizedKVCache) or hasattr(layer, "merge")
            for layer in self._new_cache())
        # mlx ties unevaluated arrays to the thread that built them: every step runs on
        # this one thread, whichever worker thread the engine calls from.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="butter-mlx")
        self._grammar_lock = threading.Lock()
        self._encoding = threading.Lock()
        self._samplers: dict[int, _Sampler] = {}
        self._compiled: OrderedDict[str, str] = OrderedDict()  # GBNF -> grammar, LRU last
        self._llg: Any = None
        self._eog = set(self._tokenizer.eos_token_ids)
        self._special = set(self._tokenizer.all_special_ids)
        with contextlib.suppress(ImportError):  # built here, not in the first request
            self._llg_tokenizer()
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
    def _head_dim(self) -> int:
        config = self._config
        return int(config.get("head_dim")
                   or config["hidden_size"] // config["num_attention_heads"])

    def _quantization_group(self) -> int | None:
        """mlx quantizes in groups of 32, 64 or 128 elements along the head dimension; 64
        (mlx-lm's default) when it divides the head size, else 32."""
        return next((group for group in (64, 32) if self._head_dim % group == 0), None)

    def _describe_kv(self, kv_type: KvCacheType) -> KvCacheType:
        if self._kv_bits is None:
            return kv_type
        return attrs.evolve(kv_type, label=f"mlx affine {self._kv_bits}-bit / {self._kv_group}")

    @property
    def kv_bytes_per_token(self) -> float:
        config = self._config
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        elements = config["num_hidden_layers"] * heads * self._head_dim * 2  # K and V
        if self._kv_bits is None:
            return float(elements * 2)
        return float(elements * (self._kv_bits / 8 + 2 * 2 / self._kv_group))  # + scale, bias

    def check_sampling(self, params: SamplingParams) -> None:
        """Refuse (ValueError) what this backend cannot honour, before admission."""
        if params.grammar is not None:
            self._grammar(params.grammar)

    # ------------------------------------------------------------------ grammars

    def _grammar(self, gbnf: str) -> str:
        """The GBNF as an llguidance grammar, checked; ValueError when it is not usable."""
        with self._grammar_lock:
            compiled = self._compiled.get(gbnf)
            if compiled is not None:
                self._compiled.move_to_end(gbnf)
                return compiled
        try:
            from llguidance import LLMatcher
            from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
        except ImportError:
            raise ValueError("grammar-constrained output (tool_choice required/named, "
                             "response_format) on MLX needs llguidance: pip install "
                             "'butter-serve[mlx]'") from None
        try:
            compiled = str(LLMatcher.grammar_from_lark(self._native_markers(gbnf_to_lark(gbnf))))
        except GbnfToLarkError as exc:
            raise ValueError(f"the grammar could not be parsed: {exc}") from None
        problem = LLMatcher.validate_grammar(compiled, self._llg_tokenizer())
        if problem:
            raise ValueError(f"the grammar could not be used: {problem}")
        with self._grammar_lock:
            self._compiled[gbnf] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _native_markers(self, lark: str) -> str:
        """Match the tool-call markers as the single tokens the vocabulary has for them.

        llguidance treats every added token as special, and a special token never matches a
        string literal: the model would have to spell `<tool_call>` byte by byte, which it
        was not trained to do. `<[id]>` is llguidance's syntax for one given token."""
        tokenizer = self._llg_tokenizer()
        for marker in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
            token = self._tokenizer.convert_tokens_to_ids(marker)  # (or the unknown token)
            if isinstance(token, int) and 0 <= token < self.info.n_vocab \
                    and self._tokenizer.convert_ids_to_tokens(token) == marker \
                    and tokenizer.is_special_token(token):
                lark = lark.replace(f'"{marker}"', f"<[{token}]>")
        return lark

    def _llg_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (~1 s to build for large ones)."""
        if self._llg is None:
            import llguidance.hf

            self._llg = llguidance.hf.from_tokenizer(
                self._tokenizer._tokenizer, n_vocab=self.info.n_vocab,
                eos_token=sorted(self._eog))
        return self._llg

    def _matcher(self, params: SamplingParams) -> Any:
        if params.grammar is None:
            return None
        from llguidance import LLMatcher

        return LLMatcher(self._llg_tokenizer(), self._grammar(params.grammar), log_level=0)

    def _allowed(self, matcher: Any, logits: Any) -> Any:
        """Logits with every token the grammar forbids next set to -inf."""
        mx = self._mx
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                             bitorder="little")[: logits.shape[-1]].astype(bool)
        allowed = np.zeros(logits.shape[-1], dtype=bool)
        allowed[: len(bits)] = bits
        return mx.where(mx.array(allowed), logits, -mx.inf)

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        if self._closed:
            raise BackendError("the model was unloaded")
        # transformers may reset the Rust tokenizer's truncation/padding inside encode, which
        # raises "Already borrowed" if two prepare threads do it at once.
        with self._encoding:
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
        return self.submit_step(ops, works).result()

    def submit_step(self, ops: list[KvOp], works: list[SeqWork]) -> Future[list[Sampled]]:
        """`step` on the mlx thread; the engine awaits the future."""
        try:
            return self._thread.submit(self._step, ops, works)
        except RuntimeError as exc:  # the executor shut down: the model is gone
            if self._closed:
                raise BackendError("the model was unloaded") from None
            raise exc

    def _step(self, ops: list[KvOp], works: list[SeqWork]) -> list[Sampled]:
        if self._closed:
            raise BackendError("the model was unloaded")
        try:
            for op in ops:
                self._apply(op)
            decoding = [work for work in works if not work.prompt]
            logits: dict[int, Any] = {}
            if self._can_batch and decoding:
                logits.update(self._decode_batched(decoding))
            for work in works:
                if work.seq not in logits:
                    logits[work.seq] = self._forward(work)
            sampled = [self._sample(work.seq, logits[work.seq])
                       for work in works if work.sample]
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error is the one to report
                self._settle()
            raise
        self._settle()
        return sampled

    def _settle(self) -> None:
        """Evaluate every lazy array the step left behind (merged, filtered or copied caches,
        sampler keys), so that no graph grows from step to step."""
        batch = [] if self._batch is None else [self._batch.cache]
        self._mx.eval(
            [layer.state for cache in (*self._caches.values(), *batch) for layer in cache],
            [sampler.key for sampler in self._samplers.values()],
        )

    def _apply(self, op: KvOp) -> None:
        if isinstance(op, RemoveTokens):
            if op.start <= 0:  # the whole sequence: no need to copy its row out first
                self._forget_row(op.seq)
                self._caches[op.seq], self._lengths[op.seq] = self._new_cache(), 0
                return
            cache = self._own_cache(op.seq)
            length = self._lengths.get(op.seq, 0)
            if cache is None:
                self._caches[op.seq], self._lengths[op.seq] = self._new_cache(), 0
            elif op.start < length:
                end = length if op.end < 0 else op.end
                if end != length:
                    raise BackendError("MLX caches can only drop their most recent positions")
                if self._trim(cache, end - op.start) != end - op.start:
                    raise BackendError(f"seq {op.seq}'s cache cannot be cut back to {op.start}")
                self._lengths[op.seq] = op.start
        elif isinstance(op, CopyPrefix):
            self._forget_row(op.dst)  # about to be overwritten
            self._caches[op.dst] = self._copy(self._read_cache(op.src), op.length)
            self._lengths[op.dst] = op.length
        elif isinstance(op, ShiftPositions):
            raise BackendError("MLX caches cannot shift positions")
        else:
            self._samplers[op.seq] = _Sampler(op.params, self._mx.random.key(op.params.seed),
                                              matcher=self._matcher(op.params))

    def _new_cache(self) -> list[Any]:
        cache = self._make_cache(self._model)
        if self._kv_bits is None:
            return cache
        return [self._quantized_cache_class(group_size=self._kv_group, bits=self._kv_bits)
                if type(layer) is self._kv_cache_class else layer for layer in cache]

    def _own_cache(self, seq: int) -> list[Any] | None:
        """The session's own cache, taken out of the decode batch if it is in it."""
        self._leave_batch([seq])
        return self._caches.get(seq)

    def _read_cache(self, seq: int) -> list[Any]:
        """The session's cache to read from; a batched session stays in its batch."""
        batch = self._batch
        if batch is not None and seq in batch.seqs:
            row = batch.seqs.index(seq)
            return [layer.extract(row) for layer in batch.cache]
        return self._caches[seq]

    def _check_position(self, work: SeqWork) -> None:
        length = self._lengths.get(work.seq, 0)
        if length != work.start:
            raise BackendError(f"seq {work.seq} is at {length}, not {work.start}")

    def _copy(self, donor: list[Any], length: int) -> list[Any]:
        fresh = self._new_cache()
        for target, source in zip(fresh, donor, strict=True):
            keys, values = source.keys_and_values()
            if isinstance(keys, tuple):  # quantized: (packed, scales, biases)
                target.keys = tuple(part[..., :length, :] for part in keys)
                target.values = tuple(part[..., :length, :] for part in values)
                target.offset = length
            elif hasattr(target, "max_size"):  # sliding window, not wrapped (rewind_limit)
                target.keys, target.values = keys[..., :length, :], values[..., :length, :]
                target.offset = target._idx = length
            else:
                target.state = (keys[..., :length, :], values[..., :length, :], length)
        return fresh

    def _forward(self, work: SeqWork) -> Any:
        cache = self._own_cache(work.seq)
        if cache is None:
            cache = self._caches[work.seq] = self._new_cache()
        self._check_position(work)
        inputs = self._mx.array([list(work.tokens)])
        logits = self._model(inputs, cache=cache)[0, -1]
        self._mx.eval(logits, [layer.state for layer in cache])
        self._lengths[work.seq] = work.start + len(work.tokens)
        return logits

    # ------------------------------------------------------------------ the decode batch

    @property
    def decode_batch(self) -> tuple[int, ...]:
        """The sessions whose decodes share one forward pass now."""
        batch = self._batch  # (read once: a step may replace it meanwhile)
        return () if batch is None else tuple(batch.seqs)

    def cached_bytes(self, seq: int) -> int:
        """Bytes of KV state the session holds (its row of the batch, if batched)."""
        def measure() -> int:
            if seq not in self._caches and seq not in self.decode_batch:
                return 0
            return sum(int(layer.nbytes) for layer in self._read_cache(seq))

        return self._thread.submit(measure).result()  # mlx work stays on the mlx thread

    def _decode_batched(self, works: list[SeqWork]) -> dict[int, Any]:
        """One forward pass for the decoding sessions that batch well; logits by seq
        (the others decode on their own)."""
        for work in works:
            self._check_position(work)
        wanted = choose_batch({work.seq: work.start for work in works})
        members = self._batch.seqs if self._batch is not None else []
        self._leave_batch([seq for seq in members if seq not in wanted])
        self._join_batch([seq for seq in wanted if seq not in members])
        batch = self._batch
        if batch is None:
            return {}
        mx = self._mx
        rows = {seq: row for row, seq in enumerate(batch.seqs)}
        tokens = [0] * len(batch.seqs)
        for work in works:
            if work.seq in rows:
                tokens[rows[work.seq]] = work.tokens[0]
                self._lengths[work.seq] = work.start + 1
        try:
            logits = self._model(mx.array(tokens)[:, None], cache=batch.cache)[:, -1]
            mx.eval(logits, [layer.state for layer in batch.cache])
        except BaseException:
            # Its caches may be half-updated: drop the batch (the engine drops these
            # sessions, every one of which was in the failed step).
            self._batch = None
            for seq in batch.seqs:
                self._lengths[seq] = 0
            raise
        return {seq: logits[row] for seq, row in rows.items()}

    def _join_batch(self, seqs: list[int]) -> None:
        if not seqs:
            return
        missing = [seq for seq in seqs if seq not in self._caches]
        if missing:
            raise BackendError(f"seq {missing[0]} has no cache to decode from")
        joining = [self._caches.pop(seq) for seq in seqs]
        merged = [self._merge_layers(list(layers)) for layers in zip(*joining, strict=True)]
        if self._batch is None:
            self._batch = _DecodeBatch(seqs=list(seqs), cache=merged)
            return
        for layer, extra in zip(self._batch.cache, merged, strict=True):
            layer.extend(extra)
        self._batch.seqs.extend(seqs)

    def _merge_layers(self, layers: list[Any]) -> Any:
        """One layer's caches of several sessions as one batched cache."""
        if isinstance(layers[0], self._quantized_cache_class):
            from butter.backends.mlx_batch import BatchQuantizedKVCache

            return BatchQuantizedKVCache.merge(layers)  # mlx-lm has no batched quantized cache
        return type(layers[0]).merge(layers)

    def _forget_row(self, seq: int) -> None:
        """Take a session out of the batch without keeping its cache."""
        self._remove_rows([seq])

    def _leave_batch(self, seqs: list[int]) -> None:
        """Give these sessions their own caches back (a copy of their rows)."""
        batch = self._batch
        for seq in seqs:
            if batch is not None and seq in batch.seqs:
                row = batch.seqs.index(seq)
                self._caches[seq] = [layer.extract(row) for layer in batch.cache]
        self._remove_rows(seqs)

    def _remove_rows(self, seqs: list[int]) -> None:
        batch = self._batch
        if batch is None or not any(seq in batch.seqs for seq in seqs):
            return
        keep = [row for row, member in enumerate(batch.seqs) if member not in seqs]
        if not keep:
            self._batch = None
            return
        for layer in batch.cache:
            layer.filter(keep)
        batch.seqs = [batch.seqs[row] for row in keep]

    def _sample(self, seq: int, logits: Any) -> Sampled:
        mx = self._mx
        sampler = self._samplers[seq]
        params = sampler.params
        if params.uses_penalties:
            logits = self._penalized(logits, sampler)
        if sampler.matcher is not None:
            if sampler.matcher.is_error():
                return self._grammar_failed(seq)
            logits = self._allowed(sampler.matcher, logits)
        if params.greedy:
            token = int(mx.argmax(logits).item())
        else:
            sampler.key, draw = mx.random.split(sampler.key)
            token = int(mx.random.categorical(self._filtered(logits, params), key=draw).item())
        sampler.recent.append(token)
        if sampler.matcher is not None and not sampler.matcher.consume_token(token):
            return self._grammar_failed(seq)
        return Sampled(seq=seq, token=token, piece=self._piece(token),
                       end_of_generation=token in self._eog)

    def _grammar_failed(self, seq: int) -> Sampled:
        """End this request alone (llguidance hit a limit or rejected the token)."""
        matcher = self._samplers[seq].matcher
        log.warning("grammar matcher failed on seq %d: %s", seq, matcher.get_error()[:500])
        return Sampled(seq=seq, token=-1, piece=b"", end_of_generation=True,
                       error="the output grammar could not be followed (see the server log)")

    def _penalized(self, logits: Any, sampler: _Sampler) -> Any:
        return penalize(self._mx, logits, sampler.recent, sampler.params)

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
        if self._closed:
            return
        self._closed = True
        self._thread.submit(self._release).result()  # after a step in flight, if any
        self._thread.shutdown()

    def _release(self) -> None:
        self._caches.clear()
        self._lengths.clear()
        self._batch = None
        self._samplers.clear()
        self._model = None  # drop the weights now, not whenever this object goes
