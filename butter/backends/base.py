"""The contract between the engine and a backend: plans in, sampled tokens out."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import attrs

from butter.backends.team import TeamStatus
from butter.chat.images import DecodedImage
from butter.chat.request import Logprobs
from butter.kv import KvCacheType
from butter.sampling import SamplingParams


@attrs.frozen
class ModelInfo:
    path: str
    architecture: str
    description: str
    n_ctx_train: int
    n_vocab: int
    embedded_chat_template: str | None
    bos_text: str
    eos_text: str
    add_bos: bool
    is_recurrent: bool
    size_bytes: int
    # Fill-in-the-middle tokens (prefix, suffix, middle), where the vocabulary has them.
    fim_tokens: tuple[int, int, int] | None = None


@attrs.frozen
class RemoveTokens:
    """Drop positions [start, end) of a sequence (end -1: to the end)."""

    seq: int
    start: int
    end: int = -1


@attrs.frozen
class CopyPrefix:
    """Share positions [0, length) of `src` into `dst` (cells are shared, not copied)."""

    src: int
    dst: int
    length: int


@attrs.frozen
class ShiftPositions:
    """Move positions [start, end of sequence) of `seq` by `delta` (a window slide)."""

    seq: int
    start: int
    delta: int


@attrs.frozen
class SetSampler:
    seq: int
    params: SamplingParams


@attrs.frozen
class SaveSequence:
    """Serialize `seq`'s KV state for the host-RAM tier (the step returns it: Saved)."""

    seq: int


@attrs.frozen(repr=False)
class RestoreSequence:
    """Load state that SaveSequence made into `seq` (emptied first), then keep only its
    first `keep` positions (the step says whether it worked: Restored). A state that
    cannot be cut back there is first rewound to `checkpoint` (SaveCheckpoint's bytes
    after `keep` tokens; b"": none)."""

    seq: int
    data: bytes
    keep: int
    checkpoint: bytes = b""

    def __repr__(self) -> str:
        return f"RestoreSequence(seq={self.seq}, {len(self.data)} bytes, keep={self.keep})"


@attrs.frozen
class SaveCheckpoint:
    """Serialize the part of `seq`'s state that cannot be cut back (a recurrent or hybrid
    model's recurrent state: llama.cpp's PARTIAL_ONLY), as it stands before this step's
    batch (the step returns it: Checkpointed)."""

    seq: int


@attrs.frozen(repr=False)
class RestoreCheckpoint:
    """Load a checkpoint that SaveCheckpoint made after `keep` tokens into `seq`, then cut
    everything else `seq` holds back to its first `keep` positions (the step says whether
    it worked: Restored; on failure the sequence is empty)."""

    seq: int
    data: bytes
    keep: int

    def __repr__(self) -> str:
        return f"RestoreCheckpoint(seq={self.seq}, {len(self.data)} bytes, keep={self.keep})"


KvOp = (RemoveTokens | CopyPrefix | ShiftPositions | SetSampler | SaveSequence
        | RestoreSequence | SaveCheckpoint | RestoreCheckpoint)


@attrs.frozen(repr=False)
class Saved:
    seq: int
    data: bytes | None  # None: the backend could not serialize it

    def __repr__(self) -> str:
        size = None if self.data is None else len(self.data)
        return f"Saved(seq={self.seq}, {size} bytes)"


@attrs.frozen(repr=False)
class Checkpointed:
    seq: int
    data: bytes | None  # None: the backend could not serialize it

    def __repr__(self) -> str:
        size = None if self.data is None else len(self.data)
        return f"Checkpointed(seq={self.seq}, {size} bytes)"


@attrs.frozen
class Restored:
    seq: int
    ok: bool  # False: nothing was loaded (e.g. no free cells); the sequence is empty


class KvEditor(Protocol):
    """What a backend does for each kind of KvOp (before the step's evaluation)."""

    def remove_tokens(self, op: RemoveTokens) -> None: ...

    def copy_prefix(self, op: CopyPrefix) -> None: ...

    def shift_positions(self, op: ShiftPositions) -> None: ...

    def set_sampler(self, op: SetSampler) -> None: ...

    def save_sequence(self, op: SaveSequence) -> Saved: ...

    def restore_sequence(self, op: RestoreSequence) -> Restored: ...

    def save_checkpoint(self, op: SaveCheckpoint) -> Checkpointed: ...

    def restore_checkpoint(self, op: RestoreCheckpoint) -> Restored: ...


KvOutcome = Saved | Restored | Checkpointed


def apply_kv_ops(editor: KvEditor, ops: Iterable[KvOp]) -> list[KvOutcome]:
    """Apply the ops in order, each through the editor's method for its kind; the saves'
    and restores' outcomes, in order."""
    outcomes: list[KvOutcome] = []
    for op in ops:
        match op:
            case RemoveTokens():
                editor.remove_tokens(op)
            case CopyPrefix():
                editor.copy_prefix(op)
            case ShiftPositions():
                editor.shift_positions(op)
            case SetSampler():
                editor.set_sampler(op)
            case SaveSequence():
                outcomes.append(editor.save_sequence(op))
            case RestoreSequence():
                outcomes.append(editor.restore_sequence(op))
            case SaveCheckpoint():
                outcomes.append(editor.save_checkpoint(op))
            case RestoreCheckpoint():
                outcomes.append(editor.restore_checkpoint(op))
    return outcomes


@attrs.frozen
class ImageGrid:
    """An image's M-RoPE positions (a Qwen-VL text model's: time, height, width and an
    unused section for each embedding), as libmtmd gives them when the image's first cell
    is at position p0: section s of embedding i is offsets[s][i], plus p0 where moves[s].
    The image takes `n_pos` positions (its cells share the time position p0)."""

    offsets: tuple[tuple[int, ...], ...]
    moves: tuple[bool, ...]
    n_pos: int

    def sections(self, p0: int, first: int, count: int) -> list[list[int]]:
        """The position sections of embeddings first..first + count."""
        return [[offset + (p0 if moving else 0) for offset in section[first:first + count]]
                for section, moving in zip(self.offsets, self.moves, strict=True)]


@attrs.frozen(eq=False)
class PromptImage:
    """An image's place in a prompt: `n_tokens` cells from `start`, evaluated from the
    projector's embeddings of the image rather than from tokens. The prompt holds
    image_token_ids(key, n_tokens) there, so that prefix matching tells images apart.
    `grid`: its M-RoPE positions, where the model gives it those (None: one position a
    cell, as text). Not `causal` (Gemma 3's): its embeddings see each other whole, so it is
    evaluated in one piece, never split between prompt chunks or cut in a cache.

    A projector that slices a large picture (SmolVLM's, MiniCPM-V's) makes several images
    of it, with text between them: `piece` says which of the picture's (0: the first)."""

    start: int
    n_tokens: int
    image: DecodedImage
    grid: ImageGrid | None = None
    causal: bool = True
    piece: int = 0

    @property
    def key(self) -> str:
        """What tells this image apart (image_token_ids'): its picture's key, and for a
        later piece of a sliced picture, a key derived from both."""
        if self.piece == 0:
            return self.image.key
        return hashlib.sha256(f"{self.image.key}:{self.piece}".encode()).hexdigest()

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def image_token_ids(key: str, n_tokens: int) -> tuple[int, ...]:
    """The ids that stand for an image's positions in a prompt: negative (no vocabulary
    token is), and derived from the image's content key, so a cached prompt matches a new
    one through an image only where it is the same image."""
    base = int(key[:15], 16)
    return tuple(-1 - ((base + i) % 2**62) for i in range(n_tokens))


@attrs.frozen
class SeqWork:
    """Tokens of one sequence to evaluate in a step, from position `start`."""

    seq: int
    tokens: tuple[int, ...]
    start: int
    sample: bool  # sample a token from the logits of the last one
    prompt: bool = False  # prompt tokens (prefill), as opposed to one decoded token
    # Score these prompt tokens: the logprobs of each token after the first, and of
    # `next_token` (the prompt's token after this chunk, None at its end), with this many
    # alternatives each (Scored); None: no scoring.
    prompt_top_logprobs: int | None = None
    next_token: int | None = None
    # A decode whose last `drafted` tokens are a guess at what comes next (speculative
    # decoding): every row from the sampled token's on is sampled in order, as far as each
    # sample equals the guess that follows it, and what the others wrote in the cache is
    # removed. One Sampled per row sampled, in order; the sequence keeps that many tokens.
    drafted: int = 0
    # Or: the backend's draft model guesses this many tokens after `tokens`, and the step
    # verifies them as it verifies a draft. `history`: the sequence's tokens before
    # `tokens` (the engine's own list, read during the step, never copied).
    guess: int = 0
    history: Sequence[int] = ()
    # The images whose positions these tokens include (their ids are image_token_ids):
    # those positions are evaluated from the projector's embeddings.
    images: tuple[PromptImage, ...] = ()


@attrs.frozen
class Sampled:
    seq: int
    token: int
    piece: bytes
    end_of_generation: bool
    error: str | None = None  # this sequence alone failed (e.g. its grammar): end it
    logprobs: Logprobs | None = None  # when the request asked for them


@attrs.frozen
class Scored:
    """A scored prompt chunk: the logprobs of its tokens after the first, then of the
    next chunk's first token (see SeqWork.prompt_top_logprobs)."""

    seq: int
    logprobs: tuple[Logprobs, ...]


StepResult = Sampled | Scored | Saved | Restored | Checkpointed


class BackendError(Exception):
    """A step failed inside the backend (e.g. the decode returned an error)."""


class Backend(Protocol):
    info: ModelInfo
    n_cells: int
    n_seq: int  # requests that generate at once (--parallel)
    # Sequence ids beyond those, for cached prefixes that no request holds (the prefix
    # cache keeps up to n_seq + n_cache_seqs prompts in the KV pool).
    n_cache_seqs: int
    # CopyPrefix shares cells (llama.cpp's unified cache) rather than copying them (MLX).
    shares_prefix_cells: bool
    # SaveSequence / RestoreSequence work (the host-RAM tier); False: never sent.
    saves_sequences: bool
    # SaveCheckpoint / RestoreCheckpoint work, and this many bytes each checkpoint takes
    # (the state a recurrent or hybrid model cannot cut back; its size does not depend on
    # the sequence's length); 0: never sent.
    checkpoint_bytes: int
    can_shift: bool
    kv_type: KvCacheType
    # A sequence's cache holding this many positions or more can no longer be cut back
    # or copied in part (recurrent state: 1; a sliding-window cache once it wraps around:
    # the window); None: always.
    rewind_limit: int | None
    # Prompt rows are evaluated in tiles of this many batch rows, and a tile holding two
    # sequences' rows costs what the union of their attention costs (llama.cpp's CPU flash
    # attention: 64); 1: no such tiles. The step planner cuts chunks to match.
    prompt_tile: int
    # The most rows a decode step may have for each row to be computed as it would be
    # alone, which is what verifying a draft needs to change no output (0: no drafts);
    # `speculation_off` says why there are none.
    draft_rows: int
    speculation_off: str | None

    @property
    def kv_bytes_per_token(self) -> float: ...

    @property
    def guesses(self) -> bool:
        """A draft model is loaded: works may ask it to guess (SeqWork.guess)."""
        ...

    @property
    def guess_seconds(self) -> float:
        """The time the draft model has spent guessing since the load."""
        ...

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]: ...

    @property
    def vision(self) -> bool:
        """A projector is loaded: prompts may hold images (tokenize_media)."""
        ...

    def tokenize_media(self, texts: Sequence[str], images: Sequence[DecodedImage], *,
                       add_bos: bool) -> tuple[list[int], list[PromptImage]]:
        """A prompt of text pieces with an image between each two (len(texts) ==
        len(images) + 1): its ids (image_token_ids at each image's positions) and where
        each image sits."""
        ...

    def write_out(self, texts: Iterable[str]) -> None:
        """Generated control tokens whose text is one of `texts` come out as that text
        rather than as empty pieces: the markers of the model family's tool calls, which
        the markup parser reads (butter/chat/tool_calls.py)."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of these tokens, special ones (BOS, end of turn) written out."""
        ...

    def check_sampling(self, params: SamplingParams) -> None:
        """Refuse (ValueError, a message for the client) what this backend cannot honour,
        such as an output constraint its grammar engine cannot follow; compiles it once."""
        ...

    def step(self, ops: list[KvOp], works: list[SeqWork]) -> list[StepResult]: ...

    def submit_step(self, ops: list[KvOp], works: list[SeqWork]) -> Future[list[StepResult]]:
        """`step`, started on the backend's own thread (every evaluation runs there).

        The engine waits for this future directly: one thread hand-off each way instead
        of two through a trio worker thread (docs/design/threads.md, "One llama.cpp
        thread")."""
        ...

    def diagnostics(self) -> dict[str, Any]:
        """What /v1/server shows about this backend in the model's metadata (JSON values):
        `step_shapes` and `lm_head` (llama.cpp's, else None), plus the backend's own."""
        ...

    def team(self) -> TeamStatus | None:
        """The threads a step computes on now, and what they saw of the machine (None
        where the backend does not size its own team: MLX)."""
        ...

    def close(self) -> None:
        """Free the model after the step in flight; idempotent. Later calls to tokenize,
        check_sampling or submit_step raise BackendError("the model was unloaded")."""
        ...

