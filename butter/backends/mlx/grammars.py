"""Output constraints as llguidance grammars, straight from their JSON schema (llguidance
reads JSON schemas itself), compiled and checked once each."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from butter.backends.constraints import CompiledConstraints
from butter.backends.mlx.loading import MlxModel
from butter.chat.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from butter.sampling import OutputConstraint

# The JSON's layout, as llama.cpp's converter allows it: at most one space between tokens
# (llguidance would otherwise allow any run of whitespace, which an unsure model can fill
# its whole budget with).
JSON_OPTIONS = {"whitespace_pattern": " ?"}


class LlguidanceGrammars:
    """Constraints to llguidance matchers for one vocabulary."""

    def __init__(self, model: MlxModel) -> None:
        self._model = model
        self._tokenizer: Any = None
        self._compiled = CompiledConstraints(self._compile)

    def check(self, constraint: OutputConstraint) -> None:
        """ValueError (for the client) when llguidance cannot follow this constraint."""
        self._compiled.get(constraint)

    def matcher(self, constraint: OutputConstraint) -> Any:
        """A matcher in its start state (ValueError as `check`)."""
        from llguidance import LLMatcher

        return LLMatcher(self.tokenizer(), self._compiled.get(constraint), log_level=0)

    def allowed(self, matcher: Any, logits: Any) -> Any:
        """Logits with every token the grammar forbids next set to -inf."""
        mx = self._model.mx
        n_vocab = logits.shape[-1]
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                             bitorder="little")[:n_vocab].astype(bool)
        allowed = np.zeros(n_vocab, dtype=bool)
        allowed[: len(bits)] = bits
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

    def _compile(self, constraint: OutputConstraint) -> str:
        try:
            from llguidance import LLMatcher
        except ImportError:
            raise ValueError("grammar-constrained output (tool_choice required/named, "
                             "response_format) on MLX needs llguidance: pip install "
                             "'butter-serve[mlx]'") from None
        compiled = str(LLMatcher.grammar_from_lark(self._lark(constraint)))
        problem = LLMatcher.validate_grammar(compiled, self.tokenizer())
        if problem:
            raise ValueError(f"the JSON schema cannot be followed: {problem}")
        return compiled

    def _lark(self, constraint: OutputConstraint) -> str:
        schema = constraint.schema
        if isinstance(schema, dict):
            schema = {"x-guidance": JSON_OPTIONS, **schema}
        json_rule = f"%json {json.dumps(schema)}"
        if not constraint.tool_call:
            return f"start: {json_rule}\n"
        opening, closing = self._marker(TOOL_CALL_OPEN), self._marker(TOOL_CALL_CLOSE)
        return f'start: {opening} "\\n" call "\\n" {closing}\ncall: {json_rule}\n'

    def _marker(self, marker: str) -> str:
        """The tool-call marker as the single token the vocabulary has for it, if any.

        llguidance treats every added token as special, and a special token never matches
        a string literal: the model would have to spell `<tool_call>` byte by byte, which
        it was not trained to do. `<[id]>` is llguidance's syntax for one given token."""
        hf = self._model.tokenizer
        token = hf.convert_tokens_to_ids(marker)  # (or the unknown token)
        if isinstance(token, int) and 0 <= token < self._model.info.n_vocab \
                and hf.convert_ids_to_tokens(token) == marker \
                and self.tokenizer().is_special_token(token):
            return f"<[{token}]>"
        return json.dumps(marker)
