"""Output constraints on MLX: llguidance matchers over the checkpoint's tokenizer, the same
engine, grammar and options as on llama.cpp (butter/backends/constraints.py), compiled once
per distinct constraint, a copy per request."""

from __future__ import annotations

import json
from typing import Any

from butter.backends.constraints import (
    CompiledConstraints,
    allowed_tokens,
    constraint_grammar,
    start_matcher,
)
from butter.backends.mlx.loading import MlxModel
from butter.sampling import OutputConstraint


class LlguidanceGrammars:
    """Constraints to llguidance matchers for one vocabulary."""

    def __init__(self, model: MlxModel) -> None:
        self._model = model
        self._tokenizer: Any = None
        self._compiled: CompiledConstraints[Any] = CompiledConstraints(self._compile)

    def check(self, constraint: OutputConstraint) -> None:
        """ValueError (for the client) when llguidance cannot follow this constraint."""
        self._compiled.get(constraint)

    def matcher(self, constraint: OutputConstraint) -> Any:
        """A matcher in its start state (ValueError as `check`)."""
        return self._compiled.get(constraint).deep_copy()

    def allowed(self, matcher: Any, logits: Any) -> Any:
        """Logits with every token the grammar forbids next set to -inf."""
        mx = self._model.mx
        allowed = allowed_tokens(matcher, logits.shape[-1])
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built once; slow for large ones)."""
        if self._tokenizer is None:
            import llguidance.hf

            model = self._model
            self._tokenizer = llguidance.hf.from_tokenizer(
                model.tokenizer._tokenizer, n_vocab=model.info.n_vocab,
                eos_token=sorted(model.end_of_generation))
        return self._tokenizer

    def _compile(self, constraint: OutputConstraint) -> Any:
        return start_matcher(self.tokenizer(), constraint_grammar(constraint, self._marker))

    def _marker(self, marker: str) -> str:
        """A marker (a tool call's, or `</think>`) as the vocabulary's single token for it
        where llguidance treats that token as special (every added token), else as a string
        literal."""
        hf = self._model.tokenizer
        token = hf.convert_tokens_to_ids(marker)  # (or the unknown token)
        if isinstance(token, int) and 0 <= token < self._model.info.n_vocab \
                and hf.convert_ids_to_tokens(token) == marker \
                and self.tokenizer().is_special_token(token):
            return f"<[{token}]>"
        return json.dumps(marker)
