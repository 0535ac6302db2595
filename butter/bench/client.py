"""Drive synchronized waves of streaming chat requests at a server (httpx on trio)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio
import trio.lowlevel

from butter.bench.metrics import CACHE_FROM_TIMINGS, CACHE_FROM_USAGE, Timeline

# The marker leads, so lanes share no prompt prefix beyond the template's own header.
STANDARD_TASK = "{marker}: write a short story about a lighthouse, starting with that tag."
SHARED_STEM = (
    "You are a careful assistant for a shipping company. Answer in plain English, be "
    "concise, and never invent facts. The fleet has twelve ships, four ports and one "
    "dispatcher. Routes change weekly; safety rules never change. "
) * 6


class BenchError(Exception):
    """A condition that makes the benchmark meaningless (unreachable server, wrong model)."""


@attrs.frozen
class BenchConfig:
    base_url: str
    model: str
    concurrency: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    waves: int
    shared_prompt: bool = False
    long_prompt: str | None = None
    long_prompt_lanes: int = 0
    timeout: float = 300.0
    # chat_template_kwargs.enable_thinking on every request; None: not sent (the
    # template's default)
    enable_thinking: bool | None = None


async def server_info(client: httpx.AsyncClient, config: BenchConfig) -> dict[str, Any]:
    """GET /v1/models, and refuse to bench a model that is not resident (no swaps)."""
    try:
        response = await client.get(f"{config.base_url}/models")
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {config.base_url}: {exc}") from None
    if response.status_code != 200:
        raise BenchError(f"GET {config.base_url}/models answered {response.status_code}")
    info: dict[str, Any] = response.json()
    ids = [m.get("id") for m in info.get("data", [])]
    if config.model not in ids:
        raise BenchError(
            f"model {config.model!r} is not resident on this server (it serves "
            f"{', '.join(map(str, ids)) or 'nothing'}); serve-bench never triggers a swap: "
            f"pass --model {ids[0]!r}" if ids else "the server lists no model"
        )
    return info


def lane_messages(config: BenchConfig, marker: str, long_prompt: bool) -> list[dict[str, str]]:
    task = STANDARD_TASK.format(marker=marker)
    if long_prompt and config.long_prompt:
        return [{"role": "user", "content": f"{config.long_prompt}\n\n{task}"}]
    if config.shared_prompt:
        return [{"role": "system", "content": SHARED_STEM}, {"role": "user", "content": task}]
    return [{"role": "user", "content": task}]


def _delta_weight(content: str, reasoning: str, calls: list[Any]) -> int:
    """Characters of output in one delta (a tool-call fragment counts at least one)."""
    weight = len(content) + len(reasoning)
    for call in calls:
        function = (call.get("function") or {}) if isinstance(call, dict) else {}
        weight += max(1, len(function.get("name") or "") + len(function.get("arguments") or ""))
    return weight


def _usage_cached(usage: dict[str, Any]) -> int | None:
    """usage.prompt_tokens_details.cached_tokens (or a top-level cached_tokens), if sent."""
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    if isinstance(usage.get("cached_tokens"), int):
        return int(usage["cached_tokens"])
    return None


def _apply_timings(timeline: Timeline, timings: dict[str, Any]) -> None:
    """llama-server's own counts: cache_n prompt tokens reused, prompt_n evaluated. Used
    only where the usage has no cached count."""
    cache_n, prompt_n = timings.get("cache_n"), timings.get("prompt_n")
    if timeline.cache_source == CACHE_FROM_USAGE or not isinstance(cache_n, int):
        return
    timeline.cached_tokens, timeline.cache_source = cache_n, CACHE_FROM_TIMINGS
    if timeline.prompt_tokens == 0 and isinstance(prompt_n, int):
        timeline.prompt_tokens = cache_n + prompt_n


def _apply_chunk(timeline: Timeline, chunk: dict[str, Any], now: float) -> None:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content") or ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        calls = delta.get("tool_calls") or []
        if (content or calls) and timeline.first_output is None:
            timeline.first_output = now
        if reasoning and timeline.first_reasoning is None:
            timeline.first_reasoning = now
        weight = _delta_weight(content, reasoning, calls)
        if weight:
            timeline.chunks.append((now, weight))
        timeline.content_deltas += bool(content)
        timeline.text += content
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        timeline.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        timeline.completion_tokens = int(usage.get("completion_tokens") or 0)
        cached = _usage_cached(usage)
        if cached is not None:
            timeline.cached_tokens, timeline.cache_source = cached, CACHE_FROM_USAGE
    timings = chunk.get("timings")
    if isinstance(timings, dict):
        _apply_timings(timeline, timings)


def _decode_line(raw: bytes, timeline: Timeline) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        timeline.invalid_utf8 = True
        return raw.decode("utf-8", errors="replace")


async def _read_events(
    response: httpx.Response, timeline: Timeline, first_token: trio.Event | None = None
) -> None:
    buffer = b""
    async for data in response.aiter_raw():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = _decode_line(raw, timeline).strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            _apply_chunk(timeline, json.loads(line[5:]), time.perf_counter())
            if first_token is not None and timeline.first_token is not None:
                first_token.set()


async def _post_stream(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], timeline: Timeline,
    first_token: trio.Event | None,
) -> None:
    async with client.stream("POST", url, json=payload) as response:
        timeline.status = response.status_code
        if response.status_code != 200:
            body = await response.aread()
            timeline.error = f"HTTP {response.status_code}: {body[:200]!r}"
        else:
            await _read_events(response, timeline, first_token)


async def stream_chat(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], timeline: Timeline,
    time_limit: float, first_token: trio.Event | None = None,
) -> None:
    """POST one streaming chat completion and record it in `timeline`; errors are
    recorded there, never raised. `first_token` is set at its first output of any kind.

    A server that closes a kept-alive connection just as it is reused (llama-server closes
    it after a streamed response although it announced keep-alive) never saw the request:
    it is sent once more, on a new connection, as OpenAI's client libraries do, and
    counted in `timeline.retries`."""
    timeline.start = time.perf_counter()
    try:
        with trio.fail_after(time_limit):
            try:
                await _post_stream(client, url, payload, timeline, first_token)
            except httpx.RemoteProtocolError:
                if timeline.status is not None:
                    raise
                timeline.retries += 1
                await _post_stream(client, url, payload, timeline, first_token)
    except (httpx.HTTPError, trio.TooSlowError, ValueError) as exc:
        timeline.error = f"{type(exc).__name__}: {exc}"[:300]
    timeline.end = time.perf_counter()
    if timeline.completion_tokens == 0 and timeline.content_deltas:
        # Servers that ignore stream_options.include_usage: one delta per token is the
        # usual streaming granularity; the report counts such requests.
        timeline.completion_tokens = timeline.content_deltas
        timeline.usage_missing = True


def sampling_fields(config: BenchConfig) -> dict[str, Any]:
    """What every serve-bench request carries besides its messages and max_tokens."""
    fields: dict[str, Any] = {
        "model": config.model, "stream": True, "stream_options": {"include_usage": True},
        "temperature": config.temperature, "top_p": config.top_p,
    }
    if config.enable_thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": config.enable_thinking}
    return fields


async def run_request(
    client: httpx.AsyncClient, config: BenchConfig, timeline: Timeline, go: trio.Event
) -> None:
    payload = {
        **sampling_fields(config), "max_tokens": config.max_tokens,
        "messages": lane_messages(config, timeline.marker, timeline.long_prompt),
    }
    await go.wait()
    await stream_chat(client, f"{config.base_url}/chat/completions", payload, timeline,
                      config.timeout)


async def run_wave(
    client: httpx.AsyncClient, config: BenchConfig, level: int, wave: int
) -> list[Timeline]:
    """`level` requests released together by one event."""
    # Random first, so that markers do not share a prefix the cache could reuse.
    timelines = [
        Timeline(lane=lane, wave=wave, marker=f"{secrets.token_hex(4)}-c{level}w{wave}l{lane}",
                 long_prompt=lane < config.long_prompt_lanes)
        for lane in range(level)
    ]
    go = trio.Event()
    async with trio.open_nursery() as nursery:
        for timeline in timelines:
            nursery.start_soon(run_request, client, config, timeline, go)
        await trio.lowlevel.checkpoint()  # let every lane reach the starting line
        go.set()
    return timelines


async def run_levels(
    config: BenchConfig, on_wave: Callable[[int, int, list[Timeline]], None]
) -> tuple[dict[str, Any], dict[int, list[list[Timeline]]]]:
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    async with httpx.AsyncClient(timeout=config.timeout, limits=limits) as client:
        info = await server_info(client, config)
        results: dict[int, list[list[Timeline]]] = {}
        for level in config.concurrency:
            results[level] = []
            for wave in range(1, config.waves + 1):
                timelines = await run_wave(client, config, level, wave)
                results[level].append(timelines)
                on_wave(level, wave, timelines)
    return info, results
