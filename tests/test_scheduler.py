"""The step planner (pure)."""

from __future__ import annotations

from butter.engine.scheduler import PendingWork, plan_step


def _prefill(seq: int, n: int, start: int = 0) -> PendingWork:
    return PendingWork(seq=seq, start=start, pending=tuple(range(n)), decoding=False)


def _decode(seq: int, pos: int) -> PendingWork:
    return PendingWork(seq=seq, start=pos, pending=(7,), decoding=True)


def test_every_decoder_gets_one_token_and_prefill_shares_the_budget() -> None:
    works = plan_step([_decode(0, 10), _prefill(1, 500), _decode(2, 4), _prefill(3, 500)], 256)
    by_seq = {w.seq: w for w in works}
    assert by_seq[0].tokens == (7,) and by_seq[0].sample and not by_seq[0].prompt
    assert by_seq[2].start == 4
    assert len(by_seq[1].tokens) == len(by_seq[3].tokens) == 128
    assert not by_seq[1].sample and by_seq[1].prompt


def test_short_prompts_leave_budget_to_the_next() -> None:
    works = plan_step([_prefill(0, 10), _prefill(1, 1000)], 256)
    sizes = {w.seq: len(w.tokens) for w in works}
    assert sizes == {0: 10, 1: 246}
    assert next(w for w in works if w.seq == 0).sample  # prompt done: sample


def test_chunk_continues_from_its_start_position() -> None:
    works = plan_step([_prefill(0, 3, start=40)], 256)
    assert works[0].start == 40 and works[0].tokens == (0, 1, 2)


def test_more_prefillers_than_budget_the_first_get_a_token_and_the_rest_wait() -> None:
    works = plan_step([_prefill(i, 5) for i in range(4)], 2)
    assert [(w.seq, len(w.tokens)) for w in works] == [(0, 1), (1, 1)]  # FIFO order


def test_nothing_to_do() -> None:
    assert plan_step([], 256) == []
