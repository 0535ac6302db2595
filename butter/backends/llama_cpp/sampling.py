"""Sampling on llama.cpp: a native sampler chain per sequence (butter/sampling.py's order
of effect), a grammar that vetoes the chain's pick, and the candidates they run on."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import attrs
import llama_cpp as ll
import numpy as np

from butter.backends.base import Sampled
from butter.backends.llama_cpp.grammars import LlguidanceGrammars
from butter.backends.llama_cpp.loading import LlamaModel
from butter.backends.logprobs import token_logprobs
from butter.sampling import SamplingParams

log = logging.getLogger(__name__)

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def sampler_chain(params: SamplingParams, n_vocab: int, *, draw: bool = True) -> Any:
    """llama.cpp's chain for these parameters: penalties, top-k, top-p, min-p, temperature,
    then the draw (`draw=False`: the filters and temperature only, nothing selected)."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())

    def add(sampler: Any) -> None:
        ll.llama_sampler_chain_add(chain, sampler)

    if params.logit_bias:
        add(_logit_bias_sampler(params.logit_bias, n_vocab))
    if params.uses_penalties:
        add(ll.llama_sampler_init_penalties(
            n_vocab, params.penalty_last_n, params.repeat_penalty,
            params.frequency_penalty, params.presence_penalty,
        ))
    if params.greedy:
        if draw:
            add(ll.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(ll.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(ll.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(ll.llama_sampler_init_min_p(params.min_p, 1))
    add(ll.llama_sampler_init_temp(params.temperature))
    if draw:
        add(ll.llama_sampler_init_dist(params.seed))
    return chain


def _logit_bias_sampler(bias: tuple[tuple[int, float], ...], n_vocab: int) -> Any:
    """llama.cpp's logit-bias sampler (it copies the entries)."""
    entries = (ll.llama_logit_bias * len(bias))(
        *(ll.llama_logit_bias(token=token, bias=value) for token, value in bias))
    return ll.llama_sampler_init_logit_bias(n_vocab, len(bias), entries)


def token_data_array(candidates: Any) -> Any:
    """A llama_token_data_array over a TOKEN_DATA numpy array (no copy)."""
    return ll.llama_token_data_array(
        data=candidates.ctypes.data_as(ll.llama_token_data_p), size=len(candidates),
        selected=-1, sorted=False,
    )


def greedy_choice(logits: Any) -> int:
    """llama.cpp's greedy sampler's pick, without building its 262k candidates: the first
    of the largest logits (numpy's argmax), or -1 where a NaN makes the two disagree
    (numpy stops at the first NaN; llama.cpp's comparisons skip them)."""
    token = int(np.argmax(logits))
    return -1 if np.isnan(logits[token]) else token


class Samplers:
    """Each sequence's chain and grammar, and sampling the rows of the last decode."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self.grammars = LlguidanceGrammars(model)
        self._chains: dict[int, Any] = {}
        self._matchers: dict[int, Any] = {}  # llguidance's, for constrained requests
        self._unusable: dict[int, str] = {}  # sequences whose constraint failed to compile
        self._logprobs: dict[int, int] = {}  # seq -> alternatives, for requests that ask
        self._argmax: set[int] = set()  # sequences whose whole chain is llama.cpp's greedy
        self._vocab_ids = np.arange(model.info.n_vocab, dtype=np.int32)
        self._candidates = np.zeros(model.info.n_vocab, dtype=TOKEN_DATA)

    def set(self, seq: int, params: SamplingParams) -> None:
        """A new request on `seq`: a fresh chain (and grammar) in its start state."""
        self._drop(seq)
        self._chains[seq] = sampler_chain(params, self._model.info.n_vocab)
        if params.greedy and not params.logit_bias and not params.uses_penalties:
            self._argmax.add(seq)
        if params.logprobs is not None:
            self._logprobs[seq] = params.logprobs
        if params.grammar is None:
            return
        try:
            self._matchers[seq] = self.grammars.matcher(params.grammar)
        except ValueError as exc:  # (checked before admission: only direct engine users)
            self._unusable[seq] = f"the output constraint cannot be used: {exc}"

    def _drop(self, seq: int) -> None:
        self._unusable.pop(seq, None)
        self._logprobs.pop(seq, None)
        self._argmax.discard(seq)
        self._matchers.pop(seq, None)
        chain = self._chains.pop(seq, None)
        if chain is not None:
            ll.llama_sampler_free(chain)

    def sample_rows(self, rows: list[tuple[int, int, int]], *, ours: bool) -> list[Sampled]:
        """Sample every (seq, batch row, output ordinal) of the last decode, in order;
        `ours`: butter's projection computed its logits (else read llama.cpp's)."""
        head = self._model.lm_head if ours else None
        picked = self._sample_plain_rows_together(rows, ours=ours)
        sampled = [
            self._sampled(seq, picked[seq]) if seq in picked
            else self._sample(seq, row, head.row(ordinal) if head is not None else None)
            for seq, row, ordinal in rows
        ]
        if not self._logprobs:  # nobody asked: nothing to compute
            return sampled
        return [self._with_logprobs(one, row, head.row(ordinal) if head is not None
                                    else None)
                for one, (_, row, ordinal) in zip(sampled, rows, strict=True)]

    def verify(self, seq: int, rows: tuple[tuple[int, int], ...], draft: tuple[int, ...], *,
               ours: bool) -> list[Sampled]:
        """Sample a draft's (batch row, output ordinal) rows in order, each with the
        sequence's own chain and grammar, while the sample equals the draft token that the
        next row was computed after: exactly the tokens, and the draws, that decoding the
        rows one step at a time would give (a point-mass draft's speculative sampling)."""
        head = self._model.lm_head if ours else None
        verified: list[Sampled] = []
        for index, (row, ordinal) in enumerate(rows):
            logits = head.row(ordinal) if head is not None else None
            sampled = self._sample(seq, row, logits)
            if self._logprobs:
                sampled = self._with_logprobs(sampled, row, logits)
            verified.append(sampled)
            if (sampled.error is not None or sampled.end_of_generation
                    or index == len(draft) or sampled.token != draft[index]):
                break
        return verified

    def _with_logprobs(self, sampled: Sampled, row: int, logits: Any) -> Sampled:
        """The sampled token's logprobs, from the row's raw logits (sampling works on a
        copy of them in the candidates, so they are as the model computed them)."""
        top = self._logprobs.get(sampled.seq)
        if top is None or sampled.error is not None:
            return sampled
        if logits is None:
            logits = self._model.llama_logits(row)
        return attrs.evolve(sampled, logprobs=token_logprobs(
            logits, sampled.token, top, self._model.piece))

    def _sample_plain_rows_together(
        self, rows: list[tuple[int, int, int]], *, ours: bool,
    ) -> dict[int, int]:
        """Rows without a grammar or a plain greedy chain, their chains run side by side on
        the model's threads (butter's native sampler); {} when there is one such row or no
        native sampler."""
        head = self._model.lm_head
        plain = [(seq, row, ordinal) for seq, row, ordinal in rows
                 if seq not in self._matchers and seq not in self._unusable
                 and seq not in self._argmax]
        if head is None or len(plain) <= 1:
            return {}
        assert len({seq for seq, _, _ in plain}) == len(plain)  # one row per chain
        chains = [self._chains[seq] for seq, _, _ in plain]
        logits = [
            head.row_address(ordinal) if ours else self._model.llama_logits_address(row)
            for _, row, ordinal in plain
        ]
        picked: dict[int, int] = {}
        tokens = head.sample_rows(chains, logits, ll.llama_sampler_apply)
        for (seq, _, _), chain, token in zip(plain, chains, tokens, strict=True):
            if token >= 0:
                ll.llama_sampler_accept(chain, token)
            picked[seq] = token
        return picked

    def _sample(self, seq: int, row: int, logits: Any) -> Sampled:
        """Sample batch row `row` for `seq`; `logits`: butter's for that row, or None for
        llama.cpp's (then read from the context)."""
        if seq in self._unusable:
            return Sampled(seq=seq, token=0, piece=b"", end_of_generation=True,
                           error=self._unusable[seq])
        if seq in self._matchers:
            if logits is None:
                logits = self._model.llama_logits(row)
            return self._sample_with_grammar(seq, logits)
        if seq in self._argmax:
            token = greedy_choice(logits if logits is not None else self._model.llama_logits(row))
            if token >= 0:  # (its chain has nothing to accept: no state to advance)
                return self._sampled(seq, token)
        if logits is None:
            token = int(ll.llama_sampler_sample(self._chains[seq], self._model.ctx, row))
        else:  # what llama_sampler_sample does, on butter's logits
            chain = self._chains[seq]
            token = self._choose(chain, self._fill_candidates(logits))
            if token >= 0:
                ll.llama_sampler_accept(chain, token)
        return self._sampled(seq, token)

    def _sampled(self, seq: int, token: int) -> Sampled:
        if token < 0:  # (the chains butter builds always keep a token: never seen)
            return Sampled(seq=seq, token=0, piece=b"", end_of_generation=True,
                           error="the sampler chain selected no token")
        return Sampled(
            seq=seq,
            token=token,
            piece=self._model.piece(token),
            end_of_generation=self._model.is_end_of_generation(token),
        )

    def _sample_with_grammar(self, seq: int, logits: Any) -> Sampled:
        """Sample normally, then let the grammar veto; only a veto pays for a mask.

        The matcher checks the token the normal chain drew (microseconds); only when it
        forbids it does the chain run again, on the tokens the grammar allows (their mask
        over the whole vocabulary: a fraction of a millisecond on 262k tokens). A matcher
        that fails (it hit a limit, or took no allowed token) ends this request alone.
        """
        chain, matcher = self._chains[seq], self._matchers[seq]
        token = self._choose(chain, self._fill_candidates(logits))
        if token < 0:
            return self._sampled(seq, token)
        if not self.grammars.permits(matcher, token):
            token = self._choose_allowed(chain, matcher, logits)
            if token < 0:
                return self._grammar_failed(seq, "it allows no token")
        if not matcher.consume_token(token):
            return self._grammar_failed(seq, matcher.get_error())
        ll.llama_sampler_accept(chain, token)
        return self._sampled(seq, token)

    def _choose_allowed(self, chain: Any, matcher: Any, logits: Any) -> int:
        """The chain's choice among the tokens the grammar allows (-1: none)."""
        allowed = self.grammars.allowed(matcher)
        candidates = self._candidates[:len(allowed)]  # (its last contents are spent)
        candidates["id"] = allowed
        candidates["logit"] = logits[allowed]
        candidates["p"] = 0.0
        return self._choose(chain, candidates) if len(allowed) else -1

    def _grammar_failed(self, seq: int, why: str) -> Sampled:
        log.warning("output grammar failed on seq %d: %s", seq, why[:500])
        return Sampled(seq=seq, token=0, piece=b"", end_of_generation=True,
                       error="the output grammar could not be followed (see the server log)")

    def _fill_candidates(self, logits: Any) -> Any:
        candidates = self._candidates  # samplers reorder it in place: refill every time
        head = self._model.lm_head
        if head is not None and logits.flags.c_contiguous:
            head.fill_candidates(logits, candidates)  # one C loop
            return candidates
        candidates["id"] = self._vocab_ids
        candidates["logit"] = logits
        candidates["p"] = 0.0
        return candidates

    @staticmethod
    def _choose(chain: Any, candidates: Any) -> int:
        array = token_data_array(candidates)
        ll.llama_sampler_apply(chain, ctypes.byref(array))
        return int(array.data[array.selected].id) if array.selected >= 0 else -1

    def free(self) -> None:
        for seq in list(self._chains):
            self._drop(seq)
        self.grammars.close()
