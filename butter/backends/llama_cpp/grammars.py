"""Output constraints on llama.cpp: llguidance matchers over the GGUF's vocabulary, the same
engine, grammar and options as on MLX (butter/backends/constraints.py), compiled once per
distinct constraint, a copy per request."""

from __future__ import annotations

import ctypes
import json
import logging
import threading
from typing import Any

import llama_cpp as ll
import numpy as np

from butter.backends.constraints import (
    CompiledConstraints,
    allowed_tokens,
    constraint_grammar,
    permits,
    start_matcher,
)
from butter.backends.llama_cpp.loading import LlamaModel
from butter.sampling import OutputConstraint

log = logging.getLogger(__name__)

PIECE_BYTES = 16 * 1024  # the longest token text read (llguidance.llamacpp's limit too)


class LlguidanceGrammars:
    """Constraints to llguidance matchers for one loaded GGUF.

    llguidance's view of the vocabulary takes a second or two to build on a large one
    (1.5 s for Gemma 3's 262k tokens), so it is built on a thread of its own while the
    model finishes loading, not in the first constrained request; the backend waits for it
    before the model serves (`wait_until_read`: built beside the first steps, it took a core
    from them), and `close` too (it reads the vocabulary, which is freed with the model)."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self._compiled: CompiledConstraints[Any] = CompiledConstraints(self._compile)
        self._tokenizer: Any = None
        self._end_of_generation: frozenset[int] = frozenset()
        self._building = threading.Lock()
        self._builder = threading.Thread(target=self._build_early, name="butter-llguidance",
                                         daemon=True)
        self._builder.start()

    def check(self, constraint: OutputConstraint) -> None:
        """ValueError (for the client) when llguidance cannot follow this constraint."""
        self._compiled.get(constraint)

    def matcher(self, constraint: OutputConstraint) -> Any:
        """A matcher in its start state (ValueError as `check`)."""
        return self._compiled.get(constraint).deep_copy()

    def permits(self, matcher: Any, token: int) -> bool:
        """Whether the matcher allows `token` next (a few microseconds)."""
        return permits(matcher, token, self._end_of_generation)

    def allowed(self, matcher: Any) -> Any:
        """The ids of the tokens the matcher allows next (its whole-vocabulary mask; its
        cost is in docs/design/sampling.md, "Sampling")."""
        return np.flatnonzero(allowed_tokens(matcher, self._model.info.n_vocab))

    def tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, its end-of-generation tokens included."""
        with self._building:
            if self._tokenizer is None:
                self._tokenizer = self._read_vocabulary()
            return self._tokenizer

    def wait_until_read(self) -> None:
        """Returns once the vocabulary has been read (or failed to be)."""
        self._builder.join()

    def close(self) -> None:
        self._builder.join()

    def _read_vocabulary(self) -> Any:
        """What llguidance.llamacpp's `lltokenizer_from_vocab` builds (each token's bytes,
        after a 0xff byte for those llguidance treats as special: control tokens, and
        user-defined ones spelled `<...>`), with every end-of-generation token as an end,
        and without its deprecated llama.cpp call, which warns once per token."""
        from llguidance import LLTokenizer

        model, vocab = self._model, self._model.vocab
        control, user_defined = ll.LLAMA_TOKEN_ATTR_CONTROL, ll.LLAMA_TOKEN_ATTR_USER_DEFINED
        buffer = ctypes.create_string_buffer(PIECE_BYTES)  # (not the model's: other threads)
        pieces, end = [], []
        for token in range(model.info.n_vocab):
            length = ll.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
            if length < 0:
                raise ValueError(f"token {token} is longer than {PIECE_BYTES} bytes")
            piece = ctypes.string_at(buffer, length)
            attributes = ll.llama_vocab_get_attr(vocab, token)
            if attributes & control or (attributes & user_defined
                                        and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            pieces.append(piece)
            if model.is_end_of_generation(token):
                end.append(token)
        self._end_of_generation = frozenset(end)
        # (llguidance tokenizes text with llama.cpp's own; missing from its type stubs)
        return LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
            tokens=pieces, vocab_ptr=vocab, eos_token=end,
            tokenize_fptr=ctypes.cast(ll.llama_tokenize, ctypes.c_void_p).value)

    def _build_early(self) -> None:
        try:
            self.tokenizer()
        except Exception:  # (it fails again, and is reported, where it is needed)
            log.exception("could not read the vocabulary for grammar-constrained output")

    def _compile(self, constraint: OutputConstraint) -> Any:
        return start_matcher(self.tokenizer(), constraint_grammar(constraint, self._marker))

    def _marker(self, marker: str) -> str:
        """A marker (a tool call's, or `</think>`) as the vocabulary's single token for it
        where llguidance treats that token as special (a control token, or a user-defined
        `<...>` one), else as a string literal."""
        tokens = self._model.tokenize(marker, add_bos=False)
        if len(tokens) == 1 and self.tokenizer().is_special_token(tokens[0]):
            return f"<[{tokens[0]}]>"
        return json.dumps(marker)
