"""What a chat template can render, found by rendering probes at load, and the rewrites
that let it render whatever a client sends.

Real templates differ in what they accept: many have no tool support, some reject a
system role, null content, tool-call arguments given as an object (or as a string), or
tool-call ids that are not 9 alphanumeric characters; some need `tools` to be a list even
when none are offered. Clients send all of these. Rather than keep a list of templates,
`probe` renders a few small conversations with markers and looks for the markers in the
output, and `adapt` rewrites a request's messages into what the template renders:
  - tool calls and tool results as text, in the `<tool_call>` / `<tool_response>` markup
    that butter's tools preamble teaches the model, where the template has no tool support;
  - arguments as the template wants them, and ids in the form it demands;
  - system messages folded into the next user turn where there is no system role, or
    none after the first turn;
  - null content as "" where the template cannot take None;
  - optional fields sent as null left out (a template sees them absent, which
    butter/chat/template.py's AbsentField makes safe to read), and tool calls without an id
    given one, which the results that answer them in order share.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable
from typing import Any

import attrs

from butter.chat.tool_calls import family_syntax

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None
# Renders (messages, tools) to text, or raises: the template under test.
Render = Callable[[Messages, Tools], str]

_TOOL = "probe_tool_name"
_CALL = "probe_call_name"
_VALUE = "probe_argument_value"
_RESULT = "probe_tool_result"
_SYSTEM = "probe_system_text"
_USER = "probe_user_text"
_REASONING = "probe_reasoning_text"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _TOOL, "description": "a probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
SHORT_ID_LENGTH = 9  # Mistral's templates refuse any other tool-call id
_ID_ALPHABET = string.ascii_letters + string.digits


@attrs.frozen
class TemplateCapabilities:
    """Shown in /v1/models meta (`chat_template_capabilities`)."""

    system_role: bool = True
    tools: bool = False  # renders the `tools` it is given
    tool_calls: bool = False  # renders an assistant turn's tool_calls
    tool_responses: bool = False  # renders `tool` messages
    string_arguments: bool = False  # wants tool-call arguments as a JSON string
    short_tool_call_ids: bool = False  # wants ids of 9 alphanumeric characters
    null_content: bool = True  # takes an assistant turn whose content is None
    tools_list: bool = False  # needs `tools` to be a list even when none are offered
    reasoning: bool = False  # renders earlier turns' reasoning_content
    # Renders it given as `thinking` instead (gpt-oss: before a tool call the model made).
    thinking_field: bool = False
    empty_assistant: bool = True  # takes an assistant turn with no content and no calls
    inner_system: bool = True  # renders system messages after the first turn
    # Writes an assistant's call as a bare JSON object (Llama 3.x, Mistral Nemo): the
    # model answers a call that way too (chat/markup.py, bare_json_calls).
    bare_json_calls: bool = False
    # The model family whose tool-call markup the template writes, besides `<tool_call>`
    # (chat/tool_calls.py, FAMILIES); None: `<tool_call>` only.
    call_family: str | None = None


def _renders(render: Render, messages: Messages, tools: Tools, *markers: str) -> bool:
    try:
        text = render(messages, tools)
    except Exception:  # (a template's own raise_exception, or any error inside it)
        return False
    return all(marker in text for marker in markers)


def _tool_round(arguments: Any, call_id: str, content: str | None) -> Messages:
    return [
        {"role": "user", "content": _USER},
        {"role": "assistant", "content": content, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": _CALL, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "name": _CALL, "content": _RESULT},
    ]


def probe(render: Render, source: str = "") -> TemplateCapabilities:
    """What the template renders; `source`: its text, where a family's tool-call markup
    may show that no probe renders."""
    user = [{"role": "user", "content": _USER}]
    tools_list = not _renders(render, user, None) and _renders(render, user, [])
    no_tools: Tools = [] if tools_list else None
    null_content = _renders(render, [*user, {"role": "assistant", "content": None}, *user],
                            no_tools, _USER)
    empty_assistant = _renders(render, [*user, {"role": "assistant", "content": ""}, *user],
                               no_tools, _USER)
    tools = _renders(render, user, _PROBE_TOOLS, _TOOL)
    offered = _PROBE_TOOLS if tools else no_tools
    content = None if null_content else ""
    found: dict[str, bool] = {}
    rendered_call = ""  # the template's own rendering of a call, where it renders them
    for string_arguments in (False, True):
        arguments = json.dumps({"x": _VALUE}) if string_arguments else {"x": _VALUE}
        for call_id in ("call_probe_1", short_tool_call_id("call_probe_1")):
            round_ = _tool_round(arguments, call_id, content)
            if _renders(render, round_, offered, _CALL, _VALUE):
                rendered_call = render(round_, offered)
                found = {"string_arguments": string_arguments,
                         "short_tool_call_ids": call_id != "call_probe_1",
                         "tool_responses": _RESULT in rendered_call,
                         "bare_json_calls": _writes_bare_json(rendered_call)}
                break
        if found:
            break
    if not found:  # no tool calls: do tool results render after a plain assistant turn?
        results = [*user, {"role": "assistant", "content": "ok"},
                   {"role": "tool", "tool_call_id": "call_probe_1", "content": _RESULT}]
        found = {"tool_responses": _renders(render, results, no_tools, _RESULT)}
    system_role = _renders(render, [{"role": "system", "content": _SYSTEM}, *user], no_tools,
                           _SYSTEM)
    inner_system = _renders(render, [*user, {"role": "assistant", "content": "ok"},
                                     {"role": "system", "content": _SYSTEM}, *user],
                            no_tools, _SYSTEM)
    reasoning = _renders(render, [*user, {"role": "assistant", "content": "ok",
                                          "reasoning_content": _REASONING}, *user],
                         no_tools, _REASONING)
    thinking_field = not reasoning and _renders_thinking(render, user, offered, content, found)
    return TemplateCapabilities(
        system_role=system_role, tools=tools, tool_calls="string_arguments" in found,
        null_content=null_content, tools_list=tools_list, reasoning=reasoning,
        thinking_field=thinking_field,
        empty_assistant=empty_assistant, inner_system=inner_system,
        call_family=_family(rendered_call.partition(_USER)[2], source), **found)


def _renders_thinking(render: Render, user: Messages, tools: Tools, content: str | None,
                      found: dict[str, bool]) -> bool:
    """Earlier reasoning given as `thinking`: after a plain answer, or before a call."""
    answered = [*user, {"role": "assistant", "content": "ok", "thinking": _REASONING}, *user]
    if _renders(render, answered, tools, _REASONING):
        return True
    if "string_arguments" not in found:
        return False
    arguments: Any = json.dumps({"x": _VALUE}) if found["string_arguments"] else {"x": _VALUE}
    call_id = short_tool_call_id("call_probe_1") if found["short_tool_call_ids"] else (
        "call_probe_1")
    round_ = _tool_round(arguments, call_id, content)
    round_[1]["thinking"] = _REASONING
    return _renders(render, round_, tools, _REASONING)


def _family(rendered_call: str, source: str) -> str | None:
    syntax = family_syntax(rendered_call, source)
    return None if syntax is None else syntax.family


def _writes_bare_json(rendered: str) -> bool:
    """The call is a JSON object naming the function, outside any `<tool_call>` tag."""
    return f'{{"name": "{_CALL}"' in rendered and "<tool_call>" not in rendered


def short_tool_call_id(call_id: str) -> str:
    """A stable 9-character alphanumeric id for any id, so a call and its result agree."""
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    letters = []
    for _ in range(SHORT_ID_LENGTH):
        number, index = divmod(number, len(_ID_ALPHABET))
        letters.append(_ID_ALPHABET[index])
    return "".join(letters)


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def tool_call_text(call: dict[str, Any]) -> str:
    """A tool call in the markup butter's tools preamble teaches (and markup.py parses)."""
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": _arguments_object(function.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = "\n".join(tool_call_text(call) for call in message["tool_calls"])
    rewritten = {key: value for key, value in message.items() if key != "tool_calls"}
    rewritten["content"] = f"{message.get('content') or ''}\n{calls}".lstrip("\n")
    return rewritten


def _calls_as_wanted(message: dict[str, Any], caps: TemplateCapabilities) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if caps.string_arguments and not isinstance(arguments, str):
            function["arguments"] = json.dumps(arguments, ensure_ascii=False)
        elif not caps.string_arguments:
            function["arguments"] = _arguments_object(arguments)
        call = {**call, "function": function}
        if caps.short_tool_call_ids and call.get("id"):
            call["id"] = short_tool_call_id(str(call["id"]))
        calls.append(call)
    return {**message, "tool_calls": calls}


def _result_as_text(message: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user",
            "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}


def _merge_user_runs(messages: Messages) -> Messages:
    """Consecutive user turns (tool results written as text) as one: many templates insist
    that user and assistant alternate."""
    merged: Messages = []
    for message in messages:
        if merged and message["role"] == "user" and merged[-1]["role"] == "user":
            merged[-1] = {**merged[-1], "content":
                          f"{merged[-1].get('content') or ''}\n{message.get('content') or ''}"}
        else:
            merged.append(dict(message))
    return merged


def _fold_system(messages: Messages) -> Messages:
    """Every system message into the next user turn (before its text); with no user turn
    after it, into the last one before it."""
    pending: list[str] = []
    folded: Messages = []
    for message in messages:
        if message["role"] == "system":
            pending.append(message.get("content") or "")
            continue
        if message["role"] == "user" and pending:
            message = {**message, "content": "\n\n".join([*pending, message.get("content") or ""])}
            pending = []
        folded.append(message)
    if pending:
        users = [i for i, message in enumerate(folded) if message["role"] == "user"]
        if not users:
            return [{"role": "user", "content": "\n\n".join(pending)}, *folded]
        last = folded[users[-1]]
        folded[users[-1]] = {**last, "content": "\n\n".join([last.get("content") or "", *pending])}
    return folded


# Optional fields that a null means the client did not send (OpenAI's SDKs send null
# where the field was not set): left out, so that templates test them with `is defined`.
_NULLABLE_MESSAGE_FIELDS = ("name", "tool_call_id")
_NULLABLE_TOOL_FIELDS = ("description", "parameters", "strict")


def _without_nulls(item: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    if not any(field in item and item[field] is None for field in fields):
        return item
    return {key: value for key, value in item.items() if not (key in fields and value is None)}


def without_null_fields(tools: Tools) -> Tools:
    """The tools with their optional fields sent as null left out."""
    if not tools:
        return tools
    cleaned = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict):
            tool = {**tool, "function": _without_nulls(function, _NULLABLE_TOOL_FIELDS)}
        cleaned.append(tool)
    return cleaned


def with_call_ids(messages: Messages) -> Messages:
    """Every tool call with an id, and every tool result with the id of the call it
    answers. A call sent without one gets `call_<turn>_<index>`; a result sent without a
    `tool_call_id` answers the first unanswered call before it, in order (as Ollama's
    results, which carry no ids, do). Templates match results to calls by id, and some
    refuse a call without one."""
    paired: Messages = []
    unanswered: list[str] = []
    for turn, message in enumerate(messages):
        message = _without_nulls(message, _NULLABLE_MESSAGE_FIELDS)
        if message.get("tool_calls"):
            calls = [call if call.get("id") else {**call, "id": f"call_{turn}_{index}"}
                     for index, call in enumerate(message["tool_calls"])]
            message = {**message, "tool_calls": calls}
            unanswered = [str(call["id"]) for call in calls]
        elif message["role"] == "tool":
            answered = message.get("tool_call_id")
            if not answered and unanswered:
                message = {**message, "tool_call_id": unanswered.pop(0)}
            elif answered in unanswered:
                unanswered.remove(answered)
        paired.append(message)
    return paired


def adapt(messages: Messages, tools: Tools, caps: TemplateCapabilities) -> tuple[Messages, Tools]:
    """The request's messages and tools as this template renders them (module docstring).
    Tools the template cannot render are expected in a system message already (the
    preamble), so `tools` here is what goes to the template itself."""
    adapted: Messages = []
    for message in with_call_ids(messages):
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        if message.get("tool_calls"):
            message = (_calls_as_wanted(message, caps) if caps.tool_calls
                       else _calls_as_text(message))
        if message["role"] == "tool":
            if not caps.tool_responses:
                message = _result_as_text(message)
            elif caps.short_tool_call_ids and message.get("tool_call_id"):
                message["tool_call_id"] = short_tool_call_id(str(message["tool_call_id"]))
        if message.get("content") is None and not caps.null_content:
            message["content"] = ""
        if caps.thinking_field and message.get("reasoning_content") and not (
                message.get("tool_calls") and message.get("content")):  # (not both: gpt-oss)
            message["thinking"] = message.pop("reasoning_content")
        if (message["role"] == "assistant" and not caps.empty_assistant
                and not message.get("content") and not message.get("tool_calls")):
            continue  # an empty turn says nothing; the template refuses to render one
        adapted.append(message)
    if not caps.tool_responses or not caps.empty_assistant:
        adapted = _merge_user_runs(adapted)
    if not caps.system_role:
        adapted = _fold_system(adapted)
    elif not caps.inner_system and any(m["role"] == "system" for m in adapted[1:]):
        adapted = adapted[:1] + _fold_system(adapted[1:])  # the first may stay where it is
    if tools is None and caps.tools_list:
        tools = []
    return adapted, tools
