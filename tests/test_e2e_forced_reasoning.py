"""A forced tool call or JSON output where the prompt opens a reasoning block (#51).

Qwen3's and Qwen3.5's templates end the generation prompt with `<think>\\n` while thinking
is on, so the answer starts inside a reasoning block. A forced call (`tool_choice`
required or named, Anthropic's `any` / `tool`) or a `response_format` schema must still
come back as a call or as content: the grammar lets the model end its reasoning first,
then holds it to the call or the JSON, which the reader finds after `</think>`.

The server runs a tiny random Qwen3 with Qwen3.5's own template. A random model almost
never writes `</think>`, so this one's LM head is changed to favour it (every embedding
shares one large component, and the `</think>` row reads only that one): at temperature
1 it closes its reasoning after a few tokens, or at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from butter.chat.grammar import json_schema_grammar, tool_call_grammar
from butter.pipeline.prepare import constrained_after_reasoning
from butter.sampling import OutputConstraint, SamplingParams
from butter.testing.tiny_gguf import build_tiny_tokenizer, special_token_ids, write_tiny_qwen3_gguf
from tests.conftest import ServerProcess

QWEN35_TEMPLATE = Path(__file__).parents[1] / "benchmarks" / "templates" / "Qwen3.5-4B.jinja"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city", "parameters": CITY}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", '{"name"', '{"city"')
CHOICES = 8  # answers per request (`n`): a seed's draws, some of them with reasoning
# Room for the reasoning (a few tokens, rarely 60) and the call (about 20).
MAX_TOKENS = 400


def favour_think_close(path: Path) -> None:
    """Make the (F32) tiny model likely to write `</think>`: the first component of every
    embedding is large, so the residual stream's is too, and the `</think>` row of the LM
    head reads only that component: its logit sits near the top at every step."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    tensors["token_embd.weight"].data[:, 0] = 8.0
    row = tensors["output.weight"].data[special_token_ids()["</think>"]]
    row[:] = 0.0
    row[0] = 0.8
    reader.data.flush()
    del reader


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = write_tiny_qwen3_gguf(tmp_path_factory.mktemp("thinker") / "thinker.gguf",
                                 quantize=False)
    favour_think_close(path)
    server = ServerProcess(["--model", str(path), "--alias", "tiny",
                            "--chat-template", str(QWEN35_TEMPLATE),
                            "--parallel", str(CHOICES), "--max-context", "4096"])
    yield server
    server.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def _model(client: openai.OpenAI) -> str:
    return str(client.models.list().data[0].id)


def _no_markup(text: str | None) -> bool:
    return not any(tag in (text or "") for tag in MARKUP)


# ------------------------------------------------------------------ the grammar alone


def _matcher_tokens(text: str, *, special: bool) -> tuple[Any, list[int]]:
    """llguidance's view of the tiny vocabulary, and `text` as tokens: its markers as the
    vocabulary's tokens for them (`special`), or spelled out a character at a time."""
    pytest.importorskip("transformers")
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=build_tiny_tokenizer())
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    if special:
        return tokenizer, hf.encode(text, add_special_tokens=False)
    return tokenizer, [token for char in text for token in hf.encode(char,
                                                                     add_special_tokens=False)]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
JSON = '{"city": "Rome"}'


@pytest.mark.parametrize("special", [True, False], ids=["marker-token", "marker-text"])
@pytest.mark.parametrize("constraint, answer", [
    (tool_call_grammar([WEATHER]), CALL), (json_schema_grammar(CITY), JSON)],
    ids=["call", "json"])
def test_the_grammar_ends_the_reasoning_before_the_answer(
        constraint: OutputConstraint, answer: str, special: bool) -> None:
    """After an open `<think>`: any reasoning (or none), `</think>`, a blank line or two,
    then the call or the JSON; the answer alone (still inside the reasoning), a second
    `</think>` or a run of blanks is not it. `</think>` as the vocabulary's token, or
    spelled out (a vocabulary without it: the reasoning ends at its first `</think>`)."""
    from llguidance import LLMatcher

    from butter.backends.constraints import constraint_grammar

    def marker(text: str) -> str:
        return f"<[{special_token_ids()[text]}]>" if special else json.dumps(text)

    grammar = constraint_grammar(constraint.after_open_reasoning(), marker)
    for output, complete in [
        (f"Paris is a city.\nCall it.</think>\n\n{answer}", True),
        (f"</think>{answer}", True),
        (f"ok</think> {answer}", True),
        # Still reasoning, never the end of the output; and a call's marker token is
        # refused there.
        (answer, None if special and answer == CALL else False),
        (f"a</think>b</think>{answer}", None),
        (f"a</think>\n\n\n\n\n\n{answer}", None),  # blanks without end: refused
    ]:
        tokenizer, tokens = _matcher_tokens(output, special=special)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        consumed = matcher.consume_tokens(tokens)
        if complete is None:
            assert not consumed, output
        else:
            assert consumed and matcher.is_accepting() == complete, output


def test_only_a_json_constraint_moves_after_the_reasoning() -> None:
    call = tool_call_grammar([WEATHER])
    moved = constrained_after_reasoning(SamplingParams(grammar=call), True)
    assert moved.grammar == call.after_open_reasoning() != call
    assert moved.grammar is not None and moved.grammar.after_reasoning
    assert constrained_after_reasoning(SamplingParams(grammar=call), False).grammar == call
    gbnf = OutputConstraint.of_gbnf('root ::= "yes" | "no"')  # the client's, as sent
    assert constrained_after_reasoning(SamplingParams(grammar=gbnf), True).grammar == gbnf
    assert constrained_after_reasoning(SamplingParams(), True).grammar is None


@pytest.mark.parametrize("fixture", ["tiny_gguf", "tiny_mlx"])
def test_both_backends_end_the_reasoning_with_its_token(
        fixture: str, request: pytest.FixtureRequest) -> None:
    """Each backend's grammar has `</think>` as the vocabulary's token (as a call's
    markers: a bias on that token closes the reasoning, where a `</think>` spelled out in
    text would refuse it), then holds the output to the call. (A server of its own: both
    backends loaded in one process can abort as it exits.)"""
    path = request.getfixturevalue(fixture)
    server = ServerProcess(["--model", str(path), "--chat-template", str(QWEN35_TEMPLATE),
                            "--max-context", "2048"])
    try:
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0,
                               timeout=120)
        result = client.chat.completions.create(
            model=_model(client), messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required", max_tokens=60, temperature=0,
            logit_bias={str(special_token_ids()["</think>"]): 100})
    finally:
        server.stop()
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content and not choice.message.model_dump().get(
        "reasoning_content")
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


# ------------------------------------------------------------------ OpenAI


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"])
def test_a_forced_call_with_thinking_on_comes_back_as_a_call(
        client: openai.OpenAI, tool_choice: Any) -> None:
    """Every answer: finish reason tool_calls, one call of a tool offered (the named one),
    no content, and whatever the model reasoned first in reasoning_content, never markup."""
    result = client.chat.completions.create(
        model=_model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
        max_tokens=MAX_TOKENS, temperature=1, seed=7, n=CHOICES)  # type: ignore[arg-type]
    reasoned = 0
    for choice in result.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name in (["get_weather", "get_time"] if tool_choice == "required"
                                      else ["get_time"])
        assert isinstance(json.loads(call.function.arguments), dict)
        assert not choice.message.content
        reasoning = choice.message.model_dump().get("reasoning_content")
        assert _no_markup(reasoning), reasoning
        reasoned += bool(reasoning)
    assert reasoned  # some answers reasoned before their call


def test_a_forced_call_with_thinking_on_streams_as_a_call(client: openai.OpenAI) -> None:
    """Streamed: reasoning deltas, then the call's deltas (its id and name first, then its
    arguments); finish reason tool_calls; no content."""
    reasoning: dict[int, str] = {}
    content: dict[int, str] = {}
    deltas: dict[int, list[Any]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(
            model=_model(client), messages=ASK, tools=[WEATHER, TIME],  # type: ignore[arg-type]
            tool_choice="required", max_tokens=MAX_TOKENS, temperature=1, seed=11,
            n=CHOICES, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning[choice.index] = (reasoning.get(choice.index, "")
                                       + (delta.get("reasoning_content") or ""))
            content[choice.index] = content.get(choice.index, "") + (delta.get("content") or "")
            calls = deltas.setdefault(choice.index, [])
            if choice.delta.tool_calls:
                calls.extend(choice.delta.tool_calls)
            else:  # nothing of the answer after its call
                assert not calls or not delta.get("reasoning_content"), delta
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == dict.fromkeys(range(CHOICES), "tool_calls")
    for index in range(CHOICES):
        assert content[index] == "" and _no_markup(reasoning[index]), reasoning[index]
        first = deltas[index][0]
        assert first.id.startswith("call_") and first.function.name in ("get_weather",
                                                                         "get_time")
        assert {d.index for d in deltas[index]} == {0}
        arguments = "".join(d.function.arguments or "" for d in deltas[index] if d.function)
        assert isinstance(json.loads(arguments), dict)
    assert any(reasoning.values())


def test_a_json_schema_with_thinking_on_comes_back_as_content(client: openai.OpenAI) -> None:
    """response_format json_schema while the prompt opens a think block: the JSON is the
    content (whole and streamed), the reasoning before it reasoning_content."""
    ask: dict[str, Any] = {
        "model": _model(client), "messages": ASK, "max_tokens": MAX_TOKENS, "temperature": 1,
        "seed": 5, "n": CHOICES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}
    whole = client.chat.completions.create(**ask)
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice
        assert json.loads(choice.message.content or "")["city"] in ("Paris", "Rome")
        assert _no_markup(choice.message.model_dump().get("reasoning_content"))
    assert any(choice.message.model_dump().get("reasoning_content")
               for choice in whole.choices)
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            content[choice.index] = content.get(choice.index, "") + (delta.get("content") or "")
            assert _no_markup(delta.get("reasoning_content")), delta
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == dict.fromkeys(range(CHOICES), "stop")
    assert all(json.loads(text)["city"] in ("Paris", "Rome") for text in content.values())


def test_thinking_off_keeps_the_call_from_the_first_token(client: openai.OpenAI) -> None:
    """With thinking off the template closes the think block itself: the call as before."""
    result = client.chat.completions.create(
        model=_model(client), messages=ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=MAX_TOKENS, temperature=1, seed=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.model_dump().get("reasoning_content")
    assert [call.function.name for call in choice.message.tool_calls or []] == ["get_weather"]


# ------------------------------------------------------------------ Anthropic


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}],
                         ids=["any", "tool"])
def test_an_anthropic_forced_tool_use_with_thinking_on(
        server: ServerProcess, tool_choice: dict[str, str]) -> None:
    """tool_choice any / tool while the template opens a think block: stop_reason
    tool_use, a thinking block if the model reasoned, then one tool_use block and no text,
    whole and through the SDK's stream."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                 timeout=120)
    names = ["get_weather", "get_time"] if tool_choice["type"] == "any" else ["get_time"]
    ask: dict[str, Any] = {
        "model": "tiny", "messages": ASK, "max_tokens": MAX_TOKENS,
        "extra_body": {"temperature": 1.0},
        "tool_choice": tool_choice, "tools": [
            {"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]}
            for tool in (WEATHER, TIME)]}
    messages = []
    for _ in range(4):
        messages.append(client.messages.create(**ask))
        with client.messages.stream(**ask) as stream:
            messages.append(stream.get_final_message())
    for message in messages:
        assert message.stop_reason == "tool_use", message
        kinds = [block.type for block in message.content]
        assert kinds in (["tool_use"], ["thinking", "tool_use"]), kinds
        call = message.content[-1]
        assert call.name in names and set(call.input) <= {"city", "zone"} and call.input
        for block in message.content[:-1]:
            assert block.thinking and _no_markup(block.thinking), block
    assert any(message.content[0].type == "thinking" for message in messages)

