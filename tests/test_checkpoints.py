"""Context checkpoints (#51): a hybrid model's cached prompts are cut back to a checkpoint
of their recurrent state, on the real engine over real hybrid GGUFs (qwen35 and lfm2) and a
purely recurrent one (mamba)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from butter.backends.base import KvOp, RestoreCheckpoint, SeqWork
from butter.chat.template import ChatTemplate, TemplateChoice, builtin_template_source
from butter.engine import checkpoints
from butter.engine.checkpoints import Checkpoint
from butter.engine.engine import Engine
from butter.engine.generation import Generation
from butter.pipeline.prepare import HINT_SPACING, MAX_HINTS, occurrences, spaced_starts
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from tests.backend_steps import forget_everything

MiB = 2**20
CHUNK = 64


# ---------------------------------------------------------------------- pure rules


def test_positions_are_the_tail_a_chunk_before_it_every_step_and_the_hints() -> None:
    assert checkpoints.positions(300, 0, CHUNK) == [300 - 4 - CHUNK, 300 - 4]
    assert checkpoints.positions(300, 0, CHUNK, message_starts=[17, 120]) == \
        [17, 120, 232, 296]
    # only past what is cached, and before the last token (it must be evaluated)
    assert checkpoints.positions(300, 200, CHUNK, message_starts=[17, 299, 300]) == [232, 299]
    # (of positions closer than CLOSEST, the last: the tail after the answer's header)
    assert checkpoints.positions(300, 240, CHUNK, message_starts=[291]) == [296]
    assert checkpoints.positions(300, 0, CHUNK, message_starts=[270, 294]) == [232, 270, 296]
    assert checkpoints.positions(3, 0, CHUNK) == []  # (n - 4 < 1)
    long = checkpoints.positions(20_000, 0, 256)
    assert long == [checkpoints.STEP, 2 * checkpoints.STEP, 20_000 - 260, 20_000 - 4]


def test_the_newest_checkpoint_within_a_limit_serves() -> None:
    saved = [Checkpoint(10, b"a"), Checkpoint(50, b"b"), Checkpoint(90, b"c")]
    assert checkpoints.newest_within(saved, 89) is saved[1]
    assert checkpoints.newest_within(saved, 90) is saved[2]
    assert checkpoints.newest_within(saved, 9) is None
    assert checkpoints.up_to(saved, 50) == saved[:2]


def test_a_full_list_drops_the_checkpoint_closest_behind_another_never_the_newest() -> None:
    saved = [Checkpoint(n, b"x") for n in (100, 200, 210, 400)]
    kept = checkpoints.with_checkpoint(saved, Checkpoint(405, b"new"), most=4)
    assert [c.n_tokens for c in kept] == [100, 200, 400, 405]  # 210 was 10 past 200
    evenly = [Checkpoint(n, b"x") for n in (100, 200, 300, 406)]
    kept = checkpoints.with_checkpoint(evenly, Checkpoint(407, b"newest"), most=4)
    # (406 -> 407 is the closest pair, but 407 is the one just taken; among equal gaps
    # the earliest goes)
    assert [c.n_tokens for c in kept] == [200, 300, 406, 407]
    replaced = checkpoints.with_checkpoint(saved, Checkpoint(200, b"again"), most=8)
    assert [c.data for c in replaced if c.n_tokens == 200] == [b"again"]
    assert len(replaced) == 4


@pytest.mark.parametrize(("builtin", "marker"), [
    ("chatml", "<|im_start|>"), ("gemma", "<start_of_turn>"),
    ("llama3", "<|start_header_id|>"), ("mistral", None),
])
def test_the_text_that_opens_every_message_comes_from_the_template(
    builtin: str, marker: str | None
) -> None:
    template = ChatTemplate(TemplateChoice(source=builtin_template_source(builtin),
                                           origin=builtin), bos_token="<s>", eos_token="</s>")
    assert template.turn_marker == marker


def test_message_starts_hinted_are_the_last_two_and_earlier_ones_spaced_apart() -> None:
    tokens = [5, 1, 2, 9, 1, 2, 7, 1, 2]
    assert occurrences(tokens, (1, 2)) == [1, 4, 7]
    assert occurrences(tokens, (1, 3)) == []
    starts = [10, 20, 30, 30 + HINT_SPACING, 40 + HINT_SPACING, 50 + 2 * HINT_SPACING,
              60 + 2 * HINT_SPACING]
    assert spaced_starts(starts) == (30, 40 + HINT_SPACING, 50 + 2 * HINT_SPACING,
                                     60 + 2 * HINT_SPACING)
    many = [i * HINT_SPACING for i in range(20)]
    assert spaced_starts(many) == tuple(many[-MAX_HINTS:])


# ---------------------------------------------------------------------- the engine


@pytest.fixture(scope="module", params=["qwen35", "lfm2", "mamba"])
def resident(request: pytest.FixtureRequest) -> Iterator[ResidentModel]:
    path: Path = request.getfixturevalue(f"tiny_{request.param}_gguf")
    model = ResidentModel.load_sync(ServeSettings(
        model=str(path), parallel=2, max_context=1024, prefill_chunk=CHUNK, threads=2))
    yield model
    model.close()


@pytest.fixture
async def engine(resident: ResidentModel) -> AsyncIterator[Engine]:
    forget_everything(resident.backend)
    fresh = Engine(resident.backend, parallel=2, max_context=1024, prefill_chunk=CHUNK,
                   max_queue=8, cache_ram_bytes=64 * MiB)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fresh.step_loop)
        yield fresh
        nursery.cancel_scope.cancel()
    forget_everything(resident.backend)


def text_tokens(resident: ResidentModel, text: str) -> list[int]:
    return resident.backend.tokenize(text, add_bos=False)


async def greedy(engine: Engine, prompt: list[int], max_tokens: int = 8,
                 hints: tuple[int, ...] = ()) -> tuple[bytes, Generation]:
    params = SamplingParams(temperature=0.0, seed=1)
    async with engine.generate_choices(prompt, [params], max_tokens,
                                       checkpoint_hints=hints) as (generation,):
        pieces = [b"".join(batch) async for batch in generation.pieces()]
    return b"".join(pieces), generation


async def cold(resident: ResidentModel, prompt: list[int], max_tokens: int = 8) -> bytes:
    """The same request on an engine with nothing cached and no checkpoints."""
    forget_everything(resident.backend)
    fresh = Engine(resident.backend, parallel=2, max_context=1024, prefill_chunk=CHUNK,
                   max_queue=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fresh.step_loop)
        text, generation = await greedy(fresh, prompt, max_tokens)
        nursery.cancel_scope.cancel()
    forget_everything(resident.backend)
    assert generation.cached_tokens == 0
    return text


def conversation(resident: ResidentModel, turns: int) -> list[int]:
    words = "the boat sails north past the island while gulls circle over the harbour"
    return text_tokens(resident, " ".join(f"turn {i}: {words}." for i in range(turns)))


async def test_a_returning_turn_resent_differently_starts_from_the_tail_checkpoint(
    resident: ResidentModel, engine: Engine
) -> None:
    first = conversation(resident, 6)
    assert len(first) > 2 * CHUNK
    await greedy(engine, first)
    # The client sends the answer back re-rendered: the prompt differs 2 tokens before
    # the end of the cached one, where no attention cut could serve a hybrid.
    returning = first[:-2] + text_tokens(resident, " and the answer, then a new question")
    text, generation = await greedy(engine, returning)
    assert generation.cached_tokens == len(first) - checkpoints.TAIL
    stats = engine.stats().checkpoints
    assert stats is not None and stats.restored == 1
    assert stats.restored_tokens == len(first) - checkpoints.TAIL
    assert stats.taken >= 2 and stats.bytes == stats.held * resident.backend.checkpoint_bytes
    assert text == await cold(resident, returning)


async def test_a_side_request_does_not_cost_the_conversation_its_checkpoints(
    resident: ResidentModel, engine: Engine
) -> None:
    first = conversation(resident, 5)
    await greedy(engine, first)
    side = first[:20] + text_tokens(resident, " write a title for this chat")
    await greedy(engine, side)
    returning = first[:-2] + text_tokens(resident, " the answer, and more")
    text, generation = await greedy(engine, returning)
    assert generation.cached_tokens == len(first) - checkpoints.TAIL
    assert text == await cold(resident, returning)


async def test_a_fork_reuses_the_stem_and_the_cached_prompt_stays_whole(
    resident: ResidentModel, engine: Engine
) -> None:
    stem = conversation(resident, 3)
    first = stem + conversation(resident, 3)
    await greedy(engine, first, hints=(len(stem),))  # (a message starts after the stem)
    (held,) = [list(s.kv_tokens) for s in engine.cache.sequences if s.kv_tokens]
    edited = stem + text_tokens(resident, " an edited message instead")
    text, fork = await greedy(engine, edited)
    assert fork.cached_tokens == len(stem)
    assert text == await cold(resident, edited)
    # The fork was copied out: the first conversation still extends its whole cache.
    _, extended = await greedy(engine, held + text_tokens(resident, " goes on"))
    assert extended.cached_tokens == len(held)


async def test_checkpoints_travel_to_host_ram_and_back(
    resident: ResidentModel, engine: Engine
) -> None:
    first = conversation(resident, 5)
    await greedy(engine, first)
    engine.cache.age_out_idle(10**9)  # (idle long enough: to the host tier)
    await greedy(engine, text_tokens(resident, "an unrelated short request"), 1)
    host = engine.stats().host
    assert host is not None and host.entries == 1
    returning = first[:-2] + text_tokens(resident, " back from host RAM")
    text, generation = await greedy(engine, returning)
    assert generation.cached_tokens == len(first) - checkpoints.TAIL
    assert text == await cold(resident, returning)


async def test_a_checkpoint_that_fails_to_load_is_prefilled_instead(
    resident: ResidentModel, engine: Engine
) -> None:
    first = conversation(resident, 5)
    await greedy(engine, first)
    (sequence,) = [s for s in engine.cache.sequences if s.kv_tokens]
    sequence.checkpoints = [Checkpoint(c.n_tokens, b"not a state") for c in sequence.checkpoints]
    returning = first[:-2] + text_tokens(resident, " after a broken checkpoint")
    text, generation = await greedy(engine, returning)
    stats = engine.stats().checkpoints
    assert stats is not None and stats.restored == 1  # (one was tried, and failed)
    assert generation.cached_tokens == 0
    assert text == await cold(resident, returning)


async def test_checkpoints_stay_within_the_ram_budget(resident: ResidentModel) -> None:
    size = resident.backend.checkpoint_bytes
    forget_everything(resident.backend)
    engine = Engine(resident.backend, parallel=2, max_context=1024, prefill_chunk=CHUNK,
                    max_queue=8, cache_ram_bytes=3 * size)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        for turns in (4, 5, 6):  # three conversations, two checkpoints planned each
            await greedy(engine, conversation(resident, turns)[::-1][:turns * 20])
            stats = engine.stats().checkpoints
            assert stats is not None and stats.bytes <= 3 * size
        assert stats.taken >= 4  # older conversations' checkpoints gave way
        nursery.cancel_scope.cancel()
    forget_everything(resident.backend)
    small = Engine(resident.backend, parallel=2, max_context=1024, prefill_chunk=CHUNK,
                   max_queue=8, cache_ram_bytes=size - 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(small.step_loop)
        first = conversation(resident, 5)
        await greedy(small, first)
        _, returning = await greedy(small, first[:-2] + text_tokens(resident, " again"))
        stats = small.stats().checkpoints
        assert stats is not None and stats.taken == 0 and stats.skipped >= 2
        assert returning.cached_tokens == 0  # (no room for one: rebuilt, never over budget)
        nursery.cancel_scope.cancel()
    forget_everything(resident.backend)


async def test_a_request_cancelled_during_its_restore_releases_everything(
    resident: ResidentModel, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = conversation(resident, 5)
    await greedy(engine, first)
    returning = first[:-2] + text_tokens(resident, " that the client gives up on")
    backend = resident.backend
    submit = backend.submit_step
    restores: list[KvOp] = []

    with trio.CancelScope() as scope:
        def cancel_at_the_restore(ops: list[KvOp], works: list[SeqWork]):  # type: ignore[no-untyped-def]
            if any(isinstance(op, RestoreCheckpoint) for op in ops):
                restores.extend(ops)
                scope.cancel()  # (the client leaves while the restore is in flight)
            return submit(ops, works)

        monkeypatch.setattr(backend, "submit_step", cancel_at_the_restore)
        await greedy(engine, returning)
    monkeypatch.setattr(backend, "submit_step", submit)
    assert restores, "the returning turn restored a checkpoint"
    text, again = await greedy(engine, returning)  # the next request runs normally
    stats = engine.stats()
    assert stats.active == 0 and stats.reserved_cells == 0
    assert not any(s.restoring for s in engine.cache.sequences)
    assert again.cached_tokens >= len(first) - checkpoints.TAIL
    assert text == await cold(resident, returning)
