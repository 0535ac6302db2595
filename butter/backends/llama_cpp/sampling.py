"""Sampling on llama.cpp: a native sampler chain per sequence (butter/sampling.py's order
of effect), a grammar that vetoes the chain's pick, and the candidates they run on."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import llama_cpp as ll
import numpy as np

from butter.backends.base import Sampled
from butter.backends.llama_cpp.grammars import GbnfGrammars
from butter.backends.llama_cpp.loading import LlamaModel
from butter.sampling import SamplingParams

log = logging.getLogger(__name__)

# When the grammar vetoes the sampled token, it is next applied to only this many most
# likely tokens; the whole vocabulary is the fallback when none of them is allowed.
GRAMMAR_SHORTLIST = 512

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def sampler_chain(params: SamplingParams, n_vocab: int, *, draw: bool = True) -> Any:
    """llama.cpp's chain for these parameters: penalties, top-k, top-p, min-p, temperature,
    then the draw (`draw=False`: the filters and temperature only, nothing selected)."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())

    def add(sampler: Any) -> None:
        ll.llama_sampler_chain_add(chain, sampler)

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


def token_data_array(candidates: Any) -> Any:
    """A llama_token_data_array over a TOKEN_DATA numpy array (no copy)."""
    return ll.llama_token_data_array(
        data=candidates.ctypes.data_as(ll.llama_token_data_p), size=len(candidates),
        selected=-1, sorted=False,
    )


class Samplers:
    """Each sequence's chain and grammar, and sampling the rows of the last decode."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self.grammars = GbnfGrammars(model.vocab)
        self._chains: dict[int, Any] = {}
        self._grammars: dict[int, Any] = {}
        self._unusable: dict[int, str] = {}  # sequences whose constraint failed to compile
        self._vocab_ids = np.arange(model.info.n_vocab, dtype=np.int32)
        self._candidates = np.zeros(model.info.n_vocab, dtype=TOKEN_DATA)

    def set(self, seq: int, params: SamplingParams) -> None:
        """A new request on `seq`: a fresh chain (and grammar) in its start state."""
        self._drop(seq)
        self._chains[seq] = sampler_chain(params, self._model.info.n_vocab)
        if params.grammar is None:
            return
        try:
            self._grammars[seq] = self.grammars.new_sampler(params.grammar)
        except ValueError as exc:  # (checked before admission: only direct engine users)
            self._unusable[seq] = f"the output constraint cannot be used: {exc}"

    def _drop(self, seq: int) -> None:
        self._unusable.pop(seq, None)
        for table in (self._chains, self._grammars):
            old = table.pop(seq, None)
            if old is not None:
                ll.llama_sampler_free(old)

    def sample_rows(self, rows: list[tuple[int, int, int]], *, ours: bool) -> list[Sampled]:
        """Sample every (seq, batch row, output ordinal) of the last decode, in order;
        `ours`: butter's projection computed its logits (else read llama.cpp's)."""
        head = self._model.lm_head if ours else None
        picked = self._sample_plain_rows_together(rows, ours=ours)
        return [
            self._sampled(seq, picked[seq]) if seq in picked
            else self._sample(seq, row, head.row(ordinal) if head is not None else None)
            for seq, row, ordinal in rows
        ]

    def _sample_plain_rows_together(
        self, rows: list[tuple[int, int, int]], *, ours: bool,
    ) -> dict[int, int]:
        """Rows without a grammar, their chains run side by side on the model's threads
        (butter's native sampler); {} when there is one such row or no native sampler."""
        head = self._model.lm_head
        plain = [(seq, row, ordinal) for seq, row, ordinal in rows
                 if seq not in self._grammars and seq not in self._unusable]
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
        if seq in self._grammars:
            if logits is None:
                logits = self._model.llama_logits(row)
            token = self._sample_with_grammar(seq, logits)
        elif logits is None:
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

    def _sample_with_grammar(self, seq: int, logits: Any) -> int:
        """Sample normally, then let the grammar veto; only a veto pays for a full pass.

        A grammar applied to the whole vocabulary is slow on large vocabularies, so (as
        llama-server does) the grammar first checks only the token the normal chain
        picked, and constrains the distribution only when it rejects it.
        """
        chain, grammar = self._chains[seq], self._grammars[seq]
        token = self._choose(chain, self._fill_candidates(logits))
        if token < 0:
            return token  # (ends the request: see _sampled)
        single = np.array([(token, 0.0, 0.0)], dtype=TOKEN_DATA)
        ll.llama_sampler_apply(grammar, ctypes.byref(token_data_array(single)))
        if not np.isfinite(single["logit"][0]):
            token = self._choose_allowed(chain, grammar, logits)
            if token < 0:
                return token
        ll.llama_sampler_accept(grammar, token)
        ll.llama_sampler_accept(chain, token)
        return token

    def _choose_allowed(self, chain: Any, grammar: Any, logits: Any) -> int:
        """The chain's choice among grammar-allowed tokens: the most likely few first."""
        likely = np.argpartition(-logits, GRAMMAR_SHORTLIST)[:GRAMMAR_SHORTLIST]
        shortlist = np.zeros(len(likely), dtype=TOKEN_DATA)
        shortlist["id"] = likely
        shortlist["logit"] = logits[likely]
        ll.llama_sampler_apply(grammar, ctypes.byref(token_data_array(shortlist)))
        if np.isfinite(shortlist["logit"]).any():
            return self._choose(chain, shortlist)
        candidates = self._fill_candidates(logits)  # rare: nothing likely is allowed
        ll.llama_sampler_apply(grammar, ctypes.byref(token_data_array(candidates)))
        return self._choose(chain, candidates)

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
