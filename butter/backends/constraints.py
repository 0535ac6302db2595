"""Output constraints for either backend, with one engine: llguidance, which reads the JSON
schema itself. The constraint's grammar (the schema, inside the tool-call markup for a
call), compiled into a matcher once per distinct constraint (the last 32 are kept; each
request gets a copy), and what a matcher allows next.

llguidance follows the whole schema (draft 2020-12, or the draft its `$schema` names):
types, `const`, `enum`, `anyOf`, `allOf`, `oneOf` (when its alternatives cannot overlap),
`$ref`/`$defs` (recursion included), `properties`, `required`, `additionalProperties`,
`patternProperties`, `min`/`maxProperties`, `items`, `prefixItems`, `min`/`maxItems`, string
`pattern`, `format` and lengths, number bounds and `multipleOf`. It refuses, rather than
skips, every keyword of the schema's vocabulary it does not implement (`not`,
`if`/`then`/`else`, `uniqueItems`, `contains`, `dependentSchemas`, `propertyNames`,
`unevaluatedProperties`...), an unknown `format` and a look-around `pattern`; the refusal
names the keyword. Words outside the vocabulary (`nullable`, `x-...`) assert nothing in
JSON Schema and are ignored by it as by validators. llguidance's own options (`x-guidance`)
are butter's alone: a client's could turn on its `lenient` mode, which skips what it cannot
enforce.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, Generic, TypeVar

import numpy as np

from butter.chat.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from butter.chat.markup import THINK_CLOSE
from butter.sampling import OutputConstraint

GRAMMAR_CACHE_SIZE = 32  # compiled grammars kept (agents resend the same tools each turn)

# The JSON's layout: at most one space between tokens (llguidance would otherwise allow any
# run of whitespace, which an unsure model can fill its whole budget with).
JSON_OPTIONS = {"whitespace_pattern": " ?"}

Compiled = TypeVar("Compiled")


class CompiledConstraints(Generic[Compiled]):
    """The last few constraints' compiled forms, shared by every thread that prepares
    requests and by the backend's own thread."""

    def __init__(self, compile: Callable[[OutputConstraint], Compiled],
                 size: int = GRAMMAR_CACHE_SIZE) -> None:
        """`compile` raises ValueError (a message for the client) for an unusable one."""
        self._compile = compile
        self._size = size
        self._lock = threading.Lock()
        self._compiled: OrderedDict[OutputConstraint, Compiled] = OrderedDict()

    def get(self, constraint: OutputConstraint) -> Compiled:
        """The compiled constraint, compiled now if it is not kept (errors are not kept)."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        compiled = self._compile(constraint)  # outside the lock: other requests go on
        with self._lock:
            self._compiled[constraint] = compiled
            self._compiled.move_to_end(constraint)
            while len(self._compiled) > self._size:
                self._compiled.popitem(last=False)
        return compiled


def constraint_grammar(constraint: OutputConstraint,
                       marker: Callable[[str], str] = json.dumps) -> str:
    """The constraint as llguidance's Lark grammar. `marker` spells a marker in it (a tool
    call's, or the `</think>` that ends reasoning): a string literal, or `<[id]>` for the
    vocabulary's single token for it (llguidance never matches a special token against a
    literal, and a model emits the marker as that token, not spelled out)."""
    if constraint.gbnf is not None:
        return gbnf_grammar(constraint.gbnf)
    schema = constraint.schema
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    json_rule = f"%json {json.dumps(schema)}"
    start = "start: reasoning " if constraint.after_reasoning else "start: "
    if not constraint.tool_call:
        grammar = f"{start}{json_rule}\n"
    else:
        grammar = (f'{start}{marker(TOOL_CALL_OPEN)} "\\n" call "\\n" '
                   f"{marker(TOOL_CALL_CLOSE)}\n"
                   f"call: {json_rule}\n")
    if constraint.after_reasoning:
        grammar += reasoning_rule(marker(THINK_CLOSE))
    return grammar


def reasoning_rule(close: str) -> str:
    """The rest of a reasoning block the prompt opened: any text (none, where the model
    closes the block at once), the `close` marker, and the blank line or two a model
    writes after it. No text contains a special token; a marker spelled as text ends the
    block at its first occurrence (`suffix` makes the text before it lazy)."""
    blank = "reasoning_blank: /[ \\t\\r\\n]{1,4}/\n"
    if close.startswith('"'):  # a string literal
        return (f"reasoning: reasoning_text reasoning_blank?\n"
                f"reasoning_text[suffix={close}]: /(?s:.*)/\n{blank}")
    return f"reasoning: /(?s:.*)/ {close} reasoning_blank?\n{blank}"


def gbnf_grammar(gbnf: str) -> str:
    """llama.cpp's GBNF as llguidance's Lark; ValueError, for the client, if it is not
    valid GBNF (a syntax error, a rule used and never defined, no `root`)."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        lark: str = gbnf_to_lark(gbnf)
    except Exception as exc:  # (its parser raises plain Exception for missing rules)
        raise ValueError(f"invalid GBNF grammar: {exc}") from None
    return lark


def start_matcher(tokenizer: Any, grammar: str) -> Any:
    """A matcher of `grammar` in its start state, to keep and copy (`deep_copy`, about a
    microsecond) for each request; ValueError, for the client, when llguidance refuses it."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        if "%json" not in grammar:  # a GBNF grammar the converter took, llguidance not
            raise ValueError(f"cannot use this grammar: {matcher.get_error()[:500]}")
        problem = schema_problem(matcher.get_error())
        raise ValueError(f"cannot turn this JSON schema into a grammar: {problem}")
    return matcher


_EXCERPT = re.compile(r"\n\s*\d+ \| ")  # where llguidance quotes the grammar's source
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")


def schema_problem(error: str) -> str:
    """llguidance's error in the schema's terms (naming the keyword), without its quote of
    butter's grammar."""
    detail = error.partition("failed to compile JSON schema: ")[2] or error
    detail = _EXCERPT.split(detail, maxsplit=1)[0].strip()
    unimplemented = _UNIMPLEMENTED.fullmatch(detail)
    if unimplemented:
        keywords = unimplemented.group(1)
        plural = "s are" if "," in keywords else " is"
        return f"the JSON Schema keyword{plural} not supported: {keywords}"
    if detail.startswith("oneOf constraints are not supported"):
        return ("oneOf is supported only where its alternatives cannot overlap (anyOf "
                "always is)")
    if detail.startswith("Unknown format: "):
        return f"the string format {detail.removeprefix('Unknown format: ')!r} is not supported"
    return detail[:500]


def allowed_tokens(matcher: Any, n_vocab: int) -> Any:
    """The tokens `matcher` allows next, as n_vocab numpy bools (tokens beyond llguidance's
    vocabulary, padding rows of the output, are never allowed)."""
    mask = np.frombuffer(matcher.compute_bitmask(), np.uint8)
    bits = np.unpackbits(mask, bitorder="little").view(np.bool_)
    if len(bits) >= n_vocab:
        return bits[:n_vocab]
    return np.concatenate([bits, np.zeros(n_vocab - len(bits), dtype=np.bool_)])


def permits(matcher: Any, token: int, end_of_generation: Collection[int]) -> bool:
    """Whether `matcher` allows `token` next. Once its grammar is complete it allows only
    the end of generation, which `validate_tokens` does not say (it answers 0 for every
    token then), though `consume_token` takes it."""
    if matcher.is_stopped():
        return token in end_of_generation
    return bool(matcher.validate_tokens([token]) == 1)
