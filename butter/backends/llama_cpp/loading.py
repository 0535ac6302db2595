"""A GGUF loaded into llama.cpp: the model, its context and batch, what it is, its text,
and who computes its logits (butter's output projection where it applies and checks out,
else llama.cpp's).

One context with a unified KV cache shared by `n_seq` sequences (a partial `seq_cp`
without a unified cache aborts the process), and `swa_full` so sliding-window models can
rewind and share prefixes exactly.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from butter.backends.base import BackendError, ModelInfo
from butter.backends.gguf_tensors import GgufHeader, read_header
from butter.backends.kernels import Isa, llama_cpp_kernel
from butter.backends.llama_cpp import ggml_boundary, layer_matmul
from butter.backends.lmhead import LmHead, Verdict
from butter.backends.native import Unavailable
from butter.backends.step_layouts import padded_outputs
from butter.cpu import this_cpu
from butter.errors import ModelLoadError
from butter.kv import KvCacheType, parse_kv_cache
from butter.models import check_gguf_file

log = logging.getLogger(__name__)

# llama.cpp's CPU matmuls take one code path for batches under 8 rows and another from
# 8 rows on; a row's result is identical within a path wherever it sits in the batch,
# but differs (slightly) across paths. Steps that evaluate prompt tokens are padded to
# 8 rows with a scratch sequence, so a prompt's KV and first logits are bit-identical
# whether it was prefilled cold, alone, beside others, or reused from the cache.
# (Weight repacking is off for the same reason where exactness is asked for, `repack`
# False: its kernels can make a row's result depend on its position in the batch; see
# docs/design/numerics.md.)
MIN_PROMPT_ROWS = 8
# Where butter's kernels multiply every matrix of a step (each layer's and the output
# projection), each row is computed alone at any row count, and so is each query row of
# llama.cpp's CPU flash attention below its tiles of 64 rows (batch.PROMPT_TILE_ROWS):
# a step of up to this many rows computes each row as alone (the output projection's
# buffers hold this many).
BUTTER_EXACT_ROWS = 16

# butter's output projection must reproduce llama.cpp's logits to within float rounding;
# checked once at load on a probe prompt.
LM_HEAD_TOLERANCE = 1e-3
# A requantized output matrix (not Q8_0 in the file) differs from llama.cpp's by both
# sides' rounding (Q8_0 weights here; for K-quants llama.cpp quantizes the activations per
# 256 values, butter per 32): measured 0.9% of the logits' spread (RMS) on a random Q6_K
# matrix of Qwen3-0.6B's shape. A wrong layout or kernel is off by ~100%. Checked as RMS of
# the difference / RMS of llama.cpp's logits.
REQUANTIZED_TOLERANCE = 0.05
LM_HEAD_PROBE = "butter checks its output projection against llama.cpp's own."

_backend_ready = threading.Lock()
_backend_initialised = False
_log_callback: Any = None  # kept alive for the life of the process, or llama.cpp segfaults


def init_llama_backend() -> None:
    """llama.cpp's process-wide setup, once, with its log chatter silenced."""
    global _backend_initialised, _log_callback
    with _backend_ready:
        if _backend_initialised:
            return
        ll.llama_backend_init()

        def _quiet(level: int, text: bytes, user_data: Any) -> None:
            return None  # butter logs what matters itself; llama.cpp's chatter is noise.

        _log_callback = ll.llama_log_callback(_quiet)
        ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
        layer_matmul.register()  # before any model load lists llama.cpp's buffer types
        _backend_initialised = True


class LlamaModel:
    """The native objects of one loaded GGUF (model, context, batch, butter's projection),
    freed together by `free`. Everything that evaluates runs on the backend's thread."""

    def __init__(
        self, path: Path, *, n_cells: int | Callable[[int], int], n_seq: int, n_batch: int,
        threads: int, kv_type: KvCacheType | None, fast_lm_head: bool, repack: bool = False,
        fast_layers: bool = True, cache_seqs: int = 0,
    ) -> None:
        """`n_cells` may be a function of the trained context (known only after loading)."""
        init_llama_backend()
        check_gguf_file(path)
        self._piece_buffer = ctypes.create_string_buffer(256)
        self._written_out: frozenset[int] = frozenset()  # control tokens shown as text
        self.model: Any
        repack = repack and not _crashing_buffer_type_listed()
        self.model, self.layers_by, stored = _load_model(path, repack=repack,
                                                         fast_layers=fast_layers)
        self.repack = repack
        # who multiplies each type of layer matrix this model has (kernels.py's table)
        header = read_header(path)
        self.layer_kernels = layer_kernels(header, stored=stored, repack=repack)
        # matrices llama.cpp multiplies one way for a lone row, another for several
        self.float_matrices = float_matrices(header)
        # (a hybrid's attention layers are a few of its layers: counted from its tensors)
        self._attention_kv_elements = attention_kv_elements(header)
        # every layer matrix is butter's (each row computed alone at any row count)
        self._butter_takes_every_layer_matrix = (
            bool(self.layer_kernels) and set(self.layer_kernels) <= stored
            and not has_expert_matrices(header))
        self.ctx: Any = None
        self.batch: Any = None
        self.vocab = ll.llama_model_get_vocab(self.model)
        try:
            self.info = self._read_info(path)
            cells = n_cells(self.info.n_ctx_train) if callable(n_cells) else n_cells
            self.kv_type = kv_type or parse_kv_cache("raw")
            self.lm_head, self.lm_head_by = _load_lm_head(
                path, enabled=fast_lm_head, threads=threads,
                max_rows=padded_outputs(max(n_seq, BUTTER_EXACT_ROWS)),
                n_vocab=self.info.n_vocab, recurrent=self.info.is_recurrent,
            )
            self._hook = self.lm_head  # referenced by the context (cb_eval) until it is freed
            # llama.cpp sizes its worst-case graph with one token per sequence at least:
            # more sequences than a batch's rows make it reserve past the batch and abort.
            cache_seqs = max(0, min(cache_seqs, n_batch + MIN_PROMPT_ROWS - n_seq - 1))
            self.cache_seqs = cache_seqs
            self.ctx = self._new_context(
                cells + MIN_PROMPT_ROWS, n_seq + cache_seqs + 1, n_batch + MIN_PROMPT_ROWS,
                threads,
            )
        except BaseException:
            self.free()
            raise
        self.mem = ll.llama_get_memory(self.ctx)
        self.n_cells = int(ll.llama_n_ctx(self.ctx)) - MIN_PROMPT_ROWS  # the padding's
        self.pad_seq = n_seq + cache_seqs  # a scratch sequence beyond every other one
        self.n_batch = n_batch + MIN_PROMPT_ROWS
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)

    # ------------------------------------------------------------------ what it is

    @property
    def butter_multiplies_every_matrix(self) -> bool:
        """butter's kernels take every layer matrix and the output projection (so a step
        computes each row as alone at up to BUTTER_EXACT_ROWS rows)."""
        return self.lm_head is not None and self._butter_takes_every_layer_matrix

    def _read_info(self, path: Path) -> ModelInfo:
        description = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, description, len(description))
        template = ll.llama_model_chat_template(self.model, None)
        return ModelInfo(
            path=str(path),
            architecture=self._meta("general.architecture") or "unknown",
            description=description.value.decode("utf-8", errors="replace"),
            n_ctx_train=int(ll.llama_model_n_ctx_train(self.model)),
            n_vocab=int(ll.llama_vocab_n_tokens(self.vocab)),
            embedded_chat_template=template.decode("utf-8") if template else None,
            bos_text=self._special_text(ll.llama_vocab_bos(self.vocab)),
            eos_text=self._special_text(ll.llama_vocab_eos(self.vocab)),
            add_bos=bool(ll.llama_vocab_get_add_bos(self.vocab)),
            is_recurrent=bool(
                ll.llama_model_is_recurrent(self.model) or ll.llama_model_is_hybrid(self.model)
            ),
            size_bytes=int(ll.llama_model_size(self.model)),
            fim_tokens=self._fim_tokens(),
        )

    def _fim_tokens(self) -> tuple[int, int, int] | None:
        tokens = (int(ll.llama_vocab_fim_pre(self.vocab)), int(ll.llama_vocab_fim_suf(self.vocab)),
                  int(ll.llama_vocab_fim_mid(self.vocab)))
        return tokens if min(tokens) >= 0 else None

    def _meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(4096)
        length = ll.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        if length < 0:
            return None
        if length >= len(buffer):
            buffer = ctypes.create_string_buffer(length + 1)
            ll.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode("utf-8", errors="replace")

    @property
    def query_heads(self) -> int:
        return int(ll.llama_model_n_head(self.model))

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V bytes one position costs across all layers, at the cache's type (for a
        recurrent or hybrid model, across the layers that have attention)."""
        if self.info.is_recurrent:
            return float(self._attention_kv_elements * self.kv_type.bytes_per_element)
        model, arch = self.model, self.info.architecture
        n_head, n_head_kv = ll.llama_model_n_head(model), ll.llama_model_n_head_kv(model)
        default_dim = ll.llama_model_n_embd(model) // max(1, n_head)
        key_dim = int(self._meta(f"{arch}.attention.key_length") or default_dim)
        value_dim = int(self._meta(f"{arch}.attention.value_length") or default_dim)
        elements = ll.llama_model_n_layer(model) * n_head_kv * (key_dim + value_dim)
        return float(elements * self.kv_type.bytes_per_element)

    @property
    def can_shift(self) -> bool:
        return bool(ll.llama_memory_can_shift(self.mem))

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
        if self.lm_head is not None:  # the hook that computes the logits (lmhead.py)
            hook = ll.ggml_backend_sched_eval_callback
            params.cb_eval = ctypes.cast(self.lm_head.callback, hook)
            params.cb_eval_user_data = self.lm_head.user_data
        ctx = ll.llama_init_from_model(self.model, params)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_cells} cells")
        return ctx

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (ll.llama_token * capacity)()
        count = ll.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_bos, True)
        if count < 0:
            capacity = -count
            tokens = (ll.llama_token * capacity)()
            count = ll.llama_tokenize(
                self.vocab, data, len(data), tokens, capacity, add_bos, True
            )
        return list(tokens[:count])

    def write_out(self, texts: Iterable[str]) -> None:
        """Generated control tokens whose text is one of `texts` come out as that text
        instead of empty pieces (a model family's tool-call markers, for the parser)."""
        found = set(self._written_out)
        for text in texts:
            tokens = self.tokenize(text, add_bos=False)
            if len(tokens) == 1 and tokens[0] not in found and self.piece(tokens[0]) == b"":
                found.add(tokens[0])
        self._written_out = frozenset(found)

    def piece(self, token: int, *, special: bool = False) -> bytes:
        special = special or token in self._written_out
        buffer = self._piece_buffer
        length = ll.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, special)
        if length < 0:
            buffer = ctypes.create_string_buffer(-length)
            length = ll.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, special)
        return ctypes.string_at(buffer, length)  # not .raw: that copies the whole buffer

    def is_end_of_generation(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ logits

    def llama_logits(self, row: int) -> Any:
        """llama.cpp's logits of batch row `row` of the last decode (a view)."""
        return np.ctypeslib.as_array(
            ll.llama_get_logits_ith(self.ctx, row), shape=(self.info.n_vocab,)
        )

    def llama_logits_address(self, row: int) -> int:
        address = ctypes.cast(ll.llama_get_logits_ith(self.ctx, row), ctypes.c_void_p).value
        if address is None:
            raise BackendError(f"llama.cpp has no logits for batch row {row}")
        return address

    # ------------------------------------------------------------------ butter's projection

    def verify_lm_head(self) -> None:
        """Compare one probe prompt's logits both ways; on disagreement use llama.cpp's.
        (Evaluates: run it on the backend's thread.)"""
        assert self.lm_head is not None
        tokens = self.tokenize(LM_HEAD_PROBE, add_bos=self.info.add_bos)[: self.lm_head.rows]
        theirs = self._probe_logits(tokens, armed=False)
        ours = self._probe_logits(tokens, armed=True)
        if ours is None or theirs is None:
            problem = "its hook never saw the final norm"
        elif self.lm_head.exact:
            error = float(np.abs(ours - theirs).max())
            limit = LM_HEAD_TOLERANCE * max(1.0, float(np.abs(theirs).max()))
            if error <= limit:
                return
            problem = f"its logits differ from llama.cpp's by {error:.3g} (limit {limit:.3g})"
        else:
            error = relative_rms_error(ours, theirs)
            if error <= REQUANTIZED_TOLERANCE:
                return
            problem = (f"its logits differ from llama.cpp's by {error:.3g} RMS relative "
                       f"(limit {REQUANTIZED_TOLERANCE})")
        log.warning("butter's output projection is off for this model: %s", problem)
        # The context keeps calling the (now unarmed) hook: `_hook` keeps its state alive.
        self.lm_head, self.lm_head_by = None, f"llama.cpp (self-check failed: {problem})"

    def checkpoint_size(self) -> int:
        """The bytes of one sequence's checkpoint (its recurrent state: the same at any
        length), measured on the scratch sequence after one token."""
        batch = self.batch
        batch.token[0], batch.pos[0], batch.n_seq_id[0] = 0, 0, 1
        batch.seq_id[0][0], batch.logits[0] = self.pad_seq, False
        batch.n_tokens = 1
        try:
            if ll.llama_decode(self.ctx, batch) != 0:
                raise ModelLoadError("llama.cpp could not evaluate the probe token")
            return int(ll.llama_state_seq_get_size_ext(
                self.ctx, self.pad_seq, ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        finally:
            ll.llama_memory_seq_rm(self.mem, self.pad_seq, -1, -1)

    def save_recurrent_state(self, seq: int, buffer: Any = None) -> tuple[Any, int]:
        """`seq`'s checkpoint: its recurrent state alone (PARTIAL_ONLY: a hybrid's attention
        KV stays out), written into `buffer` where it fits, else into a new one. Returns the
        buffer (a ctypes byte array) and the bytes written (0: nothing was saved)."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(ll.llama_state_seq_get_size_ext(self.ctx, seq, flags))
        if buffer is None or len(buffer) < size:
            buffer = (ctypes.c_uint8 * size)()
        return buffer, int(ll.llama_state_seq_get_data_ext(self.ctx, buffer, size, seq, flags))

    def load_recurrent_state(self, seq: int, data: Any, size: int) -> bool:
        """Put `size` bytes of a checkpoint (save_recurrent_state's) back as `seq`'s
        recurrent state. False where llama.cpp refused it (it then cleared that state).
        A hybrid's attention KV can be cut back only once this is done: its memory refuses
        a cut inside the recurrent state's past."""
        return bool(ll.llama_state_seq_set_data_ext(
            self.ctx, data, size, seq, ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))

    def _probe_logits(self, tokens: list[int], *, armed: bool) -> Any:
        """Logits of every probe token, computed by butter (armed) or by llama.cpp."""
        assert self.lm_head is not None
        batch = self.batch
        for row, token in enumerate(tokens):
            batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, row, 1
            batch.seq_id[row][0], batch.logits[row] = self.pad_seq, True
        batch.n_tokens = len(tokens)
        self.lm_head.arm(armed)
        try:
            if ll.llama_decode(self.ctx, batch) != 0:
                raise ModelLoadError("llama.cpp could not evaluate the probe prompt")
            if not armed:
                return np.stack([self.llama_logits(row).copy() for row in range(len(tokens))])
            if self.lm_head.verdict(len(tokens)) is not Verdict.OURS:
                return None
            return np.stack([self.lm_head.row(row).copy() for row in range(len(tokens))])
        finally:
            self.lm_head.arm(False)
            ll.llama_memory_seq_rm(self.mem, self.pad_seq, -1, -1)

    # ------------------------------------------------------------------ teardown

    def free(self) -> None:
        free_native(self)


def free_native(owner: Any) -> None:
    """Free the llama.cpp batch, context and model `owner` holds (each once, in that
    order), leaving None in their place."""
    if owner.batch is not None:
        ll.llama_batch_free(owner.batch)
        owner.batch = None
    if owner.ctx is not None:
        ll.llama_free(owner.ctx)
        owner.ctx = None
    if owner.model is not None:
        ll.llama_model_free(owner.model)
        owner.model = None


def relative_rms_error(ours: Any, theirs: Any) -> float:
    """RMS of the difference over RMS of llama.cpp's logits (centred per row, since a
    constant shift of a row changes no probability)."""
    centred = theirs - theirs.mean(axis=-1, keepdims=True)
    scale = float(np.sqrt(np.mean(np.square(centred))))
    diff = (ours - theirs) - (ours - theirs).mean(axis=-1, keepdims=True)
    return float(np.sqrt(np.mean(np.square(diff)))) / max(scale, 1e-12)


def _crashing_buffer_type_listed() -> bool:
    """Whether llama.cpp still offers weights to a buffer type that crashes it (butter's
    native library takes those out at registration; without it, repacking goes off)."""
    try:
        listed = ggml_boundary.listed_buffer_type_names()
    except Unavailable:
        return False
    crashing = [name for name in listed if name.encode() in layer_matmul.CRASHING_BUFFER_TYPES]
    if crashing:
        log.warning("llama.cpp's %s buffer type crashes at this llama.cpp version and butter's "
                    "native library could not take it out: weight repacking is off",
                    ", ".join(crashing))
    return bool(crashing)


def _load_model(path: Path, *, repack: bool, fast_layers: bool) -> tuple[Any, str, set[str]]:
    """llama.cpp's model, who computes the layer matmuls of the types butter has kernels for
    ("butter (ISA; what it took)", or "llama.cpp (why)": layer_matmul.py), and the types
    butter took."""
    params = ll.llama_model_default_params()
    params.use_extra_bufts = repack  # weight repacking: see MIN_PROMPT_ROWS
    try:
        kernel: layer_matmul.LayerMatmul | None = layer_matmul.registered()
        why_not = ""
    except Unavailable as exc:
        kernel, why_not = None, str(exc)
    if not fast_layers:
        why_not = "--no-fast-layers"
    elif not repack:
        why_not = "--deterministic turns llama.cpp's extra buffer types off"
    if kernel is None or why_not:
        return _load_llama_model(path, params), f"llama.cpp ({why_not})", set()
    before = kernel.counters()
    with kernel.accepting(True):
        model = _load_llama_model(path, params)
    after = kernel.counters()
    stored = {name: n - before.by_type()[name] for name, n in after.by_type().items()}
    if not any(stored.values()):
        failed = [name for name, who in kernel.types.items() if who != "butter"]
        if failed:
            return (model, f"llama.cpp (butter's {', '.join(failed)} kernels failed their "
                    "self-check)", set())
        return model, "llama.cpp (no layer matrices of the types butter multiplies)", set()
    counts = " + ".join(f"{n} {name.upper()}" for name, n in stored.items() if n)
    return (model, f"butter ({kernel.isa.value}; {counts} matrices)",
            {name for name, n in stored.items() if n})


def attention_kv_elements(header: GgufHeader) -> int:
    """K and V elements one position stores, from the attention layers' K and V projections
    (their output widths); 0 where no layer has attention (Mamba)."""
    tensors = header.tensors
    return sum(tensor.shape[1] for name, tensor in tensors.items()
               if name.startswith("blk.") and name.endswith((".attn_k.weight", ".attn_v.weight"))
               and len(tensor.shape) == 2)


def has_expert_matrices(header: GgufHeader) -> bool:
    """Whether a layer holds 3-D weights (a mixture of experts' stacked matrices, which
    llama.cpp multiplies itself, whatever their type)."""
    return any(t.name.startswith("blk.") and len(t.shape) > 2 for t in header.tensors.values())


# ggml's float types (F32, F16, BF16): llama.cpp's CPU multiplies a matrix of one of these by
# a lone row with ggml's dot products and by two rows or more with llamafile's tinyBLAS,
# which sum in another order, so that a row's result changes in its last bits with the
# number of rows beside it (measured: a tiny model's F32 matrices, docs/design/speculation.md).
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
# A recurrent layer's 2-D weights that are no matrix multiplied by rows: convolution
# kernels (Mamba, Qwen3.5's delta net, LFM2's short conv) and Mamba's A.
NOT_MATRICES = ("ssm_conv1d.weight", "shortconv.conv.weight", ".ssm_a")


def float_matrices(header: GgufHeader) -> list[str]:
    """The model's matrices of a float type (FLOAT_TYPES) that multiply rows: its layers'
    and its output projection (the embedding where it is tied), as "name (type)"."""
    tensors = header.tensors
    output = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    found = []
    for tensor in tensors.values():
        kind = FLOAT_TYPES.get(tensor.ggml_type)
        if kind is None or len(tensor.shape) != 2 or tensor.name.endswith(NOT_MATRICES):
            continue
        if tensor.name == output or (tensor.name.startswith("blk.") and tensor.shape[1] > 1):
            found.append(f"{tensor.name} ({kind})")
    return found


def layer_kernels(header: GgufHeader, *, stored: set[str], repack: bool) -> dict[str, str]:
    """For each type of the model's layer matrices: how many there are and who multiplies
    them ("12 x butter (AVX2)", "84 x llama.cpp (repacked)", "llama.cpp (self-check
    failed: ...)"), from kernels.py's table and what the load did."""
    try:
        kernel: layer_matmul.LayerMatmul | None = layer_matmul.registered()
    except Unavailable:
        kernel = None
    isa = kernel.isa if kernel is not None else Isa.NONE
    cpu_isa = this_cpu().isa
    table_isa = Isa(cpu_isa) if cpu_isa in {isa.value for isa in Isa} else Isa.NONE
    counts: dict[str, int] = {}
    for tensor in header.tensors.values():
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2 and tensor.shape[1] > 1:
            name = ggml_boundary.ggml_type_name(tensor.ggml_type)
            counts[name] = counts.get(name, 0) + 1
    verdicts: dict[str, str] = {}
    for name, count in sorted(counts.items()):
        if name in stored:
            who = f"butter ({isa.value})"
        elif kernel is not None and kernel.types.get(name, "butter") != "butter":
            who = kernel.types[name]  # its self-check failed
        else:
            who = llama_cpp_kernel(table_isa, name, repack=repack).value
        verdicts[name] = f"{count} x {who}"
    return verdicts


def _load_llama_model(path: Path, params: Any) -> Any:
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelLoadError(
            f"llama.cpp could not load {path} (corrupt, truncated or unsupported model)"
        )
    return model


def _load_lm_head(
    path: Path, *, enabled: bool, threads: int, max_rows: int, n_vocab: int, recurrent: bool,
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
    if head.exact and head.source_type == "Q8_0":
        return head, f"butter ({head.isa})"
    if head.exact:  # read in the file's own type
        return head, f"butter ({head.isa}; {head.source_type} output)"
    return head, f"butter ({head.isa}; {head.source_type} output requantized to Q8_0)"
