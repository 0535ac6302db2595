"""What llama.cpp's own server tests ask of a chat server beyond OpenAI's and Anthropic's
APIs (benchmarks/llama_server_tests.py runs that suite): `timings_per_token`, the chat
prompt's token count, `add_generation_prompt` and `continue_final_message`,
`verbose`, `return_progress` on a cache hit, and an Anthropic request with no messages.
Each on the wire, against `butter serve` on the SmolLM2 instruct model, through the
official SDKs where they can say it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import INSTRUCT_MODEL, ServerProcess, start_instruct_server

BOOK = [{"role": "system", "content": "Book"},
        {"role": "user", "content": "What is the best book"}]
# SmolLM2's ChatML template, rendered (it writes no BOS).
BOOK_PROMPT = ("<|im_start|>system\nBook<|im_end|>\n<|im_start|>user\nWhat is the best "
               "book<|im_end|>\n<|im_start|>assistant\n")
CONTEXT = 1024


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    started = start_instruct_server("--parallel", "2", "--max-context", str(CONTEXT))
    yield started
    started.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


def _chunks(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's data chunks, in order ([DONE] left out)."""
    with httpx.stream("POST", f"{server.api}/chat/completions", timeout=120,
                      json={"model": INSTRUCT_MODEL, **body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                if line.startswith("data: {")]


# ---------------------------------------------------------------- timings_per_token

def test_timings_per_token_puts_timings_on_every_chunk_after_the_first(
        client: openai.OpenAI) -> None:
    """As llama-server: each chunk after the role's carries the answer's `timings` so far
    (its count of predicted tokens growing to the whole), and the usage chunk, the
    stream's last, carries them whole."""
    chunks = list(client.chat.completions.create(
        model=INSTRUCT_MODEL, messages=BOOK, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"timings_per_token": True}))
    first, *rest, last = chunks
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content is None  # (null, as llama-server's)
    assert "timings" not in (first.model_extra or {})
    assert rest and all("timings" in (chunk.model_extra or {}) for chunk in rest)
    predicted = [chunk.model_extra["timings"]["predicted_n"] for chunk in rest
                 if chunk.model_extra]
    assert predicted == sorted(predicted) and predicted[0] >= 1
    assert last.choices == [] and last.usage is not None and last.model_extra
    timings = last.model_extra["timings"]
    assert timings["predicted_n"] == last.usage.completion_tokens == predicted[-1]
    assert timings["prompt_n"] + timings["cache_n"] == last.usage.prompt_tokens
    assert timings["predicted_per_second"] > 0 and "prompt_per_second" in timings


def test_without_timings_per_token_only_the_last_chunks_carry_timings(
        server: ServerProcess) -> None:
    """Each choice's finish chunk, and the usage chunk that ends the stream."""
    chunks = _chunks(server, {"messages": BOOK, "max_tokens": 6, "temperature": 0,
                              "stream_options": {"include_usage": True}})
    with_timings = [index for index, chunk in enumerate(chunks) if "timings" in chunk]
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
    finish = next(index for index, chunk in enumerate(chunks)
                  if chunk["choices"] and chunk["choices"][0]["finish_reason"])
    assert with_timings == [finish, len(chunks) - 1]


# ---------------------------------------------------------------- input_tokens

@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens",
                                  "/chat/completions/input_tokens"])
def test_input_tokens_counts_the_prompt_a_chat_request_would_have(
        server: ServerProcess, client: openai.OpenAI, path: str) -> None:
    """llama-server's count: what `usage.prompt_tokens` says for the same body, tools
    included (SmolLM2's template renders none: butter's preamble describes them)."""
    tools: list[Any] = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
    counts = []
    for body in ({"messages": BOOK}, {"messages": BOOK, "tools": tools}):
        reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["object"] == "response.input_tokens"
        counted = reply.json()["input_tokens"]
        chat = client.chat.completions.create(model=INSTRUCT_MODEL, max_tokens=1, **body)
        assert chat.usage is not None and counted == chat.usage.prompt_tokens
        counts.append(counted)
    assert counts[1] > counts[0] > 5


def test_input_tokens_counts_a_prompt_too_long_to_serve(server: ServerProcess,
                                                         client: openai.OpenAI) -> None:
    """A count, not a generation: a prompt past the context is counted (the chat request
    itself is refused), and a model the server does not hold is not found."""
    long = [{"role": "user", "content": "one two three four " * 400}]
    counted = httpx.post(f"{server.api}/chat/completions/input_tokens",
                         json={"messages": long}, timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > CONTEXT
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=INSTRUCT_MODEL, messages=long,
                                       max_tokens=1)
    assert str(counted.json()["input_tokens"]) in str(refused.value)
    other = httpx.post(f"{server.api}/chat/completions/input_tokens",
                       json={"model": "another-model", "messages": BOOK}, timeout=60)
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    empty = httpx.post(f"{server.api}/chat/completions/input_tokens",
                       json={"messages": []}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------- the continuation fields

PREFILLED = [{"role": "system", "content": "Geography"},
             {"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
# SmolLM2's ChatML, with the final assistant message left open.
PREFILLED_PROMPT = ("<|im_start|>system\nGeography<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\nThe capital of France is")


@pytest.mark.parametrize(("fields", "messages"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, PREFILLED),
    ({"add_generation_prompt": False, "continue_final_message": True}, PREFILLED[:2]),
    ({"continue_final_message": True}, [*PREFILLED, {"role": "user", "content": "Hi"}]),
])
def test_continuations_that_cannot_be_served_are_refused(
        client: openai.OpenAI, fields: dict[str, bool], messages: Any) -> None:
    """Both at once contradict each other (llama-server and vLLM answer 400 too); a final
    message that is not the assistant's has nothing to continue."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=INSTRUCT_MODEL, messages=messages,
                                       max_tokens=2, extra_body=fields)
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "continue_final_message"
    assert "continue_final_message" in refused.value.body["message"]


def _verbose(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{server.api}/chat/completions", timeout=60, json={
        "model": INSTRUCT_MODEL, "temperature": 0, "verbose": True, **body})
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


@pytest.mark.parametrize("fields", [
    {"add_generation_prompt": False, "continue_final_message": True},
    {"continue_final_message": True},  # add_generation_prompt then defaults to false
])
def test_continue_final_message_continues_the_assistants_text(
        server: ServerProcess, fields: dict[str, bool]) -> None:
    """The prompt ends inside the final assistant message (no end of turn), and the answer
    is only the new text, which the greedy model writes as the sentence's end; /tokenize
    with the same body counts the same prompt."""
    body = {"messages": PREFILLED, "max_tokens": 8, **fields}
    reply = _verbose(server, body)
    assert reply["__verbose"]["prompt"] == PREFILLED_PROMPT
    content = reply["choices"][0]["message"]["content"]
    assert "Paris" in content and not content.startswith("The capital")
    fresh = _verbose(server, {"messages": PREFILLED[:2], "max_tokens": 8})
    assert fresh["choices"][0]["message"]["content"] != content
    counted = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()
    assert counted["count"] == reply["usage"]["prompt_tokens"]


def test_a_continued_open_think_block_continues_as_reasoning(server: ServerProcess) -> None:
    """A final assistant message inside a <think> block it has not closed: the model's
    continuation is reasoning (until it closes the block), not the answer's content."""
    thinking = [*PREFILLED[:2], {"role": "assistant",
                                 "content": "<think>\nThe capital of France is"}]
    reply = _verbose(server, {"messages": thinking, "max_tokens": 8,
                              "continue_final_message": True})
    assert reply["__verbose"]["prompt"].endswith("assistant\n<think>\nThe capital of France is")
    message = reply["choices"][0]["message"]
    assert "Paris" in message["reasoning_content"] and not message["content"]


def test_without_the_generation_prompt_the_prompt_ends_after_the_last_message(
        server: ServerProcess) -> None:
    body = {"messages": BOOK, "max_tokens": 2, "add_generation_prompt": False}
    reply = _verbose(server, body)
    assert reply["__verbose"]["prompt"] == BOOK_PROMPT.removesuffix("<|im_start|>assistant\n")
    counted = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()
    assert counted["count"] == reply["usage"]["prompt_tokens"]
    whole = httpx.post(f"{server.base_url}/tokenize", json={"messages": BOOK},
                       timeout=60).json()
    assert whole["count"] > counted["count"]


def test_the_continuation_fields_at_their_defaults_are_served(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=INSTRUCT_MODEL, messages=BOOK, max_tokens=2,
        extra_body={"add_generation_prompt": True, "continue_final_message": False})
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_two_assistant_turns_in_a_row_are_served_where_the_template_renders_them(
        client: openai.OpenAI) -> None:
    """llama-server refuses [user, assistant, assistant]; ChatML renders it, so butter
    serves it (the template is the judge of what a conversation may look like)."""
    messages: Any = [{"role": "user", "content": "test"},
                     {"role": "assistant", "content": "test"},
                     {"role": "assistant", "content": "test"}]
    reply = client.chat.completions.create(model=INSTRUCT_MODEL, messages=messages,
                                           max_tokens=2)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


# ---------------------------------------------------------------- verbose

def test_verbose_returns_the_prompt_as_the_model_saw_it(server: ServerProcess) -> None:
    body = {"model": INSTRUCT_MODEL, "messages": BOOK, "max_tokens": 3, "temperature": 0}
    plain = httpx.post(f"{server.api}/chat/completions", json=body, timeout=60).json()
    assert "__verbose" not in plain
    reply = httpx.post(f"{server.api}/chat/completions", json={**body, "verbose": True},
                       timeout=60).json()
    verbose, usage = reply["__verbose"], reply["usage"]
    assert verbose["prompt"] == BOOK_PROMPT
    assert verbose["content"] == reply["choices"][0]["message"]["content"]
    assert verbose["tokens_evaluated"] == usage["prompt_tokens"]
    assert verbose["tokens_predicted"] == usage["completion_tokens"] == 3
    assert verbose["stop_type"] == "limit" and verbose["stopping_word"] == ""
    assert verbose["timings"]["predicted_n"] == 3
    chunks = _chunks(server, {**body, "verbose": True, "n": 2})
    finishes = [chunk for chunk in chunks if "__verbose" in chunk]  # each choice's last
    assert [chunk["choices"][0]["finish_reason"] for chunk in finishes] == ["length"] * 2
    assert [chunk["__verbose"]["index"] for chunk in finishes] == [0, 1]
    assert all(chunk["__verbose"]["prompt"] == BOOK_PROMPT
               and "content" not in chunk["__verbose"] for chunk in finishes)


def test_verbose_says_which_stop_string_ended_the_answer(server: ServerProcess) -> None:
    body = {"model": INSTRUCT_MODEL, "messages": BOOK, "max_tokens": 40, "temperature": 0,
            "verbose": True}
    whole = httpx.post(f"{server.api}/chat/completions", json=body, timeout=60).json()
    text = whole["choices"][0]["message"]["content"]
    word = text.split()[1]  # a word the same greedy answer writes again
    stopped = httpx.post(f"{server.api}/chat/completions", json={**body, "stop": [word]},
                         timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["__verbose"]["stop_type"] == "word"
    assert stopped["__verbose"]["stopping_word"] == word


# ---------------------------------------------------------------- return_progress

def _progress(server: ServerProcess, messages: list[dict[str, str]]) -> list[dict[str, int]]:
    chunks = _chunks(server, {"messages": messages, "max_tokens": 4,
                              "return_progress": True})
    return [chunk["prompt_progress"] for chunk in chunks if "prompt_progress" in chunk]


def test_progress_starts_where_the_cache_leaves_the_prompt(server: ServerProcess) -> None:
    """As llama-server reports it: the first report is where the evaluation starts
    (`processed` == `cache`), then it counts up to the whole prompt, the cached part the
    same in every report. The same prompt again starts at its cached part."""
    messages = [{"role": "user", "content": "This is a test " * 60}]
    for attempt in ("cold", "cached"):
        reports = _progress(server, messages)
        assert len(reports) >= 2, (attempt, reports)
        first, last = reports[0], reports[-1]
        assert first["processed"] == first["cache"], (attempt, reports)
        assert {report["cache"] for report in reports} == {first["cache"]}
        assert {report["total"] for report in reports} == {last["total"]}
        processed = [report["processed"] for report in reports]
        assert processed == sorted(set(processed)), (attempt, reports)
        assert last["processed"] == last["total"] > 60
    assert first["cache"] == last["total"] - 1  # all of it but the token sampled from


# ---------------------------------------------------------------- Anthropic, no messages

def test_an_anthropic_request_without_messages_answers_its_system_prompt(
        server: ServerProcess) -> None:
    """llama-server answers `messages: []`; so does butter: the prompt is the system
    prompt, as the template renders it, then the assistant's turn. count_tokens agrees."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    for system in ("You answer in one word.", None):
        extra: dict[str, Any] = {} if system is None else {"system": system}
        message = client.messages.create(model=INSTRUCT_MODEL, max_tokens=8, messages=[],
                                         **extra)
        assert message.type == "message" and message.usage.output_tokens >= 1
        counted = client.messages.count_tokens(model=INSTRUCT_MODEL, messages=[], **extra)
        usage = message.usage
        assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert counted.input_tokens > 3  # SmolLM2's template writes its own system prompt


def test_a_prompt_of_no_tokens_is_refused_and_the_server_goes_on(
        server: ServerProcess, client: openai.OpenAI) -> None:
    """An empty text prompt has no tokens on a model without BOS (SmolLM2): there is
    nothing to evaluate, so it is refused (it used to hold its session forever)."""
    reply = httpx.post(f"{server.api}/completions",
                       json={"model": INSTRUCT_MODEL, "prompt": "", "max_tokens": 3},
                       timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    for _ in range(3):  # (more than the sessions: none of them is held)
        answer = client.chat.completions.create(model=INSTRUCT_MODEL, messages=BOOK,
                                                max_tokens=2)
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
