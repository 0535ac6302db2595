"""Chat templates: render messages to a prompt with a sandboxed jinja2, as HF does.

Choice of template, in order: `--chat-template` (a file or a built-in name), the
GGUF's own `tokenizer.chat_template`, a built-in chosen from the architecture,
ChatML. What a template can render is probed at load (butter/chat/polyfill.py), and each
request is rewritten into that: templates that do not render `tools` get a system
preamble describing them in the JSON `<tool_call>` form, so tool recovery works with any
model, and earlier tool calls and results are written in the same markup.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import attrs
from jinja2 import TemplateError, Undefined, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import SandboxedEnvironment

from butter.chat.polyfill import TemplateCapabilities, adapt, probe, without_null_fields
from butter.chat.request import IMAGE_PART
from butter.chat.tool_calls import TOOL_CALL, syntax_named
from butter.errors import InvalidRequest

BUILTIN_TEMPLATES = ("gemma", "chatml", "llama3", "mistral")

# general.architecture prefixes → built-in template (first match wins).
_ARCHITECTURE_TEMPLATES = (
    ("gemma", "gemma"),
    ("qwen", "chatml"),
    ("llama", "llama3"),
    ("mistral", "mistral"),
)


def builtin_template_source(name: str) -> str:
    return resources.files("butter.chat").joinpath(f"templates/{name}.jinja").read_text("utf-8")


def builtin_for_architecture(architecture: str) -> str:
    for prefix, name in _ARCHITECTURE_TEMPLATES:
        if architecture.lower().startswith(prefix):
            return name
    return "chatml"


@attrs.frozen
class TemplateChoice:
    source: str
    origin: str  # "model", "builtin:<name>", "file:<path>": shown at boot and in /v1/models


def choose_template(
    override: str | None, embedded: str | None, architecture: str
) -> TemplateChoice:
    if override:
        if override in BUILTIN_TEMPLATES:
            return TemplateChoice(builtin_template_source(override), f"builtin:{override}")
        path = Path(override)
        if not path.is_file():
            raise ValueError(
                f"--chat-template {override!r} is neither a file nor one of "
                f"{', '.join(BUILTIN_TEMPLATES)}"
            )
        return TemplateChoice(path.read_text("utf-8"), f"file:{path}")
    if embedded:
        return TemplateChoice(embedded, "model")  # the checkpoint's own template
    name = builtin_for_architecture(architecture)
    return TemplateChoice(builtin_template_source(name), f"builtin:{name}")


def _json_default(value: Any) -> Any:
    # Templates pipe `map(...)` and `selectattr(...)` results, which are generators, and
    # jinja's Undefined (an absent field: null) into tojson.
    if isinstance(value, Undefined):
        return None
    if hasattr(value, "__iter__") and not isinstance(value, str | bytes | dict):
        return list(value)
    return None


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
    sort_keys: bool = False, ensure_ascii: bool = False,
) -> str:
    # jinja2's own tojson sorts keys and HTML-escapes `<`; HF's keeps both as they are.
    return json.dumps(
        value, indent=indent, separators=separators, sort_keys=sort_keys,
        ensure_ascii=ensure_ascii, default=_json_default,
    )


def _from_json(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise TemplateError(f"from_json: {exc}") from None


def _safe(value: Any) -> str:
    # A prompt is not HTML: jinja's `safe` makes Markup, and Markup joined to text
    # HTML-escapes that text (Functionary v3.1's `"..."|safe + t | tojson` wrote `&#34;`
    # for every quote of the tool's JSON). Here it is the value as text, as in llama.cpp.
    return str(value)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationBlock(Extension):
    """`{% generation %}…{% endgeneration %}`: HF marks the assistant's own tokens with it
    (for training masks); for rendering it is its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension declares it so)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# The fields that the request shapes make optional (OpenAI's tool `description`,
# `parameters` and `strict`, a message's `name`, a tool call's `id` and the `tool_call_id`
# answering it; a JSON schema's `description` too), which clients leave out.
OPTIONAL_FIELDS = frozenset(
    {"description", "parameters", "strict", "name", "id", "tool_call_id"})


class AbsentField(Undefined):
    """An optional field (OPTIONAL_FIELDS) that the request left out. It is undefined as in
    any jinja: `is defined` is false, it prints empty, `default(...)` replaces it, `if`
    skips it. Beyond jinja's Undefined, which raises on anything else, it is also empty
    text where a template joins it to text (`"// " + tool.description`, as gpt-oss's,
    Hermes' and Functionary's templates do), and reading into it gives it again
    (`tool.parameters.properties`, `.items()`): the templates that read such a field
    unguarded were written for clients that always send it, and empty is what it means.
    Every other undefined value, and every error a template raises itself, stays an error."""

    __slots__ = ()

    def _joined(self, other: Any) -> Any:
        if isinstance(other, str):
            return other
        return self._fail_with_undefined_error()

    __add__ = __radd__ = _joined

    def __getattr__(self, name: str) -> Any:
        if name[:2] == "__" and name[-2:] == "__":
            raise AttributeError(name)
        return self

    def _again(self, *args: Any, **kwargs: Any) -> Any:
        return self

    __getitem__ = __call__ = _again

    def __repr__(self) -> str:
        return "AbsentField"


class _TemplateSandbox(SandboxedEnvironment):
    """The sandbox, with the request's optional fields absent-safe (AbsentField)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _absent_safe(obj, attribute, super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _absent_safe(obj, argument, super().getitem(obj, argument))


def _absent_safe(obj: Any, key: Any, value: Any) -> Any:
    if (isinstance(value, Undefined) and not isinstance(value, AbsentField)
            and isinstance(obj, Mapping) and key in OPTIONAL_FIELDS):
        return AbsentField(obj=obj, name=key)
    return value


def _environment() -> SandboxedEnvironment:
    """A sandbox that forbids file access and private attributes (`__class__` and the
    like), but, as HF's does, lets a template build its own lists (`list.append`)."""
    env = _TemplateSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do", GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = _from_json
    env.filters["safe"] = _safe
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, choice: TemplateChoice, *, bos_token: str, eos_token: str) -> None:
        self.origin = choice.origin
        self.source = choice.source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(choice.source)
        except TemplateError as exc:
            raise ValueError(f"chat template ({choice.origin}) does not compile: {exc}") from exc
        self.capabilities: TemplateCapabilities = probe(
            lambda messages, tools: self._template.render(
                **self._variables(messages, tools, add_generation_prompt=True)),
            choice.source)
        # How the model writes tool calls: `<tool_call>`, and its family's markup.
        family = syntax_named(self.capabilities.call_family)
        self.call_syntaxes = (TOOL_CALL, *((family,) if family else ()))

    @property
    def renders_tools(self) -> bool:
        return self.capabilities.tools

    @functools.cached_property
    def turn_marker(self) -> str | None:
        """The text that opens every message (`<|im_start|>`, `<start_of_turn>`,
        `<|start_header_id|>`): the longest start of the generation prompt that also
        opens the user turn after an answer. None where the template has no such text
        or cannot render the probe conversation."""
        first, answer, again = "\ue000first", "\ue000answer", "\ue000again"
        conversation = [{"role": "user", "content": first}]
        try:
            asked = self._render(conversation, None, False, None)
            prompted = self._render(conversation, None, True, None)
            turns = self._render([*conversation, {"role": "assistant", "content": answer},
                                  {"role": "user", "content": again}], None, False, None)
        except InvalidRequest:
            return None
        generation_prompt = prompted[len(asked):] if prompted.startswith(asked) else ""
        between = turns[turns.find(answer) + len(answer):turns.find(again)] \
            if answer in turns and again in turns else ""
        for end in range(len(generation_prompt), 1, -1):
            if generation_prompt[:end] in between:
                marker = generation_prompt[:end]
                return marker if marker.strip() else None
        return None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        image_marker: str | None = None,
    ) -> str:
        """The prompt text, with the messages rewritten into what this template renders
        (butter/chat/polyfill.py): system messages after the first position stay in place
        where the template renders them, else they are folded into the next user turn.

        `continue_final_message`: the final assistant message is left open (the text
        ends right after its content), so the model continues it. `image_marker`: the
        text each image part of a message becomes (its text parts joined around it, as
        llama-server does), for the caller to split the prompt at; needed where
        messages hold images."""
        messages = with_image_markers(messages, image_marker)
        final = (final_message_content(messages, add_generation_prompt)
                 if continue_final_message else None)
        tools = without_null_fields(tools)
        if tools and not self.renders_tools:
            messages = with_tools_preamble(messages, tools)
            tools = None
        messages, tools = adapt(messages, tools, self.capabilities)
        text = self._render(messages, tools, add_generation_prompt, template_kwargs)
        return text if final is None else cut_after(text, final)

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool, template_kwargs: dict[str, Any] | None,
    ) -> str:
        variables = {**(template_kwargs or {}),
                     **self._variables(messages, tools, add_generation_prompt)}
        try:
            return self._template.render(**variables)
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected these messages: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequest(
                f"the chat template could not render these messages: {exc}"
            ) from None


    def _variables(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   add_generation_prompt: bool) -> dict[str, Any]:
        return {
            "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            # What some templates read instead of `tools`, and today's date (as llama.cpp
            # passes them; templates that do not name them ignore them).
            "functions": _tojson(tools, indent=2) if tools else "",
            "datetime": datetime.now().strftime("%b %d %Y"),
        }


def with_image_markers(messages: list[dict[str, Any]], marker: str | None
                       ) -> list[dict[str, Any]]:
    """Messages whose content lists hold images (IMAGE_PART), with each list joined into
    one string: text parts as they are, each image as `marker`. Others stay as they are."""
    def has_image(message: dict[str, Any]) -> bool:
        content = message.get("content")
        return isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") == IMAGE_PART for part in content)

    if not any(has_image(message) for message in messages):
        return messages
    if marker is None:
        raise ValueError("messages hold images: render them with an image marker")
    return [{**message, "content": "".join(
        marker if part.get("type") == IMAGE_PART else str(part.get("text") or "")
        for part in message["content"])} if has_image(message) else message
        for message in messages]


def final_message_content(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The content that continue_final_message continues: the final message's, which
    must be the assistant's and not empty."""
    if add_generation_prompt:
        raise InvalidRequest("add_generation_prompt and continue_final_message cannot both "
                             "be true: set add_generation_prompt to false to continue the "
                             "final message", param="continue_final_message")
    if not messages or messages[-1].get("role") != "assistant":
        raise InvalidRequest("continue_final_message needs the final message to be the "
                             "assistant's (the message the model continues)",
                             param="continue_final_message")
    content = messages[-1].get("content")
    if isinstance(content, list):  # text parts: the last one is continued (as HF's)
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        content = next((text for text in reversed(texts) if isinstance(text, str)), None)
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequest("continue_final_message needs the final assistant message to "
                             "have text content to continue", param="continue_final_message")
    return content


def cut_after(text: str, content: str) -> str:
    """`text` up to the end of the last occurrence of `content` (HF transformers'
    continue_final_message): what the template writes after the final message (its
    end-of-turn, a new turn) is dropped. Its trailing whitespace is kept only where the
    template kept it."""
    stripped = content.strip()
    where = text.rfind(stripped)
    if where < 0:
        raise InvalidRequest(
            "continue_final_message: the final message's content does not appear in the "
            "prompt that the chat template renders (the template changes it), so the "
            "prompt cannot end inside it", param="continue_final_message")
    kept = content.lstrip()
    if text[where:where + len(kept)] == kept:
        return text[:where + len(kept)]
    return text[:where + len(stripped)]


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You can call functions to help answer. Their signatures are inside <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding the function name and its "
        "arguments inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments object>}}\n</tool_call>'
    )


def with_tools_preamble(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Merge the tool description into the leading system message (or add one)."""
    preamble = tools_preamble(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{preamble}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]
