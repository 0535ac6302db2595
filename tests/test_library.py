"""The library API with the tiny generated GGUF: Model, generate, backends, ServeServer."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

import butter
from butter.testing.tiny_gguf import write_tiny_qwen3_gguf

MESSAGES = [{"role": "user", "content": "hello there"}]
OPTIONS = {"max_tokens": 12, "temperature": 0.8, "seed": 11}


@pytest.fixture
async def model(tiny_gguf: Path) -> AsyncIterator[butter.Model]:
    loaded = await butter.Model.load(str(tiny_gguf), parallel=4, max_context=2048)
    yield loaded
    await loaded.aclose()


async def serve(nursery: trio.Nursery, holder: object) -> str:
    server = butter.ServeServer(host="127.0.0.1", port=0, holder=holder)  # type: ignore[arg-type]
    host, port = await nursery.start(server.serve)
    return f"http://{host}:{port}"


async def test_in_process_equals_http_for_the_same_seed(model: butter.Model) -> None:
    in_process = await model.generate(MESSAGES, **OPTIONS)
    async with trio.open_nursery() as nursery:
        base = await serve(nursery, butter.FixedHolder(model=model, model_id="tiny"))
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{base}/v1/chat/completions", json={
                "model": "tiny", "messages": MESSAGES, **OPTIONS})
            missing = await client.post(f"{base}/v1/chat/completions", json={
                "model": "other", "messages": MESSAGES, "max_tokens": 2})
        nursery.cancel_scope.cancel()
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == in_process
    assert missing.status_code == 404


async def test_stream_pieces_end_with_usage(model: butter.Model) -> None:
    pieces = [piece async for piece in model.generate_stream(MESSAGES, **OPTIONS)]
    last = pieces[-1]
    assert last.usage is not None and last.usage.completion_tokens == 12
    assert last.finish_reason == "length"
    assert "".join(p.text for p in pieces) == await model.generate(MESSAGES, **OPTIONS)


async def test_raw_text_prompt(model: butter.Model) -> None:
    text = await model.generate("Once upon a time", max_tokens=8, temperature=0)
    assert text == await model.generate("Once upon a time", max_tokens=8, temperature=0)
    assert "<|im_start|>" not in text


async def test_cancelling_the_scope_frees_the_session(model: butter.Model) -> None:
    engine = model.resident.engine
    with trio.CancelScope() as scope:
        async for piece in model.generate_stream(MESSAGES, max_tokens=2000):
            if piece.text:
                scope.cancel()
                await trio.lowlevel.checkpoint()  # cancelled here, inside the generator
    with trio.fail_after(5):
        while engine.stats().active:  # noqa: ASYNC110 - the engine has no event for this
            await trio.sleep(0.01)
    stats = engine.stats()
    assert stats.reserved_cells == 0 and max(stats.session_cells) < 2000


async def test_bad_options_are_refused(model: butter.Model) -> None:
    from butter.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="temperature"):
        await model.generate(MESSAGES, temperature=-1)


async def test_resident_backend_swaps_via_http(tmp_path: Path) -> None:
    paths = {name: write_tiny_qwen3_gguf(tmp_path / f"{name}.gguf", seed=seed)
             for name, seed in (("a", 1), ("b", 2))}

    async def loader(model_id: str) -> butter.Model:
        return await butter.Model.load(str(paths.get(model_id, model_id)), parallel=2,
                                       max_context=1024, alias=model_id)

    backend = butter.SwappableHolder(loader=loader, initial_model_id="a")
    async with trio.open_nursery() as nursery:
        base = await serve(nursery, backend)
        async with httpx.AsyncClient(timeout=30) as client:
            swapped = await client.post(f"{base}/v1/chat/completions", json={
                "model": "b", "messages": MESSAGES, "max_tokens": 2})
            models = (await client.get(f"{base}/v1/models")).json()["data"]
        nursery.cancel_scope.cancel()
    await backend.aclose()
    assert swapped.status_code == 200 and swapped.json()["model"] == "b"
    assert [m["id"] for m in models] == ["b"] and backend.swaps == 1


def test_sync_one_shot_helper(tiny_gguf: Path) -> None:
    text = butter.generate(str(tiny_gguf), "Once upon a time", max_tokens=6, temperature=0)

    async def in_trio() -> str:
        model = await butter.Model.load(str(tiny_gguf), parallel=1)
        try:
            return await model.generate("Once upon a time", max_tokens=6, temperature=0)
        finally:
            await model.aclose()

    assert text and text == trio.run(in_trio)


def test_the_example_runs(tiny_gguf: Path) -> None:
    example = Path(__file__).parent.parent / "examples" / "embed_in_trio.py"
    result = subprocess.run([sys.executable, str(example), str(tiny_gguf)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "generate:" in result.stdout and "http:" in result.stdout
    assert "finish=length" in result.stdout


async def test_a_request_prepared_while_its_model_unloads_gets_model_replaced(
        tiny_gguf: Path) -> None:
    from butter.errors import ModelReplaced
    from butter.protocol import openai as wire
    from butter.server.app import prepare

    loaded = await butter.Model.load(str(tiny_gguf), parallel=1, max_context=512)
    resident = loaded.resident
    request = wire.generation_request(
        wire.parse_chat_request({"model": "tiny", "messages": MESSAGES}))
    assert (await prepare(resident, request)).prompt  # while loaded
    await loaded.aclose()  # what a swap does to the old model
    with pytest.raises(ModelReplaced):  # a 503 in the API's shape, not a 500
        await prepare(resident, request)


def test_the_model_holders_names_before_their_rename_still_work_and_warn() -> None:
    with pytest.warns(DeprecationWarning, match="FixedHolder"):
        assert butter.ButterServeBackend is butter.FixedHolder  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="SwappableHolder"):
        assert butter.ResidentServeBackend is butter.SwappableHolder  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="FixedHolder"):
        assert butter.FixedModel is butter.FixedHolder  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="SwappableHolder"):
        assert butter.SwappableModel is butter.SwappableHolder  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="holder="):
        server = butter.ServeServer(host="127.0.0.1", port=0,
                                    backend=butter.FixedHolder.__new__(butter.FixedHolder))
    assert isinstance(server.holder, butter.FixedHolder)
    with pytest.warns(DeprecationWarning, match="holder"):
        assert server.backend is server.holder
    sys.modules.pop("butter.server.backends", None)  # (its warning comes with the import)
    with pytest.warns(DeprecationWarning, match="holders"):
        import butter.server.backends as old_module
    assert old_module.ButterServeBackend is butter.FixedHolder
    with pytest.raises(AttributeError):
        butter.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
