"""Sampling parameters as the engine sees them, with llama-server's defaults.

Defaults (for fields a client omits) follow llama-server's documented ones:
temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat/presence/frequency
penalties off, a random seed. Listed in the README.
"""

from __future__ import annotations

import secrets

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
    grammar: str | None = None  # GBNF that constrains the output (tool calls, JSON)

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
