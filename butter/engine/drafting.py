"""Speculative decoding's decisions (pure): what to draft, and how much of it a step takes.

A decoding session proposes the tokens that followed an earlier occurrence of its own last
few tokens, in its prompt or its output: of the recent ones, the occurrence whose match
reaches furthest back (prompt lookup: no second model, one small index per session). The
step verifies them in the same evaluation as everyone's next token and keeps the longest
prefix the model's own sampling agrees with (docs/design/speculation.md). Where the
lookup finds nothing, a draft model, if one is loaded, guesses instead (its tokens are
made in the step, by the backend).

`Speculation` is the engine's side of it: which decoding sequences draft in a step and how
many rows each, and what the step then says about acceptance and row costs.

How many draft rows a step takes is a throughput decision: a session whose drafts were
accepted with probability `a` per token expects `a + a² + ... + a^k` extra tokens from k
rows, and the step costs what steps of that many rows were measured to cost. The step takes
the number of rows that maximizes tokens per second, which is none where drafts are rarely
accepted or rows are dear.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from butter.backends.base import Backend, SeqWork
from butter.engine.step_plan import PendingWork
from butter.kv import KvWindow

if TYPE_CHECKING:  # (a Generation holds its PromptLookup and Acceptance: no cycle at run time)
    from butter.engine.generation import Generation
    from butter.engine.prefix_cache import KvSequence

# N-gram lengths the lookup tries, longest first: a longer match is likelier to go on.
MAX_NGRAM = 4
MIN_NGRAM = 2
# Among the latest CANDIDATES earlier occurrences of the longest n-gram, the lookup follows
# the one whose match reaches furthest back (up to MAX_MATCH tokens): in text that repeats
# a pattern (a file's functions, a list's items) the latest occurrence of the last few
# tokens is usually the previous item, while the longer match finds the place being copied.
CANDIDATES = 16
MAX_MATCH = 32

# A session's acceptance starts from this prior (as if PRIOR_TRIES draft tokens had been
# tried), and every verified draft weighs the past by ACCEPTANCE_MEMORY, so a session's
# estimate follows what its text does now (a copy starts, a copy ends).
PRIOR_ACCEPTANCE = 0.6
PRIOR_TRIES = 2.0
ACCEPTANCE_MEMORY = 0.8
# A session that has stopped drafting (its estimate says rows cost more than they bring)
# drafts one token every this many steps that have a proposal, so it notices when its text
# starts to repeat what it has seen. At worst that is one extra row in this many steps.
PROBE_EVERY = 32

# Until steps of n rows have been measured, they are assumed to cost this much more per
# extra row than the nearest measured size (optimistic, so that each size gets measured).
UNMEASURED_ROW_COST = 0.05
# Weight of every step's surprise in the cost level all step sizes share (it follows the
# sequences' growth), and of a new measurement in a size's own cost at that level (how
# much dearer than other sizes it is, which changes little).
LEVEL_MEMORY = 0.2
SHAPE_MEMORY = 0.05


class PromptLookup:
    """A session's tokens and an index of their n-grams: proposes what followed the earlier
    occurrence of the longest n-gram its tokens end with, the one matching furthest back
    (the latest among equals)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._tokens: list[int] = []
        # shorter n-gram -> the position just after its latest occurrence (what followed it)
        self._after: dict[tuple[int, ...], int] = {}
        # MAX_NGRAM-gram -> the positions just after each of its latest occurrences
        self._after_longest: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> None:
        seen = self._tokens
        end = len(seen)  # the new token's position: it follows the n-grams ending here
        for n in range(MIN_NGRAM, MAX_NGRAM):
            if end >= n:
                self._after[tuple(seen[end - n:end])] = end
        if end >= MAX_NGRAM:
            after = self._after_longest.setdefault(tuple(seen[end - MAX_NGRAM:end]), [])
            after.append(end)
            if len(after) > 2 * CANDIDATES:  # (only the latest are looked at)
                del after[:CANDIDATES]
        seen.append(token)

    def propose(self, limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens that followed an earlier occurrence of the tokens' end."""
        seen = self._tokens
        if limit <= 0:
            return ()
        start = self._furthest_match()
        for n in range(min(MAX_NGRAM - 1, len(seen)), MIN_NGRAM - 1, -1):
            if start is not None:
                break
            start = self._after.get(tuple(seen[-n:]))
        if start is None:
            return ()
        proposed = seen[start:start + limit]
        # (an image's positions hold negative ids, which no token can be: a draft stops
        # where one begins)
        images_at = next((i for i, token in enumerate(proposed) if token < 0), len(proposed))
        return tuple(proposed[:images_at])

    def _furthest_match(self) -> int | None:
        """Of the latest occurrences of the last MAX_NGRAM tokens, the position after the
        one whose match with the tokens' end reaches furthest back."""
        seen = self._tokens
        end = len(seen)
        if end < MAX_NGRAM:
            return None
        after = self._after_longest.get(tuple(seen[-MAX_NGRAM:]))
        if not after:
            return None
        best, best_length = after[-1], 0
        for start in reversed(after[-CANDIDATES:]):
            length = MAX_NGRAM
            while length < MAX_MATCH and length < start and \
                    seen[start - 1 - length] == seen[end - 1 - length]:
                length += 1
            if length > best_length:
                best, best_length = start, length
        return best


@attrs.define
class Acceptance:
    """How likely a session's next draft token is to be accepted, given the one before it
    was: accepted draft tokens over draft tokens put to the test (those accepted, and the
    first rejected, if any), recent drafts weighing more."""

    accepted: float = PRIOR_ACCEPTANCE * PRIOR_TRIES
    tried: float = PRIOR_TRIES
    steps_without: int = 0  # steps with a proposal that drafted nothing

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens, of which the first `accepted` held."""
        if drafted == 0:
            return
        tried = accepted + (accepted < drafted)
        self.accepted = self.accepted * ACCEPTANCE_MEMORY + accepted
        self.tried = self.tried * ACCEPTANCE_MEMORY + tried
        self.steps_without = 0


@attrs.define
class StepCosts:
    """What decode-only steps cost, by their number of rows: each size's own cost (smoothed)
    times a level that every step moves. Steps grow dearer together as the sequences grow,
    and a size the engine seldom takes would otherwise keep the cost of its day, below what
    it costs now, while the size taken at every step keeps up."""

    seconds: dict[int, float] = attrs.field(factory=dict)  # by rows, at level 1
    level: float = 1.0

    def observe(self, rows: int, seconds: float) -> None:
        known = self.seconds.get(rows)
        if known is None:
            self.seconds[rows] = seconds / self.level
            return
        self.level *= 1 + LEVEL_MEMORY * (seconds / (self.level * known) - 1)
        self.seconds[rows] = known + SHAPE_MEMORY * (seconds / self.level - known)

    def cost(self, rows: int) -> float:
        """The measured cost of `rows` rows, else an optimistic guess from the nearest
        measured smaller size (relative units when nothing is measured yet)."""
        return self.level * self._cost_at_level_one(rows)

    def _cost_at_level_one(self, rows: int) -> float:
        if rows in self.seconds:
            return self.seconds[rows]
        smaller = [n for n in self.seconds if n < rows]
        base_rows = max(smaller, default=None)
        if base_rows is None:
            larger = [n for n in self.seconds if n > rows]
            if not larger:
                return 1.0 + UNMEASURED_ROW_COST * (rows - 1)
            base_rows = min(larger)  # (a cheaper guess below a measured size)
            return self.seconds[base_rows] * (1 - UNMEASURED_ROW_COST * (base_rows - rows))
        return self.seconds[base_rows] * (1 + UNMEASURED_ROW_COST * (rows - base_rows))


@attrs.frozen
class DraftOffer:
    """A decoding session's proposal for this step, and how likely its tokens hold."""

    proposal: tuple[int, ...]
    acceptance: float
    probe: bool = False  # draft one token whatever the estimate (where a kept one pays)
    token_cost: float = 0.0  # seconds each draft token costs to make (a draft model's)
    guessed: bool = False  # the draft model makes its tokens in the step (placeholders here)


def draft_lengths(offers: Sequence[DraftOffer], base_rows: int, max_rows: int,
                  costs: StepCosts) -> list[int]:
    """How many of each offer's tokens the step verifies: the total that maximizes the
    expected tokens per second (the step's `base_rows` decode rows each bring one token;
    a session's j-th draft token brings acceptance**j more), never past `max_rows` rows."""
    lengths = [0] * len(offers)
    for index, offer in enumerate(offers):  # (a probe's row must pay were its token kept)
        if offer.probe and offer.proposal and \
                _a_kept_token_pays(base_rows + sum(lengths), offer.token_cost, costs):
            lengths[index] = 1
    room = max_rows - base_rows - sum(lengths)
    if room <= 0:
        return [0] * len(offers) if room < 0 else lengths
    gains = sorted(
        ((offer.acceptance ** j, index)
         for index, offer in enumerate(offers)
         for j in range(lengths[index] + 1, len(offer.proposal) + 1)),
        key=lambda gain: -gain[0],
    )[:room]
    fixed = sum(lengths)
    expected = base_rows + sum(offers[i].acceptance for i, n in enumerate(lengths) if n)
    making = sum(offers[i].token_cost for i, n in enumerate(lengths) if n)
    best_total, best_rate = 0, expected / (costs.cost(base_rows + fixed) + making)
    for total, (gain, index) in enumerate(gains, start=1):
        expected += gain
        making += offers[index].token_cost
        rate = expected / (costs.cost(base_rows + fixed + total) + making)
        if rate > best_rate:
            best_total, best_rate = total, rate
    for _, index in gains[:best_total]:
        lengths[index] += 1
    return lengths


def _a_kept_token_pays(rows: int, token_cost: float, costs: StepCosts) -> bool:
    """Whether one more row, its token certain to be kept, makes the step yield more tokens
    per second: where it does not (many rows already, each one dear), no estimate of a
    session's acceptance could make its drafts pay, so probing it only slows the step."""
    return (rows + 1) / (costs.cost(rows + 1) + token_cost) >= rows / costs.cost(rows)



class Speculation:
    """The engine's speculative decoding: the drafts a step of decodes carries, and what
    each step teaches about acceptance and the cost of rows."""

    def __init__(self, backend: Backend, *, draft_max: int, window: KvWindow | None) -> None:
        self.backend = backend
        self.draft_max = draft_max
        self.draft_rows = backend.draft_rows
        self.off = self._off_reason(window)
        self.step_costs = StepCosts()  # of decode-only steps, by rows
        self.guess_cost = 0.0  # seconds the draft model takes per guessed token (measured)

    def _off_reason(self, window: KvWindow | None) -> str | None:
        """Why this engine does not speculate (None: it does)."""
        if self.draft_max <= 0:
            return "turned off (--draft-max 0)"
        if self.backend.speculation_off is not None:
            return self.backend.speculation_off
        if self.draft_rows < 2:
            return "the backend computes no batch of two rows as it computes one"
        if window is not None:  # (a slide would cut into the draft's positions)
            return "not with a sliding KV window (--kv-window-size)"
        return None

    def with_drafts(self, pending: list[PendingWork],
                    sequences: Sequence[KvSequence]) -> list[PendingWork]:
        """The decoding sequences' drafts for this step: only in a step of decodes alone (a
        prompt chunk leaves it no spare width), and only as many rows as pay for
        themselves (draft_lengths)."""
        if self.off is not None or not pending or \
                len(pending) >= self.draft_rows or any(not p.decoding for p in pending):
            return pending  # (no spare width: not even a probe fits)
        drafting = [sequences[p.seq] for p in pending]
        offers = [self._offer(sequence) for sequence in drafting]
        if not any(offer.proposal for offer, _ in offers):
            return pending
        lengths = draft_lengths([offer for offer, _ in offers], len(pending),
                                self.draft_rows, self.step_costs)
        drafted: list[PendingWork] = []
        for work, sequence, (offer, estimate), length in zip(pending, drafting, offers,
                                                             lengths, strict=True):
            if offer.proposal and not length:
                estimate.steps_without += 1
            if not length:
                drafted.append(work)
            elif offer.guessed:
                drafted.append(attrs.evolve(work, guess=length, history=sequence.kv_tokens))
            else:
                drafted.append(attrs.evolve(work, draft=offer.proposal[:length]))
        return drafted

    def _offer(self, sequence: KvSequence) -> tuple[DraftOffer, Acceptance]:
        """What a decoding request proposes, cut to what its max_tokens and its reserved
        cells leave room for: the prompt lookup's continuation, else as many guesses of
        the draft model (if one is loaded); and the estimate its drafts are judged by."""
        generation = sequence.generation
        assert generation is not None  # (a decoding sequence's)
        room = min(self.draft_max, generation.max_tokens - generation.completion_tokens - 1,
                   generation.ticket.cells - generation.prompt_tokens
                   - generation.completion_tokens)
        if generation.prompt_top_logprobs is not None or room <= 0:
            return DraftOffer((), 0.0), generation.acceptance
        lookup = generation.lookup
        history = sequence.kv_tokens
        if lookup is None:
            lookup = generation.lookup = PromptLookup(history)
        elif len(lookup) < len(history):
            lookup.extend(history[len(lookup):])
        lookup.extend(generation.pending)
        proposal = lookup.propose(room)
        # (the draft model reads the sequence's tokens, and an image's are no tokens)
        if not proposal and self.backend.guesses and not generation.images:
            estimate = generation.guess_acceptance
            return DraftOffer((0,) * room, estimate.rate,
                              probe=estimate.steps_without >= PROBE_EVERY,
                              token_cost=self.guess_cost, guessed=True), estimate
        estimate = generation.acceptance
        offer = DraftOffer(proposal, estimate.rate, probe=estimate.steps_without >= PROBE_EVERY)
        return offer, estimate

    def observe_step(self, works: Sequence[SeqWork], seconds: float, guessing: float) -> None:
        """A step's cost by rows, if it was decodes alone, less the draft model's guessing
        (measured apart, per guessed token)."""
        if self.off is not None or not works or any(work.prompt for work in works):
            return
        guessed = sum(work.guess for work in works)
        if guessed:
            per_token = guessing / guessed
            self.guess_cost = per_token if not self.guess_cost else \
                self.guess_cost + 0.2 * (per_token - self.guess_cost)
        rows = sum(len(work.tokens) + work.guess for work in works)
        self.step_costs.observe(rows, seconds - guessing)

    @staticmethod
    def verified(generation: Generation, work: SeqWork, *, accepted: int) -> int:
        """A verified draft's outcome on its request's estimate and counts; the draft
        tokens it verified."""
        drafted = work.drafted or work.guess
        estimate = generation.guess_acceptance if work.guess else generation.acceptance
        estimate.observe(drafted, accepted)
        generation.drafted_tokens += drafted
        generation.accepted_tokens += accepted
        return drafted
