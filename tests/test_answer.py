"""The answer seam (butter/pipeline/answer.py) on the real llama.cpp engine and the tiny
GGUF: what a choice says of how it ended, what it cost, how long it took and how far its
prompt came is what its generation did."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from butter.chat.markup import ContentDelta
from butter.chat.request import GenerationRequest, TextPrompt, Usage
from butter.errors import ModelReplaced
from butter.model import Model
from butter.pipeline.answer import (
    Answer,
    AnswerEvent,
    Heartbeat,
    PromptProgress,
    answering,
    prompt_alone,
    total_usage,
)
from butter.pipeline.output import LogprobsDelta
from butter.pipeline.prepare import PreparedGeneration, prepare
from butter.pipeline.run import Outcome, RequestObserver
from butter.protocol import openai
from butter.sampling import SamplingParams
from butter.settings import ServeSettings

PROMPT = "Once upon a time there was a fox"
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3}},
                   "required": ["city"]}}}


@pytest.fixture
async def loaded(tiny_gguf: Path) -> AsyncIterator[Model]:
    model = await Model.from_settings(ServeSettings(
        model=str(tiny_gguf), parallel=2, max_context=512, threads=2))
    yield model
    await model.aclose()


def greedy(max_tokens: int, *, logprobs: int | None = None, **fields: Any) -> GenerationRequest:
    return GenerationRequest(TextPrompt(PROMPT), SamplingParams(temperature=0.0,
                                                                logprobs=logprobs),
                             max_tokens=max_tokens, **fields)


async def answered(loaded: Model, request: GenerationRequest, **options: Any
                   ) -> tuple[PreparedGeneration, Answer, list[AnswerEvent]]:
    """The request answered to its end: its first choice's events, read as a stream would."""
    prepared = prepare(loaded.resident, request)
    async with answering(loaded.resident, prepared) as answer:
        events = [event async for event in answer.first.events(**options)]
    return prepared, answer, events


def text_of(events: list[AnswerEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, ContentDelta))


async def test_a_choice_cut_by_max_tokens_ends_by_length(loaded: Model) -> None:
    prepared, answer, events = await answered(loaded, greedy(6, logprobs=2))
    choice = answer.first
    assert choice.finish_reason == "length" and choice.matched_stop is None
    assert choice.usage == answer.usage == Usage(
        prompt_tokens=len(prepared.prompt), completion_tokens=6, cached_tokens=0)
    logprobs = [entry for event in events if isinstance(event, LogprobsDelta)
                for entry in event.entries]
    assert len(logprobs) == 6  # one per generated token
    timings = answer.timings
    assert timings.predicted_tokens == 6 and timings.cached_tokens == 0
    assert timings.prompt_tokens == len(prepared.prompt)  # all of it evaluated
    assert timings.prompt_ms > 0 and timings.predicted_ms > 0
    spent = answer.durations()
    assert spent.total >= spent.prompt > 0 and spent.answer > 0
    assert spent.total == pytest.approx(spent.prompt + spent.answer)


async def test_a_repeated_prompt_is_answered_from_the_cache(loaded: Model) -> None:
    _, _, first_events = await answered(loaded, greedy(4))
    prepared, again, events = await answered(loaded, greedy(4))
    assert text_of(events) == text_of(first_events)  # greedy: the same answer
    usage, timings = again.usage, again.timings
    assert 0 < usage.cached_tokens < usage.prompt_tokens == len(prepared.prompt)
    assert timings.cached_tokens == usage.cached_tokens
    assert timings.prompt_tokens + timings.cached_tokens == usage.prompt_tokens
    assert timings.predicted_tokens == usage.completion_tokens == 4


async def test_a_stop_string_ends_the_choice_where_it_matched(loaded: Model) -> None:
    _, whole, events = await answered(loaded, greedy(16))
    full = text_of(events)
    stop = next(event.text for event in events[1:]
                if isinstance(event, ContentDelta) and event.text.strip().isalpha())
    _, stopped, cut = await answered(loaded, greedy(16, stop=(stop,)))
    choice = stopped.first
    assert choice.finish_reason == "stop" and choice.matched_stop == stop
    assert text_of(cut) == full[:full.index(stop)]
    assert 0 < choice.usage.completion_tokens < whole.usage.completion_tokens == 16
    assert stopped.timings.predicted_tokens == choice.usage.completion_tokens


async def test_a_tool_call_ends_the_choice_with_tool_calls(loaded: Model) -> None:
    request = openai.generation_request(openai.parse_chat_request({
        "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
        "tool_choice": "required", "max_tokens": 100, "temperature": 0.0}))
    prepared = prepare(loaded.resident, request)
    async with answering(loaded.resident, prepared, call_id_prefix="toolu_") as answer:
        whole = await answer.first.whole()
    (call,) = whole.calls
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert answer.first.finish_reason == "tool_calls"
    assert answer.usage.completion_tokens < 100  # it ended with the call


async def test_prompt_progress_is_reported_until_the_first_output(loaded: Model) -> None:
    for _ in range(2):  # cold, then from the cache
        _, answer, events = await answered(loaded, greedy(3), progress=True)
        first_output = next(i for i, event in enumerate(events)
                            if isinstance(event, ContentDelta | LogprobsDelta))
        reports = [event for event in events[:first_output]
                   if isinstance(event, PromptProgress)]
        usage = answer.usage
        assert reports and all(report.total == usage.prompt_tokens for report in reports)
        assert reports[-1].processed == usage.prompt_tokens  # all in the cache by then
        assert [r.processed for r in reports] == sorted({r.processed for r in reports})
        assert reports[-1].cached == usage.cached_tokens
        assert not any(isinstance(event, PromptProgress) for event in events[first_output:])
        assert answer.first.progress() == PromptProgress(
            total=usage.prompt_tokens, cached=usage.cached_tokens,
            processed=usage.prompt_tokens, elapsed_ms=answer.first.progress().elapsed_ms)
    assert usage.cached_tokens > 0  # (the second time)
    _, _, plain = await answered(loaded, greedy(3))
    assert not any(isinstance(event, PromptProgress | Heartbeat) for event in plain)


async def test_choices_share_their_prompt_and_add_up_their_tokens(
        loaded: Model) -> None:
    request = GenerationRequest(TextPrompt(PROMPT), SamplingParams(temperature=0.9, seed=3),
                                max_tokens=5, n=2)
    prepared = prepare(loaded.resident, request)
    async with answering(loaded.resident, prepared) as answer:
        for choice in answer.choices:  # one after the other, as a stream reads them
            await choice.whole()
    assert len(answer.choices) == 2
    assert [choice.finish_reason for choice in answer.choices] == ["length", "length"]
    assert answer.usage == Usage(prompt_tokens=len(prepared.prompt), completion_tokens=10,
                                 cached_tokens=answer.first.usage.cached_tokens)
    assert answer.timings == answer.first.timings  # the choice that evaluated the prompt


async def test_a_cancelled_answer_releases_its_generation(loaded: Model) -> None:
    ended: list[tuple[Outcome | None, bool]] = []
    observer = RequestObserver(route="test", on_finish=lambda _, outcome, cancelled:
                               ended.append((outcome, cancelled)))
    prepared = prepare(loaded.resident, greedy(200))
    with trio.CancelScope() as scope:
        async with answering(loaded.resident, prepared, observer) as answer:
            async for _ in answer.first.events():
                scope.cancel()  # the client left
                await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught  # trio.Cancelled went through, untouched
    assert loaded.resident.engine.stats().active == 0
    ((outcome, cancelled),) = ended
    assert cancelled and outcome is not None and outcome.usage.completion_tokens < 200


async def test_an_unloaded_model_ends_the_answer_with_model_replaced(
        loaded: Model) -> None:
    prepared = prepare(loaded.resident, greedy(200))
    async with answering(loaded.resident, prepared) as answer:
        async for _ in answer.first.events():
            loaded.resident.engine.abort_all("the model was swapped out")
    with pytest.raises(ModelReplaced, match="swapped out"):
        _ = answer.first.finish_reason


def test_an_echo_alone_never_reaches_the_engine() -> None:
    def prepared(max_tokens: int, score_prompt: int | None) -> PreparedGeneration:
        request = GenerationRequest(TextPrompt("abc"), SamplingParams(), max_tokens=max_tokens,
                                    score_prompt=score_prompt)
        return PreparedGeneration(request=request, prompt=[1, 2, 3], params=request.sampling,
                                  max_tokens=max_tokens, starts_in_reasoning=False)

    alone = prompt_alone(prepared(0, None))
    assert alone is not None and alone.finish_reason == "length"
    assert alone.usage == Usage(prompt_tokens=3, completion_tokens=0, cached_tokens=0)
    assert prompt_alone(prepared(0, 1)) is None  # scoring the prompt needs the engine
    assert prompt_alone(prepared(4, None)) is None
    assert total_usage([Usage(3, 1, 2), Usage(5, 4, 0)]) == Usage(8, 5, 2)
