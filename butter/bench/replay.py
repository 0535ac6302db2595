"""`serve-bench --replay FILE`: recorded conversations, replayed request by request.

FILE is JSONL, one conversation a line: `{"id": str, "requests": [body, ...]}`, each body
a chat completion request without `model` and `stream` that resends the whole history so
far (its assistant turns and tool results are recorded, so every server sees the same
prompts). Each concurrency level replays every conversation once: C lanes, conversations
dealt round-robin, and a lane sends request k+1 of a conversation when response k ended.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from butter.bench.client import BenchConfig, BenchError, sampling_fields, server_info, stream_chat
from butter.bench.metrics import Timeline

# Set by serve-bench itself on every request.
RESERVED_FIELDS = ("model", "stream", "stream_options")
# Prefixed to each conversation's first user message, per level, so that a level cannot
# reuse the conversations a previous level left in the server's cache (the shared stem
# before the first user message stays shared). The same text on every server.
DEFAULT_TAG = "[run c={level}] "


class ReplayFileError(BenchError):
    """A replay file that cannot be used, with the file and line at fault."""


@attrs.frozen
class Conversation:
    id: str
    requests: tuple[dict[str, Any], ...]


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise ReplayFileError(f"{where} must be an object with a role")
    if not isinstance(message.get("role"), str):
        raise ReplayFileError(f"{where} has no string role")


def check_request(body: Any, where: str) -> None:
    """One recorded request body: a chat completion request serve-bench can send."""
    if not isinstance(body, dict):
        raise ReplayFileError(f"{where} must be a JSON object (a chat completion body)")
    reserved = [name for name in RESERVED_FIELDS if name in body]
    if reserved:
        raise ReplayFileError(
            f"{where} sets {', '.join(reserved)}: serve-bench sets model and stream itself; "
            "record bodies without them"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ReplayFileError(f"{where} needs a non-empty messages list")
    for index, message in enumerate(messages):
        _check_message(message, f"{where}.messages[{index}]")
    if "tools" in body and not isinstance(body["tools"], list):
        raise ReplayFileError(f"{where}.tools must be a list")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ReplayFileError(f"{where}.max_tokens must be a positive integer")


def parse_conversation(line: str, where: str) -> Conversation:
    """One JSONL line; `where` (file:line) leads every error message."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ReplayFileError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ReplayFileError(f'{where}: expected an object {{"id": ..., "requests": [...]}}')
    ident = data.get("id")
    if not isinstance(ident, str) or not ident:
        raise ReplayFileError(f"{where}: id must be a non-empty string")
    requests = data.get("requests")
    if not isinstance(requests, list) or not requests:
        raise ReplayFileError(f"{where}: conversation {ident!r} needs a non-empty requests list")
    for index, body in enumerate(requests):
        check_request(body, f"{where}: conversation {ident!r} requests[{index}]")
    return Conversation(ident, tuple(requests))


def parse_replay(lines: Sequence[str], name: str) -> list[Conversation]:
    """Every non-blank line a conversation; ids unique; at least one."""
    conversations: list[Conversation] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        conversation = parse_conversation(line, f"{name}:{number}")
        if conversation.id in seen:
            raise ReplayFileError(f"{name}:{number}: conversation id {conversation.id!r} "
                                  "appears twice")
        seen.add(conversation.id)
        conversations.append(conversation)
    if not conversations:
        raise ReplayFileError(f"{name}: no conversations")
    return conversations


def load_replay(path: Path) -> list[Conversation]:
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayFileError(f"cannot read {path}: {exc}") from None
    return parse_replay(text.splitlines(), str(path))


def deal(conversations: Sequence[Conversation], lanes: int) -> list[list[Conversation]]:
    """Round-robin: lane i replays conversations i, i + lanes, i + 2 * lanes, ..."""
    return [list(conversations[lane::lanes]) for lane in range(lanes)]


def tag_messages(messages: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """The messages with `tag` prefixed to the first user message's (first) text."""
    if not tag:
        return messages
    tagged = copy.deepcopy(messages)
    for message in tagged:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = tag + content
        elif isinstance(content, list):
            message["content"] = [{"type": "text", "text": tag}, *content]
        break
    return tagged


def request_payload(config: BenchConfig, body: dict[str, Any], tag: str) -> dict[str, Any]:
    """The recorded body, tagged, with serve-bench's streaming and sampling fields (the
    flags' temperature, top_p and enable_thinking win) and --max-tokens where the body has
    none."""
    payload = {**body, "messages": tag_messages(body["messages"], tag)}
    payload.setdefault("max_tokens", config.max_tokens)
    fields = sampling_fields(config)
    if isinstance(body.get("chat_template_kwargs"), dict) and "chat_template_kwargs" in fields:
        # (the body's own template arguments stay, the flag's enable_thinking wins)
        fields["chat_template_kwargs"] = {**body["chat_template_kwargs"],
                                          **fields["chat_template_kwargs"]}
    return {**payload, **fields}


async def replay_lane(
    client: httpx.AsyncClient, config: BenchConfig, lane: int,
    conversations: Sequence[Conversation], tag: str, out: list[Timeline],
    on_request: Callable[[Timeline], None],
) -> None:
    url = f"{config.base_url}/chat/completions"
    for conversation in conversations:
        for turn, body in enumerate(conversation.requests):
            timeline = Timeline(lane=lane, wave=0, marker=conversation.id, turn=turn)
            out.append(timeline)
            await stream_chat(client, url, request_payload(config, body, tag), timeline,
                              config.timeout)
            on_request(timeline)


async def replay_level(
    client: httpx.AsyncClient, config: BenchConfig, conversations: Sequence[Conversation],
    level: int, tag_template: str, on_request: Callable[[Timeline], None],
) -> list[Timeline]:
    tag = tag_template.format(level=level)
    timelines: list[Timeline] = []
    async with trio.open_nursery() as nursery:
        for lane, dealt in enumerate(deal(conversations, level)):
            nursery.start_soon(replay_lane, client, config, lane, dealt, tag, timelines,
                               on_request)
    return timelines


async def run_replay(
    config: BenchConfig, conversations: Sequence[Conversation], tag_template: str,
    on_request: Callable[[Timeline], None],
) -> tuple[dict[str, Any], dict[int, list[Timeline]]]:
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    async with httpx.AsyncClient(timeout=config.timeout, limits=limits) as client:
        info = await server_info(client, config)
        results = {
            level: await replay_level(client, config, conversations, level, tag_template,
                                      on_request)
            for level in config.concurrency
        }
    return info, results
