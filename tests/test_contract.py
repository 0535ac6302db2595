"""The HTTP contract, run against every backend: llama.cpp (tiny GGUF) and MLX (tiny MLX).

Random-weight models may emit an end token at any step, so these tests never assume that
max_tokens is reached.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from butter.testing.tiny_gguf import write_tiny_qwen3_gguf
from butter.testing.tiny_mlx import write_tiny_qwen3_mlx
from tests.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture(scope="module", params=["gguf", "mlx"])
def contract_server(request: pytest.FixtureRequest, tiny_gguf: Path, tiny_mlx: Path
                    ) -> Iterator[ServerProcess]:
    model = tiny_gguf if request.param == "gguf" else tiny_mlx
    server = ServerProcess(["--model", str(model), "--alias", "tiny", "--parallel", "4",
                            "--max-context", "1024"])
    yield server
    server.stop()


@pytest.fixture
def client(contract_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=contract_server.api, api_key="x", max_retries=0, timeout=60)


def test_non_stream_and_stream_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16,
                                           temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens <= 16
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_prefix_reuse_and_seeds(client: openai.OpenAI) -> None:
    def run(seed: int) -> tuple[str, int]:
        result = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Seeds and caches"}],
            max_tokens=12, temperature=0.9, seed=seed)
        assert result.usage and result.usage.prompt_tokens_details
        return (result.choices[0].message.content or "",
                result.usage.prompt_tokens_details.cached_tokens or 0)

    first, _ = run(5)
    second, cached = run(5)
    assert second == first and cached > 0


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24,
                                          temperature=0).choices[0].message.content or ""
    if len(base) < 4:
        pytest.skip("this random model ended at once")  # pragma: no cover - seed-specific
    stop = base[2:4]
    cut = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24,
                                         temperature=0, stop=[stop])
    assert cut.choices[0].message.content == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_penalties_change_a_greedy_answer(client: openai.OpenAI) -> None:
    def answer(**penalties: float) -> str:
        return client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=48, temperature=0, **penalties,
        ).choices[0].message.content or ""

    plain = answer()
    assert plain == answer()  # greedy: the difference below is the penalties' doing
    assert answer(presence_penalty=2.0, frequency_penalty=2.0) != plain


# Bounded arguments (an enum, a boolean) so that even a random model completes the call.
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"side": {"enum": ["left", "right"]}, "sure": {
        "type": "boolean"}}, "required": ["side", "sure"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_call_is_forced_by_the_grammar(client: openai.OpenAI, seed: int) -> None:
    result = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[PICK, NOOP], tool_choice="required",
        max_tokens=200, temperature=0.8, seed=seed)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)
    if call.function.name == "pick":
        assert arguments["side"] in ("left", "right") and isinstance(arguments["sure"], bool)
    else:
        assert call.function.name == "noop" and arguments == {}


def test_named_tool_and_json_schema_are_honoured(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[PICK, NOOP], max_tokens=200, temperature=0.8,
        tool_choice={"type": "function", "function": {"name": "noop"}}, seed=3)
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "noop"
    schema = PICK["function"]["parameters"]
    shaped = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.8, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    body = json.loads(shaped.choices[0].message.content or "")
    assert body["side"] in ("left", "right") and isinstance(body["sure"], bool)


def test_concurrent_requests_are_served_side_by_side(contract_server: ServerProcess) -> None:
    """Token-exact equality with sequential runs is checked at the engine level, where all
    lanes start in the same step (tests/test_engine.py); over HTTP, lanes join at different
    steps, and a decode row computed beside prompt rows can differ in the last bits."""
    before = httpx.get(f"{contract_server.api}/server").json()["engine"]
    results: dict[int, dict[str, object]] = {}

    async def lane(http: httpx.AsyncClient, i: int) -> None:
        response = await http.post(f"{contract_server.api}/chat/completions", json={
            "messages": [{"role": "user", "content": f"lane {i}: boats"}], "max_tokens": 12,
            "temperature": 0.8, "seed": i})
        assert response.status_code == 200
        results[i] = response.json()

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http, trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(lane, http, i)

    trio.run(main)
    after = httpx.get(f"{contract_server.api}/server").json()["engine"]
    completion = sum(int(r["usage"]["completion_tokens"]) for r in results.values())  # type: ignore[index, call-overload]
    assert completion == after["completion_tokens"] - before["completion_tokens"]
    assert after["requests_done"] - before["requests_done"] == 4
    assert after["active"] == 0 and after["reserved_cells"] == 0


def test_cancellation_frees_the_session(contract_server: ServerProcess) -> None:
    async def main() -> None:
        host, port = contract_server.base_url.removeprefix("http://").split(":")
        body = json.dumps({"messages": MESSAGES, "max_tokens": 900, "stream": True,
                           "temperature": 0}).encode()
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}"
            "\r\n\r\n".encode() + body)
        await stream.receive_some(1000)
        await stream.aclose()
        async with httpx.AsyncClient() as http:
            with trio.fail_after(30):
                while True:
                    stats = (await http.get(f"{contract_server.api}/server")).json()["engine"]
                    if stats["active"] == 0:
                        break
                    await trio.sleep(0.05)
        assert stats["reserved_cells"] == 0

    trio.run(main)


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
def test_swap_between_two_tiny_models(tmp_path: Path, kind: str) -> None:
    if kind == "mlx":
        first = write_tiny_qwen3_mlx(tmp_path / "mlx-a", seed=1)
        second = write_tiny_qwen3_mlx(tmp_path / "mlx-b", seed=2)
    else:
        first = write_tiny_qwen3_gguf(tmp_path / "a.gguf", seed=1)
        second = write_tiny_qwen3_gguf(tmp_path / "b.gguf", seed=2)
    server = ServerProcess(["--model", str(first)])
    try:
        api = openai.OpenAI(base_url=server.api, api_key="x", max_retries=0)
        result = api.chat.completions.create(model=str(second), messages=MESSAGES,
                                             max_tokens=4)
        assert result.model == str(second)
        listed = api.models.list().data
        assert listed[0].id == str(second)  # resident now; the first is a sibling to go back to
        assert str(first) in [m.id for m in listed[1:]]  # the boot model, by its --model
    finally:
        server.stop()


def test_mlx_describes_itself(tiny_mlx: Path) -> None:
    server = ServerProcess(["--model", str(tiny_mlx)])
    try:
        api = openai.OpenAI(base_url=server.api, api_key="x", max_retries=0)
        meta = api.models.list().data[0].model_dump()["meta"]
        assert meta["description"] == "qwen3 (MLX)" and meta["chat_template"] == "model"
        assert meta["step_shapes"] is None  # a llama.cpp feature
    finally:
        server.stop()


def test_tokenizer_routes_and_ollama_on_both_backends(contract_server: ServerProcess) -> None:
    """The same answers from either backend: a tokenize / detokenize round trip, echo of a
    token-id prompt, and Ollama's chat, whole and streamed."""
    base = contract_server.base_url
    text = "Hello there, world"
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": text,
                                                  "add_special_tokens": False}).json()["tokens"]
    assert tokens
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json()["prompt"] == text
    assert httpx.get(f"{base}/tokenizer_info").json()["chat_template"]
    echoed = httpx.post(f"{contract_server.api}/completions", json={
        "prompt": tokens, "echo": True, "max_tokens": 2, "logprobs": 1,
        "temperature": 0}).json()["choices"][0]
    assert echoed["text"].startswith(text)
    assert len(echoed["logprobs"]["token_logprobs"]) == len(tokens) + 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3}}
    whole = httpx.post(f"{base}/api/chat", json={**chat, "stream": False}).json()
    assert whole["done"] and whole["eval_count"] == 3
    lines = [json.loads(line) for line in
             httpx.post(f"{base}/api/chat", json=chat).text.splitlines()]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])


MISTRAL_STYLE = (  # a template that writes its calls in Mistral's markup (v11 on)
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}"
    "{% endfor %}</s>{% elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}"
    "{% endfor %}"
)
HARMONY_STYLE = (  # gpt-oss's: messages on channels, a call addressed to its function
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "{% for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}"
    "<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>"
    "{% endfor %}{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final"
    "<|message|>{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>"
    "{{ m.content }}<|end|>{% endif %}{% endfor %}<|start|>assistant"
)
# family → its template, and an answer in its markup: (GBNF literal, reasoning in it)
FAMILY_CASES = {
    "mistral": (MISTRAL_STYLE, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', ""),
    "harmony": (HARMONY_STYLE, "<|channel|>analysis<|message|>Need it.<|end|><|start|>"
                "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city": "Paris"}', "Need it."),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
@pytest.mark.parametrize("kind", ["gguf", "mlx"])
def test_a_familys_own_markup_becomes_tool_calls(
        kind: str, family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The template writes a family's markup (Mistral's, gpt-oss's harmony), so a model
    answering in it is understood, on either backend: the answer (forced here through
    llama-server's `grammar`) comes back as a tool call (and reasoning), whole and
    streamed, with llama-server's `timings` and `prompt_progress`; no markup reaches the
    content, and the request log says `finish=tool_calls`."""
    source, answer, reasoning = FAMILY_CASES[family]
    template = tmp_path / f"{family}.jinja"
    template.write_text(source)
    server = ServerProcess(["--model", str(request.getfixturevalue(f"tiny_{kind}")),
                            "--chat-template", str(template), "--alias", "tiny"])
    try:
        meta = httpx.get(f"{server.api}/models").json()["data"][0]["meta"]
        assert meta["chat_template_capabilities"]["call_family"] == family
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}],
                "tools": [WEATHER], "max_tokens": 400,
                "grammar": f"root ::= {json.dumps(answer)}"}
        whole = httpx.post(f"{server.api}/chat/completions", json=body, timeout=60).json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        assert (choice["message"].get("reasoning_content") or "") == reasoning
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"]
        streamed = httpx.post(f"{server.api}/chat/completions", timeout=60, json={
            **body, "stream": True, "return_progress": True}).text
        chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.splitlines()
                  if line.startswith("data: {")]
        assert any("prompt_progress" in chunk for chunk in chunks)
        deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
        assert "".join(delta.get("content") or "" for delta in deltas) == ""
        assert "".join(delta.get("reasoning_content") or "" for delta in deltas) == reasoning
        calls = [part for delta in deltas for part in delta.get("tool_calls") or []]
        assert [part["function"]["name"] for part in calls if "name" in part["function"]] == [
            "get_weather"]
        assert json.loads("".join(part["function"]["arguments"] for part in calls)) == {
            "city": "Paris"}
        assert [chunk["choices"][0]["finish_reason"] for chunk in chunks
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]] == ["tool_calls"]
        _wait_for_log(server, "/v1/chat/completions finish=tool_calls", count=2)
    finally:
        server.stop()


def _wait_for_log(server: ServerProcess, text: str, *, count: int) -> None:
    """The request log reaches the pipe a moment after the response."""
    deadline = time.monotonic() + 30
    while sum(text in line for line in server.output) < count:
        assert time.monotonic() < deadline, "".join(server.output[-5:])
        time.sleep(0.05)
