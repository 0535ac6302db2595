"""serve-bench's agent workloads: `--replay` and `--long-arrival`, against a real butter
server on the tiny GGUF, and the replay file format."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from butter.bench.client import BenchConfig, sampling_fields, stream_chat
from butter.bench.interleave import TOOL_NAME, InterleaveConfig, after_answer, turn_payload
from butter.bench.metrics import CACHE_FROM_USAGE, Timeline, longest_stall, tokens_between
from butter.bench.replay import (
    ReplayFileError,
    deal,
    parse_replay,
    request_payload,
    tag_messages,
)
from tests.conftest import ServerProcess

REPO = Path(__file__).resolve().parent.parent
STEM = ("You are a coding agent. Use the tools to inspect the repository, change code and "
        "run the tests. Keep answers short. ") * 6
TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{name} in the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}}
    for name in ("read_file", "list_dir")
]


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "butter.cli", "serve-bench", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def conversation(index: int, turns: int) -> dict[str, Any]:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": STEM},
        {"role": "user", "content": f"Task {index}: fix the failing test in module_{index}."},
    ]
    requests = []
    for turn in range(turns):
        if turn:
            call = {"id": f"call_{index}_{turn}", "type": "function",
                    "function": {"name": "read_file",
                                 "arguments": json.dumps({"path": f"m{index}/f{turn}.py"})}}
            history.append({"role": "assistant", "content": "", "tool_calls": [call]})
            history.append({"role": "tool", "tool_call_id": call["id"],
                            "content": f"def f{turn}():\n    return {turn}\n" * 8})
        requests.append({"messages": [dict(m) for m in history], "tools": TOOLS,
                         "max_tokens": 8})
    return {"id": f"conv-{index}", "requests": requests}


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--parallel", "4",
                             "--max-context", "4096"])
    yield process
    process.stop()


def test_replay_reports_growing_prompts_and_cache_reuse(server: ServerProcess,
                                                        tmp_path: Path) -> None:
    replay = tmp_path / "agents.jsonl"
    replay.write_text("".join(json.dumps(conversation(i, 3)) + "\n" for i in range(2)))
    out = tmp_path / "replay.json"
    result = bench("--model", "tiny", "--base-url", server.api, "--replay", str(replay),
                   "--concurrency", "2", "--max-tokens", "8", "--json", str(out))
    assert result.returncode == 0, result.stderr
    [record] = json.loads(out.read_text())
    assert record["workload"] == "replay" and record["concurrency"] == 2
    assert (record["conversations"], record["requests"], record["http_errors"]) == (2, 6, 0)
    turns = record["turn_prompt_tokens"]
    assert len(turns) == 3 and turns[0] < turns[1] < turns[2]
    assert record["cached_share"] > 0 and record["cached_source"] == CACHE_FROM_USAGE
    assert record["completion_tokens"] > 0 and record["completion_tok_s"] > 0
    assert record["ttft_p50"] is not None and record["latency_p95"] is not None
    assert record["prompt_tokens_per_request"] == pytest.approx(record["prompt_tokens"] / 6)
    assert "cached prompt tokens read from: " + CACHE_FROM_USAGE in result.stdout


def test_long_arrival_reports_the_prefill_window(server: ServerProcess,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "arrival.json"
    result = bench("--model", "tiny", "--base-url", server.api, "--long-arrival", "1500",
                   "--concurrency", "2", "--max-tokens", "24", "--arrival-max-tokens", "4",
                   "--arrival-settle", "1", "--arrival-after", "0.3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    [record] = json.loads(out.read_text())
    assert record["workload"] == "arrival" and record["concurrency"] == 2
    assert record["long_error"] is None and record["session_errors"] == 0
    assert record["long_ttft"] is not None and record["long_ttft"] > 0
    assert 1000 < record["long_prompt_tokens"] < 2000  # calibrated to about 1,500
    assert record["long_cached_tokens"] < 100  # unique text: only the template header
    for key in ("before_tok_s", "during_tok_s", "after_tok_s"):
        assert isinstance(record[key], float), key
    assert record["before_tok_s"] > 0
    assert record["during_seconds"] == pytest.approx(record["long_ttft"], abs=0.05)
    assert 0 <= record["starved_sessions"] <= 2 and record["longest_stall_s"] is not None


@pytest.fixture(scope="module")
def one_session_server(tiny_gguf: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny",
                             "--max-context", "2048"])  # the default: --parallel 1
    yield process
    process.stop()


def test_interleaved_conversations_keep_their_caches_amid_side_requests(
    one_session_server: ServerProcess, tmp_path: Path
) -> None:
    server = one_session_server
    out = tmp_path / "interleave.json"
    result = bench("--model", "tiny", "--base-url", server.api, "--interleave", "3",
                   "--side-requests", "2", "--history-tokens", "300", "--turns", "3",
                   "--max-tokens", "8", "--temperature", "0", "--json", str(out))
    assert result.returncode == 0, result.stderr
    [record] = json.loads(out.read_text())
    assert record["workload"] == "interleave"
    assert (record["requests"], record["http_errors"], record["turns"]) == (27, 0, 3)
    # Every returning turn finds its conversation cached, up to its previous answer (the
    # answer's text may tokenize differently from the tokens generated).
    assert record["returning_cached_share"] > 0.85
    assert record["returning_prompt_tokens"] > 6 * 300
    assert record["cached_source"] == CACHE_FROM_USAGE
    assert "returning" in result.stdout
    cache = httpx.get(server.api + "/server").json()["prefix_cache"]
    assert cache["kv_entries"] >= 3 and cache["hits"] >= 6
    assert cache["host_ram"] is not None and cache["host_ram"]["budget_bytes"] > 0
    metrics = httpx.get(server.base_url + "/metrics").text
    assert f"butter_prefix_cache_hits_total {float(cache['hits'])}" in metrics
    assert "butter_host_cache_bytes" in metrics


def test_interleaved_tool_rounds_without_thinking_are_served_and_cached(
    one_session_server: ServerProcess, tmp_path: Path
) -> None:
    server = one_session_server
    out = tmp_path / "interleave.json"
    result = bench("--model", "tiny", "--base-url", server.api, "--interleave", "2",
                   "--side-requests", "1", "--history-tokens", "300", "--turns", "3",
                   "--max-tokens", "8", "--temperature", "0", "--tool-rounds",
                   "--no-enable-thinking", "--json", str(out))
    assert result.returncode == 0, result.stderr
    [record] = json.loads(out.read_text())
    assert (record["requests"], record["http_errors"], record["turns"]) == (12, 0, 3)
    assert (record["tool_rounds"], record["enable_thinking"]) == (True, False)
    assert "tool rounds" in result.stdout and "thinking off" in result.stdout
    # The answer comes back re-rendered with a call it never generated: what precedes it
    # (the tools' system block, the history, the earlier rounds) is still cached.
    assert record["returning_cached_share"] > 0.8
    assert record["returning_ttft_p50"] is not None


def test_a_bad_replay_file_is_a_clear_error(tmp_path: Path) -> None:
    replay = tmp_path / "bad.jsonl"
    replay.write_text(json.dumps(conversation(0, 1)) + "\n{not json\n")
    result = bench("--model", "tiny", "--base-url", "http://127.0.0.1:9/v1", "--replay",
                   str(replay))
    assert result.returncode == 2
    assert f"{replay}:2: not JSON" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------ pure parts


def lines(*records: object) -> list[str]:
    return [record if isinstance(record, str) else json.dumps(record) for record in records]


GOOD = {"id": "a", "requests": [{"messages": [{"role": "user", "content": "hi"}]}]}


@pytest.mark.parametrize(("line", "message"), [
    ("{nope", "f.jsonl:1: not JSON"),
    ([1, 2], "f.jsonl:1: expected an object"),
    ({"requests": GOOD["requests"]}, "f.jsonl:1: id must be a non-empty string"),
    ({"id": "a", "requests": []}, "conversation 'a' needs a non-empty requests list"),
    ({"id": "a", "requests": ["x"]}, "requests[0] must be a JSON object"),
    ({"id": "a", "requests": [{"messages": []}]}, "requests[0] needs a non-empty messages"),
    ({"id": "a", "requests": [{"messages": [{"content": "x"}]}]},
     "requests[0].messages[0] has no string role"),
    ({"id": "a", "requests": [{**GOOD["requests"][0], "stream": True}]},  # type: ignore[dict-item]
     "requests[0] sets stream: serve-bench sets model and stream itself"),
    ({"id": "a", "requests": [{**GOOD["requests"][0], "max_tokens": 0}]},  # type: ignore[dict-item]
     "requests[0].max_tokens must be a positive integer"),
])
def test_parser_rejects_malformed_lines(line: object, message: str) -> None:
    with pytest.raises(ReplayFileError) as error:
        parse_replay(lines(line), "f.jsonl")
    assert message in str(error.value)


def test_parser_checks_the_whole_file() -> None:
    with pytest.raises(ReplayFileError) as twice:
        parse_replay(lines(GOOD, "", GOOD), "f.jsonl")
    assert "f.jsonl:3: conversation id 'a' appears twice" in str(twice.value)
    with pytest.raises(ReplayFileError) as empty:
        parse_replay(["", "  "], "f.jsonl")
    assert "f.jsonl: no conversations" in str(empty.value)
    [parsed] = parse_replay(lines(GOOD), "f.jsonl")
    assert parsed.id == "a" and len(parsed.requests) == 1


def test_requests_are_tagged_dealt_and_completed() -> None:
    config = BenchConfig(base_url="http://x/v1", model="m", concurrency=(2,), max_tokens=5,
                         temperature=0.3, top_p=0.8, waves=1)
    body: dict[str, Any] = {"messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": "task"}], "temperature": 1.5}
    payload = request_payload(config, body, "[run c=2] ")
    assert payload["messages"][1]["content"] == "[run c=2] task"
    assert body["messages"][1]["content"] == "task"  # the recorded body is unchanged
    assert (payload["temperature"], payload["top_p"], payload["max_tokens"]) == (0.3, 0.8, 5)
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["model"] == "m"
    assert tag_messages(body["messages"], "") is body["messages"]
    parsed = parse_replay(lines(*({**GOOD, "id": str(i)} for i in range(5))), "f")
    assert [[c.id for c in lane] for lane in deal(parsed, 2)] == [["0", "2", "4"], ["1", "3"]]


def test_enable_thinking_rides_on_every_request_when_set() -> None:
    config = BenchConfig(base_url="http://x/v1", model="m", concurrency=(1,), max_tokens=5,
                         temperature=0.0, top_p=1.0, waves=1)
    assert "chat_template_kwargs" not in sampling_fields(config)  # the template's default
    off = attrs.evolve(config, enable_thinking=False)
    assert sampling_fields(off)["chat_template_kwargs"] == {"enable_thinking": False}
    # A replayed body keeps its own template arguments; the flag's enable_thinking wins.
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}],
                            "chat_template_kwargs": {"enable_thinking": True, "effort": 2}}
    assert request_payload(off, body, "")["chat_template_kwargs"] == {
        "enable_thinking": False, "effort": 2}
    assert request_payload(config, body, "")["chat_template_kwargs"] == {
        "enable_thinking": True, "effort": 2}


def test_an_interleaved_tool_round_is_a_structured_call_and_its_result() -> None:
    config = BenchConfig(base_url="http://x/v1", model="m", concurrency=(1,), max_tokens=5,
                         temperature=0.0, top_p=1.0, waves=1)
    plain = InterleaveConfig(conversations=2, side_requests=1, history_tokens=10, turns=2)
    agent = attrs.evolve(plain, tool_rounds=True)
    assert after_answer(plain, 1, 0, "ok") == [{"role": "assistant", "content": "ok"}]
    call, result = after_answer(agent, 1, 2, "")
    assert call["role"] == "assistant" and call["content"] == ""
    [entry] = call["tool_calls"]
    assert entry["type"] == "function" and entry["function"]["name"] == TOOL_NAME
    assert json.loads(entry["function"]["arguments"]) == {"number": 2}  # a JSON string
    assert result["role"] == "tool" and result["tool_call_id"] == entry["id"]
    assert result["content"]
    assert after_answer(agent, 0, 2, "")[0]["tool_calls"][0]["id"] != entry["id"]
    messages = [{"role": "user", "content": "hi"}]
    assert "tools" not in turn_payload(config, plain, messages)
    payload = turn_payload(config, agent, messages)
    [tool] = payload["tools"]
    assert tool["function"]["name"] == TOOL_NAME and payload["messages"] is messages


def test_window_arithmetic() -> None:
    t = Timeline(lane=0, wave=0, marker="m", completion_tokens=10,
                 chunks=[(1.0, 4), (2.0, 4), (3.0, 2)])
    assert tokens_between(t, 0.5, 2.0) == pytest.approx(8.0)  # (start, end]
    assert tokens_between(t, 2.0, 3.5) == pytest.approx(2.0)
    assert longest_stall([t], 1.5, 2.8) == pytest.approx(0.8)  # 2.0 → 2.8
    assert longest_stall([t], 3.5, 4.0) == pytest.approx(0.5)  # nothing arrived


def test_agent_workload_writes_a_valid_deterministic_file(tmp_path: Path) -> None:
    script = REPO / "benchmarks" / "agent_workload.py"
    outputs = []
    for name in ("a.jsonl", "b.jsonl"):
        result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / name),
                                 "--conversations", "3", "--turns", "4", "--seed", "7"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        outputs.append((tmp_path / name).read_text())
    assert outputs[0] == outputs[1]
    assert "shared stem ~" in result.stdout and "turn 3: prompt ~" in result.stdout
    conversations = parse_replay(outputs[0].splitlines(), "a.jsonl")
    assert len(conversations) == 3 and all(len(c.requests) == 4 for c in conversations)
    first = conversations[0].requests
    assert [len(r["messages"]) for r in first] == [2, 4, 6, 8]
    assert first[0]["messages"][0] == conversations[1].requests[0]["messages"][0]  # the stem
    assert first[0]["messages"][1] != conversations[1].requests[0]["messages"][1]
    call = first[1]["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"])
    assert first[1]["messages"][3]["tool_call_id"] == call["id"]
    assert len(first[0]["tools"]) >= 10


async def _serve_once_per_connection(stream: trio.SocketStream) -> None:
    """Answers the first request on a connection with a one-token stream that announces
    keep-alive, then closes the connection when the next request arrives, unanswered (what
    llama-server does after streamed responses)."""
    buffer = b""
    for answered in range(2):
        while b"\r\n\r\n" not in buffer:
            buffer += await stream.receive_some(65536)
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(buffer) < length:
            buffer += await stream.receive_some(65536)
        buffer = buffer[length:]
        if answered:
            await stream.aclose()
            return
        events = [{"choices": [{"index": 0, "delta": {"content": "hi"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        body += b"data: [DONE]\n\n"
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nKeep-Alive: timeout=5\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def test_a_dropped_reused_connection_is_retried_once() -> None:
    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, _serve_once_per_connection, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with httpx.AsyncClient() as client:
            first, second = (Timeline(lane=0, wave=n, marker="m") for n in range(2))
            await stream_chat(client, url, {"messages": []}, first, 10)
            await stream_chat(client, url, {"messages": []}, second, 10)
        nursery.cancel_scope.cancel()
    assert first.ok and first.retries == 0 and first.text == "hi"
    assert second.ok and second.retries == 1 and second.completion_tokens == 1


def test_prefix_cache_benchmark_cases_and_variants() -> None:
    prefix_cache = importlib.import_module("benchmarks.prefix_cache")  # (a script)
    assert prefix_cache.parse_cases("2x1000@8192, 4X5000", 4096) == [
        (2, 1000, 8192), (4, 5000, 4096)]
    for bad in ("2x", "1000@8192", "x"):
        with pytest.raises(SystemExit):
            prefix_cache.parse_cases(bad, 4096)
    args = prefix_cache.parse_args(["--model", "m.gguf", "--model-path", "m.gguf",
                                    "--variants", "default,tools,thinking-off"])
    assert args.variants == ["default", "tools", "thinking-off"]
    assert prefix_cache.VARIANTS["tools"] == ["--tool-rounds"]
    with pytest.raises(SystemExit):
        prefix_cache.parse_args(["--model-path", "m.gguf", "--variants", "tool"])
    record = {"prefix_cache": {"checkpoints": {"per_sequence": 8, "taken": 29, "restored": 7,
                                                "restored_tokens": 6066}}}
    assert prefix_cache.checkpointed(record) == "29 / 7 (6066 tok)"
    assert prefix_cache.checkpointed({}) == "-"
    assert prefix_cache.workload({"conversations": 2, "history_tokens": 1000,
                                  "variant": "tools"}) == "K=2, 1000-token histories, tools"
