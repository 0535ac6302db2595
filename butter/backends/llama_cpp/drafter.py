"""A draft model (`--draft-model`): a smaller GGUF with the same vocabulary that guesses
the next tokens greedily, for the resident model to verify (docs/design/speculation.md,
"Speculative decoding"). It keeps, per sequence, a cache of the tokens it last saw, and
brings it up to the sequence's tokens before each guess (only what changed is evaluated).

Everything here runs on the backend's thread, beside the resident model's context."""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from butter.backends.base import BackendError
from butter.backends.llama_cpp.loading import free_native
from butter.errors import ModelLoadError

log = logging.getLogger("butter")

# The draft model's prompt chunks (a sequence's history, caught up once).
DRAFT_BATCH = 256


# How far back from the end the draft cache is compared token by token; before that, one
# slice comparison (C speed) does: what differs is nearly always the last guesses.
TAIL_COMPARED = 64


def kept_prefix(seen: list[int], history: list[int]) -> int:
    """How many leading tokens of the draft cache (`seen`) the sequence still has: the
    earlier ones compared as one slice (every step passes here, with the whole history),
    the last TAIL_COMPARED one by one."""
    n = min(len(seen), len(history))
    start = max(0, n - TAIL_COMPARED)
    if seen[:start] != history[:start]:  # (rare: the sequence was replaced)
        low, high = 0, start  # the longest equal prefix lies in [low, high)
        while low < high:
            middle = (low + high + 1) // 2
            if seen[:middle] == history[:middle]:
                low = middle
            else:
                high = middle - 1
        return low
    for i in range(start, n):
        if seen[i] != history[i]:
            return i
    return n


class DraftModel:
    def __init__(self, path: Path, *, target_vocab: Any, n_cells: int, n_seq: int,
                 threads: int) -> None:
        """Load `path` and check that its vocabulary is the resident model's token for
        token (ModelLoadError otherwise)."""
        self.path = path
        params = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(str(path).encode(), params) or None
        if self.model is None:
            raise ModelLoadError(f"llama.cpp could not load the draft model {path}")
        self.ctx: Any = None
        self.batch: Any = None
        try:
            self.vocab = ll.llama_model_get_vocab(self.model)
            self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
            why = _vocabulary_differs(self.vocab, target_vocab)
            if why:
                raise ModelLoadError(f"the draft model {path} cannot draft for this model: "
                                     f"{why}")
            if ll.llama_model_is_recurrent(self.model) or ll.llama_model_is_hybrid(self.model):
                raise ModelLoadError(f"the draft model {path} is recurrent: its state "
                                     "cannot take back a rejected guess")
            context = ll.llama_context_default_params()
            context.n_ctx = n_cells
            context.n_batch = context.n_ubatch = DRAFT_BATCH
            context.n_seq_max = n_seq
            context.n_threads = context.n_threads_batch = threads
            context.kv_unified = True
            context.swa_full = True
            context.no_perf = True
            self.ctx = ll.llama_init_from_model(self.model, context)
            if not self.ctx:
                raise ModelLoadError(f"llama.cpp could not create the draft model's context "
                                     f"of {n_cells} cells")
        except BaseException:
            self.free()
            raise
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(DRAFT_BATCH, 0, 1)
        self._seen: dict[int, list[int]] = {}  # seq -> the tokens its draft cache holds
        self.guessed = 0
        self.seconds = 0.0  # spent guessing (catching up included), since the load

    def guess(self, seq: int, history: list[int], count: int) -> tuple[int, ...]:
        """`count` greedy guesses at what follows `history` (the sequence's tokens)."""
        started = time.perf_counter()
        seen = self._seen.setdefault(seq, [])
        keep = kept_prefix(seen, history)
        keep = min(keep, len(history) - 1)  # (the last token is evaluated for its logits)
        if keep < len(seen):
            ll.llama_memory_seq_rm(self.mem, seq, keep, -1)
            del seen[keep:]
        guesses: list[int] = []
        pending = list(history[keep:])
        try:
            for _ in range(count):
                token = self._next(seq, seen, pending)
                guesses.append(token)
                pending = [token]
        except BackendError as exc:  # (no room in its cache): this step guesses less
            log.warning("the draft model stopped guessing for seq %d: %s", seq, exc)
            for other in list(self._seen):
                self.forget(other)
        self.guessed += len(guesses)
        self.seconds += time.perf_counter() - started
        return tuple(guesses)

    def _next(self, seq: int, seen: list[int], pending: list[int]) -> int:
        """Evaluate `pending` after `seen` (in chunks), the most likely next token."""
        for start in range(0, len(pending), DRAFT_BATCH):
            chunk = pending[start:start + DRAFT_BATCH]
            batch = self.batch
            for row, token in enumerate(chunk):
                batch.token[row], batch.pos[row] = token, len(seen) + row
                batch.n_seq_id[row], batch.seq_id[row][0] = 1, seq
                batch.logits[row] = row == len(chunk) - 1
            batch.n_tokens = len(chunk)
            status = int(ll.llama_decode(self.ctx, batch))
            if status != 0:
                raise BackendError(f"its llama_decode returned {status}")
            seen.extend(chunk)
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, -1),
                                       shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def forget(self, seq: int) -> None:
        if self._seen.pop(seq, None) is not None:
            ll.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def free(self) -> None:
        free_native(self)


def _vocabulary_differs(draft: Any, target: Any) -> str | None:
    """Why two vocabularies are not the same token for token (None: they are)."""
    n_draft, n_target = int(ll.llama_vocab_n_tokens(draft)), int(ll.llama_vocab_n_tokens(target))
    if n_draft != n_target:
        return f"its vocabulary has {n_draft} tokens, the model's {n_target}"
    for token in range(n_draft):
        if _text(draft, token) != _text(target, token):
            return f"token {token} is {_text(draft, token)!r} there, {_text(target, token)!r} here"
    return None


def _text(vocab: Any, token: int) -> bytes:
    text = ll.llama_vocab_get_text(vocab, token)
    return ctypes.string_at(text) if text else b""
