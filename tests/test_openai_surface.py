"""The OpenAI surface beyond the basics: n choices, logprobs, logit_bias, the paths
clients call without /v1, developer messages and both reasoning names."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from butter.backends.logprobs import log_softmax
from butter.backends.native import Unavailable
from butter.chat.request import Logprobs
from butter.engine.engine import Engine
from butter.pipeline.prepare import prepare
from butter.pipeline.resident import ResidentModel
from butter.protocol import openai as wire
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from tests.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


# ---------------------------------------------------------------- logprobs, in the engine

def _load(path: Path, *, fast_lm_head: bool) -> ResidentModel:
    return ResidentModel.load_sync(ServeSettings(
        model=str(path), parallel=2, max_context=512, threads=2, fast_lm_head=fast_lm_head))


async def _greedy_with_logprobs(resident: ResidentModel, prompt: list[int], top: int,
                                steps: int) -> tuple[list[int], list[Logprobs]]:
    engine = Engine(resident.backend, parallel=2, max_context=512, prefill_chunk=256,
                    max_queue=4)
    params = SamplingParams(temperature=0.0, logprobs=top)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        async with engine.generate(prompt, params, steps) as generation:
            async for _ in generation.pieces():
                pass
            entries = generation.take_logprobs()
        nursery.cancel_scope.cancel()
    return [entry.chosen.token for entry in entries], entries


async def test_logprobs_agree_with_llama_cpps_own_projection(demo_gguf: Path) -> None:
    """butter's output projection (where it runs) and llama.cpp's give the same logprobs;
    greedy picks the most likely token, and the alternatives come most likely first."""
    results = []
    for fast in (True, False):
        resident = _load(demo_gguf, fast_lm_head=fast)
        try:
            prompt = resident.tokenize_prompt("The sea is")
            results.append(await _greedy_with_logprobs(resident, prompt, top=5, steps=6))
        finally:
            resident.close()
    (ours_tokens, ours), (theirs_tokens, theirs) = results
    assert ours_tokens == theirs_tokens and len(ours) == 6
    for mine, reference in zip(ours, theirs, strict=True):
        assert abs(mine.chosen.logprob - reference.chosen.logprob) < 1e-3
        assert [t.token for t in mine.top] == [t.token for t in reference.top]
        np.testing.assert_allclose([t.logprob for t in mine.top],
                                   [t.logprob for t in reference.top], atol=1e-3)
        assert mine.top[0].token == mine.chosen.token  # greedy: the most likely
        assert [t.logprob for t in mine.top] == sorted((t.logprob for t in mine.top),
                                                       reverse=True)
        assert all(t.logprob <= 0 for t in mine.top)


async def test_mlx_reports_the_same_shape_of_logprobs(tiny_mlx: Path) -> None:
    resident = ResidentModel.load_sync(ServeSettings(model=str(tiny_mlx), parallel=2,
                                                     max_context=512))
    try:
        prompt = resident.tokenize_prompt("hello there")
        _, entries = await _greedy_with_logprobs(resident, prompt, top=3, steps=4)
    finally:
        resident.close()
    assert entries and all(len(entry.top) == 3 for entry in entries)
    assert all(entry.top[0].token == entry.chosen.token for entry in entries)
    assert all(entry.chosen.piece == entry.top[0].piece for entry in entries)


def test_log_softmax_is_normalized() -> None:
    values = log_softmax(np.array([1000.0, 999.0, -5.0]))  # large: no overflow
    assert np.isclose(np.exp(values).sum(), 1.0)
    assert values[0] > values[1] > values[2]


# ---------------------------------------------------------------- over HTTP, with the SDK

@pytest.fixture
def client(demo_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.api, api_key="unused", max_retries=0, timeout=120)


def test_logprobs_through_the_sdk(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and result.usage is not None
    assert len(content) == result.usage.completion_tokens
    text = result.choices[0].message.content or ""
    assert "".join(entry.token for entry in content).startswith(text[:1])
    for entry in content:
        assert bytes(entry.bytes or []).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
    plain = client.chat.completions.create(model="gemma-3-270m", messages=MESSAGES,
                                           max_tokens=2)
    assert plain.choices[0].logprobs is None  # not asked, not computed


async def test_a_minus_100_bias_bans_the_greedy_token(
    client: openai.OpenAI, demo_gguf: Path,
) -> None:
    # The greedy first token's id, found in-process on the same prompt the server renders.
    resident = _load(demo_gguf, fast_lm_head=True)
    try:
        request = wire.generation_request(wire.parse_chat_request({"messages": MESSAGES}))
        prompt = prepare(resident, request).prompt
        (greedy, *_), entries = await _greedy_with_logprobs(resident, prompt, top=0, steps=1)
    finally:
        resident.close()

    def first_piece(**extra: object) -> bytes:
        result = client.chat.completions.create(
            model="gemma-3-270m", messages=MESSAGES, max_tokens=1, temperature=0,
            logprobs=True, **extra)  # type: ignore[call-overload]
        return bytes(result.choices[0].logprobs.content[0].bytes or [])

    assert first_piece() == entries[0].chosen.piece  # the server agrees on the greedy one
    assert first_piece(logit_bias={str(greedy): -100}) != entries[0].chosen.piece


def test_n_choices_are_different_and_counted_once(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=8, n=3, temperature=1.0, seed=5)
    assert [choice.index for choice in result.choices] == [0, 1, 2]
    texts = [choice.message.content for choice in result.choices]
    assert len(set(texts)) > 1  # each choice its own seed stream
    assert result.usage is not None
    assert result.usage.completion_tokens <= 3 * 8
    alone = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5)
    assert result.usage.prompt_tokens == alone.usage.prompt_tokens  # type: ignore[union-attr]


def test_unprefixed_paths_and_developer_messages(demo_server: ServerProcess) -> None:
    body = {"messages": [{"role": "developer", "content": "Answer briefly."}, *MESSAGES],
            "max_tokens": 2}
    response = httpx.post(f"{demo_server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    assert httpx.get(f"{demo_server.base_url}/models", timeout=10).json()["object"] == "list"


# ---------------------------------------------------------------- n streamed == n whole

@pytest.fixture(scope="module")
def tiny_client(tiny_gguf: Path) -> Iterator[openai.OpenAI]:
    """A tiny-model server of its own: a seeded answer is reproduced from the same cache
    state, and a server shared with the rest of the suite has a cache whose layout the
    other tests' traffic shaped (where llama.cpp puts a token's KV orders its attention
    sums, so a reused state can differ from the next run's in the last bits). Run alone,
    the comparison below held 170 times out of 170; on the shared server it failed about
    one suite run in three. No host-RAM tier: cached prompts idle through many decode rows
    would move there, which frees their cells, and so moves where the next run's KV lands,
    between the two compared runs. And --deterministic: with repacked weights a row's
    logits depend slightly on its place in the batch, and step shaping picks the batch
    layout by measured time, so the n choices' rows could sit differently in the two runs
    (this still failed about one CI run in two without it)."""
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--parallel", "4",
                            "--max-queue", "2", "--max-context", "2048", "--cache-ram", "0",
                            "--deterministic"])
    yield openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)
    server.stop()


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 4))
def test_a_streamed_n_choice_answer_reassembles_to_the_whole_one(
    tiny_client: openai.OpenAI, seed: int, n: int,
) -> None:
    # Its own prompt, and one run before the two compared: a seeded answer is reproduced
    # exactly from the same cache state (where llama.cpp puts a token's KV changes the
    # order its attention sums in, so a cold run can differ from a warm one in the last
    # bits), and the warm-up leaves the state both compared runs start from.
    messages = [{"role": "user", "content": f"Story number {seed}."}]
    options = {"model": "tiny", "messages": messages, "max_tokens": 12, "n": n,
               "temperature": 0.9, "seed": seed}
    tiny_client.chat.completions.create(**options)  # type: ignore[call-overload]
    whole = tiny_client.chat.completions.create(**options)  # type: ignore[call-overload]
    streamed: dict[int, list[str]] = {}
    finishes: dict[int, str] = {}
    for chunk in tiny_client.chat.completions.create(stream=True, **options):  # type: ignore[call-overload]
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(streamed) == list(range(n))
    for choice in whole.choices:
        assert "".join(streamed[choice.index]) == (choice.message.content or "")
        assert finishes[choice.index] == choice.finish_reason


# ---------------------------------------------------------------- /v1/completions

def test_legacy_completions_through_the_sdk(client: openai.OpenAI) -> None:
    result = client.completions.create(model="gemma-3-270m", prompt="The sea is",
                                       max_tokens=6, temperature=0, logprobs=2, echo=False)
    choice = result.choices[0]
    assert result.object == "text_completion" and choice.index == 0
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is not None and choice.logprobs.tokens
    assert "".join(choice.logprobs.tokens).startswith(choice.text[:1])
    assert choice.logprobs.text_offset[0] == 0
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs or [])
    assert result.usage is not None and result.usage.completion_tokens <= 6
    # echo with max_tokens 0: the prompt back, nothing generated.
    echoed = client.completions.create(model="gemma-3-270m", prompt="The sea is",
                                       max_tokens=0, echo=True)
    assert echoed.choices[0].text == "The sea is"
    assert echoed.usage is not None and echoed.usage.completion_tokens == 0
    # Several prompts (strings or token ids) and n: numbered prompt by prompt.
    many = client.completions.create(model="gemma-3-270m", prompt=["A", "B"], n=2,
                                     max_tokens=2, seed=1)
    assert sorted(choice.index for choice in many.choices) == [0, 1, 2, 3]
    tokens = client.completions.create(model="gemma-3-270m", prompt=[2, 651, 5442],
                                       max_tokens=2, echo=False)
    assert tokens.usage is not None and tokens.usage.prompt_tokens == 3


def test_legacy_completions_stream_and_refusals(demo_server: ServerProcess,
                                                client: openai.OpenAI) -> None:
    streamed = "".join(
        chunk.choices[0].text for chunk in client.completions.create(
            model="gemma-3-270m", prompt="The sea is", max_tokens=6, temperature=0,
            stream=True) if chunk.choices)
    whole = client.completions.create(model="gemma-3-270m", prompt="The sea is",
                                      max_tokens=6, temperature=0)
    assert streamed == whole.choices[0].text
    for body, param in (({"prompt": "x", "suffix": "y", "echo": True}, "suffix"),
                        ({"prompt": []}, "prompt"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens")):
        response = httpx.post(f"{demo_server.api}/completions", json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, demo_gguf: Path) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0. The
    prompt tokens' logprobs agree with llama-cpp-python's own evaluation of the same
    tokens, on the kernels the server's context uses (weight repacking on, the server's
    default as llama.cpp's; butter's Q8_0 layer matmuls where they apply; flash attention:
    other kernels differ by tenths of a nat on this model)."""
    import llama_cpp

    from butter.backends.llama_cpp import layer_matmul

    prompt = "The quick brown fox jumps over the lazy dog because it was late."
    result = client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=0,
                                       echo=True, logprobs=3)
    choice = result.choices[0]
    assert choice.text == prompt and result.usage is not None
    assert result.usage.completion_tokens == 0
    scored = choice.logprobs
    assert scored is not None and scored.token_logprobs is not None
    assert scored.token_logprobs[0] is None and (scored.top_logprobs or [None])[0] is None
    assert len(scored.token_logprobs) == result.usage.prompt_tokens
    assert "".join(scored.tokens or []) == prompt

    try:  # (registered at the session's start: tests/conftest.py)
        layers: contextlib.AbstractContextManager[None] = layer_matmul.registered().accepting(True)
    except Unavailable:
        layers = contextlib.nullcontext()
    with layers:
        reference = llama_cpp.Llama(str(demo_gguf), n_ctx=256, logits_all=True, verbose=False,
                                    n_threads=2, swa_full=True, flash_attn=True)
    try:
        tokens = reference.tokenize(prompt.encode(), add_bos=True, special=True)
        assert len(tokens) == len(scored.token_logprobs)
        reference.eval(tokens)
        expected = [float(log_softmax(reference.scores[i])[tokens[i + 1]])
                    for i in range(len(tokens) - 1)]
    finally:
        reference.close()
    np.testing.assert_allclose(scored.token_logprobs[1:], expected, atol=1e-3)
    # The same prompt generating after its score: the choice goes on from the prompt.
    more = client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=2,
                                     echo=True, logprobs=1, temperature=0)
    assert more.choices[0].text.startswith(prompt)
    assert len(more.choices[0].logprobs.token_logprobs) == (  # type: ignore[union-attr]
        len(tokens) + (more.usage.completion_tokens if more.usage else 0))


def test_suffix_fills_in_the_middle_where_the_model_can(
    tmp_path: Path, demo_server: ServerProcess,
) -> None:
    from butter.chat.request import GenerationRequest, TextPrompt
    from butter.testing.tiny_gguf import write_tiny_qwen3_gguf

    coder = write_tiny_qwen3_gguf(tmp_path / "tiny-fim.gguf", fim=True)
    resident = ResidentModel.load_sync(ServeSettings(model=str(coder), max_context=256))
    try:
        pre, suf, mid = resident.backend.info.fim_tokens or (-1, -1, -1)
        assert min(pre, suf, mid) >= 0
        request = GenerationRequest(prompt=TextPrompt("def add(a, b):\n", suffix="\n# done"),
                                    sampling=SamplingParams(), max_tokens=4)
        tokens = prepare(resident, request).prompt
        before = resident.backend.tokenize("def add(a, b):\n", add_bos=False)
        after = resident.backend.tokenize("\n# done", add_bos=False)
        assert tokens == [pre, *before, suf, *after, mid]
    finally:
        resident.close()
    server = ServerProcess(["--model", str(coder), "--alias", "coder", "--max-context", "256"])
    try:
        filled = httpx.post(f"{server.api}/completions", timeout=60, json={
            "prompt": "def add(a, b):\n", "suffix": "\n# done", "max_tokens": 4})
        assert filled.status_code == 200, filled.text
        assert filled.json()["usage"]["prompt_tokens"] == len(tokens)
    finally:
        server.stop()
    refused = httpx.post(f"{demo_server.api}/completions", timeout=30,
                         json={"prompt": "x", "suffix": "y", "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
async def test_prompt_scoring_on_both_backends(kind: str, request: pytest.FixtureRequest) -> None:
    """Every prompt token after the first gets its logprob, on either backend, and a
    max_tokens of 0 generates nothing."""
    path: Path = request.getfixturevalue(f"tiny_{kind}")
    resident = ResidentModel.load_sync(ServeSettings(model=str(path), parallel=2,
                                                     max_context=512, prefill_chunk=8))
    try:
        prompt = resident.tokenize_prompt("The quick brown fox jumps over the lazy dog.")
        engine = Engine(resident.backend, parallel=2, max_context=512, prefill_chunk=8,
                        max_queue=4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.step_loop)
            async with engine.generate_choices(prompt, [SamplingParams()], 0,
                                               prompt_top_logprobs=2) as (generation,):
                pieces = [p async for batch in generation.pieces() for p in batch]
            nursery.cancel_scope.cancel()
    finally:
        resident.close()
    assert pieces == [] and generation.completion_tokens == 0
    scored = generation.prompt_logprobs
    assert [entry.chosen.token for entry in scored] == prompt[1:]  # across 8-token chunks
    assert all(entry.chosen.logprob <= 0 and len(entry.top) == 2 for entry in scored)
