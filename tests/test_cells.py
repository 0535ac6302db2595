"""The KV cell ledger and the host-RAM tier's bookkeeping (pure: no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from butter.engine.cells import CellLedger
from butter.engine.host_cache import HostCache

SEQS = 4

op = st.one_of(
    st.tuples(st.just("extend"), st.integers(0, SEQS - 1), st.integers(0, 6)),
    st.tuples(st.just("copy"), st.integers(0, SEQS - 1), st.integers(0, SEQS - 1),
              st.integers(0, 8)),
    st.tuples(st.just("remove"), st.integers(0, SEQS - 1), st.integers(0, 8)),
    st.tuples(st.just("live"), st.integers(0, SEQS - 1), st.booleans()),
    st.tuples(st.just("clear"), st.integers(0, SEQS - 1)),
)


def apply(ledger: CellLedger, step: tuple) -> None:  # type: ignore[type-arg]
    match step:
        case ("extend", seq, count):
            ledger.extend(seq, count)
        case ("copy", src, dst, count):
            if src != dst:
                ledger.clear(dst)
                ledger.copy_prefix(src, dst, min(count, ledger.length(src)))
        case ("remove", seq, start):
            ledger.remove(seq, min(start, ledger.length(seq)))
        case ("live", seq, live):
            ledger.set_live(seq, live)
        case ("clear", seq):
            ledger.clear(seq)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.booleans())
def test_counts_match_a_recount_after_any_sequence_of_changes(
    steps: list[tuple], shares: bool  # type: ignore[type-arg]
) -> None:
    ledger = CellLedger(shares_cells=shares)
    for step in steps:
        apply(ledger, step)
        held = {seq: set(ledger._cells.get(seq, [])) for seq in range(SEQS)}
        every = set().union(*held.values())
        live = set().union(*(cells for seq, cells in held.items() if ledger.is_live(seq)))
        assert ledger.used == len(every)
        assert ledger.idle_only == len(every - live)
        for seq in range(SEQS):
            others = set().union(*(c for s, c in held.items() if s != seq))
            assert ledger.unique(seq) == len(held[seq] - others)


def test_a_shared_prefix_costs_its_cells_once_and_frees_them_with_its_last_holder() -> None:
    ledger = CellLedger()
    ledger.extend(0, 100)  # a conversation's prompt
    ledger.copy_prefix(0, 1, 90)  # a fork of it shares 90 cells
    ledger.extend(1, 10)
    assert ledger.used == 110
    assert (ledger.unique(0), ledger.unique(1)) == (10, 10)
    ledger.set_live(1, True)
    assert ledger.idle_only == 10  # only the first's own tail has no live holder
    ledger.clear(0)
    assert (ledger.used, ledger.idle_only) == (100, 0)


def test_copies_that_copy_take_new_cells() -> None:
    ledger = CellLedger(shares_cells=False)  # (MLX copies a prefix's arrays)
    ledger.extend(0, 50)
    ledger.copy_prefix(0, 1, 50)
    assert ledger.used == 100 and ledger.unique(0) == 50


def saved(cache: HostCache, tokens: list[int], size: int, now: float) -> None:
    cache.finish_save(cache.begin_save(tokens, now), b"x" * size)


def test_the_host_tier_keeps_the_most_recent_entries_within_its_budget() -> None:
    cache = HostCache(budget_bytes=250)
    saved(cache, [1, 2, 3], 100, now=1)
    saved(cache, [4, 5, 6], 100, now=2)
    saved(cache, [7, 8, 9], 100, now=3)  # over budget: the oldest goes
    assert [e.tokens for e in cache.entries()] == [(4, 5, 6), (7, 8, 9)]
    assert cache.stats().bytes == 200
    saved(cache, [10], 300, now=4)  # larger than the whole budget: not kept at all
    assert len(cache.entries()) == 2


def test_an_entry_replaces_the_ones_it_extends() -> None:
    cache = HostCache(budget_bytes=1000)
    saved(cache, [1, 2, 3], 100, now=1)
    saved(cache, [1, 2, 9], 100, now=2)  # a fork: both kept
    saved(cache, [1, 2, 3, 4, 5], 150, now=3)  # the first conversation's next turn
    assert [e.tokens for e in cache.entries()] == [(1, 2, 9), (1, 2, 3, 4, 5)]
    assert cache.longest_shared([1, 2, 3, 4, 7]) == 4
    (entry, *_) = [e for e in cache.entries() if e.tokens[2] == 3]
    assert cache.take(entry, restored_tokens=4) == b"x" * 150
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.restored, stats.restored_tokens) == (1, 100, 1, 4)


def test_a_failed_save_leaves_nothing_behind() -> None:
    cache = HostCache(budget_bytes=1000)
    entry = cache.begin_save([1, 2], now=1)
    cache.finish_save(entry, None)
    assert cache.entries() == [] and cache.stats().bytes == 0
