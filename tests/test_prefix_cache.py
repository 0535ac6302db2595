"""The prefix cache on the real engine and the tiny generated models: cached prompts kept
apart from the generating sessions, evicted least recently used, saved to and restored
from the host-RAM tier."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

import pytest
import trio

from butter.backends.base import Backend, KvOp, RemoveTokens, RestoreSequence, SeqWork, StepResult
from butter.backends.llama_cpp import LlamaCppBackend
from butter.engine.engine import Engine
from butter.engine.generation import Generation, RequestState
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.settings import ServeSettings

HEADER = "<|im_start|>user\n"
GREEDY = SamplingParams(temperature=0)


def conversation(topic: str) -> str:
    return HEADER + f"Tell me everything about {topic}. " * 12 + "<|im_end|>\n"


async def run(engine: Engine, prompt: list[int], max_tokens: int = 8) -> tuple[bytes, Generation]:
    async with engine.generate(prompt, GREEDY, max_tokens) as generation:
        pieces = [b"".join(batch) async for batch in generation.pieces()]
    return b"".join(pieces), generation


def cached_prompts(engine: Engine) -> list[list[int]]:
    return [list(s.kv_tokens) for s in engine.cache.sequences
            if s.kv_tokens and s.generation is None]


@pytest.fixture(scope="module", params=["gguf", "mlx"])
def resident(request: pytest.FixtureRequest) -> Iterator[ResidentModel]:
    # The defaults: one generating session, and sequence ids for cached prompts beside it.
    path: Path = request.getfixturevalue(f"tiny_{request.param}")
    model = ResidentModel.load_sync(ServeSettings(model=str(path), parallel=1,
                                                  max_context=1024, prefill_chunk=64,
                                                  threads=2))
    yield model
    model.close()


async def test_a_side_request_does_not_cost_a_conversation_its_cache(
    resident: ResidentModel
) -> None:
    assert resident.backend.n_seq == 1 and resident.backend.n_cache_seqs > 0
    engine = resident.engine
    tokenize = resident.tokenize_prompt
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        first = tokenize(conversation("butter"))
        await run(engine, first)
        (held,) = cached_prompts(engine)
        # A chat UI asks for a title: it shares only the template's header.
        title = tokenize(HEADER + "Write a title for this chat")
        _, side = await run(engine, title)
        assert 0 < side.cached_tokens < 8
        second = held + tokenize("<|im_end|>\n" + HEADER + "And its history?")
        _, returning = await run(engine, second)
        assert returning.cached_tokens == len(held)
        stats = engine.stats()
        assert stats.prefix_hits == 1 and stats.prefix_misses == 2
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- eviction and the host tier


@pytest.fixture(scope="module")
def backend(tiny_gguf: Path) -> Iterator[LlamaCppBackend]:
    # One generating session and two more sequence ids: a fourth prompt needs a place.
    model = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=1, cache_seqs=2, n_batch=128,
                            threads=2)
    yield model
    model.close()


class GatedBackend:
    """The real backend, whose steps that restore a prefix wait until the test opens the
    gate (so a request can be cancelled while its restore is in flight)."""

    def __init__(self, backend: Backend, token: trio.lowlevel.TrioToken) -> None:
        self._backend = backend
        self._token = token
        self._thread = ThreadPoolExecutor(max_workers=1)
        self.gate = threading.Event()
        self.restore_submitted = trio.Event()

    def submit_step(self, ops: list[KvOp], works: list[SeqWork]) -> Future[list[StepResult]]:
        if not any(isinstance(op, RestoreSequence) for op in ops):
            return self._backend.submit_step(ops, works)
        self._token.run_sync_soon(self.restore_submitted.set)

        def gated() -> list[StepResult]:
            self.gate.wait(timeout=30)
            return self._backend.step(ops, works)

        return self._thread.submit(gated)

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)


@pytest.fixture
async def engine(backend: LlamaCppBackend) -> AsyncIterator[Engine]:
    gated = GatedBackend(backend, trio.lowlevel.current_trio_token())
    fresh = Engine(cast(Backend, gated), parallel=1, max_context=1024, prefill_chunk=64,
                   max_queue=8, cache_ram_bytes=64 * 2**20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fresh.step_loop)
        yield fresh
        nursery.cancel_scope.cancel()
    gated.gate.set()
    gated._thread.shutdown()
    backend.step([RemoveTokens(seq, -1, -1) for seq in range(3)], [])


def tokenize(backend: LlamaCppBackend, text: str) -> list[int]:
    return backend.tokenize(text, add_bos=False)


async def test_cached_prompts_give_way_least_recently_used_first(
    backend: LlamaCppBackend, engine: Engine
) -> None:
    engine.cache.host.budget_bytes = 0  # eviction alone here: nothing saved
    a, b, c = (tokenize(backend, conversation(t)) for t in ("apples", "boats", "clouds"))
    for prompt in (a, b, c):
        await run(engine, prompt)
    more = a + tokenize(backend, " More?")
    await run(engine, more)  # a's cache, extended: the most recent now
    assert len(cached_prompts(engine)) == 3
    # A fourth prompt needs a sequence: b, the least recently used, gives its place.
    await run(engine, tokenize(backend, conversation("drums")))
    held = cached_prompts(engine)
    assert len(held) == 3 and all(p[:len(b)] != b for p in held)
    assert any(p[:len(c)] == c for p in held)
    _, returning = await run(engine, more)
    assert returning.cached_tokens == len(more) - 1


async def test_a_reservation_evicts_cached_prompts_and_never_a_live_one(
    backend: LlamaCppBackend, engine: Engine
) -> None:
    engine.cache.host.budget_bytes = 0
    cached = tokenize(backend, conversation("apples"))
    live = tokenize(backend, conversation("boats"))
    big = tokenize(backend, HEADER + "A different request. ")

    async def live_beside_the_cached_prompt(reserve_the_rest: bool) -> bytes:
        # The same cache layout each time (the cached prompt, then the live one sharing
        # its header): attention's rounding depends on where a sequence's cells lie.
        engine.drop_idle_caches()
        await run(engine, cached)
        (held,) = cached_prompts(engine)
        assert engine.stats().idle_cached_cells == len(held)
        async with engine.generate(live, GREEDY, 48) as streaming:
            pieces = streaming.pieces()
            out = [b"".join(await anext(pieces))]  # it decodes now
            async with trio.open_nursery() as nursery:
                if reserve_the_rest:  # a reservation that needs every cell but the live one's
                    room = backend.n_cells - streaming.ticket.cells
                    nursery.start_soon(run, engine, big, room - len(big))
                out += [b"".join(batch) async for batch in pieces]
        return b"".join(out)

    alone = await live_beside_the_cached_prompt(reserve_the_rest=False)
    beside = await live_beside_the_cached_prompt(reserve_the_rest=True)
    assert beside == alone  # the live request's cells were never touched
    assert all(p[:len(cached)] != cached for p in cached_prompts(engine))


async def evict_to_host(engine: Engine, backend: LlamaCppBackend, prompt: list[int]) -> None:
    """Three more conversations take every sequence, so `prompt`'s cache goes to host RAM."""
    for topic in ("boats", "clouds", "drums"):
        await run(engine, tokenize(backend, conversation(topic)))
    assert all(p[:len(prompt)] != prompt for p in cached_prompts(engine))
    assert engine.stats().host is not None


async def test_a_restored_prefix_decodes_what_a_cold_prefill_does(
    backend: LlamaCppBackend, engine: Engine
) -> None:
    prompt = tokenize(backend, conversation("apples"))
    cold_text, cold = await run(engine, prompt, max_tokens=16)
    await evict_to_host(engine, backend, prompt)
    host = engine.stats().host
    assert host is not None and host.saved >= 1 and host.entries >= 1
    warm_text, warm = await run(engine, prompt, max_tokens=16)
    assert cold.cached_tokens == 0 and warm.cached_tokens == len(prompt) - 1
    assert warm_text == cold_text
    host = engine.stats().host
    assert host is not None and host.restored == 1 and host.restored_tokens == len(prompt) - 1


async def test_a_request_cancelled_mid_restore_releases_everything(
    backend: LlamaCppBackend, engine: Engine
) -> None:
    gated = cast(GatedBackend, engine.backend)
    prompt = tokenize(backend, conversation("apples"))
    cold_text, _ = await run(engine, prompt, max_tokens=16)
    await evict_to_host(engine, backend, prompt)
    with trio.CancelScope() as scope:
        async with engine.generate(prompt, GREEDY, 16) as generation:
            await gated.restore_submitted.wait()
            assert generation.state is RequestState.RESTORING
            scope.cancel()
            gated.gate.set()  # the step in flight finishes; the request is gone
            await trio.sleep_forever()
    assert scope.cancelled_caught
    await run(engine, tokenize(backend, HEADER + "anything"), max_tokens=2)
    stats = engine.stats()
    assert stats.active == 0 and stats.reserved_cells == 0
    # The restored prefix stayed as a cached prompt, whole and exact.
    warm_text, warm = await run(engine, prompt, max_tokens=16)
    assert warm.cached_tokens == len(prompt) - 1 and warm_text == cold_text


async def test_a_prompt_left_idle_through_many_decode_rows_moves_to_host_ram(
    backend: LlamaCppBackend, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each decode row walks the cached prompts' cells too: one idle long enough goes to RAM.
    monkeypatch.setattr("butter.engine.prefix_cache.IDLE_DECODE_ROWS", 24)
    prompt = tokenize(backend, conversation("apples"))
    cold_text, _ = await run(engine, prompt, max_tokens=16)
    other = tokenize(backend, conversation("boats"))
    decoded = 0
    while decoded < 24:  # (a random model may end its answers early)
        _, generation = await run(engine, other + tokenize(backend, f" {decoded}"), 16)
        decoded += generation.completion_tokens
    assert all(p[:len(prompt)] != prompt for p in cached_prompts(engine))
    warm_text, warm = await run(engine, prompt, max_tokens=16)
    assert warm.cached_tokens == len(prompt) - 1 and warm_text == cold_text
    host = engine.stats().host
    assert host is not None and host.restored == 1


async def test_forks_of_a_conversation_keep_their_shared_stem_once(
    backend: LlamaCppBackend, engine: Engine
) -> None:
    stem = tokenize(backend, conversation("apples"))
    one = stem + tokenize(backend, " First branch: tell me about the orchards. " * 4)
    two = stem + tokenize(backend, " Second branch: tell me about the markets. " * 4)
    await run(engine, one)
    _, forked = await run(engine, two)
    shared = forked.cached_tokens
    assert shared >= len(stem)
    held = cached_prompts(engine)
    assert len(held) == 2 and {tuple(p[:len(one)]) for p in held} >= {tuple(one)}
    # Both branches stay cached; the stem's cells are held once, by both.
    assert engine.stats().used_cells == sum(map(len, held)) - shared
