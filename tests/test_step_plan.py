"""The step planner (pure)."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from butter.backends.base import PromptImage, SeqWork
from butter.chat.images import DecodedImage
from butter.engine.step_plan import PendingWork, PrefillBudget, plan_step


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


def test_budget_is_full_while_nobody_decodes_whatever_steps_took() -> None:
    budget = PrefillBudget(full=256, stall=0.5)
    budget.observe(prompt_tokens=256, decode_rows=4, seconds=9.0)
    assert budget.for_step(decoding=False) == 256
    assert budget.for_step(decoding=True) == 128


def test_slow_steps_beside_decodes_halve_the_budget_down_to_64() -> None:
    budget = PrefillBudget(full=256, stall=0.5)
    seen = []
    for _ in range(4):
        budget.observe(prompt_tokens=budget.for_step(decoding=True), decode_rows=2, seconds=2.0)
        seen.append(budget.for_step(decoding=True))
    assert seen == [128, 64, 64, 64]


def test_fast_steps_double_it_back_and_steps_near_the_target_keep_it() -> None:
    budget = PrefillBudget(full=256, stall=0.5, decoding_budget=64)
    budget.observe(prompt_tokens=64, decode_rows=1, seconds=0.3)  # under stall, over a third
    assert budget.for_step(decoding=True) == 64
    budget.observe(prompt_tokens=64, decode_rows=1, seconds=0.1)
    budget.observe(prompt_tokens=128, decode_rows=1, seconds=0.1)
    budget.observe(prompt_tokens=256, decode_rows=1, seconds=0.1)
    assert budget.for_step(decoding=True) == 256  # never past the full chunk


def test_steps_without_both_kinds_of_rows_say_nothing_about_the_stall() -> None:
    budget = PrefillBudget(full=256, stall=0.5)
    budget.observe(prompt_tokens=256, decode_rows=0, seconds=9.0)  # nobody was waiting
    budget.observe(prompt_tokens=0, decode_rows=8, seconds=9.0)  # no chunk to shrink
    assert budget.for_step(decoding=True) == 256


def test_stall_zero_keeps_the_full_chunk_and_a_small_chunk_is_its_own_floor() -> None:
    off = PrefillBudget(full=256, stall=0.0)
    off.observe(prompt_tokens=256, decode_rows=4, seconds=9.0)
    assert off.for_step(decoding=True) == 256
    small = PrefillBudget(full=16, stall=0.5)
    small.observe(prompt_tokens=16, decode_rows=4, seconds=9.0)
    assert small.for_step(decoding=True) == 16  # never raised to MIN_DECODING_BUDGET


def _sizes(works: list[SeqWork]) -> dict[int, int]:
    return {w.seq: len(w.tokens) for w in works}


def test_a_burst_of_prompts_a_little_over_their_share_finishes_all_it_can() -> None:
    works = plan_step([_prefill(i, 33) for i in range(8)], 256)  # 264 tokens against 256
    assert _sizes(works) == {**dict.fromkeys(range(7), 33), 7: 25}
    assert [w.sample for w in works] == [True] * 7 + [False]  # seven first tokens now


def test_budget_a_later_short_prompt_leaves_goes_back_to_the_long_one() -> None:
    assert _sizes(plan_step([_prefill(0, 1000), _prefill(1, 10)], 256)) == {0: 246, 1: 10}


def test_a_long_prompt_gives_short_ones_their_tails_but_keeps_half_its_share() -> None:
    sizes = _sizes(plan_step([_prefill(0, 5000)] + [_prefill(i, 33) for i in range(1, 8)],
                             256))
    assert all(sizes[i] == 33 for i in range(1, 8))
    assert sizes[0] == 256 - 7 * 33 == 25 and sizes[0] >= 32 // 2


def test_long_prompts_still_share_equally() -> None:
    assert _sizes(plan_step([_prefill(0, 900), _prefill(1, 700)], 256)) == {0: 128, 1: 128}


@given(needs=st.lists(st.integers(1, 600), min_size=1, max_size=8),
       budget=st.integers(1, 512))
def test_chunks_fit_the_budget_and_keep_half_of_an_equal_share(needs: list[int],
                                                               budget: int) -> None:
    prompts = [_prefill(i, n) for i, n in enumerate(needs)]
    sizes = _sizes(plan_step(prompts, budget))
    assert sum(sizes.values()) <= budget
    assert all(0 < sizes[i] <= n for i, n in enumerate(needs) if i in sizes)
    share = max(1, budget // len(needs))
    for i, n in enumerate(needs):
        # Nobody drops below half of an equal share, and whoever would finish still does.
        assert sizes.get(i, 0) >= min(n, share // 2) or budget < len(needs)
    if sum(needs) <= budget:
        assert sizes == dict(enumerate(needs))
    elif budget >= len(needs):
        assert sum(sizes.values()) == budget  # nothing left unused while prompts wait


def test_prompts_sharing_a_step_get_whole_tiles_the_least_advanced_first() -> None:
    prompts = [_prefill(0, 4000, start=900), _prefill(1, 4000, start=100),
               _prefill(2, 4000, start=500)]
    assert _sizes(plan_step(prompts, 256)) == {0: 85, 1: 85, 2: 86}  # no tiles: equal
    assert _sizes(plan_step(prompts, 256, tile=64)) == {0: 64, 1: 128, 2: 64}


def test_a_prompt_ending_here_keeps_its_size_and_goes_last_in_the_batch() -> None:
    works = plan_step([_prefill(0, 100), _prefill(1, 5000, start=64)], 256, tile=64)
    assert [(w.seq, len(w.tokens)) for w in works] == [(1, 128), (0, 100)]
    assert works[1].sample and not works[0].sample


def test_without_one_whole_tile_the_step_is_left_as_it_was() -> None:
    prompts = [_prefill(0, 500), _prefill(1, 500)]
    assert _sizes(plan_step(prompts, 48, tile=64)) == _sizes(plan_step(prompts, 48)) == {
        0: 24, 1: 24}


@given(needs=st.lists(st.integers(1, 600), min_size=2, max_size=8),
       starts=st.lists(st.integers(0, 4000), min_size=8, max_size=8),
       budget=st.integers(1, 512))
def test_tiled_chunks_fit_the_budget_and_someone_always_progresses(
    needs: list[int], starts: list[int], budget: int
) -> None:
    prompts = [_prefill(i, n, start=starts[i]) for i, n in enumerate(needs)]
    works = plan_step(prompts, budget, tile=64)
    sizes = _sizes(works)
    assert 0 < sum(sizes.values()) <= budget
    assert all(0 < sizes[i] <= n for i, n in enumerate(needs) if i in sizes)
    untiled = _sizes(plan_step(prompts, budget))
    if sizes != untiled:  # aligned: every chunk that goes on is whole tiles, and comes first
        going_on = [w for w in works if len(w.tokens) < needs[w.seq]]
        assert all(len(w.tokens) % 64 == 0 for w in going_on)
        assert works[:len(going_on)] == going_on


def test_a_chunk_carries_the_images_its_positions_include() -> None:
    def image(start: int) -> PromptImage:
        return PromptImage(start=start, n_tokens=16, image=DecodedImage(
            key=f"{start:064x}", width=1, height=1, rgb=b"\0\0\0"))

    early, split, late = image(10), image(60), image(200)
    pending = attrs.evolve(_prefill(0, 300), images=(early, split, late))
    (first,) = plan_step([pending], 64)
    assert first.images == (early, split)  # (positions 0..63: the second image in part)
    (second,) = plan_step([attrs.evolve(pending, start=64, pending=pending.pending[64:])], 64)
    assert second.images == (split,)


def test_a_chunk_stops_at_the_next_checkpoint() -> None:
    (work,) = plan_step([attrs.evolve(_prefill(0, 300), stop=37)], 256)
    assert len(work.tokens) == 37 and not work.sample
    (whole,) = plan_step([attrs.evolve(_prefill(0, 30), stop=37)], 256)
    assert len(whole.tokens) == 30 and whole.sample


def _whole_image(start: int, n_tokens: int) -> PromptImage:
    """An image evaluated whole (its embeddings see each other, as Gemma 3's)."""
    return PromptImage(start=start, n_tokens=n_tokens, causal=False, image=DecodedImage(
        key=f"{start:064x}", width=1, height=1, rgb=b"\0\0\0"))


def test_a_chunk_stops_before_an_image_evaluated_whole_and_the_next_holds_all_of_it() -> None:
    image = _whole_image(40, 100)
    pending = attrs.evolve(_prefill(0, 300), images=(image,))
    (first,) = plan_step([pending], 64)
    assert len(first.tokens) == 40 and first.images == ()
    (second,) = plan_step([attrs.evolve(pending, start=40, pending=pending.pending[40:])], 64)
    assert len(second.tokens) == 100 and second.images == (image,)  # (past the budget)


def test_an_image_evaluated_whole_goes_alone_where_it_does_not_fit_beside_another() -> None:
    a = attrs.evolve(_prefill(0, 300), images=(_whole_image(0, 200),))
    b = attrs.evolve(_prefill(1, 300), images=(_whole_image(0, 200),))
    c = _prefill(2, 300)
    works = plan_step([a, b, c], 256)
    sizes = {w.seq: len(w.tokens) for w in works}
    assert sizes == {0: 200, 2: 56}  # (b waits a step; c takes what the budget leaves)


@given(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 300), st.integers(1, 256)),
                min_size=1, max_size=4),
       st.integers(1, 512))
def test_no_chunk_ends_inside_an_image_evaluated_whole(
        prompts: list[tuple[int, int, int]], budget: int) -> None:
    sessions = []
    for seq, (length, at, n_tokens) in enumerate(prompts):
        images = (_whole_image(at, n_tokens),) if at + n_tokens <= length else ()
        sessions.append(attrs.evolve(_prefill(seq, length), images=images))
    works = plan_step(sessions, budget)
    assert works, "the step plans some work"
    biggest = max([image.n_tokens for s in sessions for image in s.images] + [0])
    assert sum(len(w.tokens) for w in works) <= max(budget, biggest)
    for work in works:
        end = work.start + len(work.tokens)
        for image in sessions[work.seq].images:
            assert not image.start < end < image.end
