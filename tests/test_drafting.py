"""Speculative decoding's decisions (butter/engine/drafting.py, pure): what prompt lookup
proposes, how acceptance is estimated, and how many draft rows a step takes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from butter.engine.drafting import (
    CANDIDATES,
    MAX_MATCH,
    MAX_NGRAM,
    MIN_NGRAM,
    PRIOR_ACCEPTANCE,
    Acceptance,
    DraftOffer,
    PromptLookup,
    StepCosts,
    draft_lengths,
)


def match_reach(tokens: list[int], start: int, n: int) -> int:
    """How far back the n tokens at `start` and the tokens' end match (up to MAX_MATCH)."""
    end, length = len(tokens), n
    while length < MAX_MATCH and start - 1 - (length - n) >= 0 and \
            tokens[start - 1 - (length - n)] == tokens[end - 1 - length]:
        length += 1
    return length


def brute_force_proposal(tokens: list[int], limit: int) -> tuple[int, ...]:
    """What followed an earlier occurrence of the longest suffix n-gram: the latest one,
    except for the longest n-grams, where of the latest CANDIDATES occurrences it is the one
    whose match reaches furthest back (up to MAX_MATCH tokens), the latest among equals."""
    end = len(tokens)
    for n in range(min(MAX_NGRAM, end), MIN_NGRAM - 1, -1):
        suffix = tokens[-n:]
        starts = [start for start in range(end - n - 1, -1, -1)  # latest first, not the suffix
                  if tokens[start:start + n] == suffix]
        if not starts:
            continue
        best = starts[0]
        if n == MAX_NGRAM:
            best = max(starts[:CANDIDATES],
                       key=lambda start: (match_reach(tokens, start, MAX_NGRAM), start))
        return tuple(tokens[best + n:best + n + limit])
    return ()


def test_the_lookup_proposes_what_followed_the_tokens_end_before() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3])
    assert lookup.propose(3) == (4, 5, 9)
    assert lookup.propose(1) == (4,)
    assert lookup.propose(0) == ()


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    # (7, 2, 3) occurred once, followed by 9; (2, 3) last occurred followed by 6.
    lookup = PromptLookup([7, 2, 3, 9, 8, 2, 3, 6, 7, 2, 3])
    assert lookup.propose(2) == (9, 8)


def test_a_draft_stops_where_an_image_begins() -> None:
    # (an image's positions hold negative ids: image_token_ids)
    lookup = PromptLookup([1, 2, 3, 4, -7, -8, 5, 9, 2, 3])
    assert lookup.propose(4) == (4,)
    assert PromptLookup([1, 2, 3, -7, 4, 1, 2, 3]).propose(3) == ()


def test_no_earlier_occurrence_proposes_nothing() -> None:
    assert PromptLookup([1, 2, 3, 4]).propose(4) == ()
    assert PromptLookup([5]).propose(4) == ()


def test_a_repeated_pattern_is_copied_from_where_the_match_reaches_furthest_back() -> None:
    # A file of items "9 8 7 <i> 5" copied once and now being copied again: the last four
    # tokens, (5, 9, 8, 7), last occurred before the copy's previous item, whose index is
    # one less; the match reaching back through "<i-1> 5" is the original's item i.
    items = [token for i in range(20, 26) for token in (9, 8, 7, i, 5)]
    tokens = [*items, 1, *items[:3 * 5], 9, 8, 7]
    assert PromptLookup(tokens).propose(3) == (23, 5, 9)


@st.composite
def repetitive_tokens(draw: st.DrawFn) -> list[int]:
    """Up to 100 items drawn from a few short ones: text that repeats itself, where an
    n-gram occurs many times (more than the lookup keeps) with different matches behind."""
    items = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5),
                          min_size=1, max_size=6))
    rng = random.Random(draw(st.integers(0, 2**16)))  # (lists drawn item by item stay short)
    return [token for _ in range(draw(st.integers(0, 100))) for token in rng.choice(items)]


@given(st.lists(st.integers(0, 4), max_size=60) | repetitive_tokens(),
       st.integers(0, 8), st.integers(1, 10))
def test_the_index_agrees_with_a_brute_force_search_however_it_was_fed(
    tokens: list[int], limit: int, cut: int
) -> None:
    whole = PromptLookup(tokens)
    grown = PromptLookup(tokens[:cut])
    for token in tokens[cut:]:
        grown.extend([token])
    expected = brute_force_proposal(tokens, limit)
    assert whole.propose(limit) == expected
    assert grown.propose(limit) == expected
    assert len(grown) == len(tokens)


def test_acceptance_counts_the_accepted_tokens_and_the_first_rejected_one() -> None:
    acceptance = Acceptance()
    assert acceptance.rate == PRIOR_ACCEPTANCE
    for _ in range(20):
        acceptance.observe(drafted=4, accepted=4)  # all held: nothing rejected
    assert acceptance.rate > 0.95
    for _ in range(20):
        acceptance.observe(drafted=4, accepted=0)  # the first one failed
    assert acceptance.rate < 0.05
    before = acceptance.rate
    acceptance.observe(drafted=0, accepted=0)  # nothing drafted: nothing learned
    assert acceptance.rate == before


def test_half_accepted_drafts_estimate_one_half() -> None:
    acceptance = Acceptance()
    for _ in range(40):
        acceptance.observe(drafted=3, accepted=1)  # one held, the second failed: 1 of 2
    assert abs(acceptance.rate - 0.5) < 0.01


def flat_costs(per_row: float) -> StepCosts:
    """Steps that cost 1 + per_row for each row past the first, measured up to 8 rows."""
    return StepCosts({rows: 1.0 + per_row * (rows - 1) for rows in range(1, 9)})


def test_drafts_that_usually_hold_fill_the_step_up_to_its_width() -> None:
    offers = [DraftOffer(tuple(range(10)), acceptance=0.9)]
    assert draft_lengths(offers, base_rows=1, max_rows=7, costs=flat_costs(0.05)) == [6]


def test_drafts_that_rarely_hold_are_not_verified() -> None:
    offers = [DraftOffer((1, 2, 3), acceptance=0.1)]
    assert draft_lengths(offers, base_rows=1, max_rows=7, costs=flat_costs(0.3)) == [0]


def test_dear_rows_take_fewer_drafts_than_cheap_ones() -> None:
    offers = [DraftOffer(tuple(range(6)), acceptance=0.7)]
    cheap = draft_lengths(offers, base_rows=1, max_rows=7, costs=flat_costs(0.02))
    dear = draft_lengths(offers, base_rows=1, max_rows=7, costs=flat_costs(0.5))
    assert cheap[0] > dear[0] > 0


def test_the_rows_go_to_the_session_whose_drafts_hold_best() -> None:
    offers = [DraftOffer((1, 2, 3), acceptance=0.3), DraftOffer((4, 5, 6), acceptance=0.95)]
    lengths = draft_lengths(offers, base_rows=2, max_rows=5, costs=flat_costs(0.01))
    assert lengths == [0, 3]


def test_a_step_already_as_wide_as_allowed_takes_no_drafts() -> None:
    offers = [DraftOffer((1, 2), acceptance=1.0, probe=True) for _ in range(3)]
    assert draft_lengths(offers, base_rows=3, max_rows=3, costs=flat_costs(0.0)) == [0, 0, 0]


def test_a_probe_drafts_one_token_whatever_the_estimate() -> None:
    offers = [DraftOffer((1, 2, 3), acceptance=0.0, probe=True), DraftOffer((), 0.9)]
    assert draft_lengths(offers, base_rows=2, max_rows=7, costs=flat_costs(1.0)) == [1, 0]


def test_no_probe_where_even_a_kept_token_would_not_pay_for_its_row() -> None:
    # Eight rows cost 28 ms, nine 34.5: a ninth row would need 1.76 tokens to pay.
    costs = StepCosts({8: 0.028, 9: 0.0345, 10: 0.040})
    probes = [DraftOffer((1, 2), acceptance=0.5, probe=True) for _ in range(8)]
    assert draft_lengths(probes, base_rows=8, max_rows=16, costs=costs) == [0] * 8
    probes = probes[:7]
    # With one row fewer in the step, a kept token pays for the eighth: one probe, not two.
    assert draft_lengths(probes, base_rows=7, max_rows=16,
                         costs=StepCosts({7: 0.026, 8: 0.028, 9: 0.0345})) == [1] + [0] * 6


def test_a_size_seldom_taken_is_judged_at_todays_cost_level() -> None:
    costs = StepCosts()
    costs.observe(8, 0.028)
    costs.observe(9, 0.0345)
    for _ in range(30):  # the sequences grow: eight rows now cost a fifth more
        costs.observe(8, 0.028 * 1.2)
    assert costs.cost(8) == pytest.approx(0.028 * 1.2, rel=0.01)
    # Nine rows were never measured again, yet they carry most of the rise, not the 0.0345
    # of their day (the rest is read as eight rows growing dearer than nine).
    assert 0.0345 * 1.15 < costs.cost(9) < 0.0345 * 1.2


def test_an_unmeasured_step_size_is_guessed_a_little_dearer_than_the_nearest_measured() -> None:
    costs = StepCosts()
    assert costs.cost(3) > costs.cost(1)  # relative units before any measurement
    costs.observe(2, 0.010)
    assert 0.010 < costs.cost(4) < 0.012
    assert costs.cost(1) < 0.010  # below the only measured size
    costs.observe(2, 0.020)  # smoothed, not replaced
    assert 0.010 < costs.cost(2) < 0.020


@given(st.lists(st.integers(0, 2), max_size=200), st.lists(st.integers(0, 2), max_size=200),
       st.integers(0, 200))
def test_the_draft_caches_kept_prefix_is_the_common_prefix(
    head: list[int], tail: list[int], shared: int
) -> None:
    from butter.backends.llama_cpp.drafter import kept_prefix

    seen = head[:shared] + tail
    history = head
    expected = next((i for i, (a, b) in enumerate(zip(seen, history, strict=False)) if a != b),
                    min(len(seen), len(history)))
    assert kept_prefix(seen, history) == expected
