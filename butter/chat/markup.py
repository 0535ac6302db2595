"""Incremental markup parser: think blocks and tool calls out of generated text (pure).

Text goes in as it is generated; events come out: content, reasoning, and complete tool
calls. A tag split across deltas (`<tool_` + `call>`) is held back until it can be
decided, so raw markup never leaks into content. Tool-call bodies are buffered until
`</tool_call>` and parsed in either form:

- JSON (Hermes / Qwen2.5 / Qwen3): `{"name": "f", "arguments": {...}}`
- XML (Qwen3-Coder): `<function=f><parameter=k>v</parameter></function>`, values typed
  by the tool's JSON schema (strings stay strings, the rest is parsed as JSON).
- Key/value (GLM, Laguna, Ling): `f<arg_key>k</arg_key><arg_value>v</arg_value>`, typed
  the same way.

With `bare_json_calls` (templates that write calls as bare JSON: Llama 3.x, Mistral Nemo,
whose `[TOOL_CALLS]` marker is a control token and renders empty), an answer that begins
with `{` or `[` is held to its end and becomes calls if it is one call object, or an array
of them, of tools offered (`name` with `arguments` or `parameters`); else it is content.

Broken markup (unclosed at the end, invalid JSON, unknown function) degrades to plain
content. Feeding the same text in any split gives the same events, merged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
_KEY_VALUE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class ReasoningDelta:
    text: str


@attrs.frozen
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as text


Event = ContentDelta | ReasoningDelta | ToolCall

# Tool name → JSON schema of its parameters (None: no schema given).
ToolSchemas = Mapping[str, Mapping[str, Any] | None]


class MarkupParser:
    def __init__(
        self,
        tools: ToolSchemas | None = None,
        *,
        start_in_reasoning: bool = False,
        new_call_id: Callable[[int], str] = lambda index: f"call_{index}",
        bare_json_calls: bool = False,
    ) -> None:
        self._tools = tools
        self._new_call_id = new_call_id
        self._mode = "reasoning" if start_in_reasoning else "content"
        # Until the answer's first visible character: may it be a bare JSON call?
        self._bare_possible = bare_json_calls and bool(tools)
        self._pending = ""
        self._body = ""  # the open tool call's text
        self._lstrip = start_in_reasoning  # drop whitespace right after a tag
        self._calls = 0

    @property
    def tool_calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[Event]:
        if self._mode == "bare":
            self._body += text
            return []
        self._pending += text
        events: list[Event] = []
        if self._bare_possible and self._mode == "content":
            start = self._pending.lstrip()
            if not start:
                return events  # only whitespace so far: undecided
            self._bare_possible = False
            if start[0] in "{[":
                self._mode, self._body, self._pending = "bare", start, ""
                return events
        while True:
            tags = self._tags()
            found = _earliest(self._pending, tags)
            if found is None:
                keep = _partial_tag_suffix(self._pending, tags)
                ready, self._pending = _split_at(self._pending, len(self._pending) - keep)
                self._emit(ready, events)
                return events
            index, tag = found
            self._emit(self._pending[:index], events)
            self._pending = self._pending[index + len(tag):]
            self._switch(tag, events)

    def finish(self) -> list[Event]:
        """End of generation: release held text; an unclosed call becomes content."""
        events: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._mode == "bare":
            self._mode = "content"
            calls = self._calls_from(parse_bare_json_calls(self._body, self._tools or {}))
            if calls is None:
                self._emit(self._body, events)
            else:
                events.extend(calls)
            self._body = ""
            return events
        if self._mode == "tool":
            self._mode = "content"
            self._lstrip = False
            self._emit(CALL_OPEN + self._body + pending, events)
            self._body = ""
        else:
            self._emit(pending, events)
        return events

    # ------------------------------------------------------------------ internals

    def _tags(self) -> tuple[str, ...]:
        if self._mode == "reasoning":
            return (THINK_CLOSE,)
        if self._mode == "tool":
            return (CALL_CLOSE,)
        return (THINK_OPEN, CALL_OPEN) if self._tools else (THINK_OPEN,)

    def _emit(self, text: str, events: list[Event]) -> None:
        if self._mode == "tool":
            self._body += text
            return
        if self._lstrip:
            text = text.lstrip()
            if not text:
                return
            self._lstrip = False
        if not text:
            return
        if self._mode == "content":
            self._bare_possible = False  # the answer has begun: not a bare call
        event: Event = ReasoningDelta(text) if self._mode == "reasoning" else ContentDelta(text)
        events.append(event)

    def _switch(self, tag: str, events: list[Event]) -> None:
        if tag == THINK_OPEN:
            self._mode, self._lstrip = "reasoning", True
        elif tag == THINK_CLOSE:
            self._mode, self._lstrip = "content", True
        elif tag == CALL_OPEN:
            self._mode, self._body = "tool", ""
        else:  # CALL_CLOSE
            self._mode = "content"
            calls = self._parse_body(self._body)
            if calls is None:
                self._emit(CALL_OPEN + self._body + CALL_CLOSE, events)
            else:
                events.extend(calls)
                self._lstrip = True
            self._body = ""

    def _parse_body(self, body: str) -> list[ToolCall] | None:
        return self._calls_from(parse_tool_call_body(body, self._tools or {}))

    def _calls_from(self, parsed: list[tuple[str, str]] | None) -> list[ToolCall] | None:
        if parsed is None:
            return None
        calls = []
        for name, arguments in parsed:
            calls.append(ToolCall(index=self._calls, id=self._new_call_id(self._calls),
                                  name=name, arguments=arguments))
            self._calls += 1
        return calls


def parse_tool_call_body(body: str, tools: ToolSchemas) -> list[tuple[str, str]] | None:
    """One tool-call body → [(name, arguments JSON)], or None if it is not a valid call."""
    text = body.strip()
    if text.startswith("{"):
        return _parse_json_call(text, tools)
    if "<function=" in text:
        return _parse_xml_calls(text, tools)
    if "<arg_key>" in text or (text and text in tools):
        return _parse_key_value_call(text, tools)
    return None


def parse_bare_json_calls(text: str, tools: ToolSchemas) -> list[tuple[str, str]] | None:
    """A whole answer that is one JSON call object, or an array of them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    objects = value if isinstance(value, list) else [value]
    calls: list[tuple[str, str]] = []
    for item in objects:
        found = _parse_json_call(json.dumps(item), tools) if isinstance(item, dict) else None
        if found is None:
            return None
        calls.extend(found)
    return calls or None


def _parse_key_value_call(text: str, tools: ToolSchemas) -> list[tuple[str, str]] | None:
    name, _, rest = text.partition("<arg_key>")
    name = name.strip()
    if name not in tools:
        return None
    rest = "<arg_key>" + rest if rest else ""
    properties = _properties(tools[name])
    arguments = {key.strip(): _typed_value(value, properties.get(key.strip()))
                 for key, value in _KEY_VALUE.findall(rest)}
    if _KEY_VALUE.sub("", rest).strip():
        return None
    return [(name, json.dumps(arguments, ensure_ascii=False))]


def _parse_json_call(text: str, tools: ToolSchemas) -> list[tuple[str, str]] | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    name = call["name"]
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if name not in tools or not isinstance(arguments, dict):
        return None
    return [(name, json.dumps(arguments, ensure_ascii=False))]


def _parse_xml_calls(text: str, tools: ToolSchemas) -> list[tuple[str, str]] | None:
    calls = []
    for match in _FUNCTION.finditer(text):
        name, inner = match.group(1), match.group(2)
        if name not in tools:
            return None
        properties = _properties(tools[name])
        arguments = {
            key: _typed_value(value, properties.get(key))
            for key, value in _PARAMETER.findall(inner)
        }
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    leftover = _FUNCTION.sub("", text).strip()
    return calls if calls and not leftover else None


def _properties(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    properties = (schema or {}).get("properties")
    return properties if isinstance(properties, Mapping) else {}


def _typed_value(raw: str, schema: Any) -> Any:
    # The XML form puts values on their own lines: one newline each side is framing.
    value = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _earliest(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for tag in tags:
        index = text.find(tag)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, tag)
    return best


def _partial_tag_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could still grow into a tag."""
    longest = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:length]):
                longest = length
                break
    return longest


def _split_at(text: str, index: int) -> tuple[str, str]:
    return text[:index], text[index:]
