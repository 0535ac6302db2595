"""OpenAI Chat Completions: request types, validation, response and chunk bodies."""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

import attrs

from butter.chat import grammar as grammars
from butter.chat.request import (
    IMAGE_PART,
    ChatPrompt,
    FinishReason,
    GenerationRequest,
    ImageInput,
    Logprobs,
    Prompt,
    Timings,
    TokenLogprob,
    Usage,
)
from butter.errors import InvalidRequest
from butter.protocol.convert import make_converter, structure_request
from butter.sampling import MAX_SEED, SamplingParams

# Larger than any vocabulary; keeps the value inside llama.cpp's int32.
MAX_TOP_K = 1 << 20
MAX_CHOICES = 16  # `n`; also bounded by the server's sessions (--parallel)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen
class ContentPart:
    type: str
    text: str | None = None
    # {"url": "data:image/png;base64,...", "detail": ...}; some clients send the URL alone.
    image_url: dict[str, Any] | str | None = None


@attrs.frozen
class CalledFunction:
    name: str
    arguments: str | dict[str, Any] = "{}"


@attrs.frozen
class AssistantToolCall:
    """A tool call in a request's assistant message, as OpenAI's wire spells it (the
    model's own calls are butter.chat.markup.ToolCall)."""

    function: CalledFunction
    id: str | None = None
    type: str = "function"


@attrs.frozen
class ChatMessage:
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


@attrs.frozen
class FunctionDef:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class Tool:
    function: FunctionDef
    type: str = "function"


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen
class ResponseFormat:
    type: str
    json_schema: dict[str, Any] | None = None


@attrs.frozen
class ChatCompletionRequest:
    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    n: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama-server's: a GBNF grammar the output must follow
    return_progress: bool = False  # llama-server's: prompt_progress chunks while prefilling
    timings_per_token: bool = False  # llama-server's: `timings` on every chunk of a stream
    verbose: bool = False  # llama-server's: a `__verbose` object with the rendered prompt
    # vLLM's and llama-server's. add_generation_prompt false: the prompt ends after the
    # last message. continue_final_message: the final assistant message is left open for
    # the model to continue (add_generation_prompt then defaults to false; both true: 400).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)


_converter = make_converter()


def parse_chat_request(payload: Any) -> ChatCompletionRequest:
    request = structure_request(_converter, payload, ChatCompletionRequest)
    _validate(request)
    return request


def _validate(request: ChatCompletionRequest) -> None:
    if not request.messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidRequest(
                f"messages[{index}].role must be one of {', '.join(ROLES)}; got {message.role!r}",
                param=f"messages[{index}].role",
            )
        for number, part in enumerate(message.content if isinstance(message.content, list)
                                      else []):
            _check_part(message.role, part, f"messages[{index}].content[{number}]")
    check_sampling_ranges(request)
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be between 0 and {MAX_SEED}", param="seed")
    max_tokens = request.requested_max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}", param="n")
    _validate_logprobs(request.logprobs, request.top_logprobs)
    logit_bias(request.logit_bias)  # (validates)
    if request.stop is not None and isinstance(request.stop, list) and len(request.stop) > 16:
        raise InvalidRequest("at most 16 stop sequences are supported", param="stop")
    _validate_tools(request)
    _validate_response_format(request.response_format)
    _validate_continuation(request)


# Roles whose content may hold images: OpenAI takes them in user messages; a tool's result
# may be a screenshot too (vLLM and llama-server take them there).
IMAGE_ROLES = ("user", "tool")


def _check_part(role: str, part: ContentPart, where: str) -> None:
    if part.type == "text" and part.text is not None:
        return
    if part.type != "image_url":
        raise InvalidRequest(f"{where}: only text and image_url parts are supported, got "
                             f"{part.type!r}", param=where)
    if role not in IMAGE_ROLES:
        raise InvalidRequest(f"{where}: images are taken in user and tool messages, not in "
                             f"a {role} message", param=where)
    image_input(part, where)  # (validates)


def image_input(part: ContentPart, where: str) -> ImageInput:
    """An image_url part's image: a base64 data URL (data:image/png;base64,...). A remote
    URL is not fetched (a server that fetches what a request names can be made to reach
    what only it can reach); a file: URL never is."""
    url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
    param = f"{where}.image_url" + (".url" if isinstance(part.image_url, dict) else "")
    if not isinstance(url, str):
        raise InvalidRequest(f"{where}.image_url must be an object with a url (a "
                             "data:image/...;base64 URL)", param=param)
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise InvalidRequest(f"{param}: remote images are not fetched: send the image "
                             "inline as a data URL (data:image/png;base64,...)", param=param)
    header, comma, data = url.partition(",") if scheme.startswith("data:") else ("", "", "")
    if not comma or not header.lower().endswith(";base64"):
        raise InvalidRequest(f"{param} must be a base64 data URL "
                             "(data:image/png;base64,...)", param=param)
    media_type = header[len("data:"):].split(";")[0].strip().lower() or None
    if media_type is not None and not media_type.startswith("image/"):
        raise InvalidRequest(f"{param}: a data URL of {media_type} is not an image",
                             param=param)
    return ImageInput(data=data, media_type=media_type, param=param)


def _validate_continuation(request: ChatCompletionRequest) -> None:
    """Both true contradict each other (vLLM and llama-server refuse it too); continuing
    needs a final assistant message to continue."""
    if not request.continue_final_message:
        return
    if request.add_generation_prompt:
        raise InvalidRequest("add_generation_prompt and continue_final_message cannot both "
                             "be true: set add_generation_prompt to false to continue the "
                             "final message", param="continue_final_message")
    if request.messages[-1].role != "assistant":
        raise InvalidRequest("continue_final_message needs the final message to be the "
                             "assistant's (the message the model continues); it is the "
                             f"{request.messages[-1].role}'s", param="continue_final_message")


def _validate_logprobs(logprobs: bool | None, top_logprobs: int | None) -> None:
    if top_logprobs is None:
        return
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
                             param="top_logprobs")
    if not logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; -100 bans the token (-inf)."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}",
                                 param="logit_bias") from None
        if token < 0 or not -100 <= value <= 100:
            raise InvalidRequest("logit_bias maps token ids >= 0 to values between -100 and "
                                 "100", param="logit_bias")
        pairs.append((token, float("-inf") if value <= -100 else float(value)))
    return tuple(pairs)


def _validate_tools(request: ChatCompletionRequest) -> None:
    for index, tool in enumerate(request.tools or []):
        if tool.type != "function":
            raise InvalidRequest(f"tools[{index}].type must be 'function'",
                                 param=f"tools[{index}].type")
    choice = request.tool_choice
    if choice is None or choice in ("auto", "none", "required"):
        return
    if isinstance(choice, str):
        raise InvalidRequest(
            f"tool_choice must be auto, none, required or a function; got {choice!r}",
            param="tool_choice",
        )
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(
        function.get("name"), str
    ):
        raise InvalidRequest(
            'tool_choice must look like {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )


def _validate_response_format(response_format: ResponseFormat | None) -> None:
    if response_format is None or response_format.type in ("text", "json_object"):
        return
    if response_format.type != "json_schema":
        raise InvalidRequest(
            "response_format.type must be text, json_object or json_schema",
            param="response_format.type",
        )
    schema = (response_format.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                             param="response_format.json_schema")


def forced_tool(request: ChatCompletionRequest) -> str | None:
    """The function a named tool_choice forces, if any."""
    choice = request.tool_choice
    if isinstance(choice, dict):
        return str(choice["function"]["name"])
    return None


def tools_offered(request: ChatCompletionRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return kwargs


class SamplingFields(Protocol):
    @property
    def temperature(self) -> float | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def repeat_penalty(self) -> float | None: ...


def check_sampling_ranges(request: SamplingFields) -> None:
    """The sampling fields both OpenAI endpoints share, each within its range."""
    _check_range(request.temperature, "temperature", 0.0, 2.0)
    _check_range(request.top_p, "top_p", 0.0, 1.0)
    _check_range(request.min_p, "min_p", 0.0, 1.0)
    _check_range(request.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(request.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(request.repeat_penalty, "repeat_penalty", 0.0, 10.0)
    if request.top_k is not None and not 0 <= request.top_k <= MAX_TOP_K:
        raise InvalidRequest(f"top_k must be between 0 and {MAX_TOP_K}", param="top_k")


def _check_range(value: float | None, name: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low:g} and {high:g}", param=name)


def sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """Client values over llama-server's defaults (attrs defaults of SamplingParams)."""
    overrides: dict[str, Any] = {
        name: getattr(request, name)
        for name in (
            "temperature", "top_p", "top_k", "min_p", "seed",
            "presence_penalty", "frequency_penalty", "repeat_penalty",
        )
        if getattr(request, name) is not None
    }
    return SamplingParams(**overrides)


def message_text(content: str | list[ContentPart] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content)


def message_content(content: str | list[ContentPart] | None, index: int
                    ) -> str | list[dict[str, Any]] | None:
    """A message's content for the template: its text, or where it holds images, its
    parts in order, text ({"type": "text", "text": ...}) and images (IMAGE_PART)."""
    if not isinstance(content, list) or all(part.type == "text" for part in content):
        return message_text(content)
    return [{"type": IMAGE_PART,
             "image": image_input(part, f"messages[{index}].content[{number}]")}
            if part.type == "image_url" else {"type": "text", "text": part.text or ""}
            for number, part in enumerate(content)]


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content, tool-call arguments as objects."""
    rendered: list[dict[str, Any]] = []
    for index, message in enumerate(request.messages):
        # OpenAI's `developer` replaces `system`; most templates know only the latter.
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": message_content(message.content,
                                                                          index)}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            item["reasoning_content"] = reasoning
        if message.tool_calls:
            item["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
        rendered.append(item)
    return rendered


def _template_tool_call(call: AssistantToolCall) -> dict[str, Any]:
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # Templates render a non-JSON string as it came.
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not tools_offered(request):
        return None
    return [template_tool(tool) for tool in request.tools or []]


def template_tool(tool: Tool) -> dict[str, Any]:
    """A tool as templates expect it: the client's JSON, without fields it did not send."""
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    if tool.function.parameters is not None:
        function["parameters"] = tool.function.parameters
    return {"type": tool.type, "function": function}


# ---------------------------------------------------------------- request → generation

def generation_request(
    request: ChatCompletionRequest, prompt: Prompt | None = None
) -> GenerationRequest:
    """What the pipeline runs for this request; `prompt` replaces the messages (the
    library completes raw text with the chat request's other fields)."""
    if prompt is None:
        continued = bool(request.continue_final_message)
        prompt = ChatPrompt(template_messages(request), tools=template_tools(request),
                            template_kwargs=template_kwargs(request),
                            add_generation_prompt=(not continued
                                                   if request.add_generation_prompt is None
                                                   else request.add_generation_prompt),
                            continue_final_message=continued)
    sampling = attrs.evolve(
        sampling_params(request), grammar=output_constraint(request),
        logit_bias=logit_bias(request.logit_bias),
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
    )
    return GenerationRequest(
        prompt=prompt, sampling=sampling, max_tokens=request.requested_max_tokens,
        stop=request.stop_strings, tool_schemas=tool_schemas(request), n=request.n or 1,
    )


def output_constraint(request: ChatCompletionRequest) -> grammars.OutputConstraint | None:
    """What the output must follow: a call for `tool_choice` required / named, or JSON
    for `response_format`; None: free text."""
    forced = forced_tool(request)
    wants_call = request.tool_choice == "required" or forced is not None
    response_format = request.response_format
    wants_json = response_format is not None and response_format.type != "text"
    if wants_call and wants_json:
        raise InvalidRequest("tool_choice that forces a call cannot be combined with a JSON "
                             "response_format", param="response_format")
    if request.grammar is not None:
        return gbnf_constraint(request.grammar, wants_call or wants_json)
    if wants_call:
        if not request.tools:
            raise InvalidRequest("tool_choice requires tools", param="tool_choice")
        tools = [template_tool(tool) for tool in request.tools]
        return grammars.tool_call_grammar(tools, forced)
    if response_format is None or not wants_json:
        return None
    if response_format.type == "json_object":
        return grammars.json_object_grammar()
    return grammars.json_schema_grammar((response_format.json_schema or {})["schema"])


def gbnf_constraint(grammar: str, constrained_otherwise: bool) -> grammars.OutputConstraint:
    """llama-server's `grammar` field (GBNF; the backend checks that it is valid)."""
    if constrained_otherwise:
        raise InvalidRequest("grammar cannot be combined with a forced tool call or a JSON "
                             "response_format", param="grammar")
    if not grammar.strip():
        raise InvalidRequest("grammar is empty", param="grammar")
    return grammars.OutputConstraint.of_gbnf(grammar)


# ---------------------------------------------------------------- responses

def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def progress_chunk_body(*, completion_id: str, model: str, created: int, total: int,
                        cache: int, processed: int, time_ms: int) -> dict[str, Any]:
    """llama-server's `prompt_progress` chunk, sent while a stream's prompt is evaluated:
    `processed` counts the prompt positions in the KV cache so far (the cached ones too)."""
    body = chunk_body(completion_id=completion_id, model=model, created=created,
                      delta={"role": "assistant", "content": None})
    body["prompt_progress"] = {"total": total, "cache": cache, "processed": processed,
                               "time_ms": time_ms}
    return body


def timings_body(timings: Timings) -> dict[str, Any]:
    """llama-server's `timings`, which its web UI and several clients read."""
    def per_token(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_second(ms: float, n: int) -> float:
        return n * 1000 / ms if ms > 0 else 0.0

    return {
        "cache_n": timings.cached_tokens,
        "prompt_n": timings.prompt_tokens, "prompt_ms": timings.prompt_ms,
        "prompt_per_token_ms": per_token(timings.prompt_ms, timings.prompt_tokens),
        "prompt_per_second": per_second(timings.prompt_ms, timings.prompt_tokens),
        "predicted_n": timings.predicted_tokens, "predicted_ms": timings.predicted_ms,
        "predicted_per_token_ms": per_token(timings.predicted_ms, timings.predicted_tokens),
        "predicted_per_second": per_second(timings.predicted_ms, timings.predicted_tokens),
    }


def tool_schemas(request: ChatCompletionRequest) -> dict[str, dict[str, Any] | None]:
    """Name → parameters schema of the tools offered (for the markup parser)."""
    if not tools_offered(request):
        return {}
    return {tool.function.name: tool.function.parameters for tool in request.tools or []}


def message_body(content: str | None, reasoning: str | None,
                 tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:  # under both names clients read (llama-server's and vLLM's)
        message["reasoning_content"] = message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def logprobs_body(entries: list[Logprobs]) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice: per token, its text, bytes, logprob and the most
    likely alternatives."""
    return {"content": [{**_token_logprob(entry.chosen),
                         "top_logprobs": [_token_logprob(top) for top in entry.top]}
                        for entry in entries]}


def _token_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.piece.decode("utf-8", errors="replace"),
            "logprob": entry.logprob, "bytes": list(entry.piece)}


def choice_body(index: int, message: dict[str, Any], finish_reason: FinishReason,
                logprobs: list[Logprobs] | None) -> dict[str, Any]:
    """One choice; `logprobs` None: not asked."""
    return {"index": index, "message": message, "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else logprobs_body(logprobs)}


def completion_body(
    *, completion_id: str, model: str, created: int, choices: list[dict[str, Any]],
    usage: Usage, timings: Timings | None = None,
) -> dict[str, Any]:
    body = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(usage),
    }
    if timings is not None:
        body["timings"] = timings_body(timings)
    return body


def chunk_body(
    *, completion_id: str, model: str, created: int, delta: dict[str, Any],
    finish_reason: FinishReason | None = None, index: int = 0,
    logprobs: list[Logprobs] | None = None, timings: Timings | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                     "logprobs": None if logprobs is None else logprobs_body(logprobs)}],
    }
    if timings is not None:  # on a choice's last chunk, as llama-server sends them
        body["timings"] = timings_body(timings)
    return body


def usage_chunk_body(
    *, completion_id: str, model: str, created: int, usage: Usage,
    timings: Timings | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }
    if timings is not None:  # (a stream's last chunk carries them, as llama-server's does)
        body["timings"] = timings_body(timings)
    return body


def verbose_body(*, prompt: str, model: str, usage: Usage, timings: Timings,
                 finish_reason: FinishReason, matched_stop: str | None,
                 content: str | None = None, index: int = 0) -> dict[str, Any]:
    """llama-server's `__verbose` (`"verbose": true`): a choice in its native words, the
    prompt as the model saw it (special tokens written out) first among them. `content`:
    the answer's text (None on a stream, which sent it already)."""
    body: dict[str, Any] = {
        "index": index,
        "prompt": prompt,
        "model": model,
        "stop": True,
        "stop_type": ("limit" if finish_reason == "length"
                      else "word" if matched_stop is not None else "eos"),
        "stopping_word": matched_stop or "",
        "tokens_predicted": usage.completion_tokens,
        "tokens_evaluated": usage.prompt_tokens,
        "truncated": False,  # (a prompt too long for the context is refused, never cut)
        "timings": timings_body(timings),
    }
    if content is not None:
        body["content"] = content
    return body


def now() -> int:
    return int(time.time())
