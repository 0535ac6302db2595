"""KV controls: cache types, sliding window, flag validation, reporting."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from butter.kv import KvWindow, kv_window, parse_aura_decode_path, parse_kv_cache
from butter.model import Model
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from tests.conftest import ServerProcess


def test_cache_type_mapping() -> None:
    assert parse_kv_cache("raw").name == "f16"
    assert parse_kv_cache("affine8").name == "q8_0"
    assert parse_kv_cache("affine4").name == "q4_0"
    aura = parse_kv_cache("aura4v2")
    assert aura.name == "f16" and aura.note and "AURA" in aura.note
    assert parse_kv_cache("aura").note
    for bad in ("q8", "affine16", "aurora", ""):
        with pytest.raises(ValueError, match="raw, affine8, affine4"):
            parse_kv_cache(bad)
    assert parse_aura_decode_path("dequant-mirror") == "dequant-mirror"
    with pytest.raises(ValueError, match="compressed, dequant-mirror"):
        parse_aura_decode_path("fast")


def test_window_arithmetic_and_validation() -> None:
    window = KvWindow(size=64, keep=4)
    assert window.overflow(63, 1) == 0
    assert window.overflow(64, 1) == window.drop == 15
    assert kv_window(None, None) is None
    with pytest.raises(ValueError, match="requires --kv-window-size"):
        kv_window(None, 4)
    with pytest.raises(ValueError, match="between 0 and half"):
        kv_window(64, 40)
    with pytest.raises(ValueError, match="at least 8"):
        kv_window(4, 0)


async def _greedy(path: Path, kv_cache: str, tokens: int) -> list[bytes]:
    model = await Model.from_settings(ServeSettings(model=str(path), parallel=1,
                                                    max_context=1024, kv_cache=kv_cache))
    try:
        prompt = model.resident.backend.tokenize("The quick brown fox jumps", add_bos=False)
        async with model.resident.engine.generate(prompt, SamplingParams(temperature=0),
                                                  tokens) as generation:
            pieces = [p async for batch in generation.pieces() for p in batch]
        assert generation.finish_reason in ("length", "stop")
        return pieces
    finally:
        await model.aclose()


@pytest.mark.parametrize("kv_cache", ["affine8", "affine4"])
async def test_quantized_caches_generate_full_streams(tiny_gguf: Path, kv_cache: str) -> None:
    assert len(await _greedy(tiny_gguf, kv_cache, 64)) == 64  # the tiny model never stops


async def test_q8_0_cache_matches_raw_greedy_on_the_demo_model(demo_gguf: Path) -> None:
    # Measured: identical for 40 tokens on the demo GGUF; q4_0 diverges within a few.
    raw = await _greedy(demo_gguf, "raw", 24)
    assert await _greedy(demo_gguf, "affine8", 24) == raw


@pytest.fixture
async def windowed(tiny_gguf: Path) -> AsyncIterator[Model]:
    model = await Model.from_settings(ServeSettings(
        model=str(tiny_gguf), parallel=2, max_context=2048, kv_window_size=64,
        kv_window_keep=4))
    yield model
    await model.aclose()


async def test_window_runs_past_its_size(windowed: Model) -> None:
    engine = windowed.resident.engine
    prompt = windowed.resident.backend.tokenize("Hello there, sliding window", add_bos=False)
    peak = 0
    async with engine.generate(prompt, SamplingParams(seed=1), 300) as generation:
        async for _ in generation.pieces():
            peak = max(peak, *engine.stats().session_cells)
    assert generation.completion_tokens == 300 and generation.finish_reason == "length"
    assert peak <= 64
    # The slid cache no longer matches fresh positions: only the sinks may be reused.
    async with engine.generate(prompt, SamplingParams(seed=1), 2) as again:
        async for _ in again.pieces():
            pass
    assert again.cached_tokens == 4


async def test_prompt_longer_than_the_window_is_refused(windowed: Model) -> None:
    from butter.errors import ContextLengthExceeded

    with pytest.raises(ContextLengthExceeded, match="window"):
        await windowed.generate("word " * 200, max_tokens=2)


def _serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "butter.cli", "serve", "--model", "x", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-window-keep", "4"], "requires --kv-window-size"),
    (["--kv-window-size", "64", "--kv-window-keep", "60"], "between 0 and half"),
    (["--kv-cache", "q4"], "raw, affine8, affine4"),
    (["--aura-decode-path", "fast"], "compressed, dequant-mirror"),
])
def test_invalid_flag_combinations_fail_fast(args: list[str], message: str) -> None:
    result = _serve_fails(*args)  # fails before even resolving the (bogus) model
    assert result.returncode == 2 and message in result.stderr


def test_server_reports_kv_settings(tiny_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--kv-cache", "aura4v2",
                            "--aura-decode-path", "compressed", "--kv-window-size", "128",
                            "--kv-window-keep", "4"])
    try:
        boot = "".join(server.output)
        assert "AURA KV compression is not available" in boot
        assert "--aura-decode-path compressed ignored" in boot
        kv = httpx.get(f"{server.api}/server").json()["model"]["meta"]["kv"]
        assert kv["cache"] == "aura4v2" and kv["type"] == "f16"
        assert (kv["window_size"], kv["window_keep"]) == (128, 4)
        assert kv["bytes_per_token"] > 0 and kv["pool_mib"] > 0
    finally:
        server.stop()


def test_cache_types_really_shrink_the_kv_state(tiny_gguf: Path) -> None:
    """The KV bytes llama.cpp holds for the same tokens, per --kv-cache choice."""
    import llama_cpp as ll

    from butter.backends.base import SeqWork, SetSampler
    from butter.backends.llama_cpp import LlamaCppBackend

    sizes = {}
    for kv_cache in ("raw", "affine8", "affine4"):
        backend = LlamaCppBackend(tiny_gguf, n_cells=256, n_seq=1, n_batch=64, threads=1,
                                  kv_type=parse_kv_cache(kv_cache))
        try:
            tokens = tuple(backend.tokenize("hello there, a few tokens of KV", add_bos=False))
            backend.step([SetSampler(0, SamplingParams(temperature=0))],
                         [SeqWork(0, tokens, 0, sample=True, prompt=True)])
            sizes[kv_cache] = ll.llama_state_seq_get_size(backend.model.ctx, 0)  # what is stored
        finally:
            backend.close()
    assert sizes["raw"] > sizes["affine8"] > sizes["affine4"]
