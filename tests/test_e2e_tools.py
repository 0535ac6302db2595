"""Tool calls, JSON output and reasoning end to end, through the official openai SDK."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from butter.backends.llama_cpp import LlamaCppBackend
from butter.chat.grammar import json_schema_grammar, tool_call_grammar
from butter.errors import InvalidRequest
from butter.sampling import SamplingParams
from tests.conftest import ServerProcess, start_instruct_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture
def client(demo_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.api, api_key="unused", max_retries=0, timeout=120)


def test_required_tool_call_non_stream(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="gemma-3-270m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=80, temperature=0,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict)
    assert "<tool_call>" not in (choice.message.content or "")


def test_named_tool_call_streams_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="gemma-3-270m", messages=ASK, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80, temperature=0.7, seed=4, stream=True,
    )
    deltas = []
    finish = None
    content = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas.extend(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert len(deltas) >= 2
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function and first.function.name == "get_weather"
    assert all(d.id is None and d.function and d.function.name is None for d in rest)
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert isinstance(json.loads(arguments)["city"], str)
    assert "<tool_call>" not in content


def test_tool_round_trip_reuses_the_prefix(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="gemma-3-270m", messages=ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=80, temperature=0,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    follow_up = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 °C"},
    ]
    second = client.chat.completions.create(
        model="gemma-3-270m", messages=follow_up, tools=[WEATHER], max_tokens=24, temperature=0,
    )
    assert second.usage and second.usage.prompt_tokens_details
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_offers_no_tools(client: openai.OpenAI) -> None:
    with_tools = client.chat.completions.create(
        model="gemma-3-270m", messages=ASK, tools=[WEATHER], tool_choice="none",
        max_tokens=1, temperature=0,
    )
    without = client.chat.completions.create(
        model="gemma-3-270m", messages=ASK, max_tokens=1, temperature=0,
    )
    assert with_tools.usage and without.usage
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    # The grammar follows the schema as written: without additionalProperties false other
    # keys would be valid too, and without bounds so would be an integer of any length
    # (which a 270M model at this seed writes until max_tokens).
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    result = client.chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        max_tokens=80, temperature=0.7, seed=2,
    )
    body = json.loads(result.choices[0].message.content or "")
    assert set(body) == {"name", "age"}
    assert isinstance(body["name"], str) and isinstance(body["age"], int)


def test_json_object_response_format(client: openai.OpenAI) -> None:
    # A 270M base model rambles inside free-form JSON and rarely closes the object within
    # max_tokens, so check what the grammar guarantees: the output is JSON from the start.
    ask = [{"role": "user", "content": "Describe a cat."}]
    free = client.chat.completions.create(model="gemma-3-270m", messages=ask, max_tokens=8,
                                          temperature=0)
    constrained = client.chat.completions.create(
        model="gemma-3-270m", messages=ask, response_format={"type": "json_object"},
        max_tokens=8, temperature=0,
    )
    assert not (free.choices[0].message.content or "").lstrip().startswith("{")
    text = (constrained.choices[0].message.content or "").lstrip()
    assert text.startswith("{")
    decoder = json.JSONDecoder()
    try:
        decoder.decode(text)
    except json.JSONDecodeError as exc:  # cut off by max_tokens: only at the very end
        assert exc.pos == len(text) or exc.msg.startswith(("Unterminated", "Expecting"))


def test_bad_tool_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="gemma-3-270m", messages=ASK, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="gemma-3-270m", messages=ASK, tools=[WEATHER],
                                       tool_choice="sometimes")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="requires tools"):
        client.chat.completions.create(model="gemma-3-270m", messages=ASK,
                                       tool_choice="required")


def test_constraints_are_accepted_by_llama_cpp(tiny_gguf: Path) -> None:
    backend = LlamaCppBackend(tiny_gguf, n_cells=256, n_seq=1, n_batch=64, threads=1)
    try:
        for constraint in (
            tool_call_grammar([WEATHER, TIME]),
            tool_call_grammar([WEATHER, TIME], "get_time"),
            json_schema_grammar({"type": "object", "properties": {"age": {"type": "integer"}}}),
        ):
            backend.check_sampling(SamplingParams(grammar=constraint))
        with pytest.raises(ValueError, match="cannot turn this JSON schema into a grammar"):
            backend.check_sampling(SamplingParams(
                grammar=json_schema_grammar({"$ref": "#/definitions/missing"})))
    finally:
        backend.close()
    with pytest.raises(InvalidRequest):
        tool_call_grammar([WEATHER], "missing")


@pytest.fixture(scope="module")
def thinking_server(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
        "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}"
    )
    server = ServerProcess(["--model", str(tiny_gguf), "--chat-template", str(template)])
    yield server
    server.stop()


def test_template_opened_think_block_becomes_reasoning(thinking_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=thinking_server.api, api_key="x", max_retries=0)
    thinking = client.chat.completions.create(
        model=str(client.models.list().data[0].id),
        messages=[{"role": "user", "content": "hi"}], max_tokens=30, temperature=0,
    )
    message = thinking.choices[0].message.model_dump()
    reasoning = message.get("reasoning_content") or ""
    assert reasoning  # generation starts inside the <think> the template opened
    for text in (reasoning, message.get("content") or ""):
        assert "<think>" not in text and "</think>" not in text
    plain = client.chat.completions.create(
        model=str(client.models.list().data[0].id), messages=[{"role": "user", "content": "hi"}],
        max_tokens=30, temperature=0, extra_body={"chat_template_kwargs": {
            "enable_thinking": False}},
    )
    assert not plain.choices[0].message.model_dump().get("reasoning_content")


@pytest.fixture(scope="module")
def instruct_server() -> Iterator[ServerProcess]:
    server = start_instruct_server("--max-context", "2048")
    yield server
    server.stop()


def test_a_two_round_tool_loop_on_a_template_without_tool_support(
    instruct_server: ServerProcess,
) -> None:
    """SmolLM2's ChatML template knows neither tools nor tool calls nor null content; the
    agent loop's second request (the assistant's call, `content: null`, then the tool's
    result) renders anyway, with the call and the result in the preamble's markup."""
    client = openai.OpenAI(base_url=instruct_server.api, api_key="unused", max_retries=0,
                           timeout=120)
    meta = client.models.list().data[0].model_dump()["meta"]
    capabilities = meta["chat_template_capabilities"]
    assert not capabilities["tools"] and not capabilities["tool_calls"]
    messages: list[dict[str, object]] = [*ASK]
    first = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=[WEATHER], tool_choice="required",
        max_tokens=64, temperature=0)  # type: ignore[arg-type]
    call = (first.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_weather"
    turn = first.choices[0].message.model_dump(exclude_none=True)
    turn["content"] = None  # as openai-agents and pydantic-ai send it
    messages += [turn, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 °C"}]
    final = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=[WEATHER], max_tokens=48,
        temperature=0)  # type: ignore[arg-type]
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage is not None and final.usage.prompt_tokens_details is not None
    # The second prompt extends the first: its tool round came out of the cache.
    assert final.usage.prompt_tokens_details.cached_tokens > 0
    again = client.chat.completions.create(  # and without `tools` at all
        model="smollm2-135m", messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert again.choices[0].message.role == "assistant"


def test_a_gbnf_grammar_shapes_the_output(instruct_server: ServerProcess) -> None:
    """llama-server's `grammar` field, on both OpenAI routes; a bad grammar is a 400."""
    import httpx

    answer = "root ::= verdict \".\"\nverdict ::= \"yes\" | \"no\""
    chat = httpx.post(f"{instruct_server.api}/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Is the sky blue?"}], "grammar": answer,
        "max_tokens": 10}).json()["choices"][0]
    assert chat["message"]["content"] in ("yes.", "no.") and chat["finish_reason"] == "stop"
    word = httpx.post(f"{instruct_server.api}/completions", timeout=60, json={
        "prompt": "The sky is", "grammar": 'root ::= " " [a-z]+ "."', "max_tokens": 12,
        "temperature": 0}).json()["choices"][0]
    assert word["text"][0] == " " and word["text"][1:-1].isalpha() and word["text"][-1] == "."
    for bad, reason in (("root ::= (((", "Expected ')'"), ("root ::= nothing", "'nothing'"),
                        ('x ::= "a"', "No 'root'")):
        refused = httpx.post(f"{instruct_server.api}/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "grammar": bad})
        assert refused.status_code == 400, bad
        assert "invalid GBNF grammar" in refused.text and reason in refused.text
    both = httpx.post(f"{instruct_server.api}/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "grammar": answer,
        "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "grammar"


def test_an_openai_agents_tool_loop(instruct_server: ServerProcess) -> None:
    """openai-agents (from PyPI), unmodified: round one calls the tool (forced), its result
    goes back as the SDK sends it, and round two answers (the SDK resets tool_choice)."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return (f"Sunny, 21 C in {city}. Tell the user this weather in one sentence now; "
                "do not call any tool again.")

    client = AsyncOpenAI(base_url=instruct_server.api, api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer questions about weather using the tool.",
        tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model="smollm2-135m", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=64))
    log_start = len(instruct_server.output)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    def rounds() -> int:
        return sum("/v1/chat/completions finish=" in line
                   for line in instruct_server.output[log_start:])

    deadline = time.monotonic() + 30  # the request log reaches the pipe after the answer
    while rounds() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rounds() == 2  # the call, then the answer



# ------------------------------------------- calls cut by max_tokens, on SmolLM2 (ChatML)

FINAL_ANSWER = {"type": "function", "function": {
    "name": "final_answer", "description": "Give the final answer",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                   "required": ["answer"]}}}
FORECAST = {"type": "object", "properties": {"city": {"type": "string"},
                                             "days": {"type": "integer"}},
            "required": ["city", "days"]}


def _squeezed(text: str) -> str:
    """Without white space (a prefix stays a prefix: the server writes a whole call's
    arguments in its own layout, a cut one as the model wrote them)."""
    return "".join(text.split())


def _as_far_as(partial: dict[str, object], whole: dict[str, object]) -> bool:
    """`partial` holds members of `whole`, a number possibly cut short."""
    return all(key in whole and (value == whole[key] or (
        isinstance(value, int) and str(whole[key]).startswith(str(value))))
        for key, value in partial.items())


# Questions whose forced final_answer call SmolLM2 finishes within 200 tokens, greedily: which
# ones do depends on the CPU class (its kernels' last bits steer a 135M model's text: on an
# AVX2-only Zen 3 it never closes its answer to the first, repeating "2 + 2 = 4" inside it).
FORCED_QUESTIONS = ("What is 2+2? Explain at length.",
                    "What is the capital of France? Explain at length.",
                    "Why is the sky blue? Explain at length.")


def _a_finished_forced_call(client: openai.OpenAI) -> tuple[dict[str, Any], Any]:
    """The request for the first of FORCED_QUESTIONS whose whole call the model finishes,
    and that whole answer: the reference every cut is held to."""
    for question in FORCED_QUESTIONS:
        ask: dict[str, Any] = {
            "model": "smollm2-135m", "messages": [{"role": "user", "content": question}],
            "tools": [FINAL_ANSWER], "tool_choice": "required", "temperature": 0}
        whole = client.chat.completions.create(**ask, max_tokens=200)
        if whole.choices[0].finish_reason == "tool_calls":
            return ask, whole
    raise AssertionError(f"no forced call finished within 200 tokens: {FORCED_QUESTIONS}")


def test_a_forced_call_cut_by_max_tokens_is_a_call_not_markup(
        instruct_server: ServerProcess) -> None:
    """smolagents' case (its own max_tokens cut the forced final_answer call): at every
    cut the answer is no text and either nothing (the function's name was not finished)
    or the call as far as it went, its arguments a prefix of the whole call's; finish
    reason length, streamed or not."""
    client = openai.OpenAI(base_url=instruct_server.api, api_key="unused", max_retries=0,
                           timeout=120)
    ask, whole = _a_finished_forced_call(client)
    (call,) = whole.choices[0].message.tool_calls or []
    written = _squeezed(call.function.arguments)
    outcomes = set()
    for max_tokens in range(2, whole.usage.completion_tokens, 2):
        cut = client.chat.completions.create(**ask, max_tokens=max_tokens)  # type: ignore[call-overload]
        choice = cut.choices[0]
        assert choice.finish_reason == "length", max_tokens
        assert not choice.message.content, (max_tokens, choice.message.content)
        calls = [(c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        assert len(calls) <= 1 and all(c.id.startswith("call_")
                                       for c in choice.message.tool_calls or [])
        for name, arguments in calls:
            assert name == "final_answer" and written.startswith(_squeezed(arguments))
        outcomes.add(bool(calls))
        content, deltas, finish = "", [], None
        for chunk in client.chat.completions.create(**ask, max_tokens=max_tokens,
                                                    stream=True):  # type: ignore[call-overload]
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                deltas += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and content == "", (max_tokens, content)
        streamed = [(d.function.name, "".join(e.function.arguments or "" for e in deltas
                                              if e.index == d.index and e.function))
                    for d in deltas if d.id and d.function]
        assert streamed == calls, max_tokens
    assert outcomes == {False, True}  # cut inside the name, and inside the arguments


def test_a_tool_use_cut_by_max_tokens_has_its_input_as_far_as_it_went(
        instruct_server: ServerProcess) -> None:
    """Anthropic's words: stop_reason max_tokens, a tool_use block (or none, where the
    name was not finished) whose input holds the members written so far; the SDK's stream
    (which reads the partial input_json) gives the same message."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=instruct_server.base_url, api_key="unused",
                                 max_retries=0, timeout=120)
    ask = {"model": "smollm2-135m", "messages": [
        {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}],
        "tools": [{"name": "get_weather", "description": "Weather forecast for a city",
                   "input_schema": FORECAST}],
        "tool_choice": {"type": "any"}, "extra_body": {"temperature": 0}}
    whole = client.messages.create(**ask, max_tokens=200)
    assert whole.stop_reason == "tool_use"
    (call,) = whole.content
    assert call.type == "tool_use" and set(call.input) == {"city", "days"}
    inputs = []
    for max_tokens in range(2, whole.usage.output_tokens, 3):
        cut = client.messages.create(**ask, max_tokens=max_tokens)
        with client.messages.stream(**ask, max_tokens=max_tokens) as stream:
            streamed = stream.get_final_message()
        assert cut.stop_reason == streamed.stop_reason == "max_tokens", max_tokens
        blocks = [(b.type, b.name, b.input) for b in cut.content]
        assert blocks == [(b.type, b.name, b.input) for b in streamed.content], max_tokens
        assert len(blocks) <= 1, blocks
        for kind, name, given in blocks:
            assert kind == "tool_use" and name == "get_weather"
            assert _as_far_as(given, call.input), (given, call.input)
            inputs.append(given)
    assert {} in inputs and {"city": "Paris"} in inputs  # before and after the first member


def test_an_ollama_call_cut_by_num_predict(instruct_server: ServerProcess) -> None:
    """Ollama has no tool_choice: SmolLM2 calls the tool after two examples of it. Cut at
    every few tokens: done_reason length, no markup in content, the call's arguments (an
    object) as far as they went, streamed or not."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=instruct_server.base_url, timeout=120)
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city",
        "parameters": FORECAST}}

    def example(city: str, days: int) -> list[dict[str, object]]:
        return [{"role": "user", "content": f"What is the weather in {city} for {days} days?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {
                    "name": "get_weather", "arguments": {"city": city, "days": days}}}]},
                {"role": "tool", "content": "Sunny", "tool_name": "get_weather"},
                {"role": "assistant", "content": f"It is sunny in {city}."}]

    messages = [*example("Oslo", 2), *example("Rome", 5),
                {"role": "user", "content": "What is the weather in Paris for 3 days?"}]

    def chat(num_predict: int, stream: bool = False) -> object:
        return client.chat(model="smollm2-135m", messages=messages, tools=[weather],
                           stream=stream, options={"num_predict": num_predict,
                                                   "temperature": 0})

    whole = chat(100)
    (call,) = whole.message.tool_calls or []
    assert whole.done_reason == "stop" and call.function.arguments == {"city": "Paris",
                                                                       "days": 3}
    named = []
    for num_predict in range(2, whole.eval_count, 3):
        cut = chat(num_predict)
        parts = list(chat(num_predict, stream=True))
        assert cut.done_reason == parts[-1].done_reason == "length", num_predict
        assert cut.message.content == "".join(p.message.content for p in parts) == "", (
            num_predict, cut.message.content)
        calls = [(c.function.name, dict(c.function.arguments))
                 for c in cut.message.tool_calls or []]
        assert calls == [(c.function.name, dict(c.function.arguments))
                         for p in parts for c in p.message.tool_calls or []], num_predict
        assert len(calls) <= 1
        for name, arguments in calls:
            assert name == "get_weather" and _as_far_as(arguments, call.function.arguments)
            named.append(arguments)
    assert named and len(named) < len(range(2, whole.eval_count, 3))  # both kinds of cut


# ------------------------------------------- JSON schemas leave no object open, on SmolLM2

# `llm --schema 'name, age int'`: properties and required, no additionalProperties.
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _exactly_a_person(value: object) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, {**PERSON, "additionalProperties": False})
    assert isinstance(value, dict) and set(value) == {"name", "age"}


@pytest.mark.parametrize("strict", [True, False])
def test_a_response_format_schema_gets_exactly_its_keys(
        instruct_server: ServerProcess, strict: bool) -> None:
    """The schema as `llm` sends it (strict or not) once ran to 5,014 tokens of extra keys
    and an endless array; closed, the object ends after its two keys and the model's turn
    with it."""
    client = openai.OpenAI(base_url=instruct_server.api, api_key="unused", max_retries=0,
                           timeout=120)
    for seed in (1, 2, 3):
        result = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "strict": strict, "schema": PERSON}},
            max_tokens=200, temperature=0 if seed == 1 else 1.0, seed=seed)
        choice = result.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        _exactly_a_person(json.loads(choice.message.content or ""))


def test_an_ollama_format_schema_gets_exactly_its_keys(instruct_server: ServerProcess) -> None:
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=instruct_server.base_url, timeout=120)
    for seed in (1, 2, 3):
        result = client.chat(model="smollm2-135m", format=PERSON, options={
            "num_predict": 200, "seed": seed, "temperature": 0 if seed == 1 else 1.0},
            messages=[{"role": "user", "content": "Invent a person."}])
        assert result.done_reason == "stop", result.message.content
        _exactly_a_person(json.loads(result.message.content))


def test_an_anthropic_forced_tool_input_gets_exactly_its_keys(
        instruct_server: ServerProcess) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=instruct_server.base_url, api_key="unused",
                                 max_retries=0, timeout=120)
    result = client.messages.create(  # (the Messages API has no seed: greedy)
        model="smollm2-135m", max_tokens=200, tool_choice={"type": "any"},
        tools=[{"name": "record_person", "description": "Record a person",
                "input_schema": PERSON}],
        messages=[{"role": "user", "content": "Invent a person and record them."}],
        extra_body={"temperature": 0})
    assert result.stop_reason == "tool_use"
    (block,) = result.content
    assert block.type == "tool_use" and block.name == "record_person"
    _exactly_a_person(block.input)
