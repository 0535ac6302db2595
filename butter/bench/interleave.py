"""`serve-bench --interleave K`: the traffic a chat UI sends, for prefix caches.

K conversations with long histories take turns, one request at a time; after each answer
the client sends S short side requests with unrelated prompts (Open WebUI asks for a title
and tags after every answer; agents send summaries and "small fast model" calls). What
matters is how much of a returning conversation's prompt the server still has cached, and
its first token's latency.

With `tool_rounds`, every turn offers one tool and every answer is followed by a tool
round, as an agent's: the answer comes back as an assistant message that calls the tool
(a structured `tool_calls` entry) and a `tool` message with its result precedes the next
user message, so the server sees its answer re-rendered with a call it never generated.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

import attrs
import httpx

from butter.bench.client import BenchConfig, sampling_fields, server_info, stream_chat
from butter.bench.metrics import SIDE_MARKER, Timeline

# Words for the synthetic histories (a Gemma or Llama tokenizer gives ~1.5 tokens a word).
WORDS = ("harbor lantern copper meadow signal orchard granite velvet compass ember river "
         "paper winter thistle anchor saddle marble pepper canyon violet ledger quartz "
         "falcon bramble cobalt willow tundra rocket basalt juniper").split()
SIDE_TASKS = (
    "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat.\n"
    "### Chat history:\n{last}",
    "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat, as JSON.\n"
    "### Chat history:\n{last}",
    "### Task:\nSuggest 3 follow-up questions the user might ask next.\n"
    "### Chat history:\n{last}",
)


@attrs.frozen
class InterleaveConfig:
    conversations: int  # K
    side_requests: int  # S, after each answer
    history_tokens: int  # about this many tokens in each conversation's first prompt
    turns: int  # requests per conversation
    side_max_tokens: int = 16
    tool_rounds: bool = False  # each answer followed by a tool call and its result


# The one tool a --tool-rounds conversation offers.
TOOL_NAME = "read_note"
TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "Read one of the user's notes by its number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}},
                   "required": ["number"]}}}


def history_text(conversation: int, tokens: int, run: str) -> str:
    """A long first message, unique to this conversation and run (about `tokens` tokens)."""
    lines, words = [f"[{run}-{conversation}] Here are my notes; read them all."], 0
    n = 0
    while words * 1.5 < tokens:
        picked = [WORDS[(n * 7 + i * (conversation + 3)) % len(WORDS)] for i in range(9)]
        lines.append(f"Note {n}: the {' '.join(picked)}.")
        words += 12
        n += 1
    return "\n".join(lines)


def tool_round(conversation: int, turn: int, answer: str) -> list[dict[str, Any]]:
    """What an agent appends after an answer: the answer as an assistant message calling
    TOOL (arguments a JSON string, as OpenAI's API sends them) and the tool's result."""
    call_id = f"call_{conversation}_{turn}"
    call = {"id": call_id, "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"number": turn})}}
    return [
        {"role": "assistant", "content": answer, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id,
         "content": f"Note {turn}: the {' '.join(WORDS[turn % 7:turn % 7 + 5])}."},
    ]


def after_answer(interleave: InterleaveConfig, conversation: int, turn: int,
                 answer: str) -> list[dict[str, Any]]:
    """The messages a conversation appends once its turn is answered."""
    if interleave.tool_rounds:
        return tool_round(conversation, turn, answer)
    return [{"role": "assistant", "content": answer}]


def turn_payload(config: BenchConfig, interleave: InterleaveConfig,
                 messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A conversation turn's request body (the tool offered with --tool-rounds)."""
    payload = {**sampling_fields(config), "messages": messages,
               "max_tokens": config.max_tokens}
    if interleave.tool_rounds:
        payload["tools"] = [TOOL]
    return payload


def side_messages(index: int, last_user: str) -> list[dict[str, str]]:
    task = SIDE_TASKS[index % len(SIDE_TASKS)].format(last=last_user[-300:])
    return [{"role": "user", "content": task}]


async def run_interleave(
    config: BenchConfig, interleave: InterleaveConfig, on_request: Callable[[Timeline], None],
) -> tuple[dict[str, Any], list[Timeline]]:
    run = secrets.token_hex(4)  # nothing of an earlier run may be cached
    histories: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": history_text(k, interleave.history_tokens, run)}]
        for k in range(interleave.conversations)
    ]
    timelines: list[Timeline] = []
    url = f"{config.base_url}/chat/completions"
    async with httpx.AsyncClient(timeout=config.timeout) as client:
        info = await server_info(client, config)
        for turn in range(interleave.turns):
            for k, messages in enumerate(histories):
                if turn:
                    messages.append({"role": "user", "content": f"Turn {turn}: and then?"})
                last_user = messages[-1]["content"]
                timeline = Timeline(lane=k, wave=0, marker=f"conv{k}", turn=turn)
                payload = turn_payload(config, interleave, messages)
                await stream_chat(client, url, payload, timeline, config.timeout)
                timelines.append(timeline)
                on_request(timeline)
                messages.extend(after_answer(interleave, k, turn, timeline.text))
                for s in range(interleave.side_requests):
                    side = Timeline(lane=k, wave=0, marker=SIDE_MARKER, turn=turn)
                    body = {**sampling_fields(config), "max_tokens": interleave.side_max_tokens,
                            "messages": side_messages(s, last_user)}
                    await stream_chat(client, url, body, side, config.timeout)
                    timelines.append(side)
                    on_request(side)
    return info, timelines
