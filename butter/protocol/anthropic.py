"""Anthropic Messages API: request types, conversion to and from the neutral request (pure).

A Messages request becomes the pipeline's GenerationRequest directly (chat template
messages, sampling, stops, the tool-call constraint), so both APIs share one path through
templates, the engine and the markup parser, and every error names Anthropic's own
fields; the results convert back into
content blocks, stop reasons and Anthropic's usage (input tokens exclude the cached
part, which is reported as cache_read_input_tokens).

What agent clients send beyond the basics (Claude Code, see the README):
- `system`-role entries inside `messages` stay in place, in order, as system messages
  (the chat template renders them, or they are folded into the nearest user turn: see
  butter/chat/template.py).
- A system text block that starts with `x-anthropic-billing-header:` is billing metadata,
  not an instruction: it never reaches the prompt, so that its per-version (and in some
  versions per-request) values never invalidate the cached prefix.
- `thinking`: `enabled` and `adaptive` turn the template's thinking on, `disabled` off;
  `display: "omitted"` returns thinking blocks empty. `output_config.effort` becomes the
  template's `reasoning_effort`.
- `cache_control` and `context_management` are accepted and have nothing to do here:
  butter reuses every cached prefix by itself, and the client manages its own context.
- `messages: []` is accepted, as llama-server accepts it: the prompt is the `system`
  prompt alone, as the chat template renders it; a template that refuses to render it
  (one that needs a user turn) answers 400 with its reason, as does a prompt of no tokens.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from butter.chat import grammar as grammars
from butter.chat.request import (
    IMAGE_PART,
    ChatPrompt,
    FinishReason,
    GenerationRequest,
    ImageInput,
    Usage,
)
from butter.chat.tool_calls import arguments_object
from butter.errors import InvalidRequest
from butter.protocol.convert import make_converter, structure_request
from butter.sampling import SamplingParams


@attrs.frozen
class Block:
    """One content block; which fields matter depends on `type`."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    tool_name: str | None = None  # tool_reference blocks
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    # image blocks: {"type": "base64", "media_type": "image/png", "data": "..."}
    source: dict[str, Any] | None = None


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
    # Deferred tools are loaded only once a tool search references them (Claude Code's
    # ToolSearch); until then the model is not offered them.
    defer_loading: bool | None = None


@attrs.frozen
class ToolChoice:
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class ThinkingConfig:
    type: str  # enabled, adaptive (on where the template can think) or disabled
    budget_tokens: int | None = None
    display: str | None = None  # "omitted": thinking blocks come back empty


@attrs.frozen
class OutputConfig:
    effort: str | None = None  # low, medium, high (xhigh and max: high)


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
    output_config: OutputConfig | None = None
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
    output_config: OutputConfig | None = None


BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
THINKING_TYPES = ("enabled", "adaptive", "disabled")
# Anthropic's effort levels -> the chat templates' reasoning_effort (--reasoning-effort).
EFFORT_LEVELS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high",
                 "max": "high"}

_converter = make_converter()


def parse_messages_request(payload: Any) -> MessagesRequest:
    if isinstance(payload, dict) and "max_tokens" not in payload:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    request = structure_request(_converter, payload, MessagesRequest)
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens: must be at least 1", param="max_tokens")
    if request.temperature is not None and not 0.0 <= request.temperature <= 1.0:
        raise InvalidRequest("temperature: must be between 0 and 1", param="temperature")
    _check_thinking_and_effort(request)
    return request


def parse_count_tokens_request(payload: Any) -> CountTokensRequest:
    request = structure_request(_converter, payload, CountTokensRequest)
    _check_thinking_and_effort(request)
    return request


def _check_thinking_and_effort(request: MessagesRequest | CountTokensRequest) -> None:
    if request.thinking is not None and request.thinking.type not in THINKING_TYPES:
        raise InvalidRequest(f"thinking.type: must be one of {', '.join(THINKING_TYPES)}",
                             param="thinking.type")
    effort = request.output_config.effort if request.output_config else None
    if effort is not None and effort not in EFFORT_LEVELS:
        raise InvalidRequest(f"output_config.effort: must be one of {', '.join(EFFORT_LEVELS)}",
                             param="output_config.effort")


def shows_thinking(request: MessagesRequest) -> bool:
    """False when the client asked for thinking blocks without their text."""
    return request.thinking is None or request.thinking.display != "omitted"


# ---------------------------------------------------------------- request → generation

MAX_TOP_K = 1 << 20
MAX_STOP_SEQUENCES = 16  # (the engine's limit, as for OpenAI's `stop`)


def generation_request(request: MessagesRequest | CountTokensRequest) -> GenerationRequest:
    """What the pipeline runs for this request (a count_tokens request: its prompt)."""
    offered = [tool for tool in request.tools or [] if not tool.defer_loading]
    choice, forced = _tool_choice(request.tool_choice)
    tools = [_template_tool(tool) for tool in offered] if choice != "none" else []
    prompt = ChatPrompt(_template_messages(request), tools=tools or None,
                        template_kwargs=_template_kwargs(request))
    if not isinstance(request, MessagesRequest):
        return GenerationRequest(prompt=prompt, sampling=SamplingParams())
    stops = tuple(stop for stop in request.stop_sequences or [] if stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"stop_sequences: at most {MAX_STOP_SEQUENCES} are supported",
                             param="stop_sequences")
    constraint = _tool_constraint(choice, forced, tools)
    sampling = attrs.evolve(_sampling_params(request), grammar=constraint)
    return GenerationRequest(
        prompt=prompt, sampling=sampling, max_tokens=request.max_tokens, stop=stops,
        tool_schemas={tool.name: tool.input_schema for tool in offered} if tools else {},
    )


def _sampling_params(request: MessagesRequest) -> SamplingParams:
    """Client values over llama-server's defaults, as for the OpenAI routes."""
    if request.top_p is not None and not 0.0 <= request.top_p <= 1.0:
        raise InvalidRequest("top_p: must be between 0 and 1", param="top_p")
    if request.top_k is not None and not 0 <= request.top_k <= MAX_TOP_K:
        raise InvalidRequest(f"top_k: must be between 0 and {MAX_TOP_K}", param="top_k")
    overrides = {name: getattr(request, name) for name in ("temperature", "top_p", "top_k")
                 if getattr(request, name) is not None}
    return SamplingParams(**overrides)


def _template_kwargs(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if request.thinking is not None:
        kwargs["enable_thinking"] = request.thinking.type != "disabled"
    effort = request.output_config.effort if request.output_config else None
    if effort is not None:
        kwargs["reasoning_effort"] = EFFORT_LEVELS[effort]
    return kwargs


def _tool_constraint(choice: str, forced: str | None, tools: list[dict[str, Any]]) -> (
    grammars.OutputConstraint | None
):
    """`any` and `tool` force a call (`tool`: of the named one); `auto` and `none` leave
    the output free."""
    if choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice: forcing a tool call needs tools",
                             param="tool_choice")
    return grammars.tool_call_grammar(tools, forced)


def _template_messages(request: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates take it (tool-call arguments as objects). An
    empty `messages` is served as llama-server serves it: the prompt is what the template
    renders of the system prompt alone (or of nothing), then the assistant's turn."""
    messages: list[dict[str, Any]] = []
    system = _system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        if message.role == "user":
            messages.extend(_user_messages(message, index))
        elif message.role == "assistant":
            messages.append(_assistant_message(message, index))
        elif message.role == "system":  # e.g. Claude Code's reminders between user turns
            text = _system_text(message.content, f"messages.{index}.content")
            if text:
                messages.append({"role": "system", "content": text})
        else:
            raise InvalidRequest(f"messages.{index}.role: must be user, assistant or system",
                                 param=f"messages.{index}.role")
    return messages


def _system_text(system: str | list[Block] | None, where: str = "system") -> str:
    """The instructions of a system prompt: its text blocks, without billing metadata."""
    if system is None or isinstance(system, str):
        return "" if system is None or _is_billing_header(system) else system
    texts = [_text_of(block, where) for block in system]
    return "\n\n".join(text for text in texts if not _is_billing_header(text))


def _is_billing_header(text: str) -> bool:
    return text.lstrip().startswith(BILLING_HEADER_PREFIX)


def _text_of(block: Block, where: str) -> str:
    if block.type != "text" or block.text is None:
        raise InvalidRequest(f"{where}: only text blocks are supported here, got {block.type!r}")
    return block.text


def _user_messages(message: Message, index: int) -> list[dict[str, Any]]:
    """Tool results become `tool` messages (first, as they answer the previous turn)."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for number, block in enumerate(message.content):
        if block.type == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                            "content": _tool_result_content(block, index, number)})
        elif block.type == "image":
            parts.append(_image_part(block, f"messages.{index}.content.{number}"))
        else:
            parts.append(_text_part(_text_of(block, f"messages.{index}.content")))
    if parts:
        results.append({"role": "user", "content": _content(parts)})
    return results


def _tool_result_content(block: Block, index: int, number: int) -> str | list[dict[str, Any]]:
    """A tool result's text, or where it holds images (Claude Code's screenshots and the
    PNG files it reads), its text and image parts."""
    content = block.content
    if content is None or isinstance(content, str):
        parts = [_text_part(content or "")]
    else:
        where = f"messages.{index}.content.{number}.content"
        parts = [_image_part(part, f"{where}.{item}") if part.type == "image"
                 else _text_part(_tool_result_part(part, index))
                 for item, part in enumerate(content)]
    if block.is_error:
        parts.insert(0, _text_part("Error: "))
    return _content(parts, glue_first=block.is_error is True)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _content(parts: list[dict[str, Any]], *, glue_first: bool = False
             ) -> str | list[dict[str, Any]]:
    """Content blocks as the template takes them: text blocks one after another joined by
    a blank line (`glue_first`: the first two without one: a prefix), images between them
    as their own parts; without images, the text alone (a string, as before images)."""
    merged: list[dict[str, Any]] = []
    for number, part in enumerate(parts):
        previous = merged[-1] if merged else None
        if part["type"] == "text" and previous is not None and previous["type"] == "text":
            glue = "" if glue_first and number == 1 else "\n\n"
            previous["text"] = f"{previous['text']}{glue}{part['text']}"
        else:
            merged.append(dict(part))
    if all(part["type"] == "text" for part in merged):
        return "".join(part["text"] for part in merged)
    return merged


def _image_part(block: Block, where: str) -> dict[str, Any]:
    """An image block's image: base64 only. A URL is not fetched (a server that fetches
    what a request names can be made to reach what only it can reach)."""
    source = block.source or {}
    kind = source.get("type")
    param = f"{where}.source"
    if kind == "url":
        raise InvalidRequest(f"{param}: remote images are not fetched: send the image as "
                             'base64 (source.type "base64")', param=param)
    if kind != "base64":
        raise InvalidRequest(f'{param}.type: must be "base64" (images are sent inline), got '
                             f"{kind!r}", param=f"{param}.type")
    data, media_type = source.get("data"), source.get("media_type")
    if not isinstance(data, str) or not (media_type is None or isinstance(media_type, str)):
        raise InvalidRequest(f"{param}: data must be a base64 string and media_type a string",
                             param=f"{param}.data")
    return {"type": IMAGE_PART, "image": ImageInput(data=data, media_type=media_type,
                                                    param=f"{param}.data")}


def _tool_result_part(part: Block, index: int) -> str:
    if part.type == "tool_reference":  # a tool search's answer: this tool is now offered
        return f"Tool loaded: {part.tool_name}"
    return _text_of(part, f"messages.{index}.content")


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
                "name": block.name, "arguments": block.input or {}}})
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


def _template_tool(tool: ToolDef) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice | None) -> tuple[str, str | None]:
    """auto, any, none or tool, and the name of the tool a call must use."""
    if choice is None or choice.type in ("auto", "any", "none"):
        return ("auto" if choice is None else choice.type), None
    if choice.type == "tool" and choice.name:
        return "tool", choice.name
    raise InvalidRequest("tool_choice.type must be auto, any, tool (with name) or none",
                         param="tool_choice")


# ---------------------------------------------------------------- results → messages

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(finish: FinishReason, matched_stop: str | None) -> StopReason:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if matched_stop is not None else "end_turn"


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message_body(
    *, message_id: str, model: str, content: list[dict[str, Any]], stop: StopReason | None,
    stop_sequence: str | None, usage: Usage,
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
    # (A call cut short by max_tokens: its input as far as it was written.)
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": arguments_object(arguments)}
