"""Sampling on MLX, in butter/sampling.py's order of effect (llama.cpp's): penalties,
then top-k, top-p and min-p on the untempered distribution, then temperature and the draw;
a grammar vetoes the drawn token, and only then constrains a second draw."""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from butter.backends.base import Sampled
from butter.backends.logprobs import token_logprobs
from butter.backends.mlx.grammars import LlguidanceGrammars
from butter.backends.mlx.loading import MlxModel
from butter.chat.request import Logprobs
from butter.sampling import SamplingParams

log = logging.getLogger("butter")


def penalize(mx: Any, logits: Any, recent: Iterable[int], params: SamplingParams) -> Any:
    """llama.cpp's penalties over `recent` (the tokens the request generated, its last n):
    repeat divides a positive logit and multiplies a negative one, frequency subtracts per
    occurrence, presence once per token."""
    counts = Counter(recent)
    if not counts:
        return logits
    ids = mx.array(list(counts))
    seen = logits[ids].astype(mx.float32)
    seen = mx.where(seen <= 0, seen * params.repeat_penalty, seen / params.repeat_penalty)
    seen = (seen - mx.array(list(counts.values()), dtype=mx.float32)
            * params.frequency_penalty - params.presence_penalty)
    penalized = logits.astype(mx.float32)
    penalized[ids] = seen
    return penalized


def bias_logits(mx: Any, logits: Any, bias: tuple[tuple[int, float], ...]) -> Any:
    """The request's logit bias added first, as llama.cpp's chain does (-inf bans)."""
    ids = mx.array([token for token, _ in bias])
    biased = logits.astype(mx.float32)
    biased[ids] = biased[ids] + mx.array([value for _, value in bias], dtype=mx.float32)
    return biased


def filter_logits(mx: Any, logits: Any, params: SamplingParams) -> Any:
    """Top-k, top-p and min-p on the untempered logits, then temperature: the logits to
    draw from (softmax), -inf where filtered out. Not for greedy parameters."""
    logits = logits.astype(mx.float32)
    if 0 < params.top_k < logits.shape[-1]:
        kth = mx.sort(logits)[-params.top_k]
        logits = mx.where(logits < kth, -mx.inf, logits)
    if params.top_p < 1.0:
        probs = mx.softmax(logits)  # over what top-k kept
        order = mx.argsort(-probs)
        likelier = mx.cumsum(probs[order]) - probs[order]  # mass before each, sorted
        keep_sorted = (likelier < params.top_p) | (mx.arange(order.size) == 0)
        keep = mx.zeros_like(keep_sorted).at[order].add(keep_sorted)
        logits = mx.where(keep, logits, -mx.inf)
    if params.min_p > 0.0:  # p >= min_p * p_max, as logits
        logits = mx.where(logits < logits.max() + math.log(params.min_p), -mx.inf, logits)
    return logits / params.temperature


@attrs.define
class SessionSampler:
    """A request's sampling state: its parameters, its random key, its grammar matcher, the
    tokens it generated (as many as its penalties look back on)."""

    params: SamplingParams
    key: Any
    matcher: Any = None  # llguidance's LLMatcher when the request has a constraint
    unusable: str | None = None  # why its constraint could not be compiled
    recent: deque[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        last_n = self.params.penalty_last_n
        self.recent = deque(maxlen=None if last_n < 0 else last_n)


class Samplers:
    """Each session's sampler, and sampling a token from its logits."""

    def __init__(self, model: MlxModel, grammars: LlguidanceGrammars) -> None:
        self._model = model
        self._mx = model.mx
        self._grammars = grammars
        self._samplers: dict[int, SessionSampler] = {}

    def set(self, seq: int, params: SamplingParams) -> None:
        """A new request on `seq`: its sampler in its start state."""
        sampler = SessionSampler(params, self._mx.random.key(params.seed))
        if params.grammar is not None:
            try:
                sampler.matcher = self._grammars.matcher(params.grammar)
            except ValueError as exc:  # (checked before admission: only direct engine users)
                sampler.unusable = f"the output constraint cannot be used: {exc}"
        self._samplers[seq] = sampler

    def keys(self) -> list[Any]:
        """Every sampler's random key (to evaluate what a step left lazy)."""
        return [sampler.key for sampler in self._samplers.values()]

    def sample(self, seq: int, logits: Any) -> Sampled:
        sampler = self._samplers[seq]
        if sampler.unusable is not None:
            return Sampled(seq=seq, token=-1, piece=b"", end_of_generation=True,
                           error=sampler.unusable)
        raw = logits
        if sampler.params.logit_bias:
            logits = bias_logits(self._mx, logits, sampler.params.logit_bias)
        if sampler.params.uses_penalties:
            logits = penalize(self._mx, logits, sampler.recent, sampler.params)
        matcher = sampler.matcher
        if matcher is not None and matcher.is_error():
            return self._grammar_failed(seq)
        token = self._draw(sampler, logits)
        if matcher is not None and matcher.validate_tokens([token]) != 1:
            # The grammar vetoes it: draw again among the tokens it allows (checking the
            # free draw first, as llama.cpp's backend does, spares most tokens the mask).
            token = self._draw(sampler, self._grammars.allowed(matcher, logits))
        sampler.recent.append(token)
        if matcher is not None and not matcher.consume_token(token):
            return self._grammar_failed(seq)
        return Sampled(seq=seq, token=token, piece=self._model.piece(token),
                       end_of_generation=token in self._model.end_of_generation,
                       logprobs=self._logprobs(raw, token, sampler.params.logprobs))

    def _logprobs(self, raw: Any, token: int, top: int | None) -> Logprobs | None:
        """From the model's raw logits, as on llama.cpp (butter/backends/logprobs.py)."""
        if top is None:
            return None
        values = np.array(raw.astype(self._mx.float32))
        return token_logprobs(values, token, top, self._model.piece)

    def _draw(self, sampler: SessionSampler, logits: Any) -> int:
        mx, params = self._mx, sampler.params
        if params.greedy:
            return int(mx.argmax(logits).item())
        sampler.key, draw = mx.random.split(sampler.key)
        return int(mx.random.categorical(filter_logits(mx, logits, params), key=draw).item())

    def _grammar_failed(self, seq: int) -> Sampled:
        """End this request alone (llguidance hit a limit or rejected the token)."""
        matcher = self._samplers[seq].matcher
        log.warning("grammar matcher failed on seq %d: %s", seq, matcher.get_error()[:500])
        return Sampled(seq=seq, token=-1, piece=b"", end_of_generation=True,
                       error="the output grammar could not be followed (see the server log)")

    def clear(self) -> None:
        self._samplers.clear()
