"""llama.cpp through llama-cpp-python's low-level ctypes API.

One context with a unified KV cache shared by `n_seq` sequences (a partial
`seq_cp` without a unified cache aborts the process), `swa_full` so sliding-window
models can rewind and share prefixes exactly, and native sampler chains per
sequence. Every method that touches the context runs on the engine's single worker
thread; ctypes releases the GIL during decode so the trio loop keeps serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp as ll
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
from butter.backends.lmhead import LmHead, Unavailable, Verdict
from butter.backends.shaping import Shape, StepShaper, padded_outputs
from butter.errors import ModelLoadError
from butter.kv import KvCacheType, parse_kv_cache
from butter.sampling import SamplingParams

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# llama.cpp's CPU matmuls take one code path for batches under 8 rows and another from
# 8 rows on; a row's result is identical within a path wherever it sits in the batch,
# but differs (slightly) across paths. Steps that evaluate prompt tokens are padded to
# 8 rows with a scratch sequence, so a prompt's KV and first logits are bit-identical
# whether it was prefilled cold, alone, beside others, or reused from the cache.
# (Weight repacking is off for the same reason: its kernels make a row's result
# depend on its position in the batch; measured faster here too, see RESULTS.md.)
MIN_PROMPT_ROWS = 8

# butter's output projection must reproduce llama.cpp's logits to within float rounding
# (differences seen: ~1e-6 of the largest logit); checked once at load on a probe prompt.
LM_HEAD_TOLERANCE = 1e-3
LM_HEAD_PROBE = "butter checks its output projection against llama.cpp's own."

# When the grammar vetoes the sampled token, it is next applied to only this many most
# likely tokens; the whole vocabulary is the fallback when none of them is allowed.
GRAMMAR_SHORTLIST = 512

_backend_ready = threading.Lock()
_backend_initialised = False
_log_callback: Any = None  # kept alive for the life of the process, or llama.cpp segfaults


def _init_llama_backend() -> None:
    global _backend_initialised, _log_callback
    with _backend_ready:
        if _backend_initialised:
            return
        ll.llama_backend_init()

        def _quiet(level: int, text: bytes, user_data: Any) -> None:
            return None  # butter logs what matters itself; llama.cpp's chatter is noise.

        _log_callback = ll.llama_log_callback(_quiet)
        ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _backend_initialised = True


def check_gguf_file(path: Path) -> None:
    """Cheap validation before touching the resident model: exists, readable, GGUF magic."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(f"model file is not readable: {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")


class _Users:
    """Any number of users at once, or one closer once they are done (and none after)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        with self._changed:
            self._count += 1
        try:
            yield
        finally:
            with self._changed:
                self._count -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._count == 0)
            yield  # users that arrive now wait for this, then find the model gone


class LlamaCppBackend:
    def __init__(
        self, path: Path, *, n_cells: int | Callable[[int], int], n_seq: int, n_batch: int,
        threads: int, kv_type: KvCacheType | None = None, step_shaping: bool = True,
        fast_lm_head: bool = True,
    ) -> None:
        """`n_cells` may be a function of the trained context (known only after loading).

        `fast_lm_head`: let butter compute the logits (butter/backends/lmhead.py) where
        that applies; `lm_head` then says which one does, and why."""
        _init_llama_backend()
        check_gguf_file(path)
        self._piece_buffer = ctypes.create_string_buffer(256)
        # Requests are prepared (tokenized, grammar-checked) on worker threads, side by side,
        # while a swap may close this backend on another one: close() waits for them.
        self._users = _Users()
        # llama.cpp's OpenMP builds keep one team of worker threads per calling thread.
        # Engine steps come from whichever worker thread trio hands out, so each new one
        # would grow another team; once the teams hold more threads than there are cores,
        # libgomp stops spinning between parallel regions and every step waits for its
        # threads to wake (measured: 8-row steps 19 ms on one thread, 29-34 ms after a few
        # hundred requests). So every evaluation runs on this one thread.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="butter-llama")
        self._model = self._load_model(path)
        self._vocab = ll.llama_model_get_vocab(self._model)
        try:
            self.info = self._read_info(path)
            cells = n_cells(self.info.n_ctx_train) if callable(n_cells) else n_cells
            self.kv_type = kv_type or parse_kv_cache("raw")
            self._lm_head, self.lm_head = self._load_lm_head(
                path, enabled=fast_lm_head, threads=threads, max_rows=padded_outputs(n_seq),
                n_vocab=self.info.n_vocab, recurrent=self.info.is_recurrent,
            )
            self._hook = self._lm_head  # referenced by the context (cb_eval) until it is freed
            self._ctx = self._new_context(
                cells + MIN_PROMPT_ROWS, n_seq + 1, n_batch + MIN_PROMPT_ROWS, threads,
            )
        except BaseException:
            ll.llama_model_free(self._model)
            self._thread.shutdown()
            raise
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_cells = int(ll.llama_n_ctx(self._ctx)) - MIN_PROMPT_ROWS  # the padding's
        self.n_seq = n_seq
        self._pad_seq = n_seq  # a scratch sequence beyond the sessions' ones
        self.n_batch = n_batch + MIN_PROMPT_ROWS
        self.can_shift = bool(ll.llama_memory_can_shift(self._mem))
        # swa_full keeps sliding-window layers whole, so only recurrent state cannot rewind.
        self.rewind_limit = 1 if self.info.is_recurrent else None
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self.shaper = StepShaper(enabled=step_shaping)
        self._decode_seconds = 0.0  # llama_decode time of the current step
        self._ours = False  # whether butter's projection gave the last decode's logits
        self.lm_head_redos = 0  # steps evaluated again because llama.cpp split them
        self._samplers: dict[int, Any] = {}
        self._grammars: dict[int, Any] = {}
        self._vocab_ids = np.arange(self.info.n_vocab, dtype=np.int32)
        self._candidates = np.zeros(
            self.info.n_vocab, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)]
        )
        if self._lm_head is not None:
            try:
                self._thread.submit(self._verify_lm_head).result()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ loading

    @staticmethod
    def _load_model(path: Path) -> Any:
        params = ll.llama_model_default_params()
        params.use_extra_bufts = False  # no weight repacking: see MIN_PROMPT_ROWS
        model = ll.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {path} (corrupt, truncated or unsupported model)"
            )
        return model

    @staticmethod
    def _load_lm_head(
        path: Path, *, enabled: bool, threads: int, max_rows: int, n_vocab: int,
        recurrent: bool,
    ) -> tuple[LmHead | None, str]:
        """butter's output projection and "butter", or None and why llama.cpp's is used."""
        if not enabled:
            return None, "llama.cpp (--no-fast-lm-head)"
        if ll.llama_supports_gpu_offload():
            return None, "llama.cpp (a GPU build: the hidden state is not in host memory)"
        if recurrent:  # llama.cpp splits their steps per sequence, and they cannot rewind
            return None, "llama.cpp (a recurrent or hybrid model)"
        try:
            head = LmHead(path, threads=threads, max_rows=max_rows)
        except Unavailable as exc:
            return None, f"llama.cpp ({exc})"
        except Exception as exc:  # e.g. a library that will not load: serve without it
            log.warning("butter's output projection failed to load: %r", exc)
            return None, f"llama.cpp (butter's failed to load: {exc!r})"
        if head.n_vocab != n_vocab:
            return None, f"llama.cpp (the output matrix has {head.n_vocab} rows, not {n_vocab})"
        return head, f"butter ({head.isa})"

    def _verify_lm_head(self) -> None:
        """Compare one probe prompt's logits both ways; on disagreement use llama.cpp's."""
        assert self._lm_head is not None
        tokens = self._tokenize(LM_HEAD_PROBE, add_bos=self.info.add_bos)[: self._lm_head.rows]
        theirs = self._probe_logits(tokens, armed=False)
        ours = self._probe_logits(tokens, armed=True)
        if ours is None or theirs is None:
            problem = "its hook never saw the final norm"
        else:
            error = float(np.abs(ours - theirs).max())
            limit = LM_HEAD_TOLERANCE * max(1.0, float(np.abs(theirs).max()))
            if error <= limit:
                return
            problem = f"its logits differ from llama.cpp's by {error:.3g} (limit {limit:.3g})"
        log.warning("butter's output projection is off for this model: %s", problem)
        # The context keeps calling the (now unarmed) hook: `_hook` keeps its state alive.
        self._lm_head, self.lm_head = None, f"llama.cpp (self-check failed: {problem})"

    def _probe_logits(self, tokens: list[int], *, armed: bool) -> Any:
        """Logits of every probe token, computed by butter (armed) or by llama.cpp."""
        assert self._lm_head is not None
        batch = self._batch
        for row, token in enumerate(tokens):
            batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, row, 1
            batch.seq_id[row][0], batch.logits[row] = self._pad_seq, True
        batch.n_tokens = len(tokens)
        self._lm_head.arm(armed)
        try:
            if ll.llama_decode(self._ctx, batch) != 0:
                raise ModelLoadError("llama.cpp could not evaluate the probe prompt")
            if not armed:
                return np.stack([self._llama_logits(row).copy() for row in range(len(tokens))])
            if self._lm_head.verdict(len(tokens)) is not Verdict.OURS:
                return None
            return np.stack([self._lm_head.row(row).copy() for row in range(len(tokens))])
        finally:
            self._lm_head.arm(False)
            ll.llama_memory_seq_rm(self._mem, self._pad_seq, -1, -1)

    def _meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(4096)
        length = ll.llama_model_meta_val_str(self._model, key.encode(), buffer, len(buffer))
        if length < 0:
            return None
        if length >= len(buffer):
            buffer = ctypes.create_string_buffer(length + 1)
            ll.llama_model_meta_val_str(self._model, key.encode(), buffer, len(buffer))
        return buffer.value.decode("utf-8", errors="replace")

    def _read_info(self, path: Path) -> ModelInfo:
        description = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self._model, description, len(description))
        template = ll.llama_model_chat_template(self._model, None)
        return ModelInfo(
            path=str(path),
            architecture=self._meta("general.architecture") or "unknown",
            description=description.value.decode("utf-8", errors="replace"),
            n_ctx_train=int(ll.llama_model_n_ctx_train(self._model)),
            n_vocab=int(ll.llama_vocab_n_tokens(self._vocab)),
            embedded_chat_template=template.decode("utf-8") if template else None,
            bos_text=self._special_text(ll.llama_vocab_bos(self._vocab)),
            eos_text=self._special_text(ll.llama_vocab_eos(self._vocab)),
            add_bos=bool(ll.llama_vocab_get_add_bos(self._vocab)),
            is_recurrent=bool(
                ll.llama_model_is_recurrent(self._model) or ll.llama_model_is_hybrid(self._model)
            ),
            size_bytes=int(ll.llama_model_size(self._model)),
        )

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V bytes one position costs across all layers, at the cache's type."""
        model, arch = self._model, self.info.architecture
        n_head, n_head_kv = ll.llama_model_n_head(model), ll.llama_model_n_head_kv(model)
        default_dim = ll.llama_model_n_embd(model) // max(1, n_head)
        key_dim = int(self._meta(f"{arch}.attention.key_length") or default_dim)
        value_dim = int(self._meta(f"{arch}.attention.value_length") or default_dim)
        elements = ll.llama_model_n_layer(model) * n_head_kv * (key_dim + value_dim)
        return float(elements * self.kv_type.bytes_per_element)

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._piece(token, special=True).decode("utf-8", errors="replace")

    def _new_context(self, n_cells: int, n_seq: int, n_batch: int, threads: int) -> Any:
        params = ll.llama_context_default_params()
        params.n_ctx = n_cells
        params.n_batch = n_batch
        params.n_ubatch = n_batch  # one step = one graph evaluation
        params.n_seq_max = n_seq
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = True
        params.swa_full = True
        params.no_perf = True
        params.type_k = params.type_v = self.kv_type.ggml_type
        if self.kv_type.quantized:  # a quantized V cache needs flash attention
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if self._lm_head is not None:  # the hook that computes the logits (lmhead.py)
            hook = ll.ggml_backend_sched_eval_callback
            params.cb_eval = ctypes.cast(self._lm_head.callback, hook)
            params.cb_eval_user_data = self._lm_head.user_data
        ctx = ll.llama_init_from_model(self._model, params)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_cells} cells")
        return ctx

    # ------------------------------------------------------------------ text

    def _check_open(self) -> None:
        if self._model is None:
            raise BackendError("the model was unloaded")

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        with self._users.using():
            self._check_open()
            return self._tokenize(text, add_bos=add_bos)

    def _tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (ll.llama_token * capacity)()
        count = ll.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_bos, True)
        if count < 0:
            capacity = -count
            tokens = (ll.llama_token * capacity)()
            count = ll.llama_tokenize(
                self._vocab, data, len(data), tokens, capacity, add_bos, True
            )
        return list(tokens[:count])

    def _piece(self, token: int, *, special: bool) -> bytes:
        buffer = self._piece_buffer
        length = ll.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        if length < 0:
            buffer = ctypes.create_string_buffer(-length)
            length = ll.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        return ctypes.string_at(buffer, length)  # not .raw: that copies the whole buffer

    # ------------------------------------------------------------------ stepping

    def step(self, ops: list[KvOp], works: list[SeqWork]) -> list[Sampled]:
        return self.submit_step(ops, works).result()

    def submit_step(self, ops: list[KvOp], works: list[SeqWork]) -> Future[list[Sampled]]:
        """`step` on the backend's thread; the engine awaits the future."""
        try:
            return self._thread.submit(self._step, ops, works)
        except RuntimeError:  # the thread is shut down: closed
            raise BackendError("the model was unloaded") from None

    def _step(self, ops: list[KvOp], works: list[SeqWork]) -> list[Sampled]:
        self._check_open()
        for op in ops:
            self._apply(op)
        if not works:
            return []
        decode_only = not any(work.prompt for work in works)
        outputs = sum(1 for work in works if work.sample)
        shape = self.shaper.choose(outputs, decode_only=decode_only)
        self._decode_seconds = 0.0
        if shape is Shape.SPLIT:
            sampled = [s for work in works for s in self._decode([work], outputs=0)]
        else:
            wanted = padded_outputs(outputs) if shape is Shape.PADDED else 0
            sampled = self._decode(works, outputs=wanted)
        if decode_only:  # the decodes only: sampling costs the same in every shape
            self.shaper.observe(outputs, shape, self._decode_seconds)
        return sampled

    def _decode(self, works: list[SeqWork], *, outputs: int) -> list[Sampled]:
        """One llama_decode of these works (logits on at least `outputs` rows), sampled."""
        sample_rows, n_outputs, padded = self._fill_batch(works, outputs=outputs)
        head = self._lm_head
        status, verdict = self._evaluate(head is not None and n_outputs <= head.rows, n_outputs)
        if status == 0 and verdict is Verdict.NEITHER:
            # llama.cpp split the step into micro-batches: butter's logits may be out of
            # order and llama.cpp's incomplete. Rare (a fragmented sliding-window cache);
            # evaluate the step again with llama.cpp's own projection.
            self._rewind_batch(works)
            self.lm_head_redos += 1
            status, verdict = self._evaluate(False, n_outputs)
        self._ours = verdict is Verdict.OURS
        if padded:
            ll.llama_memory_seq_rm(self._mem, self._pad_seq, -1, -1)
        if status != 0:
            raise BackendError(f"llama_decode failed with status {status}")
        return self._sample_rows(sample_rows)

    def _sample_rows(self, sample_rows: list[tuple[int, int, int]]) -> list[Sampled]:
        """Sample every (seq, batch row, output ordinal) of the last decode, in order."""
        head = self._lm_head
        ours = head is not None and self._ours
        plain = [(seq, row, ordinal) for seq, row, ordinal in sample_rows
                 if seq not in self._grammars]
        picked: dict[int, int] = {}
        if head is not None and len(plain) > 1:  # several chains at once, side by side
            chains = [self._samplers[seq] for seq, _, _ in plain]
            logits = [
                head.row_address(ordinal) if ours else self._llama_logits_address(row)
                for _, row, ordinal in plain
            ]
            assert len({seq for seq, _, _ in plain}) == len(plain)  # one row per chain
            for (seq, _, _), chain, token in zip(
                plain, chains, head.sample_rows(chains, logits, ll.llama_sampler_apply),
                strict=True,
            ):
                if token >= 0:
                    ll.llama_sampler_accept(chain, token)
                picked[seq] = token
        return [
            self._sampled(seq, picked[seq]) if seq in picked
            else self._sample(seq, row, head.row(ordinal) if head is not None and ours else None)
            for seq, row, ordinal in sample_rows
        ]

    def _evaluate(self, armed: bool, n_outputs: int) -> tuple[int, Verdict]:
        """llama_decode of the filled batch, butter's projection armed or not."""
        head = self._lm_head
        if head is not None:
            head.arm(armed)
        started = time.perf_counter()
        status = int(ll.llama_decode(self._ctx, self._batch))
        ll.llama_synchronize(self._ctx)  # GPU builds return before the work is done
        self._decode_seconds += time.perf_counter() - started
        if head is None:
            return status, Verdict.LLAMA
        verdict = head.verdict(n_outputs)
        head.arm(False)
        return status, verdict

    def _rewind_batch(self, works: list[SeqWork]) -> None:
        """Forget what the last llama_decode of these works wrote into the cache."""
        for work in works:
            ll.llama_memory_seq_rm(self._mem, work.seq, work.start, -1)
        ll.llama_memory_seq_rm(self._mem, self._pad_seq, -1, -1)

    def _apply(self, op: KvOp) -> None:
        if isinstance(op, RemoveTokens):
            if not ll.llama_memory_seq_rm(self._mem, op.seq, op.start, op.end):
                # A partial removal the cache cannot do: drop the whole sequence instead;
                # the engine only asks for partial removals when rewinding is supported.
                raise BackendError(f"cannot remove positions {op.start}.. of seq {op.seq}")
        elif isinstance(op, CopyPrefix):
            ll.llama_memory_seq_cp(self._mem, op.src, op.dst, 0, op.length)
        elif isinstance(op, ShiftPositions):
            ll.llama_memory_seq_add(self._mem, op.seq, op.start, -1, op.delta)
        else:
            self._set_sampler(op.seq, op.params)

    def _fill_batch(
        self, works: list[SeqWork], *, outputs: int = 0,
    ) -> tuple[list[tuple[int, int, int]], int, bool]:
        """Write the works into the batch.

        Returns (seq, batch row, output ordinal) of each row to sample, the number of rows
        with logits, and whether scratch rows were added.

        `outputs`: request logits on at least this many rows (see butter.backends.shaping),
        first on rows that need none, then on scratch rows."""
        rows = sum(len(work.tokens) for work in works)
        if rows > self.n_batch:
            raise BackendError(f"a step of {rows} tokens exceeds the batch size {self.n_batch}")
        prompt_padding = 0
        if any(work.prompt for work in works) and rows < MIN_PROMPT_ROWS:
            prompt_padding = MIN_PROMPT_ROWS - rows
        sampled = sum(1 for work in works if work.sample)
        spare_outputs = max(0, outputs - sampled)
        padding = max(prompt_padding, spare_outputs - (rows - sampled))
        if rows + padding > self.n_batch:  # no room to shape: evaluate as it is
            padding, spare_outputs = prompt_padding, 0
        if padding:
            works = [*works, SeqWork(self._pad_seq, (0,) * padding, 0, sample=False)]
        batch = self._batch
        token, pos, n_seq_id = batch.token, batch.pos, batch.n_seq_id
        seq_id, logits = batch.seq_id, batch.logits
        row = n_outputs = 0
        sample_rows: list[tuple[int, int, int]] = []
        for work in works:
            last = len(work.tokens) - 1
            for offset, tok in enumerate(work.tokens):
                token[row] = tok
                pos[row] = work.start + offset
                n_seq_id[row] = 1
                seq_id[row][0] = work.seq
                wants = work.sample and offset == last
                output = wants or spare_outputs > 0
                logits[row] = output
                if wants:
                    sample_rows.append((work.seq, row, n_outputs))
                elif spare_outputs > 0:
                    spare_outputs -= 1
                n_outputs += output
                row += 1
        batch.n_tokens = row
        return sample_rows, n_outputs, padding > 0

    def _sample(self, seq: int, row: int, logits: Any) -> Sampled:
        """Sample batch row `row` for `seq`; `logits`: butter's for that row, or None for
        llama.cpp's (then read from the context)."""
        if seq in self._grammars:
            if logits is None:
                logits = self._llama_logits(row)
            token = self._sample_with_grammar(seq, logits)
        elif logits is None:
            token = int(ll.llama_sampler_sample(self._samplers[seq], self._ctx, row))
        else:  # what llama_sampler_sample does, on butter's logits
            chain = self._samplers[seq]
            token = self._choose(chain, self._fill_candidates(logits))
            if token >= 0:
                ll.llama_sampler_accept(chain, token)
        return self._sampled(seq, token)

    def _sampled(self, seq: int, token: int) -> Sampled:
        if token < 0:  # (the chains butter builds always keep a token: never seen)
            return Sampled(seq=seq, token=0, piece=b"", end_of_generation=True,
                           error="the sampler chain selected no token")
        return Sampled(
            seq=seq,
            token=token,
            piece=self._piece(token, special=False),
            end_of_generation=bool(ll.llama_vocab_is_eog(self._vocab, token)),
        )

    def step_logits(self, row: int) -> Any:
        """A copy of the logits batch row `row` of the last decode was sampled from."""
        if self._ours and self._lm_head is not None:
            ordinal = sum(bool(self._batch.logits[earlier]) for earlier in range(row))
            return self._lm_head.row(ordinal).copy()
        return self._llama_logits(row).copy()

    def _llama_logits_address(self, row: int) -> int:
        address = ctypes.cast(ll.llama_get_logits_ith(self._ctx, row), ctypes.c_void_p).value
        if address is None:
            raise BackendError(f"llama.cpp has no logits for batch row {row}")
        return address

    def _llama_logits(self, row: int) -> Any:
        return np.ctypeslib.as_array(
            ll.llama_get_logits_ith(self._ctx, row), shape=(self.info.n_vocab,)
        )

    def _sample_with_grammar(self, seq: int, logits: Any) -> int:
        """Sample normally, then let the grammar veto; only a veto pays for a full pass.

        A grammar applied to the whole vocabulary costs ~100 ms a token on a 262k vocab,
        so (as llama-server does) the grammar first checks only the token the normal
        chain picked, and constrains the full distribution only when it rejects it.
        """
        chain, grammar = self._samplers[seq], self._grammars[seq]
        token = self._choose(chain, self._fill_candidates(logits))
        if token < 0:
            return token  # (ends the request: see _sampled)
        single = np.array([(token, 0.0, 0.0)], dtype=self._candidates.dtype)
        ll.llama_sampler_apply(grammar, ctypes.byref(self._as_array(single)))
        if not np.isfinite(single["logit"][0]):
            token = self._choose_allowed(chain, grammar, logits)
            if token < 0:
                return token
        ll.llama_sampler_accept(grammar, token)
        ll.llama_sampler_accept(chain, token)
        return token

    def _choose_allowed(self, chain: Any, grammar: Any, logits: Any) -> int:
        """The chain's choice among grammar-allowed tokens: the most likely few first."""
        likely = np.argpartition(-logits, GRAMMAR_SHORTLIST)[:GRAMMAR_SHORTLIST]
        shortlist = np.zeros(len(likely), dtype=self._candidates.dtype)
        shortlist["id"] = likely
        shortlist["logit"] = logits[likely]
        ll.llama_sampler_apply(grammar, ctypes.byref(self._as_array(shortlist)))
        if np.isfinite(shortlist["logit"]).any():
            return self._choose(chain, shortlist)
        candidates = self._fill_candidates(logits)  # rare: nothing likely is allowed
        ll.llama_sampler_apply(grammar, ctypes.byref(self._as_array(candidates)))
        return self._choose(chain, candidates)

    def _fill_candidates(self, logits: Any) -> Any:
        candidates = self._candidates  # samplers reorder it in place: refill every time
        if self._lm_head is not None and logits.flags.c_contiguous:
            self._lm_head.fill_candidates(logits, candidates)  # one C loop
            return candidates
        candidates["id"] = self._vocab_ids
        candidates["logit"] = logits
        candidates["p"] = 0.0
        return candidates

    @staticmethod
    def _as_array(candidates: Any) -> Any:
        return ll.llama_token_data_array(
            data=candidates.ctypes.data_as(ll.llama_token_data_p), size=len(candidates),
            selected=-1, sorted=False,
        )

    def _choose(self, chain: Any, candidates: Any) -> int:
        array = self._as_array(candidates)
        ll.llama_sampler_apply(chain, ctypes.byref(array))
        return int(array.data[array.selected].id) if array.selected >= 0 else -1

    def check_sampling(self, params: SamplingParams) -> None:
        """Refuse (ValueError) what this backend cannot honour, before admission."""
        if params.grammar is not None:
            self.check_grammar(params.grammar)

    def check_grammar(self, grammar: str) -> None:
        """Raise ValueError if llama.cpp cannot parse this GBNF (before it reaches a step)."""
        with self._users.using():
            self._check_open()
            sampler = ll.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
            if not sampler:
                raise ValueError("llama.cpp rejected the grammar")
            ll.llama_sampler_free(sampler)

    def _set_sampler(self, seq: int, params: SamplingParams) -> None:
        for table in (self._samplers, self._grammars):
            old = table.pop(seq, None)
            if old is not None:
                ll.llama_sampler_free(old)
        self._samplers[seq] = self._sampler_chain(params)
        if params.grammar is not None:
            grammar = ll.llama_sampler_init_grammar(
                self._vocab, params.grammar.encode(), b"root"
            )
            if grammar:  # checked at request time; a None here only loses the constraint
                self._grammars[seq] = grammar

    def _sampler_chain(self, params: SamplingParams) -> Any:
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())

        def add(sampler: Any) -> None:
            ll.llama_sampler_chain_add(chain, sampler)

        if params.uses_penalties:
            add(ll.llama_sampler_init_penalties(
                self.info.n_vocab, params.penalty_last_n, params.repeat_penalty,
                params.frequency_penalty, params.presence_penalty,
            ))
        if params.greedy:
            add(ll.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            add(ll.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(ll.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(ll.llama_sampler_init_min_p(params.min_p, 1))
        add(ll.llama_sampler_init_temp(params.temperature))
        add(ll.llama_sampler_init_dist(params.seed))
        return chain

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        with self._users.closing():
            if self._model is None:
                return  # closed already
            self._thread.submit(self._free).result()  # after the step in flight, if any
        self._thread.shutdown()

    def _free(self) -> None:
        for table in (self._samplers, self._grammars):
            for sampler in table.values():
                ll.llama_sampler_free(sampler)
            table.clear()
        if self._ctx is not None:
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None
