"""The real engine on the tiny generated GGUF and MLX models: batching, cancellation, prefix
reuse."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

import pytest
import trio
import trio.lowlevel
import trio.testing

from butter.backends.base import Backend, KvOp, RemoveTokens, SeqWork, StepResult
from butter.backends.llama_cpp import LlamaCppBackend
from butter.engine.engine import Engine, _wait_for
from butter.engine.generation import Generation
from butter.errors import InvalidRequest
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.settings import ServeSettings

PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a café",
    "Numbers: 1, 2, 3, 4",
    "日本語 and emoji 🙂 together",
]


@pytest.fixture(scope="module", params=["gguf", "mlx"])
def resident(request: pytest.FixtureRequest) -> Iterator[ResidentModel]:
    # The same engine behaviour over both backends (the MLX one batches its decodes too).
    path: Path = request.getfixturevalue(f"tiny_{request.param}")
    settings = ServeSettings(model=str(path), parallel=4, max_context=1024,
                             prefill_chunk=64, threads=2)
    model = ResidentModel.load_sync(settings)
    yield model
    model.close()


@pytest.fixture
async def engine(resident: ResidentModel) -> AsyncIterator[Engine]:
    # A fresh engine (empty sessions) over the module's loaded model, per test.
    backend = resident.backend
    backend.step([], [])
    fresh = Engine(backend, parallel=4, max_context=1024, prefill_chunk=64, max_queue=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fresh.step_loop)
        yield fresh
        nursery.cancel_scope.cancel()
    # Forget everything this engine cached, so the next test starts cold.
    every_seq = range(backend.n_seq + backend.n_cache_seqs)
    backend.step([RemoveTokens(seq, -1, -1) for seq in every_seq], [])


def tokens(resident: ResidentModel, text: str) -> list[int]:
    return resident.backend.tokenize(text, add_bos=False)


async def wait_until_idle(engine: Engine) -> None:
    """Until the step loop is parked on its wakeup: no step in flight on the backend's thread
    and no task runnable. Nothing runs from there until something wakes the engine."""
    with trio.fail_after(30):
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if engine.step_started is None:
                return
            await trio.sleep(0.01)  # a step is running on the backend's thread: poll again


async def run(
    engine: Engine, prompt: list[int], seed: int, max_tokens: int = 24,
    temperature: float = 0.8,
) -> tuple[bytes, Generation]:
    params = SamplingParams(seed=seed, temperature=temperature)
    async with engine.generate(prompt, params, max_tokens) as generation:
        pieces = [b"".join(batch) async for batch in generation.pieces()]
    return b"".join(pieces), generation


async def test_concurrent_equals_sequential(resident: ResidentModel, engine: Engine) -> None:
    prompts = [tokens(resident, p) for p in PROMPTS]
    sequential = [(await run(engine, p, seed=i))[0] for i, p in enumerate(prompts)]
    # Both phases start cold: batching is what is compared, not cache placement.
    engine.drop_idle_caches()
    results: dict[int, bytes] = {}

    async def lane(i: int) -> None:
        results[i], generation = await run(engine, prompts[i], seed=i)
        assert generation.completion_tokens == 24

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(lane, i)
    assert [results[i] for i in range(4)] == sequential
    assert len(set(sequential)) == 4


async def test_cancelled_sibling_does_not_disturb_others(
    resident: ResidentModel, engine: Engine
) -> None:
    prompts = [tokens(resident, p + " again") for p in PROMPTS]
    alone = [(await run(engine, p, seed=10 + i, max_tokens=32))[0] for i, p in
             enumerate(prompts)]
    engine.drop_idle_caches()
    results: dict[int, bytes] = {}

    async def lane(i: int) -> None:
        results[i], _ = await run(engine, prompts[i], seed=10 + i, max_tokens=32)

    async def doomed() -> None:
        params = SamplingParams(seed=99)
        with trio.CancelScope() as scope:
            async with engine.generate(prompts[0][:3], params, 500) as generation:
                async for _ in generation.pieces():
                    if generation.completion_tokens >= 5:
                        scope.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(lane, i)
        nursery.start_soon(doomed)
    assert [results[i] for i in range(3)] == alone[:3]
    stats = engine.stats()
    assert stats.active == 0 and stats.reserved_cells == 0


async def test_cached_tokens_is_the_true_common_prefix(
    resident: ResidentModel, engine: Engine
) -> None:
    first = tokens(resident, "A long shared beginning about foxes and dogs, then: apples")
    second = tokens(resident, "A long shared beginning about foxes and dogs, then: pears")
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    _, cold = await run(engine, first, seed=1)
    assert cold.cached_tokens == 0
    _, warm = await run(engine, second, seed=1)
    assert warm.cached_tokens == common


async def test_resent_tool_round_reuses_the_whole_conversation(
    resident: ResidentModel, engine: Engine
) -> None:
    turn1 = tokens(resident, "<|im_start|>user\nCall the tool<|im_end|>\n<|im_start|>assistant\n")
    _, first = await run(engine, turn1, seed=3, max_tokens=12)
    # The client resends everything: its turn, the answer it got, then a tool result.
    session_tokens = max(engine.stats().session_cells)
    assert session_tokens == len(turn1) + 12 - 1  # the last sampled token was never evaluated
    answer = engine.cache.sequences[0].kv_tokens[len(turn1):] or next(
        s.kv_tokens for s in engine.cache.sequences if s.kv_tokens)[len(turn1):]
    turn2 = turn1 + answer + tokens(resident, "<tool_response>42</tool_response>")
    _, second = await run(engine, turn2, seed=3, max_tokens=4)
    assert second.cached_tokens == len(turn1) + len(answer)
    assert first.cached_tokens == 0


async def test_forked_conversation_rebuilds_from_the_fork(
    resident: ResidentModel, engine: Engine
) -> None:
    base = tokens(resident, "Shared history: the cat sat on the mat. ")
    await run(engine, base + tokens(resident, "Branch one"), seed=1, max_tokens=4)
    branch_two = base + tokens(resident, "Branch two, different")
    _, fork = await run(engine, branch_two, seed=1, max_tokens=4)
    expected = next(i for i, (a, b) in enumerate(zip(
        base + tokens(resident, "Branch one"), branch_two, strict=False)) if a != b)
    assert fork.cached_tokens == expected
    cold_text, _ = await run(engine, branch_two, seed=5, max_tokens=16, temperature=0)
    warm_text, warm = await run(engine, branch_two, seed=5, max_tokens=16, temperature=0)
    assert warm.cached_tokens == len(branch_two) - 1
    assert warm_text == cold_text


async def test_prefix_in_a_busy_session_is_shared_into_a_new_one(
    resident: ResidentModel, engine: Engine
) -> None:
    stem = tokens(resident, "System: you are a helpful assistant who loves trains. " * 3)
    question = stem + tokens(resident, "User: what is a locomotive?")
    cold_text, cold = await run(engine, question, seed=7, max_tokens=16)
    assert cold.cached_tokens == 0
    # Start over: only a busy session holds the stem when the question arrives.
    engine.drop_idle_caches()

    other = stem + tokens(resident, "User: hi")
    common = next(i for i, (a, b) in enumerate(zip(other, question, strict=False)) if a != b)
    assert common >= len(stem)
    async with engine.generate(other, SamplingParams(seed=1), 400) as busy:
        async for _ in busy.pieces():
            if busy.completion_tokens >= 2:
                break
        shared_text, shared = await run(engine, question, seed=7, max_tokens=16)
    assert shared.cached_tokens == common
    assert shared_text == cold_text


async def test_cancelled_prefill_leaves_its_remaining_chunks_unrun(
    resident: ResidentModel, engine: Engine
) -> None:
    long_prompt = tokens(resident, "a very long prompt that keeps going " * 60)
    chunks = -(-len(long_prompt) // 64)
    assert chunks >= 10
    with trio.CancelScope() as scope:
        async with engine.generate(long_prompt, SamplingParams(seed=1), 8):
            while max(engine.stats().session_cells) == 0:  # its first chunk is in
                await trio.lowlevel.checkpoint()
            scope.cancel()  # the client leaves mid-prefill
            await trio.sleep_forever()
    # Closed now (the cancellation lands at the next checkpoint, so the engine may have
    # planned one more chunk meanwhile); the step in flight may still finish.
    evaluated_when_closed = max(engine.stats().session_cells)
    await wait_until_idle(engine)  # whatever still ran for it has run; nothing more will
    stats = engine.stats()
    assert stats.active == 0 and stats.reserved_cells == 0
    cached = max(stats.session_cells)
    # The chunk in flight when it closed may finish; the rest never runs.
    assert cached % 64 == 0
    assert evaluated_when_closed <= cached <= evaluated_when_closed + 64
    assert cached < len(long_prompt)


async def test_penalties_keep_greedy_from_repeating(
    resident: ResidentModel, engine: Engine
) -> None:
    prompt = tokens(resident, "Repeat after me: la la la la")

    async def greedy_pieces(**penalties: float) -> list[bytes]:
        params = SamplingParams(temperature=0, **penalties)
        async with engine.generate(prompt, params, 60) as generation:
            return [piece async for batch in generation.pieces() for piece in batch]

    plain = await greedy_pieces()
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself when left alone
    # llama.cpp's semantics: presence subtracts once, frequency per occurrence, both over
    # the generated tokens; this much makes any repeat lose to a fresh token.
    penalized = await greedy_pieces(presence_penalty=50.0, frequency_penalty=50.0)
    assert len(penalized) >= 20  # (a penalized stream may end early: EOS gets its turn)
    assert len(set(penalized)) == len(penalized)


async def test_caches_that_cannot_be_cut_are_only_extended(
    resident: ResidentModel, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's choices for a cache that cannot be cut (rewind_limit 1), on both backends
    # (a real recurrent model: test_a_recurrent_model_...).
    monkeypatch.setattr(resident.backend, "rewind_limit", 1)
    first = tokens(resident, "A conversation about boats, first turn")
    _, cold = await run(engine, first, seed=1, max_tokens=6)
    (held,) = [list(s.kv_tokens) for s in engine.cache.sequences if s.kv_tokens]
    _, extended = await run(engine, [*held, *tokens(resident, " and more")], seed=1,
                            max_tokens=2)
    assert cold.cached_tokens == 0 and extended.cached_tokens == len(held)
    _, forked = await run(engine, first[:-2] + tokens(resident, " else"), seed=1, max_tokens=2)
    assert forked.cached_tokens == 0  # cutting back is impossible: rebuilt
    _, again = await run(engine, first[:-2] + tokens(resident, " else"), seed=1, max_tokens=2)
    assert again.cached_tokens == 0  # the same prompt would need one token cut: rebuilt


async def test_a_recurrent_model_reuses_its_state_only_by_extending_it(
    tiny_mamba_gguf: Path,
) -> None:
    """A real recurrent model (Mamba): a cached conversation is extended and decodes what a
    cold run decodes; a prompt that would need its state cut back is rebuilt."""
    resident = ResidentModel.load_sync(ServeSettings(
        model=str(tiny_mamba_gguf), parallel=2, max_context=1024, prefill_chunk=64, threads=2))
    try:
        backend = resident.backend
        assert backend.info.is_recurrent and backend.rewind_limit == 1

        async def greedy(prompt: list[int], max_tokens: int) -> tuple[bytes, Generation]:
            # (an engine starts on an empty cache: the last one's sequences go first)
            backend.step([RemoveTokens(seq, -1, -1)
                          for seq in range(backend.n_seq + backend.n_cache_seqs)], [])
            engine = Engine(backend, parallel=2, max_context=1024, prefill_chunk=64,
                            max_queue=4)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.step_loop)
                try:
                    text, generation = await run(engine, prompt, seed=1, max_tokens=max_tokens,
                                                 temperature=0)
                    if not reuse:
                        return text, generation
                    (held,) = [list(s.kv_tokens) for s in engine.cache.sequences if s.kv_tokens]
                    longer = [*held, *tokens(resident, " and then the sea")]
                    extended = await run(engine, longer, seed=1, max_tokens=6, temperature=0)
                    cut = await run(engine, prompt[:-2], seed=1, max_tokens=6, temperature=0)
                    outcomes.extend([(held, longer, *extended), (prompt[:-2], prompt[:-2], *cut)])
                    return text, generation
                finally:
                    nursery.cancel_scope.cancel()

        outcomes: list[tuple[list[int], list[int], bytes, Generation]] = []
        first = tokens(resident, "A conversation about boats, first turn")
        reuse = True
        _, cold = await greedy(first, 6)
        (held, longer, extended_text, extended), (_, shorter, cut_text, cut) = outcomes
        assert cold.cached_tokens == 0 and extended.cached_tokens == len(held)
        assert cut.cached_tokens == 0  # cutting recurrent state back is impossible: rebuilt
        reuse = False  # the same prompts on a fresh engine (nothing cached)
        assert (await greedy(longer, 6))[0] == extended_text
        assert (await greedy(shorter, 6))[0] == cut_text
    finally:
        resident.close()


async def test_a_step_in_flight_finishes_before_a_cancellation_lands() -> None:
    """The engine's wait for a step: cancelling it must not abandon the step halfway."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        # (the sleep is the workload, not synchronisation)
        future = thread.submit(lambda: (time.sleep(0.3), "done")[1])  # a step taking 0.3 s
        results: list[str] = []
        with trio.move_on_after(0.05) as scope:  # cancelled long before it ends
            results.append(await _wait_for(future))
            await trio.lowlevel.checkpoint()  # the cancellation lands at the next checkpoint
        assert results == ["done"] and scope.cancelled_caught


async def test_waiting_for_a_step_returns_its_result_or_its_error() -> None:
    with ThreadPoolExecutor(max_workers=1) as thread:
        done = thread.submit(lambda: "early")
        done.result()  # already finished before anyone waits
        assert await _wait_for(done) == "early"

        def fail() -> str:
            raise ValueError("the step failed")

        with pytest.raises(ValueError, match="the step failed"):
            await _wait_for(thread.submit(fail))


def test_step_times_fall_in_the_first_bucket_that_holds_them(resident: ResidentModel) -> None:
    engine = Engine(resident.backend, parallel=1, max_context=64, prefill_chunk=8, max_queue=1)
    for seconds in (0.005, 0.006, 0.3, 3.0):  # a bound itself counts in its own bucket
        engine._step_times.observe(seconds)
    buckets, total = engine.step_histogram()
    cumulative = dict(buckets)
    assert (cumulative["0.005"], cumulative["0.01"], cumulative["0.25"]) == (1, 2, 2)
    assert (cumulative["0.5"], cumulative["2.5"], cumulative["+Inf"]) == (3, 3, 4)
    assert total == pytest.approx(3.311)


class RecordingBackend:
    """The real backend, with the work of each step the engine submits written down."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.steps: list[list[SeqWork]] = []

    def submit_step(self, ops: list[KvOp], works: list[SeqWork]) -> Future[list[StepResult]]:
        self.steps.append(list(works))
        return self._backend.submit_step(ops, works)

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)


async def drain(pieces: AsyncIterator[list[bytes]]) -> None:
    async for _ in pieces:
        pass


@pytest.fixture(scope="module", params=["gguf", "mlx"])
def resident_256(request: pytest.FixtureRequest) -> Iterator[ResidentModel]:
    """The tiny models again, loaded for 256-token prompt chunks."""
    path: Path = request.getfixturevalue(f"tiny_{request.param}")
    model = ResidentModel.load_sync(ServeSettings(model=str(path), parallel=2, max_context=1024,
                                                  prefill_chunk=256, threads=2))
    yield model
    model.close()


@pytest.mark.parametrize("decode_stall", [0.0, 1e-9])
async def test_a_long_prompt_beside_a_stream_shrinks_its_chunks_to_the_stall(
    resident_256: ResidentModel, decode_stall: float
) -> None:
    # A stall of 1 ns: every step that carries a chunk beside a decode is over it.
    resident = resident_256
    recorder = RecordingBackend(resident.backend)
    engine = Engine(cast(Backend, recorder), parallel=2, max_context=1024, prefill_chunk=256,
                    max_queue=8, decode_stall=decode_stall)
    long_prompt = tokens(resident, "a very long prompt that keeps going " * 30)
    decoded_beside: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        async with engine.generate(tokens(resident, PROMPTS[0]), SamplingParams(seed=3),
                                   200) as streaming:
            pieces = streaming.pieces()
            await anext(pieces)  # it decodes now
            async with trio.open_nursery() as reading:
                reading.start_soon(drain, pieces)
                await run(engine, long_prompt, seed=4, max_tokens=1)
                decoded_beside.append(streaming.completion_tokens)
                reading.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    resident.backend.step([RemoveTokens(seq, -1, -1) for seq in range(2)], [])

    assert decoded_beside[0] < 200  # it streamed through the whole prefill
    beside_decodes = [sum(len(w.tokens) for w in step if w.prompt) for step in recorder.steps
                      if any(w.prompt for w in step) and any(not w.prompt for w in step)]
    assert sum(beside_decodes) == len(long_prompt)
    if decode_stall:
        assert beside_decodes[:3] == [256, 128, 64]
        assert max(beside_decodes[3:]) == 64
        assert engine.stats().decoding_prefill_budget == 64
    else:
        assert beside_decodes[:-1] == [256] * (len(beside_decodes) - 1)
        assert engine.stats().decoding_prefill_budget == 256


def test_decode_stall_flag_reaches_the_engine(tiny_gguf: Path) -> None:
    from butter.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["serve", "--model", str(tiny_gguf), "--decode-stall",
                                      "0.75", "--prefill-chunk", "128", "--parallel", "2"])
    resident = ResidentModel.load_sync(settings_from_args(args))
    try:
        budget = resident.engine.prefill_budget
        assert (budget.stall, budget.full) == (0.75, 128)
        assert resident.engine.stats().decoding_prefill_budget == 128
    finally:
        resident.close()
    off = build_parser().parse_args(["serve", "--model", str(tiny_gguf)])
    assert settings_from_args(off).decode_stall == 0.0  # off unless asked


async def test_prompts_prefilled_together_are_cut_to_the_backends_tiles(
    resident_256: ResidentModel
) -> None:
    resident = resident_256
    recorder = RecordingBackend(resident.backend)
    engine = Engine(cast(Backend, recorder), parallel=2, max_context=1024, prefill_chunk=256,
                    max_queue=8)
    first = tokens(resident, "one prompt that goes on and on " * 40)[:300]
    second = tokens(resident, "another prompt, longer than the first " * 60)[:600]
    assert (len(first), len(second)) == (300, 600)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        async with trio.open_nursery() as requests:
            requests.start_soon(run, engine, first, 5, 1)
            requests.start_soon(run, engine, second, 6, 1)
        nursery.cancel_scope.cancel()
    resident.backend.step([RemoveTokens(seq, -1, -1) for seq in range(2)], [])

    shared = [[w for w in step if w.prompt] for step in recorder.steps
              if sum(1 for w in step if w.prompt) == 2]
    assert shared  # the two prompts met in a step at least once
    ends = {len(first), len(second)}
    going_on = [len(w.tokens) for step in shared for w in step if w.start + len(w.tokens)
                not in ends]
    if resident.backend.prompt_tile == 1:  # mlx evaluates each prompt alone
        assert not isinstance(resident.backend, LlamaCppBackend)
    else:  # llama.cpp on the CPU: whole 64-row flash-attention tiles
        assert resident.backend.prompt_tile == 64
        assert going_on and all(size % 64 == 0 for size in going_on)


async def test_a_prompt_of_no_tokens_is_refused_and_holds_nothing(engine: Engine) -> None:
    # Nothing to evaluate means no logits to sample from: admitted, it would wait forever.
    with pytest.raises(InvalidRequest, match="no tokens"):
        async with engine.generate([], SamplingParams(temperature=0.0), 4):
            pass
    stats = engine.stats()
    assert stats.active == 0 and stats.queued == 0 and stats.reserved_cells == 0
