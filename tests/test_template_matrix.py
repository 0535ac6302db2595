"""Every chat template of llama.cpp's collection (`models/templates/*.jinja`, read from the
pinned llama-cpp-python sdist) renders what clients send: the conversations below, shaped
as the OpenAI route shapes them, through butter's template probing and rewrites
(butter/chat/polyfill.py). A rendered tool call parses back to the same call wherever
butter reads that family's markup: `<tool_call>` bodies, bare JSON calls, and each family
of butter/chat/tool_calls.py, through the streaming markup parser."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from butter.chat.answers import answer_parser
from butter.chat.markup import (
    CALL_CLOSE,
    CALL_OPEN,
    ContentDelta,
    ToolCall,
    parse_bare_json_calls,
    parse_tool_call_body,
)
from butter.chat.polyfill import short_tool_call_id
from butter.chat.template import ChatTemplate, TemplateChoice
from butter.errors import InvalidRequest
from butter.protocol import openai

CACHE_DIR = Path(os.environ.get("BUTTER_TEST_CACHE", Path.home() / ".cache" / "butter-tests"))
TEMPLATES_AT = "vendor/llama.cpp/models/templates/"
EXPECTED_TEMPLATES = 70  # the collection at the pinned llama.cpp; all of them must render

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_abc123", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_ROUND = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "Sunny, 21 C"},
]
# OpenAI makes a tool's `description`, `parameters` and `strict` optional, and a tool
# call's `id`, a tool result's `tool_call_id` and a message's `name`: clients leave them
# out (openai-agents sends a tool without a description).
MINIMAL_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}}]
NAME_ONLY_TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
NULL_FIELD_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": None, "parameters": None, "strict": None}}]
FULL_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
CALL_WITHOUT_ID = {key: value for key, value in CALL.items() if key != "id"}
TOOL_ROUND_WITHOUT_IDS = [TOOL_ROUND[0], {**TOOL_ROUND[1], "tool_calls": [CALL_WITHOUT_ID]},
                          {"role": "tool", "content": "Sunny, 21 C"}]
TOOL_ROUND_WITH_NAMES = [{**TOOL_ROUND[0], "name": "alice"}, TOOL_ROUND[1],
                         {**TOOL_ROUND[2], "name": "get_weather"}]
CONVERSATIONS: dict[str, dict[str, Any]] = {
    "system and user": {"messages": [{"role": "system", "content": "You are brief."},
                                     {"role": "user", "content": "Hi there"}]},
    "multi-turn": {"messages": [{"role": "user", "content": "Hi there"},
                                {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "How are you?"}]},
    "inner system": {"messages": [{"role": "user", "content": "Hi there"},
                                  {"role": "assistant", "content": "Hello!"},
                                  {"role": "developer", "content": "Answer in French."},
                                  {"role": "user", "content": "How are you?"}]},
    "typed and null content": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "again"}]}]},
    "tools offered": {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                      "tools": TOOLS},
    "a tool round": {"messages": TOOL_ROUND, "tools": TOOLS},
    "a tool round without tools": {"messages": TOOL_ROUND},
    "minimal tools offered": {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                              "tools": MINIMAL_TOOLS},
    "name-only tools offered": {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                "tools": NAME_ONLY_TOOLS},
    "a tool round with minimal tools": {"messages": TOOL_ROUND, "tools": MINIMAL_TOOLS},
    "a tool round with name-only tools": {"messages": TOOL_ROUND, "tools": NAME_ONLY_TOOLS},
    "a tool round with null fields": {"messages": TOOL_ROUND, "tools": NULL_FIELD_TOOLS},
    "a tool round without ids": {"messages": TOOL_ROUND_WITHOUT_IDS, "tools": NAME_ONLY_TOOLS},
    "a tool round without ids or tools": {"messages": TOOL_ROUND_WITHOUT_IDS},
    "a tool round with every optional field": {"messages": TOOL_ROUND_WITH_NAMES,
                                               "tools": FULL_TOOLS},
    "a reasoning history": {"messages": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "They greet me."},
        {"role": "user", "content": "What is 2 + 2?"}]},
}


def _extract_templates(sdist: Path, folder: Path) -> None:
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if TEMPLATES_AT in member.name and member.name.endswith(".jinja"):
                source = archive.extractfile(member)
                assert source is not None
                (folder / Path(member.name).name).write_bytes(source.read())


def llama_cpp_templates() -> list[Path]:
    """The .jinja files of the llama.cpp that llama-cpp-python vendors, from its sdist
    (pip's cache serves it: installing butter built llama-cpp-python from it); skips
    where the sdist is out of reach."""
    version = importlib.metadata.version("llama_cpp_python")
    folder = CACHE_DIR / f"llama-cpp-templates-{version}"
    if not any(folder.glob("*.jinja")):
        folder.mkdir(parents=True, exist_ok=True)
        download = CACHE_DIR / "sdist"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--quiet", "-d", str(download), f"llama-cpp-python=={version}"],
            capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"the llama-cpp-python {version} sdist is not reachable: "
                        f"{done.stderr.strip()[-300:]}")
        _extract_templates(next(download.glob(f"llama_cpp_python-{version}.tar.gz")), folder)
    return sorted(folder.glob("*.jinja"))


@pytest.fixture(scope="module")
def templates() -> list[Path]:
    return llama_cpp_templates()


def render(template: ChatTemplate, body: dict[str, Any]) -> str:
    request = openai.parse_chat_request({"model": "m", **body})
    return template.render(openai.template_messages(request),
                           tools=openai.template_tools(request))


SCHEMAS = {"get_weather": TOOLS[0]["function"]["parameters"]}
EXPECTED_CALL = [("get_weather", json.dumps({"city": "Paris"}))]


def check_tool_round(template: ChatTemplate, text: str) -> str | None:
    """What is wrong with a rendered tool round, if anything. The rendered call must
    parse back to the same call where butter reads that family's markup: the
    `<tool_call>` bodies, and bare JSON calls where the template writes those."""
    after_question = text.split("What is the weather in Paris?", 1)[-1]
    if "Paris" not in after_question or "get_weather" not in after_question:
        return "the assistant's tool call is missing"
    if "Sunny, 21 C" not in after_question:
        return "the tool result is missing"
    for body in re.findall(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE),
                           after_question, re.DOTALL):
        parsed = parse_tool_call_body(body, SCHEMAS)
        if parsed is not None and parsed != EXPECTED_CALL:
            return f"the rendered call parses back as {parsed}"
    if template.capabilities.bare_json_calls:
        parsed = parse_bare_json_calls(_first_json(after_question), SCHEMAS)
        if parsed != EXPECTED_CALL:
            return f"the bare JSON call parses back as {parsed}"
    family = template.call_syntaxes[-1]
    if family.open in after_question and family.open != CALL_OPEN:
        return check_family_call(template, after_question)
    return None


# Where an answer ends in the rendered history: a call with no closing marker runs to
# the end of the model's answer, which these end-of-turn texts stand for.
TURN_ENDS = ("</s>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|message_sep|>",
             "<|im_end|>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|call|>")
# Where the model's answer begins, for a family whose marker is not its first word: what
# the generation prompt ends with (gpt-oss writes the recipient before the channel).
ANSWER_AFTER = {"harmony": "<|start|>assistant", "functionary-v3.2": ">>>"}


def check_family_call(template: ChatTemplate, after_question: str) -> str | None:
    """The family's own markup, as the model would write it (from its marker to its close
    or the end of its answer), fed to the markup parser a character at a time, gives the
    call and no markup as content."""
    family = template.call_syntaxes[-1]
    after = ANSWER_AFTER.get(family.family)
    answer = (after_question.partition(after)[2] if after
              else after_question[after_question.index(family.open):])
    if family.close is not None:
        # (DeepSeek-R1-Distill's templates drop the close the model writes: put it back.)
        end = answer.find(family.close)
        answer = (answer[:end] if end >= 0 else answer.partition(
            "<｜tool▁outputs▁begin｜>")[0]) + family.close
    else:
        answer = answer[:min(i for i in (answer.find(end) for end in TURN_ENDS) if i > 0)]
    parser = answer_parser(SCHEMAS, syntaxes=template.call_syntaxes)
    events = [event for char in answer for event in parser.feed(char)] + parser.finish()
    calls = [(event.name, event.arguments) for event in events if isinstance(event, ToolCall)]
    content = "".join(event.text for event in events if isinstance(event, ContentDelta))
    if calls != EXPECTED_CALL or content.strip():
        return f"{family.family} markup {answer!r} parses back as {calls}, content {content!r}"
    return None


def _first_json(text: str) -> str:
    """The JSON value (a call object, or an array of them) where the call is written."""
    start = min(i for i in (text.find('{"name"'), text.find('[{"name"')) if i >= 0)
    _, end = json.JSONDecoder().raw_decode(text, start)
    return text[start:end]


def test_every_template_renders_every_conversation(templates: list[Path]) -> None:
    assert len(templates) == EXPECTED_TEMPLATES, [path.name for path in templates]
    failures = []
    for path in templates:
        try:
            template = ChatTemplate(TemplateChoice(path.read_text("utf-8"), path.name),
                                    bos_token="<s>", eos_token="</s>")
        except ValueError as exc:
            failures.append(f"{path.name}: {exc}")
            continue
        for name, body in CONVERSATIONS.items():
            try:
                text = render(template, body)
            except Exception as exc:
                failures.append(f"{path.name} / {name}: {exc}")
                continue
            problem = (check_tool_round(template, text) if name.startswith("a tool round")
                       else None)
            if problem:
                failures.append(f"{path.name} / {name}: {problem}")
            if name == "inner system" and "Answer in French." not in text:
                failures.append(f"{path.name} / {name}: the inner system message is missing")
            if name.endswith("tools offered") and "get_weather" not in text:
                failures.append(f"{path.name} / {name}: the tool is missing")
            if "&#34;" in text or "&lt;" in text:
                failures.append(f"{path.name} / {name}: HTML-escaped text in the prompt")
    assert not failures, "\n".join(failures)


def test_absent_fields_do_not_hide_a_template_refusing_the_conversation(
        templates: list[Path]) -> None:
    """Leaving optional fields out is safe, but a template's own refusal still stands:
    two assistant turns in a row, where a template insists that roles alternate, are a
    400 with its words, minimal tools or not."""
    refusers = []
    for path in templates:
        template = ChatTemplate(TemplateChoice(path.read_text("utf-8"), path.name),
                                bos_token="<s>", eos_token="</s>")
        if "must alternate" not in template.source:
            continue
        refusers.append(path.stem)
        for tools in (None, NAME_ONLY_TOOLS):
            with pytest.raises(InvalidRequest, match="must alternate"):
                render(template, {"messages": [
                    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"},
                    {"role": "assistant", "content": "b"}], **({"tools": tools} if tools else {})})
    assert {"google-gemma-2-2b-it", "mistralai-Mistral-Nemo-Instruct-2407"} <= set(refusers)


def test_calls_without_ids_take_ids_their_results_share(templates: list[Path]) -> None:
    """A call sent without an id gets one, and the result that answers it the same one:
    Mistral's templates, which refuse any id but 9 alphanumeric characters, render the
    round, with the call's id on its result."""
    for name in ("mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506"):
        path = next(path for path in templates if path.stem == name)
        template = ChatTemplate(TemplateChoice(path.read_text("utf-8"), path.name),
                                bos_token="<s>", eos_token="</s>")
        assert template.capabilities.short_tool_call_ids, name
        text = render(template, {"messages": TOOL_ROUND_WITHOUT_IDS, "tools": NAME_ONLY_TOOLS})
        # The call (the second message) gets call_1_0, in the 9 characters Mistral wants.
        assert text.count(short_tool_call_id("call_1_0")) == 2, text


def test_capabilities_are_probed_not_assumed(templates: list[Path]) -> None:
    """The probes tell templates apart: the collection holds every kind."""
    seen = []
    for path in templates:
        template = ChatTemplate(TemplateChoice(path.read_text("utf-8"), path.name),
                                bos_token="<s>", eos_token="</s>")
        seen.append(template.capabilities)
    for field in ("system_role", "tools", "tool_calls", "tool_responses", "null_content"):
        values = {getattr(caps, field) for caps in seen}
        assert values == {True, False}, field
    assert any(caps.string_arguments for caps in seen)
    assert any(caps.short_tool_call_ids for caps in seen)
    assert any(caps.tools_list for caps in seen)
    assert 3 <= sum(caps.bare_json_calls for caps in seen) < len(seen) // 2  # Llama 3.x...
    families = {caps.call_family for caps in seen}
    assert {None, "mistral", "deepseek", "kimi", "command-r", "llama3"} <= families


def test_reasoning_before_a_call_reaches_templates_that_read_it_as_thinking(
        templates: list[Path]) -> None:
    """gpt-oss (and LFM2.5) read an earlier turn's reasoning from `thinking`, where
    clients send `reasoning_content`: the analysis before a call reaches the prompt."""
    reasoning_round = [{**message, "reasoning_content": "I should look it up."}
                       if message["role"] == "assistant" else message for message in TOOL_ROUND]
    readers = []
    for path in templates:
        template = ChatTemplate(TemplateChoice(path.read_text("utf-8"), path.name),
                                bos_token="<s>", eos_token="</s>")
        text = render(template, {"messages": reasoning_round, "tools": TOOLS})
        if template.capabilities.thinking_field:
            readers.append(path.stem)
            assert "I should look it up." in text, path.name
    assert "openai-gpt-oss-120b" in readers
