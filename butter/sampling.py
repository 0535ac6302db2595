"""Sampling parameters as the engine sees them, with llama-server's defaults.

Defaults (for fields a client omits) follow llama-server's documented ones:
temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat/presence/frequency
penalties off, a random seed. Listed in the README.

Order of effect, the same in every backend (llama.cpp's sampler chain, and llama-server's
default order):

1. penalties (repeat, frequency, presence) over the request's last `penalty_last_n`
   generated tokens;
2. top-k: the k highest logits;
3. top-p: the smallest set of those, most likely first, whose probability reaches p
   (probabilities at temperature 1, over what top-k kept);
4. min-p: those at least min_p times as likely as the most likely one;
5. temperature: the surviving logits divided by it, then one draw from their softmax.
   Temperature 0 (or below) is greedy: the highest penalized logit, no filters.

So temperature changes how the survivors share the probability, never which tokens
survive. With an output constraint, the token drawn is checked against the grammar;
only when the grammar forbids it, steps 2-5 run again on the tokens it allows.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_PENALTY = 1.0
DEFAULT_PENALTY_LAST_N = 64
# A seed is a uint32 in llama.cpp; 0xFFFFFFFF means "random" there, so avoid it.
MAX_SEED = 0xFFFFFFFE


def random_seed() -> int:
    return secrets.randbelow(MAX_SEED)


@attrs.frozen
class OutputConstraint:
    """The output is JSON that follows a schema: alone, or as exactly one tool call,
    `<tool_call>\\n{json}\\n</tool_call>`, either one after the rest of a reasoning block
    that the prompt opened (`after_reasoning`); or text that a GBNF grammar derives.

    Built by butter/chat/grammar.py (which owns the markers); each backend compiles it
    into its own grammar engine's form, once per distinct value."""

    schema_json: str  # the JSON schema, as JSON text: hashable, so compiled once per value
    tool_call: bool = False
    # Or a grammar in llama.cpp's GBNF (llama-server's `grammar` field), schema_json "".
    gbnf: str | None = None
    # The output begins inside a reasoning block that the prompt opened (a template's
    # generation prompt that ends with `<think>`): the rest of that block, free text up to
    # its `</think>`, comes first, then the JSON or the call (a JSON constraint only).
    after_reasoning: bool = False

    @classmethod
    def of(cls, schema: Mapping[str, Any], *, tool_call: bool = False) -> OutputConstraint:
        return cls(schema_json=json.dumps(schema), tool_call=tool_call)

    @classmethod
    def of_gbnf(cls, grammar: str) -> OutputConstraint:
        return cls(schema_json="", gbnf=grammar)

    @property
    def schema(self) -> Any:
        return json.loads(self.schema_json)

    def after_open_reasoning(self) -> OutputConstraint:
        """This constraint where the prompt left the answer inside a reasoning block: the
        model ends its reasoning first. A GBNF grammar is the client's, and stays as sent
        (it derives the whole output, as llama-server applies it)."""
        return self if self.gbnf is not None else attrs.evolve(self, after_reasoning=True)


@attrs.frozen
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    seed: int = attrs.field(factory=random_seed)
    repeat_penalty: float = DEFAULT_REPEAT_PENALTY
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N
    # What the output must follow (a forced tool call, JSON); each backend compiles it.
    grammar: OutputConstraint | None = None
    # Added to the logits before everything else (llama-server's place for it): token id
    # -> bias; -inf bans the token (OpenAI's -100 means that).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report each sampled token's log-probability and this many most likely alternatives
    # (0: the token's alone); None: not asked, and nothing is computed.
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
