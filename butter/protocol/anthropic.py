"""Anthropic Messages API: request types, conversion to and from the chat request (pure).

A Messages request becomes an OpenAI-shaped chat request, so both APIs share one path
through templates, the engine and the markup parser; the results convert back into
content blocks, stop reasons and Anthropic's usage (input tokens exclude the cached
part, which is reported as cache_read_input_tokens).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs

from butter.errors import InvalidRequest
from butter.protocol import openai
from butter.protocol.convert import make_converter, structure_request


@attrs.frozen
class Block:
    """One content block; which fields matter depends on `type`."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


@attrs.frozen
class Message:
    role: str
    content: str | list[Block]


@attrs.frozen
class ToolDef:
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None


@attrs.frozen
class ToolChoice:
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class ThinkingConfig:
    type: str
    budget_tokens: int | None = None


@attrs.frozen
class MessagesRequest:
    messages: list[Message]
    max_tokens: int
    model: str | None = None
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False


@attrs.frozen
class CountTokensRequest:
    messages: list[Message]
    model: str | None = None
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


_converter = make_converter()


def parse_messages_request(payload: Any) -> MessagesRequest:
    if isinstance(payload, dict) and "max_tokens" not in payload:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    request = structure_request(_converter, payload, MessagesRequest)
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens: must be at least 1", param="max_tokens")
    if request.temperature is not None and not 0.0 <= request.temperature <= 1.0:
        raise InvalidRequest("temperature: must be between 0 and 1", param="temperature")
    return request


def parse_count_tokens_request(payload: Any) -> CountTokensRequest:
    return structure_request(_converter, payload, CountTokensRequest)


# ---------------------------------------------------------------- request → chat

def to_chat_request(request: MessagesRequest | CountTokensRequest) -> (
    openai.ChatCompletionRequest
):
    """The equivalent chat request (validated by the chat parser, like any client's)."""
    payload: dict[str, Any] = {"messages": _chat_messages(request)}
    if request.model is not None:
        payload["model"] = request.model
    if request.tools:
        payload["tools"] = [_chat_tool(tool) for tool in request.tools]
    if request.tool_choice is not None:
        payload["tool_choice"] = _chat_tool_choice(request.tool_choice)
    if request.thinking is not None:
        payload["chat_template_kwargs"] = {"enable_thinking": request.thinking.type == "enabled"}
    if isinstance(request, MessagesRequest):
        payload["max_tokens"] = request.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(request, name) is not None:
                payload[name] = getattr(request, name)
        if request.stop_sequences:
            payload["stop"] = request.stop_sequences
    return openai.parse_chat_request(payload)


def _chat_messages(request: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = _system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        if message.role == "user":
            messages.extend(_user_messages(message, index))
        elif message.role == "assistant":
            messages.append(_assistant_message(message, index))
        else:
            raise InvalidRequest(f"messages.{index}.role: must be user or assistant",
                                 param=f"messages.{index}.role")
    return messages


def _system_text(system: str | list[Block] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(_text_of(block, "system") for block in system)


def _text_of(block: Block, where: str) -> str:
    if block.type != "text" or block.text is None:
        raise InvalidRequest(f"{where}: only text blocks are supported here, got {block.type!r}")
    return block.text


def _user_messages(message: Message, index: int) -> list[dict[str, Any]]:
    """Tool results become `tool` messages (first, as they answer the previous turn)."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.content:
        if block.type == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                            "content": _tool_result_text(block, index)})
        else:
            texts.append(_text_of(block, f"messages.{index}.content"))
    if texts:
        results.append({"role": "user", "content": "\n\n".join(texts)})
    return results


def _tool_result_text(block: Block, index: int) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = "\n\n".join(_text_of(part, f"messages.{index}.content") for part in content)
    return f"Error: {text}" if block.is_error else text


def _assistant_message(message: Message, index: int) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, thinking, calls = [], [], []
    for block in message.content:
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type in ("thinking", "redacted_thinking"):
            thinking.append(block.thinking or "")
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input or {})}})
        else:
            raise InvalidRequest(
                f"messages.{index}.content: unsupported block type {block.type!r}",
                param=f"messages.{index}.content",
            )
    result: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thinking:
        result["reasoning_content"] = "".join(thinking)
    if calls:
        result["tool_calls"] = calls
    return result


def _chat_tool(tool: ToolDef) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "auto":
        return "auto"
    if choice.type == "any":
        return "required"
    if choice.type == "none":
        return "none"
    if choice.type == "tool" and choice.name:
        return {"type": "function", "function": {"name": choice.name}}
    raise InvalidRequest("tool_choice.type must be auto, any, tool (with name) or none",
                         param="tool_choice")


# ---------------------------------------------------------------- results → messages

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(finish: openai.FinishReason, matched_stop: str | None) -> StopReason:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if matched_stop is not None else "end_turn"


def usage_body(usage: openai.Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message_body(
    *, message_id: str, model: str, content: list[dict[str, Any]], stop: StopReason | None,
    stop_sequence: str | None, usage: openai.Usage,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": stop_sequence,
        "usage": usage_body(usage),
    }


def tool_use_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}
