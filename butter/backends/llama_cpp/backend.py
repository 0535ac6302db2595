"""The llama.cpp backend: a loaded GGUF (loading.py), stepped (batch.py) and sampled
(sampling.py) on the backend's own thread (butter/backends/worker.py).

Every method that touches the context runs on that thread; ctypes releases the GIL during
decode, so the trio loop keeps serving.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import llama_cpp as ll

from butter.backends.base import (
    BackendError,
    Checkpointed,
    CopyPrefix,
    KvOp,
    PromptImage,
    RemoveTokens,
    RestoreCheckpoint,
    Restored,
    RestoreSequence,
    SaveCheckpoint,
    Saved,
    SaveSequence,
    SeqWork,
    SetSampler,
    ShiftPositions,
    StepResult,
    apply_kv_ops,
)
from butter.backends.kernels import Kernel
from butter.backends.llama_cpp import layer_matmul
from butter.backends.llama_cpp.batch import (
    EXACT_BATCH_ROWS,
    PROMPT_TILE_ROWS,
    REPACKED_EXACT_ROWS,
    Stepper,
)
from butter.backends.llama_cpp.drafter import DraftModel
from butter.backends.llama_cpp.loading import BUTTER_EXACT_ROWS, LlamaModel
from butter.backends.llama_cpp.placement import TeamPlacement
from butter.backends.llama_cpp.positions import SequencePositions
from butter.backends.llama_cpp.sampling import Samplers
from butter.backends.llama_cpp.vision import Projector
from butter.backends.native import Unavailable
from butter.backends.step_layouts import LayoutTimer
from butter.backends.team import StepPace, TeamSizer, TeamStatus, read_sample
from butter.backends.worker import BackendWorker
from butter.chat.images import DecodedImage
from butter.cpu import allowed_cpus, this_cpu
from butter.errors import ModelLoadError
from butter.kv import KvCacheType
from butter.sampling import SamplingParams

log = logging.getLogger("butter.engine")



def _recurrent_ops_by() -> dict[str, str]:
    """Who computes a hybrid model's recurrent ops in this process: the Gated DeltaNet
    recurrence and the short convolution before it (layer_matmul._checked_delta_net and
    _checked_short_conv), "butter (ISA)" or "llama.cpp (why)"."""
    try:
        kernels = layer_matmul.registered()
    except Unavailable as exc:
        off = f"llama.cpp (butter's kernels are off: {exc})"
        return {"delta_net": off, "short_conv": off}
    return {"delta_net": kernels.delta_net, "short_conv": kernels.short_conv}


class LlamaCppBackend:
    def __init__(
        self, path: Path, *, n_cells: int | Callable[[int], int], n_seq: int, n_batch: int,
        threads: int, kv_type: KvCacheType | None = None, step_shaping: bool = True,
        fast_lm_head: bool = True, repack: bool = False, fast_layers: bool = True,
        cache_seqs: int = 0, draft_model: Path | None = None, draft_required: bool = True,
        exact_decode: bool = False, fit_threads: bool = True, mmproj: Path | None = None,
    ) -> None:
        """`n_cells` may be a function of the trained context (known only after loading).
        `cache_seqs`: sequence ids beyond the `n_seq` generating ones, for cached prefixes.

        `fast_lm_head`: let butter compute the logits (butter/backends/lmhead.py) where
        that applies; `lm_head` then says which one does, and why. `repack`: let llama.cpp
        repack weights for its interleaved kernels (faster one-row decode of some K-quants,
        but a row's result then depends on its place in the batch: docs/design/numerics.md).
        `fast_layers`: let butter multiply the layers' Q8_0, Q6_K and Q5_K matrices inside
        llama.cpp (layer_matmul.py; it needs `repack`); `layer_matmuls` says who does.
        `exact_decode`: every decode row is computed as a row of a bigger step is: a one-row
        step gets a scratch row (batch.ONE_ROW_SCRATCH; slower where llama.cpp's
        lone-row attention or its repacked kernels are faster), unless butter computes the
        attention (`decode_attention`), which already computes a lone row that way.
        `draft_model`: a GGUF with the same vocabulary that guesses tokens for speculative
        decoding (drafter.py); one that cannot serve this model raises ModelLoadError when
        `draft_required`, else stays unloaded, and `draft_model_off` says why.
        `fit_threads`: steps run on fewer than `threads` threads while other programs take
        the cores (team.py), else always on `threads`. `mmproj`: a vision projector GGUF
        for this model (vision.py); one that does not fit it, or that butter cannot evaluate
        yet, raises ModelLoadError with the reason."""
        # Everything that runs llama.cpp's threads runs on this one thread, loading included:
        # see BackendWorker.
        self._worker = BackendWorker("butter-llama", free=self._free)
        try:
            self.model = self._worker.call(
                LlamaModel, path, n_cells=n_cells, n_seq=n_seq, cache_seqs=cache_seqs,
                n_batch=n_batch, threads=threads, kv_type=kv_type, fast_lm_head=fast_lm_head,
                repack=repack, fast_layers=fast_layers,
            )
        except BaseException:
            self._worker.abandon()
            raise
        self.info = self.model.info
        self.kv_type = self.model.kv_type
        self.n_cells = self.model.n_cells
        self.n_seq = n_seq
        self.n_cache_seqs = self.model.cache_seqs  # (at most what a batch's rows allow)
        self.shares_prefix_cells = True  # seq_cp tags the source's cells (unified cache)
        self.saves_sequences = True
        self.n_batch = self.model.n_batch
        self.can_shift = self.model.can_shift
        # swa_full keeps sliding-window layers whole, so only recurrent state cannot rewind.
        self.rewind_limit = 1 if self.info.is_recurrent else None
        # What cannot be cut back is checkpointed instead (llama-server's context checkpoints).
        self.checkpoint_bytes = self._worker.call(self.model.checkpoint_size) \
            if self.info.is_recurrent else 0
        self.samplers = Samplers(self.model)
        self.drafter: DraftModel | None = None
        self.draft_model_off: str | None = None
        self.projector: Projector | None = None  # (before anything that may close)
        if draft_model is not None:
            self._load_drafter(draft_model, required=draft_required, threads=threads)
        if mmproj is not None:
            try:
                self.projector = self._worker.call(
                    Projector, mmproj, self.model.model, n_batch=self.model.n_batch,
                    threads=threads)
            except BaseException:
                self.close()
                raise
        self.layouts = LayoutTimer(enabled=step_shaping)
        # Measured on llama.cpp's CPU kernels; a GPU build keeps llama-server's one batch.
        cpu = not ll.llama_supports_gpu_offload()
        self.butter_attention, self.decode_attention = self._choose_decode_attention()
        # (butter computes a lone row as a bigger step's row: no scratch row beside it)
        pad_one_row = cpu and exact_decode and not self.butter_attention
        # Images with M-RoPE positions: where each sequence's cells sit (positions.py)
        self.positions = SequencePositions() \
            if self.projector is not None and self.projector.m_rope else None
        self.stepper = Stepper(self.model, self.samplers, self.layouts, separate_prompts=cpu,
                               pad_one_row=pad_one_row, drafter=self.drafter,
                               projector=self.projector, positions=self.positions)
        self.prompt_tile = PROMPT_TILE_ROWS if cpu else 1  # (GPU kernels: unmeasured)
        self.draft_rows, self.speculation_off = self._draft_rows()
        if self.model.lm_head is not None:
            try:
                self._worker.call(self.model.verify_lm_head)
            except BaseException:
                self.close()
                raise
        # Time llama.cpp's own projection against butter's, per number of rows, where both
        # exist, exactness was not asked for (they round differently), and butter's serves a
        # requantized matrix (more bytes than the file's). On a Q8_0 output matrix both read
        # the same bytes and butter's kernel is the faster (docs/design/kernels.md): trying
        # llama.cpp's there only costs time, and changes the last bits of some steps' logits,
        # so that the same seeded request could sample differently from one run to the next.
        head = self.model.lm_head
        self.layouts.head_choice = head is not None and repack and not head.exact
        self.threads = self.most_threads = threads  # (threads: the team's size now)
        self._cpus = allowed_cpus()
        self.team_sizer = TeamSizer(threads, len(self._cpus)) if fit_threads and threads > 1 \
            else None
        self.pace = StepPace()
        self._stepped = 0.0  # seconds in steps since the team sizer last looked
        self.placement: TeamPlacement | None = None
        self.placement_off: str | None = "--no-fit-threads" if not fit_threads else None
        if self.team_sizer is not None:
            self._worker.call(self._place_team)
        # The vocabulary for constrained output is read on a thread of its own while the
        # model loads, and a large one outlasts the load (2.8 s for Qwen3.5's 248k tokens):
        # loaded before it is read, the first request's steps ran beside it, their team saw
        # a core taken and shrank, and a 1.8k-token prefill took 7 s instead of 4.
        self.samplers.grammars.wait_until_read()

    def _load_drafter(self, path: Path, *, required: bool, threads: int) -> None:
        model = self.model
        try:
            self.drafter = self._worker.call(
                DraftModel, path, target_vocab=model.vocab, n_cells=model.n_cells,
                n_seq=model.pad_seq + 1, threads=threads)
        except ModelLoadError as exc:
            if required:
                self.close()
                raise
            self.draft_model_off = str(exc)
        except BaseException:
            self.close()
            raise

    @property
    def drafter_path(self) -> str | None:
        return str(self.drafter.path) if self.drafter is not None else None

    @property
    def guesses(self) -> bool:
        return self.drafter is not None

    @property
    def guess_seconds(self) -> float:
        return self.drafter.seconds if self.drafter is not None else 0.0

    def _draft_rows(self) -> tuple[int, str | None]:
        """How many rows a verifying step may have (docs/design/speculation.md, "Speculative
        decoding"): llama.cpp's CPU matmuls compute each row of a batch of fewer than
        EXACT_BATCH_ROWS as they would alone, but its repacked kernels multiply rows four
        at a time from four rows on, where they round differently. A hybrid model's
        rejected drafts are taken back by checkpoint and replay (batch.py), where a row
        is computed as alone: llama.cpp splits a hybrid's step into micro-batches of as
        many tokens of each sequence, which can leave one row alone, and multiplies float
        matrices one way for a lone row and another for several (loading.FLOAT_TYPES)."""
        if ll.llama_model_is_recurrent(self.model.model):
            # (Measured on the tiny Mamba: a step of several tokens leaves other state bits
            # than as many one-token steps, scratch row or not; never made exact.)
            return 0, "a recurrent model's drafts would change its outputs"
        floats = self.model.float_matrices
        if self.info.is_recurrent and floats:
            shown = ", ".join(floats[:3]) + (f" and {len(floats) - 3} more"
                                             if len(floats) > 3 else "")
            return 0, (f"llama.cpp multiplies this hybrid model's float matrices ({shown}) "
                       "one way for a lone row and another for several: drafts would change "
                       "its outputs")
        repacked = any(Kernel.REPACKED.value in who
                       for who in self.model.layer_kernels.values())
        if repacked:
            return REPACKED_EXACT_ROWS, None
        if self.model.butter_multiplies_every_matrix:
            return BUTTER_EXACT_ROWS, None
        return EXACT_BATCH_ROWS - 1, None

    def _choose_decode_attention(self) -> tuple[bool, str]:
        """Who computes the attention: butter (layer_matmul.LayerMatmul.decode_attention and
        .prompt_attention), each row, decode or prompt, over the cells it sees with
        fixed-point sums, so that a decode row verified beside drafts or beside other
        requests is bit for bit the lone row it stands for at any context length, and a
        prompt's rows the same in any chunk and beside any other prompts, wherever their
        cells lie in the cache; or llama.cpp, which from 512 cells on splits a one-row
        step's cells among its threads, sums a prompt tile's cells in blocks of the places
        they lie in, and sums in the order cells lie in. Returns whether butter does, and
        who, in words."""
        try:
            kernels = layer_matmul.registered()
        except Unavailable as exc:
            return False, f"llama.cpp (butter's kernels are off: {exc})"
        if kernels.attention != "butter":
            return False, kernels.attention
        if self.model.kv_type.quantized:  # (llama.cpp then computes every row alone)
            return False, f"llama.cpp (a {self.model.kv_type.name} cache: row by row)"
        return True, "butter (every row, decode and prompt, over the cells it sees, in fixed point)"

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token

    @property
    def lm_head(self) -> str:
        """Who computes the logits ("butter (ISA)" or "llama.cpp (why)")."""
        return self.model.lm_head_by

    @property
    def lm_head_redos(self) -> int:
        """Steps evaluated again by llama.cpp because it split them (docs/design/kernels.md)."""
        return self.stepper.redone_steps

    def diagnostics(self) -> dict[str, Any]:
        layouts = self.layouts
        shapes = ({str(n): shape for n, shape in layouts.verdicts().items()}
                  if layouts.enabled else None)
        return {
            "step_shapes": shapes,  # decode-step layouts chosen so far, by output rows
            "lm_head": {"by": self.lm_head, "redone_steps": self.lm_head_redos},
            "weight_repacking": self.model.repack,  # off with --deterministic
            # llama.cpp buffer types butter took out because they crash (layer_matmul.py)
            "dropped_buffer_types": list(layer_matmul.dropped_buffer_types),
            # who multiplies the layer matrices of the types butter has kernels for:
            # "butter (...)" or "llama.cpp (why)"
            "layer_matmuls": self.model.layers_by,
            # the CPU class, and who multiplies each type of layer matrix (kernels.py)
            "kernels": {"cpu": this_cpu().as_dict(), "layers": self.model.layer_kernels,
                        "output": self.lm_head},
            # who computes decode steps' attention: "butter (...)", each row the same
            # beside drafts and other requests, or "llama.cpp (why)"
            "decode_attention": self.decode_attention,
            # who computes a hybrid model's recurrent ops (ggml's GATED_DELTA_NET and
            # SSM_CONV, with llama.cpp's bits either way)
            "recurrent_ops": _recurrent_ops_by(),
            # steps whose decode rows were evaluated apart from a prompt chunk
            "separated_prompt_steps": self.stepper.separated_steps,
            # the vision projector (--mmproj): its file, type and encodes; None: none
            "projector": None if self.projector is None else {
                **self.projector.describe(), "image_runs": self.stepper.image_runs},
        }

    def team(self) -> TeamStatus:
        team = self.team_sizer
        last = team.last if team else None
        return TeamStatus(
            now=self.threads, most=self.most_threads, fitted=team is not None,
            others_cores=None if last is None else round(last.others, 2),
            team_wait=None if last is None or last.waited is None else round(last.waited, 2),
            step_time_ratio=None if self.pace.ratio is None else round(self.pace.ratio, 2),
            shrinks=team.shrinks if team else 0, full_team_tries=team.tries if team else 0,
            pinned=self.placement is not None and self.placement.pinned,
            pinning_off=self.placement_off,
        )

    # ------------------------------------------------------------------ text and checks

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        with self._worker.using():
            return self.model.tokenize(text, add_bos=add_bos)

    @property
    def vision(self) -> bool:
        return self.projector is not None

    def tokenize_media(self, texts: Sequence[str], images: Sequence[DecodedImage], *,
                       add_bos: bool) -> tuple[list[int], list[PromptImage]]:
        """On the caller's thread (libmtmd's tokenizer is thread-safe; it resizes the
        images there, not in a step)."""
        if self.projector is None:
            raise BackendError("no projector is loaded (--mmproj)")
        with self._worker.using():
            return self.projector.tokenize(texts, images, add_bos=add_bos)

    def write_out(self, texts: Iterable[str]) -> None:
        self._worker.call(self.model.write_out, list(texts))

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._worker.using():
            pieces = [self.model.piece(token, special=True) for token in tokens]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def check_sampling(self, params: SamplingParams) -> None:
        """Refuse (ValueError) what this backend cannot honour, before admission."""
        with self._worker.using():
            if params.grammar is not None:
                self.samplers.grammars.check(params.grammar)

    # ------------------------------------------------------------------ steps

    def step(self, ops: list[KvOp], works: list[SeqWork]) -> list[StepResult]:
        return self.submit_step(ops, works).result()

    def submit_step(self, ops: list[KvOp], works: list[SeqWork]) -> Future[list[StepResult]]:
        """`step` on the backend's thread; the engine awaits the future."""
        return self._worker.submit(self._step, ops, works)

    def _step(self, ops: list[KvOp], works: list[SeqWork]) -> list[StepResult]:
        outcomes: list[StepResult] = list(apply_kv_ops(self, ops))
        if self.team_sizer is None:  # (--no-fit-threads: nothing to time)
            return outcomes + self.stepper.evaluate(works)
        started = time.perf_counter()
        outcomes += self.stepper.evaluate(works)
        seconds = time.perf_counter() - started
        if works and not any(work.prompt for work in works):
            self.pace.observe(sum(len(work.tokens) + work.guess for work in works), seconds)
        self._fit_team(self.team_sizer, seconds)
        return outcomes

    def _fit_team(self, team: TeamSizer, stepped: float) -> None:
        """Between steps: the team for the next ones, when a window of steps closes."""
        self._stepped += stepped
        if not team.due(time.monotonic()):
            return
        size = team.observe(read_sample(self._cpus, self._team_tids()), self._stepped,
                            self.pace.close_window)
        self._stepped = 0.0
        if size != self.threads:
            log.debug("compute team %d -> %d threads after %s", self.threads, size, team.last)
            self._set_threads(size)
            team.restart(read_sample(self._cpus, self._team_tids()))

    def _team_tids(self) -> list[int]:
        """The kernel thread ids of the team now, where known (thread 0 first)."""
        return self.placement.tids[:self.threads] if self.placement is not None else []

    def resize_team(self, threads: int) -> None:
        """Compute the next steps on `threads` threads (1 to --threads), from any thread;
        with --fit-threads the team sizer may change it again after a window of steps."""
        self._worker.call(self._set_threads, threads)

    def _set_threads(self, threads: int) -> None:
        """`resize_team` on the backend's thread."""
        threads = max(1, min(threads, self.most_threads))
        ll.llama_set_n_threads(self.model.ctx, threads, threads)
        if self.model.lm_head is not None:
            self.model.lm_head.set_threads(threads)
        if self.drafter is not None:
            ll.llama_set_n_threads(self.drafter.ctx, threads, threads)
        self.threads = threads
        self._place_team()

    def _place_team(self) -> None:
        """One team thread per CPU when the team fills them, else anywhere in the mask
        (placement.py); without butter's extension the scheduler places them."""
        if self.placement is None and self.placement_off is None:
            if b"OPENMP = 1" not in ll.llama_print_system_info():
                # (its own thread pool: butter's OpenMP regions would reach other threads)
                self.placement_off = "llama.cpp was built without OpenMP"
                return
            try:
                self.placement = TeamPlacement(self._cpus)
            except Unavailable as exc:
                self.placement_off = str(exc)
        if self.placement is not None:
            try:
                self.placement.place(self.threads, self.most_threads)
            except Unavailable as exc:
                self.placement, self.placement_off = None, str(exc)

    def remove_tokens(self, op: RemoveTokens) -> None:
        start, end = op.start, op.end
        if self.positions is not None:
            if end != -1 and self.positions.images(op.seq):
                raise BackendError(f"cannot remove cells {start}..{end} from the middle of "
                                   f"seq {op.seq}: its images take M-RoPE positions")
            start = self.positions.cut(op.seq, start)
        if not ll.llama_memory_seq_rm(self.model.mem, op.seq, start, end):
            # A partial removal the cache cannot do: drop the whole sequence instead;
            # the engine only asks for partial removals when rewinding is supported.
            raise BackendError(f"cannot remove positions {op.start}.. of seq {op.seq}")

    def copy_prefix(self, op: CopyPrefix) -> None:
        length = op.length if self.positions is None else \
            self.positions.copy(op.src, op.dst, op.length)
        ll.llama_memory_seq_cp(self.model.mem, op.src, op.dst, 0, length)

    def shift_positions(self, op: ShiftPositions) -> None:
        ll.llama_memory_seq_add(self.model.mem, op.seq, op.start, -1, op.delta)

    def save_sequence(self, op: SaveSequence) -> Saved:
        ctx = self.model.ctx
        size = int(ll.llama_state_seq_get_size(ctx, op.seq))
        buffer = (ctypes.c_uint8 * size)()
        written = int(ll.llama_state_seq_get_data(ctx, buffer, size, op.seq))
        if not written:
            return Saved(op.seq, None)
        state = ctypes.string_at(buffer, written)
        if self.positions is not None:  # (its images' positions go with its cells)
            state = self.positions.saved_with(op.seq, state)
        return Saved(op.seq, state)

    def restore_sequence(self, op: RestoreSequence) -> Restored:
        ctx, data, keep = self.model.ctx, op.data, op.keep
        try:
            if self.positions is not None:
                data = self.positions.restored_from(op.seq, data)
            loaded = ll.llama_state_seq_set_data(ctx, _no_copy(data), len(data), op.seq)
            if loaded and op.checkpoint:
                loaded = self.model.load_recurrent_state(op.seq, _no_copy(op.checkpoint),
                                                         len(op.checkpoint))
            if loaded and self.positions is not None:
                keep = self.positions.cut(op.seq, keep)
        except BackendError:
            loaded = False
        if not loaded or not ll.llama_memory_seq_rm(self.model.mem, op.seq, keep, -1):
            self._empty(op.seq)  # (whatever it loaded)
            return Restored(op.seq, ok=False)
        return Restored(op.seq, ok=True)

    def _empty(self, seq: int) -> None:
        ll.llama_memory_seq_rm(self.model.mem, seq, -1, -1)
        if self.positions is not None:
            self.positions.forget(seq)

    def save_checkpoint(self, op: SaveCheckpoint) -> Checkpointed:
        buffer, written = self.model.save_recurrent_state(op.seq)
        return Checkpointed(op.seq, ctypes.string_at(buffer, written) if written else None)

    def restore_checkpoint(self, op: RestoreCheckpoint) -> Restored:
        """Recurrent state first: with it back at `keep`, llama.cpp's hybrid memory can cut
        the attention KV there (it refuses a cut inside the recurrent state's past)."""
        data, mem, keep = op.data, self.model.mem, op.keep
        loaded = self.model.load_recurrent_state(op.seq, _no_copy(data), len(data))
        try:
            if loaded and self.positions is not None:
                keep = self.positions.cut(op.seq, keep)
        except BackendError:
            loaded = False
        if not loaded or not ll.llama_memory_seq_rm(mem, op.seq, keep, -1):
            self._empty(op.seq)  # (whatever it loaded)
            return Restored(op.seq, ok=False)
        return Restored(op.seq, ok=True)

    def set_sampler(self, op: SetSampler) -> None:
        self.samplers.set(op.seq, op.params)

    def step_logits(self, row: int) -> Any:
        """A copy of the logits batch row `row` of the last decode was sampled from."""
        return self.stepper.step_logits(row)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        self._worker.close()

    def _free(self) -> None:
        self.samplers.free()
        if self.drafter is not None:
            self.drafter.free()
        if self.projector is not None:  # (it holds the text model's pointer)
            self.projector.free()
        self.model.free()


def _no_copy(data: bytes) -> Any:
    """`data` as the uint8 pointer llama.cpp reads from, without copying it."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
