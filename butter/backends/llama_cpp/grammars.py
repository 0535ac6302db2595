"""Output constraints as llama.cpp grammars: GBNF from llama-cpp-python's JSON-schema
converter (the one llama.cpp's server ships), checked by llama.cpp, compiled once each."""

from __future__ import annotations

import re
from typing import Any

import llama_cpp as ll
from llama_cpp.llama_grammar import json_schema_to_gbnf

from butter.backends.constraints import CompiledConstraints
from butter.chat.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from butter.sampling import OutputConstraint

_ROOT_RULE = re.compile(r"^root ::=", re.MULTILINE)


def constraint_gbnf(constraint: OutputConstraint) -> str:
    """The constraint as GBNF; ValueError when the schema cannot be converted."""
    try:
        body = str(json_schema_to_gbnf(constraint.schema_json))
    except Exception as exc:  # the converter asserts, and fails in other ways, on bad input
        raise ValueError(f"cannot turn this JSON schema into a grammar: {exc}") from None
    if not constraint.tool_call:
        return body
    call = _ROOT_RULE.sub("call ::=", body)
    return f'root ::= "{TOOL_CALL_OPEN}" "\\n" call "\\n" "{TOOL_CALL_CLOSE}"\n' + call


class GbnfGrammars:
    """Constraints to grammar samplers for one vocabulary: converted and checked once per
    distinct constraint (any thread), a fresh sampler per request (the backend's thread)."""

    def __init__(self, vocab: Any) -> None:
        self._vocab = vocab
        self._checked = CompiledConstraints(self._compile)

    def check(self, constraint: OutputConstraint) -> None:
        """ValueError (for the client) when llama.cpp cannot follow this constraint."""
        self._checked.get(constraint)

    def new_sampler(self, constraint: OutputConstraint) -> Any:
        """A grammar sampler in its start state (free it with llama_sampler_free)."""
        sampler = self._init(self._checked.get(constraint))
        if not sampler:
            raise ValueError("llama.cpp rejected the grammar")
        return sampler

    def _compile(self, constraint: OutputConstraint) -> str:
        gbnf = constraint_gbnf(constraint)
        sampler = self._init(gbnf)
        if not sampler:
            raise ValueError("llama.cpp rejected the grammar")
        ll.llama_sampler_free(sampler)
        return gbnf

    def _init(self, gbnf: str) -> Any:
        return ll.llama_sampler_init_grammar(self._vocab, gbnf.encode(), b"root")
