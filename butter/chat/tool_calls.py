"""How model families write tool calls, and the parsers of what they write (pure).

Every family marks its calls with an opening text and, most of the time, a closing one;
between them is a body only that family's parser reads. `<tool_call>` (Hermes, Qwen, GLM,
and what butter's tools preamble teaches) is always understood. A template that writes
another family's markup (found in its rendering of a probe call, else in its source)
adds that family's syntax: the markup parser (chat/markup.py) then watches for both.

Many of these markers are control tokens, which llama.cpp renders as empty pieces; the
backends write out the ones in `CallSyntax.markers` as text so the parser sees them.

Each parser returns [(name, arguments as JSON text)], or None when the body is not a
valid call of an offered tool (the markup then degrades to plain content).

A call that max_tokens cut short has a second reader (`CallSyntax.cut`, for the forms
that mark where a function's name ends): the call as far as it was written, its arguments
the start of a JSON object (`arguments_object` reads them as far as they go).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from butter.chat.partial_json import partial_string, read_prefix

# Tool name → JSON schema of its parameters (None: no schema given).
ToolSchemas = Mapping[str, Mapping[str, Any] | None]
Parsed = list[tuple[str, str]] | None
BodyParser = Callable[[str, ToolSchemas], Parsed]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@attrs.frozen
class CallSyntax:
    """One family's tool-call markup: `open`, then a body for `parse`, then `close` (None:
    the calls run to the end of the answer)."""

    family: str
    open: str
    close: str | None
    parse: BodyParser
    inner: tuple[str, ...] = ()  # marker texts inside the body
    # `open` is an ordinary word, a call only where it begins a line (`Action:`).
    line_start: bool = False
    # The body of a call cut short (max_tokens): its calls, the last as far as it was
    # written; None: where the form does not mark the end of the function's name yet.
    cut: BodyParser | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker text the parser must see (the backends write these out as text
        where they are control tokens)."""
        return (self.open, *((self.close,) if self.close else ()), *self.inner)


# ---------------------------------------------------------------- shared pieces

def _calls(pairs: Iterable[tuple[str, Any]], tools: ToolSchemas) -> Parsed:
    """[(name, arguments as JSON text)] if every pair names an offered tool and gives its
    arguments as an object (or as JSON text of one, which some models double-encode)."""
    calls = []
    for name, arguments in pairs:
        if isinstance(arguments, str):
            arguments = _json(arguments)
        if not isinstance(name, str) or name not in tools or not isinstance(arguments, dict):
            return None
        try:
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError, RecursionError):  # not JSON data, or nested too deep
            return None
    return calls or None


def _json(text: str) -> Any:
    """The JSON value `text` holds, whitespace aside; None if it holds none (or one nested
    too deep to read: a model stuck repeating `[` writes those)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_call_pair(call: Any) -> tuple[Any, Any] | None:
    """(name, arguments) of a call object in any of the common key spellings."""
    if not isinstance(call, dict):
        return None
    name = call.get("name", call.get("tool_name"))
    if name is None and len(call) == 1:  # {"f": {...}} (Apertus)
        ((name, arguments),) = call.items()
        return name, arguments
    return name, call.get("arguments", call.get("parameters", {}))


def json_calls(text: str, tools: ToolSchemas) -> Parsed:
    """One call object, an array of them, or one object per line."""
    value = _json(text)
    if value is None:
        lines = [line for line in text.splitlines() if line.strip()]
        values = [_json(line) for line in lines]
        if len(values) < 2 or any(item is None for item in values):
            return None
        value = values
    pairs = [_json_call_pair(item) for item in (value if isinstance(value, list) else [value])]
    if any(pair is None for pair in pairs):
        return None
    return _calls((pair for pair in pairs if pair is not None), tools)


def json_arguments_call(name: str, arguments: str, tools: ToolSchemas
                        ) -> tuple[str, str] | None:
    """A call whose function is named apart from its arguments' JSON text."""
    found = _calls([(name.strip(), _json(arguments))], tools)
    return None if found is None else found[0]


def _properties(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    properties = (schema or {}).get("properties")
    return properties if isinstance(properties, Mapping) else {}


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter written as text, typed by its JSON schema: strings stay strings, the
    rest is parsed as JSON where it is JSON."""
    # The XML forms put values on their own lines: one newline each side is framing.
    value = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    parsed = _json(value)
    return value if parsed is None and value.strip() != "null" else parsed


def _elements(text: str, opening: str, closing: str, *, at_least: int = 1
              ) -> list[tuple[str, str]] | None:
    """(attributes, inside) of each `opening ATTRIBUTES>INSIDE closing` element of a text
    that holds nothing else but white space. Split, not matched: linear in the text, however
    long or broken the model's output."""
    head, *parts = text.split(opening)
    if head.strip() or len(parts) < at_least:
        return None
    found = []
    for part in parts:
        attributes, opened, rest = part.partition(">")
        inside, closed, tail = rest.partition(closing)
        if not (opened and closed) or tail.strip():
            return None
        found.append((attributes, inside))
    return found


def _parameters(inner: str, opening: str, closing: str, name: str, tools: ToolSchemas,
                key: Callable[[str], str] = lambda attributes: attributes.strip()
                ) -> dict[str, Any] | None:
    """A call's parameters, written as elements (`<parameter=k>v</parameter>` and the
    like), typed by the tool's schema; None if anything else is there."""
    elements = _elements(inner, opening, closing, at_least=0)
    if elements is None or name not in tools:
        return None
    properties = _properties(tools[name])
    return {key(attributes): typed_value(value, properties.get(key(attributes)))
            for attributes, value in elements}


def _quoted(attributes: str) -> str:
    """`f"` (what follows `name="` up to the tag's end) → f."""
    return attributes.partition('"')[0]


# ---------------------------------------------------------------- <tool_call> bodies

def parse_tool_call_body(body: str, tools: ToolSchemas) -> Parsed:
    """One `<tool_call>` body, in any of its forms:

    - JSON (Hermes / Qwen2.5 / Qwen3): `{"name": "f", "arguments": {...}}`
    - XML (Qwen3-Coder, Seed-OSS): `<function=f><parameter=k>v</parameter></function>`
    - key/value (GLM, Laguna, Ling): `f<arg_key>k</arg_key><arg_value>v</arg_value>`
    """
    text = body.strip()
    if text.startswith("{"):
        value = _json(text)
        pair = _json_call_pair(value) if isinstance(value, dict) else None
        return None if pair is None else _calls([pair], tools)
    if "<function=" in text:
        return _xml_calls(text, tools)
    if "<arg_key>" in text or (text and text in tools):
        return _key_value_call(text, tools)
    return None


def parse_bare_json_calls(text: str, tools: ToolSchemas) -> Parsed:
    """A whole answer that is one JSON call object, or an array of them (Llama 3.x,
    Mistral Nemo)."""
    value = _json(text)
    items = value if isinstance(value, list) else [value]
    if value is None or not all(isinstance(item, dict) for item in items):
        return None
    return json_calls(text, tools)


def _key_value_call(text: str, tools: ToolSchemas) -> Parsed:
    name, _, rest = text.partition("<arg_key>")
    name = name.strip()
    if name not in tools:
        return None
    properties = _properties(tools[name])
    arguments = {}
    for pair in (rest.split("<arg_key>") if rest else []):
        key, closed, value = pair.partition("</arg_key>")
        value = value.lstrip()
        if not closed or not value.startswith("<arg_value>"):
            return None
        value, closed, tail = value.removeprefix("<arg_value>").partition("</arg_value>")
        if not closed or tail.strip():
            return None
        arguments[key.strip()] = typed_value(value, properties.get(key.strip()))
    return _calls([(name, arguments)], tools)


def _xml_calls(text: str, tools: ToolSchemas) -> Parsed:
    calls = _elements(text, "<function=", "</function>")
    if calls is None:
        return None
    return _calls(((name.strip(), _parameters(inner, "<parameter=", "</parameter>",
                                              name.strip(), tools))
                   for name, inner in calls), tools)


# ---------------------------------------------------------------- calls cut short

def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object: the JSON object they are, or, for a call cut short,
    its members as far as they were written (read_prefix's rule: a member cut short is
    left out); {} where none was."""
    value = _json(arguments)
    if isinstance(value, dict):
        return value
    prefix = read_prefix(arguments)
    return prefix.value if prefix is not None and isinstance(prefix.value, dict) else {}


def cut_json_call(text: str, tools: ToolSchemas) -> Parsed:
    """A JSON call object cut short: [(name, arguments)] where its name is complete and
    offered and its arguments, so far, are the start of a JSON object (the text as the
    model wrote it; "" where it had not begun them); else None."""
    text = text.strip()
    prefix = read_prefix(text)
    if prefix is None or not isinstance(prefix.value, dict):
        return None
    name = prefix.value.get("name", prefix.value.get("tool_name"))
    if not isinstance(name, str) or name not in tools:
        return None
    span = prefix.members.get("arguments", prefix.members.get("parameters"))
    written: str | None = "" if span is None else text[span[0]:span[1]].strip()
    if written and written.startswith('"'):  # double-encoded: the text inside
        written = partial_string(written)
    if written is None or not written.strip():
        return None if written is None else [(name, "")]
    arguments = read_prefix(written)
    if arguments is None or not isinstance(arguments.value, dict):
        return None
    if arguments.complete:
        return _calls([(name, arguments.value)], tools)
    return [(name, written.strip())]


def cut_tool_call_body(body: str, tools: ToolSchemas) -> Parsed:
    """A `<tool_call>` body cut short, in the forms that mark where the name ends: JSON,
    and XML (its complete parameters, as the start of a JSON object)."""
    text = body.strip()
    if text.startswith("{"):
        return cut_json_call(text, tools)
    if text.startswith("<function="):
        return _cut_xml_calls(text, tools)
    return None


def _cut_xml_calls(text: str, tools: ToolSchemas) -> Parsed:
    done, _, last = text.rpartition("<function=")
    calls = _xml_calls(done, tools) if done.strip() else []
    if calls is None:
        return None
    if "</function>" in last:  # whole, but for what follows it
        whole = _xml_calls("<function=" + last, tools)
        return None if whole is None else calls + whole
    name, opened, inner = last.partition(">")
    name = name.strip()
    if not opened or name not in tools:
        return None
    closed = inner.rfind("</parameter>") + len("</parameter>") if "</parameter>" in inner else 0
    rest = inner[closed:].strip()
    if rest and not (rest.startswith("<parameter=") or "<parameter=".startswith(rest)
                     or "</function>".startswith(rest)):
        return None
    parameters = _parameters(inner[:closed], "<parameter=", "</parameter>", name, tools)
    if parameters is None:
        return None
    try:
        written = json.dumps(parameters, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return [*calls, (name, written[:-1])]  # an object not closed: cut short


TOOL_CALL = CallSyntax("tool_call", CALL_OPEN, CALL_CLOSE, parse_tool_call_body,
                       cut=cut_tool_call_body)


# ---------------------------------------------------------------- other families

def _mistral(body: str, tools: ToolSchemas) -> Parsed:
    """`[TOOL_CALLS]f[ARGS]{...}` (v11 on, an optional `[CALL_ID]id` after the name), one
    `[TOOL_CALLS]` per call; or `[TOOL_CALLS][{"name": ..., "arguments": ...}]` (Nemo)."""
    if body.lstrip().startswith("["):
        return json_calls(body, tools)
    pairs: list[tuple[str, Any]] = []
    for part in body.split("[TOOL_CALLS]"):
        name, found, arguments = part.partition("[ARGS]")
        if not found:
            return None
        pairs.append((name.partition("[CALL_ID]")[0].strip(), _json(arguments)))
    return _calls(pairs, tools)


_DS_BEGIN, _DS_SEP, _DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _marked_calls(body: str, begin: str, end: str) -> list[str] | None:
    """The text of each `begin`…`end` call of a body that holds nothing else (split, not
    matched: no backtracking on long or broken output)."""
    head, *parts = body.split(begin)
    if head.strip() or not parts:
        return None
    calls = []
    for part in parts:
        inner, found, rest = part.partition(end)
        if not found or rest.strip():
            return None
        calls.append(inner)
    return calls


def _fenced(text: str) -> str | None:
    """The inside of a ``` (or ```json) fenced block that is all of `text`."""
    text = text.strip()
    if len(text) < 6 or not (text.startswith("```") and text.endswith("```")):
        return None
    inside = text[3:-3]
    return inside.removeprefix("json") if inside.startswith("json") else inside


def _deepseek(body: str, tools: ToolSchemas) -> Parsed:
    """Between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`, R1 writes
    `function<｜tool▁sep｜>f` and the arguments in a fenced json block on the next lines;
    V3.1 writes `f<｜tool▁sep｜>{...}`."""
    calls = _marked_calls(body, _DS_BEGIN, _DS_END)
    if calls is None:
        return None
    pairs: list[tuple[str, Any]] = []
    for call in calls:
        kind, found, rest = call.partition(_DS_SEP)
        if not found:
            return None
        if kind.strip() == "function":
            name, _, fenced = rest.partition("\n")
            arguments = _fenced(fenced)
            if arguments is None:
                return None
            pairs.append((name.strip(), _json(arguments)))
        else:
            pairs.append((kind.strip(), _json(rest)))
    return _calls(pairs, tools)


def _kimi(body: str, tools: ToolSchemas) -> Parsed:
    """`<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`"""
    calls = _marked_calls(body, "<|tool_call_begin|>", "<|tool_call_end|>")
    if calls is None:
        return None
    pairs: list[tuple[str, Any]] = []
    for call in calls:
        target, found, arguments = call.partition("<|tool_call_argument_begin|>")
        if not found:
            return None
        name = target.strip().removeprefix("functions.")
        head, colon, index = name.rpartition(":")
        pairs.append((head if colon and index.isdigit() else name, _json(arguments)))
    return _calls(pairs, tools)


def _solar(body: str, tools: ToolSchemas) -> Parsed:
    """`<|tool_call:begin|>id<|tool_call:name|>f<|tool_call:args|>{...}<|tool_call:end|>`"""
    calls = _marked_calls(body, "<|tool_call:begin|>", "<|tool_call:end|>")
    if calls is None:
        return None
    pairs: list[tuple[str, Any]] = []
    for call in calls:
        _, named, rest = call.partition("<|tool_call:name|>")
        name, found, arguments = rest.partition("<|tool_call:args|>")
        if not (named and found):
            return None
        pairs.append((name.strip(), _json(arguments)))
    return _calls(pairs, tools)


def _semicolon_json_calls(body: str, tools: ToolSchemas) -> Parsed:
    """Llama 3.x after `<|python_tag|>`: one call object, or several joined by `;`."""
    whole = json_calls(body, tools)
    if whole is not None:
        return whole
    calls: list[tuple[str, str]] = []
    for part in body.split(";"):
        found = json_calls(part, tools)
        if found is None:
            return None
        calls += found
    return calls or None


def _invoke(body: str, tools: ToolSchemas) -> Parsed:
    """`<invoke name="f"><parameter name="k">v</parameter></invoke>` (MiniMax-M2)."""
    calls = _elements(body, '<invoke name="', "</invoke>")
    if calls is None:
        return None
    return _calls(((_quoted(name), _parameters(inner, '<parameter name="', "</parameter>",
                                               _quoted(name), tools, key=_quoted))
                   for name, inner in calls), tools)


def _dsml(body: str, tools: ToolSchemas) -> Parsed:
    """DeepSeek V3.2 on: `<｜DSML｜invoke name="f"><｜DSML｜parameter name="k"
    string="true">v</｜DSML｜parameter></｜DSML｜invoke>` (string="false": a JSON value)."""
    calls = _elements(body, '<｜DSML｜invoke name="', "</｜DSML｜invoke>")
    if calls is None:
        return None
    pairs: list[tuple[str, Any]] = []
    for name, inner in calls:
        parameters = _elements(inner, '<｜DSML｜parameter name="', "</｜DSML｜parameter>",
                               at_least=0)
        if parameters is None:
            return None
        pairs.append((_quoted(name), {
            _quoted(attributes): value if 'string="true"' in attributes
            else typed_value(value, None) for attributes, value in parameters}))
    return _calls(pairs, tools)


_GEMMA_QUOTE = '<|"|>'
_GEMMA_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.-]*)(\s*:)")


def _gemma(body: str, tools: ToolSchemas) -> Parsed:
    """Gemma 4: `call:f{key:<|"|>text<|"|>,n:3}`; `<|"|>` quotes strings, keys are bare."""
    name, brace, rest = body.strip().removeprefix("call:").partition("{")
    if not brace:
        return None
    pieces = ("{" + rest).split(_GEMMA_QUOTE)
    if len(pieces) % 2 == 0:
        return None  # an unclosed string
    as_json = "".join(json.dumps(piece) if index % 2 else _GEMMA_KEY.sub(r'\1"\2"\3', piece)
                      for index, piece in enumerate(pieces))
    return _calls([(name.strip(), _json(as_json))], tools)


_FUNCTIONARY_CALL = re.compile(r"\A([^>\s]+)>(.*)\Z", re.DOTALL)


def _functionary(body: str, tools: ToolSchemas) -> Parsed:
    """Functionary v3.1: `<function=f>{...}</function>`, one call each."""
    found = _FUNCTIONARY_CALL.match(body)
    return None if found is None else _calls([(found.group(1), _json(found.group(2)))], tools)


def _pythonic(body: str, tools: ToolSchemas) -> Parsed:
    """LFM2: `[f(city='Paris'), g(n=3)]`, Python call syntax with literal arguments."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
        calls = tree.elts if isinstance(tree, ast.List) else [tree]
        pairs = []
        for call in calls:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) \
                    or call.args or any(keyword.arg is None for keyword in call.keywords):
                return None
            pairs.append((call.func.id, {keyword.arg: ast.literal_eval(keyword.value)
                                         for keyword in call.keywords}))
        return _calls(pairs, tools)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


_HY_SUFFIX = re.compile(r"(</?[a-z_]+):opensource>")


def _hunyuan(body: str, tools: ToolSchemas) -> Parsed:
    """Hunyuan 3: GLM's key/value calls with `:opensource` on every tag, `<tool_sep>`
    after the name."""
    elements = _elements(_HY_SUFFIX.sub(r"\1>", body), "<tool_call", "</tool_call>")
    if elements is None:
        return None
    calls: list[tuple[str, str]] = []
    for _, inner in elements:
        found = _key_value_call(inner.replace("<tool_sep>", ""), tools)
        if found is None:
            return None
        calls += found
    return calls


def _minicpm(body: str, tools: ToolSchemas) -> Parsed:
    """MiniCPM5: `<function name="f"><param name="k">v</param></function>`."""
    name, found, inner = body.partition('">')
    parameters = _parameters(inner, '<param name="', "</param>", name, tools, key=_quoted)
    return None if not found or parameters is None else _calls([(name, parameters)], tools)


def _prefixed_invoke(prefix: str) -> BodyParser:
    """`_invoke`'s markup with every tag name prefixed (muse-glimmer's `atem:`)."""
    def parse(body: str, tools: ToolSchemas) -> Parsed:
        return _invoke(body.replace(f"<{prefix}", "<").replace(f"</{prefix}", "</"), tools)

    return parse


def _fenced_json_calls(body: str, tools: ToolSchemas) -> Parsed:
    """Command R+: `Action:` then a fenced json block of `tool_name` / `parameters`."""
    inside = _fenced(body)
    return None if inside is None else json_calls(inside, tools)


def _harmony(body: str, tools: ToolSchemas) -> Parsed:
    """gpt-oss, after `<|channel|>`: `commentary to=functions.f <|constrain|>json<|message|>{...}`.
    (A harmony answer is read whole by chat/harmony.py; this reads one call message.)"""
    header, found, arguments = body.partition("<|message|>")
    _, to, recipient = header.partition("to=functions.")
    if not (found and to):
        return None
    name = recipient.split("<|", 1)[0].split(None, 1)[0] if recipient.strip() else ""
    call = json_arguments_call(name, arguments.removesuffix("<|call|>"), tools)
    return None if call is None else [call]


def _addressed(body: str, tools: ToolSchemas) -> Parsed:
    """Functionary v3.2, after `>>>`: `f` on its own line, then the arguments' JSON (an
    answer is read whole by chat/recipients.py; this reads one call message)."""
    name, newline, arguments = body.partition("\n")
    call = json_arguments_call(name, arguments, tools) if newline else None
    return None if call is None else [call]


# The families other than `<tool_call>`, in the order they are looked for.
FAMILIES = (
    CallSyntax("mistral", "[TOOL_CALLS]", None, _mistral, ("[ARGS]", "[CALL_ID]")),
    CallSyntax("deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _deepseek,
               ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")),
    CallSyntax("deepseek-v3.2", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _dsml),
    CallSyntax("deepseek-v4", "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", _dsml),
    CallSyntax("kimi", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _kimi,
               ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
    CallSyntax("command-r", "<|START_ACTION|>", "<|END_ACTION|>", json_calls),
    CallSyntax("solar", "<|tool_calls|>", "<|calls|>", _solar,
               ("<|tool_call:begin|>", "<|tool_call:name|>", "<|tool_call:args|>",
                "<|tool_call:end|>")),
    CallSyntax("gemma4", "<|tool_call>", "<tool_call|>", _gemma, (_GEMMA_QUOTE,)),
    CallSyntax("lfm2", "<|tool_call_start|>", "<|tool_call_end|>", _pythonic),
    CallSyntax("granite", "<|tool_call|>", None, json_calls),
    CallSyntax("llama3", "<|python_tag|>", None, _semicolon_json_calls),
    CallSyntax("apertus", "<|tools_prefix|>", "<|tools_suffix|>", json_calls),
    CallSyntax("nemotron", "<TOOLCALL>", "</TOOLCALL>", json_calls),
    CallSyntax("tool_calls", "<tool_calls>", "</tool_calls>", json_calls),  # Apriel, MiniMax-M1
    CallSyntax("gigachat", "<|function_call|>", None, json_calls),
    CallSyntax("minimax", "<minimax:tool_call>", "</minimax:tool_call>", _invoke),
    CallSyntax("seed", "<seed:tool_call>", "</seed:tool_call>", parse_tool_call_body,
               cut=cut_tool_call_body),
    CallSyntax("functionary", "<function=", "</function>", _functionary),
    CallSyntax("hunyuan", "<tool_calls:opensource>", "</tool_calls:opensource>", _hunyuan),
    CallSyntax("minicpm", '<function name="', "</function>", _minicpm),
    CallSyntax("muse", "<atem:function_calls>", "</atem:function_calls>",
               _prefixed_invoke("atem:")),
    CallSyntax("command-r-plus", "Action:", None, _fenced_json_calls, line_start=True),
    CallSyntax("functionary-v3.2", ">>>", None, _addressed),
    CallSyntax("harmony", "<|channel|>", None, _harmony,
               ("<|message|>", "<|start|>", "<|constrain|>", "<|end|>", "<|return|>",
                "<|call|>")),
    CallSyntax("firefunction", "functools", None, json_calls, line_start=True),
)


def family_syntax(rendered_call: str, source: str) -> CallSyntax | None:
    """The family whose markup a template writes: found in its own rendering of a call
    (empty where it renders none), else anywhere in its source (Llama 3.x writes
    `<|python_tag|>` only for some calls; Granite 3.x tells the model its markup in the
    system prompt). None: `<tool_call>` only."""
    written = sorted((rendered_call.find(syntax.open), order)
                     for order, syntax in enumerate((TOOL_CALL, *FAMILIES))
                     if syntax.open in rendered_call)
    if written:  # the first marker the call is written with
        first = written[0][1]
        return None if first == 0 else FAMILIES[first - 1]
    return next((syntax for syntax in FAMILIES if syntax.open in source), None)


def syntax_named(family: str | None) -> CallSyntax | None:
    return next((syntax for syntax in FAMILIES if syntax.family == family), None)
