"""Ollama's native API (`/api/chat`, `/api/generate` and the model routes): request types,
validation, response bodies (pure).

For the apps that speak only Ollama (Zed, JetBrains AI, n8n, Cline, Roo Code, Goose, Open
WebUI's Ollama connection). Requests become the neutral GenerationRequest directly;
answers are NDJSON lines, errors `{"error": "..."}`. What Ollama does and butter cannot
(`context` token lists, a custom `template`) is refused with a 400, never dropped.

A message's `images` (base64) come before its text, as Ollama puts them; /api/generate's
go with its prompt the same way, through the chat template (a raw prompt takes none).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import attrs

from butter.chat import grammar as grammars
from butter.chat.markup import ToolCall
from butter.chat.request import (
    IMAGE_PART,
    ChatPrompt,
    GenerationRequest,
    ImageInput,
    Prompt,
    TextPrompt,
)
from butter.chat.tool_calls import arguments_object
from butter.errors import InvalidRequest
from butter.protocol.convert import make_converter, structure_request
from butter.protocol.openai import MAX_TOP_K
from butter.sampling import MAX_SEED, SamplingParams

# The Ollama API release whose routes and fields these follow (GET /api/version).
API_VERSION = "0.12.0"
ROLES = ("system", "user", "assistant", "tool")
IMAGE_ROLES = ("user", "tool")  # (a tool's result may be a screenshot)
THINK_LEVELS = ("low", "medium", "high")


@attrs.frozen
class CalledFunction:
    name: str
    arguments: dict[str, Any] | str = attrs.field(factory=dict)


@attrs.frozen
class AssistantToolCall:
    """A tool call in a request's assistant message, as Ollama's wire spells it (the
    model's own calls are butter.chat.markup.ToolCall)."""

    function: CalledFunction
    id: str | None = None


@attrs.frozen
class Message:
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


@attrs.frozen
class Options:
    """The `options` butter honours; Ollama's others (num_gpu, mirostat, ...) are about
    its own runtime and are ignored, as Ollama ignores options a model does not use."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1: until the context is full
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None  # accepted; the context is the server's (--max-context)


@attrs.frozen
class ChatRequest:
    model: str | None = None
    messages: list[Message] = attrs.field(factory=list)
    tools: list[dict[str, Any]] | None = None
    think: bool | str | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | float | int | None = None  # accepted: one model stays resident


@attrs.frozen
class GenerateRequest:
    model: str | None = None
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    context: list[int] | None = None
    template: str | None = None
    think: bool | str | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | float | int | None = None


@attrs.frozen
class ModelRequest:
    """/api/show: `model` (older clients: `name`)."""

    model: str | None = None
    name: str | None = None

    @property
    def id(self) -> str:
        found = self.model or self.name
        if not found:
            raise InvalidRequest("model is required", param="model")
        return found


_converter = make_converter()


def parse_chat_request(payload: Any) -> ChatRequest:
    request = structure_request(_converter, payload, ChatRequest)
    if not request.messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidRequest(f"messages[{index}].role must be one of {', '.join(ROLES)}",
                                 param="messages")
        if message.images:
            if message.role not in IMAGE_ROLES:
                raise InvalidRequest(f"messages[{index}].images: images are taken in user and "
                                     f"tool messages, not in a {message.role} message",
                                     param=f"messages[{index}].images")
            _check_images(message.images, f"messages[{index}].images")
    _check_common(request.think, request.options)
    return request


def parse_generate_request(payload: Any) -> GenerateRequest:
    request = structure_request(_converter, payload, GenerateRequest)
    if request.images:
        if request.raw or request.suffix is not None:
            raise InvalidRequest("images go through the chat template: a raw prompt (raw: "
                                 "true, or a suffix) takes none", param="images")
        _check_images(request.images, "images")
    if request.context:
        raise InvalidRequest("context (token ids of an earlier answer) is not supported: "
                             "send the conversation as text, or use /api/chat", param="context")
    if request.template:
        raise InvalidRequest("a custom template is not supported: the model's own is used, "
                             "or raw: true for none", param="template")
    _check_common(request.think, request.options)
    return request


def _check_images(images: list[Any], where: str) -> None:
    for number, image in enumerate(images):
        if not isinstance(image, str):
            raise InvalidRequest(f"{where}[{number}] must be a base64 string",
                                 param=f"{where}[{number}]")


def _with_images(text: str, images: list[Any] | None, where: str
                 ) -> str | list[dict[str, Any]]:
    """A message's content: its text, or where it has images, the images first (as Ollama
    puts them) and then its text."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [
        {"type": IMAGE_PART, "image": ImageInput(data=image, param=f"{where}[{number}]")}
        for number, image in enumerate(images)]
    return [*parts, {"type": "text", "text": text}] if text else parts


def parse_model_request(payload: Any) -> ModelRequest:
    return structure_request(_converter, payload, ModelRequest)


def _check_common(think: bool | str | None, options: Options | None) -> None:
    if isinstance(think, str) and think not in THINK_LEVELS:
        raise InvalidRequest(f"think must be true, false or one of {', '.join(THINK_LEVELS)}",
                             param="think")
    if options is None:
        return
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0),
                            ("min_p", 0.0, 1.0), ("repeat_penalty", 0.0, 10.0),
                            ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        value = getattr(options, name)
        if value is not None and not low <= value <= high:
            raise InvalidRequest(f"options.{name} must be between {low:g} and {high:g}",
                                 param=f"options.{name}")
    if options.top_k is not None and not 0 <= options.top_k <= MAX_TOP_K:
        raise InvalidRequest(f"options.top_k must be between 0 and {MAX_TOP_K}",
                             param="options.top_k")
    if options.seed is not None and not 0 <= options.seed <= MAX_SEED:
        raise InvalidRequest(f"options.seed must be between 0 and {MAX_SEED}",
                             param="options.seed")


# ---------------------------------------------------------------- request → generation

def _template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages in the shape templates expect. Ollama's tool results carry no
    call id: each takes the id of the call it answers, in order."""
    rendered: list[dict[str, Any]] = []
    unanswered: list[str] = []
    for turn, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": _with_images(
            message.content or "", message.images, f"messages[{turn}].images")}
        if message.thinking:
            item["reasoning_content"] = message.thinking
        if message.tool_calls:
            unanswered = [call.id or f"call_{turn}_{index}"
                          for index, call in enumerate(message.tool_calls)]
            item["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {
                    "name": call.function.name, "arguments": _arguments(call.function)}}
                for call_id, call in zip(unanswered, message.tool_calls, strict=True)]
        if message.role == "tool":
            if message.tool_name:
                item["name"] = message.tool_name
            answered = message.tool_call_id or (unanswered.pop(0) if unanswered else None)
            if answered:
                item["tool_call_id"] = answered
        rendered.append(item)
    return rendered


def _arguments(function: CalledFunction) -> Any:
    if isinstance(function.arguments, str):
        try:
            return json.loads(function.arguments)
        except ValueError:
            return function.arguments
    return function.arguments


def _template_kwargs(think: bool | str | None) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


def _sampling(options: Options | None, constraint: grammars.OutputConstraint | None
              ) -> SamplingParams:
    overrides = {name: getattr(options, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty",
        "presence_penalty", "frequency_penalty") if options and getattr(options, name) is not None}
    return attrs.evolve(SamplingParams(**overrides), grammar=constraint)


def _max_tokens(options: Options | None) -> int | None:
    if options is None or options.num_predict is None or options.num_predict < 0:
        return None  # Ollama's -1 (and -2): until the context is full
    if options.num_predict == 0:
        raise InvalidRequest("options.num_predict must be positive, or -1 for no limit",
                             param="options.num_predict")
    return options.num_predict


def _stops(options: Options | None) -> tuple[str, ...]:
    stop = options.stop if options else None
    stops = [stop] if isinstance(stop, str) else stop or []
    return tuple(s for s in stops if s)


def _format_constraint(format_: str | dict[str, Any] | None) -> grammars.OutputConstraint | None:
    if format_ is None or format_ == "":
        return None
    if format_ == "json":
        return grammars.json_object_grammar()
    if isinstance(format_, dict):
        return grammars.json_schema_grammar(format_)
    raise InvalidRequest('format must be "json" or a JSON schema', param="format")


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any] | None]:
    schemas: dict[str, dict[str, Any] | None] = {}
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"tools[{index}] must be {{type: function, function: "
                                 "{name, parameters}}}", param="tools")
        schemas[function["name"]] = function.get("parameters")
    return schemas


def chat_generation(request: ChatRequest) -> GenerationRequest:
    schemas = tool_schemas(request.tools)
    prompt = ChatPrompt(_template_messages(request.messages), tools=request.tools or None,
                        template_kwargs=_template_kwargs(request.think))
    return GenerationRequest(
        prompt=prompt, sampling=_sampling(request.options, _format_constraint(request.format)),
        max_tokens=_max_tokens(request.options), stop=_stops(request.options),
        tool_schemas=schemas)


def generate_generation(request: GenerateRequest) -> GenerationRequest:
    prompt: Prompt
    if request.raw or request.suffix is not None:
        prompt = TextPrompt(request.prompt, suffix=request.suffix)
    else:
        messages = [{"role": "system", "content": request.system}] if request.system else []
        prompt = ChatPrompt([*messages, {"role": "user", "content": _with_images(
            request.prompt, request.images, "images")}],
            template_kwargs=_template_kwargs(request.think))
    return GenerationRequest(
        prompt=prompt, sampling=_sampling(request.options, _format_constraint(request.format)),
        max_tokens=_max_tokens(request.options), stop=_stops(request.options))


# ---------------------------------------------------------------- responses

def now() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def line(body: dict[str, Any]) -> bytes:
    """One NDJSON line."""
    return json.dumps(body, ensure_ascii=False).encode() + b"\n"


@attrs.frozen
class Timings:
    """Nanoseconds, as Ollama reports them."""

    total: int
    prompt_eval: int
    eval: int
    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, Any]:
        return {"total_duration": self.total, "load_duration": 0,
                "prompt_eval_count": self.prompt_tokens,
                "prompt_eval_duration": self.prompt_eval,
                "eval_count": self.completion_tokens, "eval_duration": self.eval}


def done_reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"  # Ollama says stop for tool calls


def chat_message(content: str, thinking: str = "",
                 tool_calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "function": {"index": call.index, "name": call.name,
                                          "arguments": arguments_object(call.arguments)}}
            for call in tool_calls]
    return message


def chat_body(model: str, message: dict[str, Any], *, done: bool,
              reason: str | None = None, timings: Timings | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "created_at": now(), "message": message,
                            "done": done}
    if done:
        body["done_reason"] = reason or "stop"
        body.update(timings.body() if timings else {})
    return body


def generate_body(model: str, response: str, *, thinking: str = "", done: bool,
                  reason: str | None = None, timings: Timings | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "created_at": now(), "response": response,
                            "done": done}
    if thinking:
        body["thinking"] = thinking
    if done:
        body["done_reason"] = reason or "stop"
        body.update(timings.body() if timings else {})
    return body


def error_body(message: str) -> dict[str, Any]:
    return {"error": message}


@attrs.frozen
class ModelFacts:
    """What the model routes say of one model (the resident one knows more)."""

    id: str
    size: int = 0
    architecture: str = ""
    quantization: str = ""
    parameter_size: str = ""
    context_length: int | None = None
    template: str = ""
    capabilities: tuple[str, ...] = ("completion", "tools")

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": self.architecture,
                "families": [self.architecture] if self.architecture else None,
                "parameter_size": self.parameter_size,
                "quantization_level": self.quantization}

    def tag(self) -> dict[str, Any]:
        """An entry of /api/tags."""
        return {"name": self.id, "model": self.id, "modified_at": now(), "size": self.size,
                "digest": "", "details": self.details()}

    def show(self) -> dict[str, Any]:
        info: dict[str, Any] = {"general.architecture": self.architecture}
        if self.context_length and self.architecture:
            info[f"{self.architecture}.context_length"] = self.context_length
        return {"modelfile": "", "parameters": "", "template": self.template,
                "details": self.details(), "model_info": info,
                "capabilities": list(self.capabilities), "modified_at": now()}

    def running(self) -> dict[str, Any]:
        """An entry of /api/ps: resident until another model is asked for."""
        return {"name": self.id, "model": self.id, "size": self.size, "digest": "",
                "details": self.details(), "expires_at": "2318-01-01T00:00:00Z",
                "size_vram": 0, "context_length": self.context_length}
