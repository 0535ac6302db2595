"""What only the MLX backend does: decodes batched through mlx-lm's batched caches, and
affine-quantized KV caches (tiny MLX model)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from butter.backends.mlx import MlxBackend
from butter.chat.grammar import tool_call_grammar
from butter.model import Model
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from butter.testing.tiny_mlx import write_tiny_gemma3_mlx, write_tiny_qwen35_mlx

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1, 2, 3", "Boats and the sea"]


async def _load(path: Path, **settings: object) -> tuple[Model, MlxBackend]:
    model = await Model.from_settings(ServeSettings(model=str(path), parallel=4,
                                                    max_context=1024, **settings))
    backend = model.resident.backend
    assert isinstance(backend, MlxBackend)
    return model, backend


async def _greedy(model: Model, text: str | list[int], max_tokens: int) -> tuple[bytes, int]:
    tokens = model.resident.backend.tokenize(text, add_bos=False) if isinstance(
        text, str) else text
    engine = model.resident.engine
    async with engine.generate(tokens, SamplingParams(temperature=0), max_tokens) as gen:
        pieces = [p async for batch in gen.pieces() for p in batch]
    return b"".join(pieces), gen.cached_tokens


async def _solo_then_together(model: Model, run: Callable[[int], Awaitable[bytes]],
                              lanes: int) -> tuple[list[bytes], list[bytes]]:
    """Each lane's output run alone (cold caches), then all lanes at once (cold again)."""
    alone = [await run(i) for i in range(lanes)]
    model.resident.engine.drop_idle_caches()
    together: dict[int, bytes] = {}

    async def lane(i: int) -> None:
        together[i] = await run(i)

    async with trio.open_nursery() as nursery:
        for i in range(lanes):
            nursery.start_soon(lane, i)
    return alone, [together[i] for i in range(lanes)]


@pytest.mark.parametrize("kv_cache", ["raw", "affine8", "affine4"])
async def test_concurrent_decodes_share_one_forward_pass(tiny_mlx: Path, kv_cache: str) -> None:
    model, backend = await _load(tiny_mlx, kv_cache=kv_cache)
    widest: list[int] = []
    try:
        engine = model.resident.engine

        async def run(i: int) -> bytes:
            tokens = backend.tokenize(PROMPTS[i], add_bos=False)
            async with engine.generate(tokens, SamplingParams(seed=i), 24) as gen:
                pieces = []
                async for batch in gen.pieces():
                    pieces += batch
                    widest.append(len(backend.decode_batch))
            return b"".join(pieces)

        alone, together = await _solo_then_together(model, run, 4)
        # All four decoded in one pass at some step (solo runs alone never reach 4)...
        assert max(widest) == 4
        assert together == alone  # ...giving the tokens of solo runs
        assert all(backend.cached_bytes(seq) > 0 for seq in range(4))  # caches kept for reuse
    finally:
        await model.aclose()


async def test_affine_kv_caches_quantize_and_still_reuse_prefixes(tiny_mlx: Path) -> None:
    prompt = "A shared beginning about foxes and dogs, then apples"
    stored: dict[str, int] = {}
    for kv_cache in ("raw", "affine8", "affine4"):
        model, backend = await _load(tiny_mlx, kv_cache=kv_cache)
        try:
            cold, _ = await _greedy(model, prompt, 12)
            stored[kv_cache] = max(backend.cached_bytes(seq) for seq in range(4))
            model.resident.engine.drop_idle_caches()
            await _greedy(model, prompt + " and pears", 4)  # the prompt again, then more
            warm, cached = await _greedy(model, prompt, 12)
            assert cached > 0 and warm == cold  # trimmed, not rebuilt; same greedy tokens
            if kv_cache != "raw":
                assert backend.kv_type.name == f"mlx affine {kv_cache[-1]}-bit / 32"
        finally:
            await model.aclose()
    assert stored["raw"] > stored["affine8"] > stored["affine4"] > 0


# ------------------------------------------------------------------ sliding-window caches

WINDOW = 16


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_mlx(tmp_path_factory.mktemp("gemma") / "g", sliding_window=WINDOW)


async def _cold(model: Model, text: str | list[int], max_tokens: int) -> bytes:
    model.resident.engine.drop_idle_caches()
    text_out, cached = await _greedy(model, text, max_tokens)
    assert cached == 0
    return text_out


async def test_sliding_window_caches_are_cut_only_before_they_wrap(tiny_gemma: Path) -> None:
    model, backend = await _load(tiny_gemma)
    try:
        assert backend.rewind_limit == WINDOW
        tokens = model.resident.backend.tokenize
        # Short: the cache has not wrapped, so a fork keeps the common prefix.
        await _cold(model, "ab cd ef", 2)
        fork = "ab cd gh"
        expected = await _cold(model, fork, 4)
        await _greedy(model, "ab cd ef", 2)
        text, cached = await _greedy(model, fork, 4)
        pairs = zip(tokens("ab cd ef", add_bos=False), tokens(fork, add_bos=False), strict=False)
        common = next(i for i, (a, b) in enumerate(pairs) if a != b)
        assert cached == common > 0 and text == expected
        # Long: the rotating caches wrapped; a fork rebuilds instead of failing.
        long = "The quick brown fox jumps over the lazy dog. " * 2
        await _cold(model, long + "Apples", 4)
        expected = await _cold(model, long + "Pears", 4)
        await _greedy(model, long + "Apples", 4)
        text, cached = await _greedy(model, long + "Pears", 4)
        assert (text, cached) == (expected, 0)
        # ...but a prompt that extends the wrapped cache still reuses all of it.
        await _cold(model, long, 6)
        (held,) = [list(s.kv_tokens) for s in model.resident.engine.cache.sequences if s.kv_tokens]
        follow_up = [*held, *tokens(" and then", add_bos=False)]
        expected = await _cold(model, follow_up, 4)
        await _greedy(model, long, 6)
        text, cached = await _greedy(model, follow_up, 4)
        assert cached == len(held) > WINDOW and text == expected
    finally:
        await model.aclose()


async def test_batched_rotating_caches_equal_sequential_runs(tiny_gemma: Path) -> None:
    model, backend = await _load(tiny_gemma)
    prompts = [p + " and more words to pass the window" for p in PROMPTS]
    try:
        engine = model.resident.engine

        async def run(i: int) -> bytes:
            tokens = backend.tokenize(prompts[i], add_bos=False)
            async with engine.generate(tokens, SamplingParams(seed=i), 24) as gen:
                return b"".join([p async for batch in gen.pieces() for p in batch])

        alone, together = await _solo_then_together(model, run, 4)
        assert together == alone
    finally:
        await model.aclose()


# ------------------------------------------------------------------ recurrent state


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35_mlx(tmp_path_factory.mktemp("qwen35") / "q")


async def test_hybrid_recurrent_model_is_served_and_only_extended(tiny_qwen35: Path) -> None:
    model, backend = await _load(tiny_qwen35)
    try:
        assert backend.info.is_recurrent and backend.rewind_limit == 1
        tokens = backend.tokenize
        engine = model.resident.engine
        await _cold(model, "A conversation about boats", 6)
        (held,) = [list(s.kv_tokens) for s in engine.cache.sequences if s.kv_tokens]
        follow_up = [*held, *tokens(" and then", add_bos=False)]
        expected = await _cold(model, follow_up, 4)
        await _greedy(model, "A conversation about boats", 6)
        text, cached = await _greedy(model, follow_up, 4)
        assert (text, cached) == (expected, len(held))  # the state is extended, exactly
        text, cached = await _greedy(model, "A conversation about trains", 4)
        assert cached == 0 and text  # a fork rebuilds (the state cannot be cut back)
        # Concurrent sessions (each its own forward pass) give the tokens of solo runs.
        engine.drop_idle_caches()

        async def run(i: int) -> bytes:
            return (await _greedy(model, PROMPTS[i], 8))[0]

        alone, together = await _solo_then_together(model, run, 2)
        assert together == alone
    finally:
        await model.aclose()


async def test_a_long_session_is_not_batched_with_short_ones(tiny_mlx: Path) -> None:
    model, backend = await _load(tiny_mlx)
    try:
        engine = model.resident.engine
        long_prompt = backend.tokenize("a long conversation that goes on " * 40, add_bos=False)
        seen: set[tuple[int, ...]] = set()

        async def lane(prompt: list[int], seed: int) -> None:
            async with engine.generate(prompt, SamplingParams(seed=seed), 16) as gen:
                async for _ in gen.pieces():
                    seen.add(backend.decode_batch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lane, long_prompt, 0)
            for i in range(3):
                nursery.start_soon(lane, backend.tokenize(PROMPTS[i], add_bos=False), i + 1)
        long_seq = next(s.seq for s in engine.cache.sequences
                        if len(s.kv_tokens) >= len(long_prompt))
        widest = max(seen, key=len)
        assert len(widest) == 3 and long_seq not in widest  # the short ones together...
        # ...and the long one never joins two or more of them: padded to its length, three
        # rows would hold more than twice what they need (backends/batching.py).
        assert all(len(batch) <= 2 for batch in seen if long_seq in batch), seen
    finally:
        await model.aclose()


async def test_forced_tool_call_starts_with_the_vocabularys_marker_token(tiny_mlx: Path) -> None:
    tool = {"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    model, backend = await _load(tiny_mlx)
    try:
        prompt = backend.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                  add_bos=False)
        params = SamplingParams(seed=1, grammar=tool_call_grammar([tool]))
        async with model.resident.engine.generate(prompt, params, 40) as gen:
            pieces = [p async for batch in gen.pieces() for p in batch]
        # One token for the marker (llguidance's <[id]>), not "<" "tool" "_call" ">".
        assert pieces[0] == b"<tool_call>"
        text = b"".join(pieces)
        assert pieces[-1] == b"</tool_call>" and text.startswith(b"<tool_call>\n")
        call = json.loads(text.removeprefix(b"<tool_call>\n").removesuffix(b"\n</tool_call>"))
        assert call == {"name": "noop", "arguments": {}}
    finally:
        await model.aclose()


async def test_a_grammar_failure_ends_only_its_own_request(
        tiny_mlx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, backend = await _load(tiny_mlx)
    # Let the constrained request sample freely, so its grammar rejects a token.
    monkeypatch.setattr(backend.grammars, "allowed", lambda matcher, logits: logits)
    tool = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
    try:
        engine = model.resident.engine
        finished: dict[str, tuple[str | None, int]] = {}

        async def run(name: str, params: SamplingParams) -> None:
            prompt = backend.tokenize(f"{name}: tell me about boats", add_bos=False)
            async with engine.generate(prompt, params, 24) as gen:
                async for _ in gen.pieces():
                    pass
            finished[name] = (gen.finish_reason, gen.completion_tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "constrained", SamplingParams(
                temperature=0, grammar=tool_call_grammar([tool])))
            nursery.start_soon(run, "plain", SamplingParams(seed=3, temperature=0.1))
        assert finished["constrained"][0] == "error"
        assert finished["plain"][0] in ("length", "stop")  # the sibling was untouched
    finally:
        await model.aclose()


async def test_every_step_runs_on_the_backends_own_thread(
        tiny_mlx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    model, backend = await _load(tiny_mlx)
    threads: set[str] = set()
    step = backend._step

    def recording_step(*args: object) -> object:
        threads.add(threading.current_thread().name)
        return step(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "_step", recording_step)
    try:
        await _greedy(model, "first", 4)
        await _greedy(model, "second", 4)
        # Not trio's worker threads (which come and go): the one thread mlx's lazy arrays
        # are tied to.
        assert len(threads) == 1 and threads.pop().startswith("butter-mlx")
    finally:
        await model.aclose()
