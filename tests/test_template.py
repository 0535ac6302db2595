"""Chat templates: built-ins, choice order, HF-compatible filters, tools preamble."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from butter.chat.template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    TemplateChoice,
    builtin_template_source,
    choose_template,
)
from butter.errors import InvalidRequest

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Bye"},
]


def _template(name: str, bos: str = "<bos>", eos: str = "<eos>") -> ChatTemplate:
    return ChatTemplate(TemplateChoice(builtin_template_source(name), name),
                        bos_token=bos, eos_token=eos)


def test_gemma_matches_llama_cpp_builtin_format() -> None:
    text = _template("gemma").render([{"role": "user", "content": "Hello"}])
    assert text == "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"


def test_gemma_folds_system_into_first_user_turn() -> None:
    text = _template("gemma").render(CHAT)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nHi!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_chatml() -> None:
    text = _template("chatml").render(CHAT[:2])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama3_and_mistral_render() -> None:
    llama = _template("llama3", bos="<|begin_of_text|>").render(CHAT[:2])
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert llama.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    mistral = _template("mistral", bos="<s>", eos="</s>").render(CHAT)
    assert mistral == "<s>[INST] Be brief.\n\nHello [/INST]Hi!</s>[INST] Bye [/INST]"


def test_no_generation_prompt() -> None:
    text = _template("chatml").render(CHAT[1:2], add_generation_prompt=False)
    assert not text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_builtins_render_tool_history(name: str) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "a": "<b>"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ]
    text = _template(name).render(messages)
    # HF's tojson keeps key order and does not HTML-escape.
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "a": "<b>"}}' in text
    assert "sunny" in text


def test_tools_preamble_for_templates_without_tools() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = _template("gemma").render(CHAT[:2], tools=tools)
    assert "Be brief." in text and "get_weather" in text and "<tool_call>" in text
    assert text.count("<start_of_turn>user") == 1


def test_template_kwargs_reach_the_template() -> None:
    source = "{{ 'T' if enable_thinking else 'F' }}{{ messages[0]['content'] }}"
    template = ChatTemplate(TemplateChoice(source, "x"), bos_token="", eos_token="")
    assert template.render([{"role": "user", "content": "q"}],
                           template_kwargs={"enable_thinking": True}) == "Tq"


def test_raise_exception_becomes_a_400() -> None:
    source = "{{ raise_exception('roles must alternate') }}"
    template = ChatTemplate(TemplateChoice(source, "x"), bos_token="", eos_token="")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        template.render([{"role": "user", "content": "q"}])


def test_sandbox_blocks_unsafe_attribute_access() -> None:
    source = "{{ messages.__class__.__mro__ }}"
    template = ChatTemplate(TemplateChoice(source, "x"), bos_token="", eos_token="")
    with pytest.raises(InvalidRequest):
        template.render([{"role": "user", "content": "q"}])


def test_choice_order(tmp_path: Path) -> None:
    assert choose_template(None, "{{ x }}", "gemma3").origin == "model"
    assert choose_template(None, None, "gemma3").origin == "builtin:gemma"
    assert choose_template(None, None, "qwen3").origin == "builtin:chatml"
    assert choose_template(None, None, "llama").origin == "builtin:llama3"
    assert choose_template(None, None, "mystery").origin == "builtin:chatml"
    assert choose_template("mistral", "{{ x }}", "gemma3").origin == "builtin:mistral"
    custom = tmp_path / "t.jinja"
    custom.write_text("{{ messages[0]['content'] }}")
    assert choose_template(str(custom), None, "gemma3").origin == f"file:{custom}"
    with pytest.raises(ValueError, match="neither a file"):
        choose_template("nope", None, "gemma3")


# A template in the style of many HF ones: one system message, and only first.
ONE_SYSTEM_FIRST = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
)
WITH_REMINDER = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "system", "content": "<reminder>"},
    {"role": "user", "content": "Bye"},
]


def test_inner_system_messages_render_in_place_where_the_template_can() -> None:
    text = _template("chatml").render(WITH_REMINDER)
    assert text.index("Hello") < text.index("<|im_start|>system\n<reminder>") < text.index("Bye")


def test_inner_system_messages_fold_into_the_next_user_turn_where_it_cannot() -> None:
    template = ChatTemplate(TemplateChoice(ONE_SYSTEM_FIRST, "file:x"), bos_token="",
                            eos_token="")
    assert template.render(WITH_REMINDER, add_generation_prompt=False) == (
        "[system]Be brief.[user]Hello[user]<reminder>\n\nBye")
    # No user turn after it: appended to the previous one.
    trailing = [*WITH_REMINDER[:2], {"role": "system", "content": "<late>"}]
    assert template.render(trailing, add_generation_prompt=False) == (
        "[system]Be brief.[user]Hello\n\n<late>")
    # No user turn at all: the inner one becomes the user's turn.
    assert template.render([{"role": "system", "content": "y"},
                            {"role": "system", "content": "z"}],
                           add_generation_prompt=False) == "[system]y[user]z"
    # A refusal for another reason is still a clear 400.
    picky = ChatTemplate(TemplateChoice(
        "{% for m in messages %}{% if 'forbidden' in m['content'] %}"
        "{{ raise_exception('no forbidden words') }}{% endif %}{{ m['content'] }}{% endfor %}",
        "file:y"), bos_token="", eos_token="")
    with pytest.raises(InvalidRequest, match="no forbidden words"):
        picky.render([{"role": "user", "content": "a forbidden word"}])


# A template that reads the optional fields the way real ones do, unguarded.
READS_OPTIONAL_FIELDS = (
    "{% for t in tools %}{% set f = t.function %}"
    "[{{ f.name }}// {{ '' + f.description }}|{{ f.description is defined }}"
    "|{{ f.parameters | tojson }}|{% for k, v in f.parameters.properties.items() %}{{ k }}"
    "{% endfor %}|{{ f.parameters.properties | length }}|{{ f.strict == true }}]"
    "{% endfor %}{% for m in messages %}<{{ m.name | default('anon') }}:{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %} {{ c.function.name }}{{ c.function.arguments | tojson }}"
    " {{ c.id }}{% endfor %}"
    "{% if m.role == 'tool' %} answers {{ m.tool_call_id }}{% endif %}>{% endfor %}"
)


def test_optional_fields_left_out_are_undefined_and_safe_to_read() -> None:
    """A tool with only a name, and messages without names or ids, render: the absent
    fields are undefined (`is defined` false, `default` applies) and empty where a
    template joins them to text or reads into them. Null is the same as left out."""
    template = ChatTemplate(TemplateChoice(READS_OPTIONAL_FIELDS, "x"), bos_token="",
                            eos_token="")
    assert template.renders_tools
    messages = [{"role": "user", "content": "q", "name": None},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": {}}}]},
                {"role": "tool", "content": "r"}]
    for function in ({"name": "f"}, {"name": "f", "description": None, "parameters": None,
                                     "strict": None}):
        text = template.render(messages, tools=[{"type": "function", "function": function}],
                               add_generation_prompt=False)
        assert text == ("[f// |False|null||0|False]<anon:q><anon: f{} call_1_0>"
                        "<anon:r answers call_1_0>")
    full = {"name": "f", "description": "d", "strict": True,
            "parameters": {"type": "object", "properties": {"x": {}}}}
    text = template.render([{"role": "user", "content": "q", "name": "bob"}],
                           tools=[{"type": "function", "function": full}],
                           add_generation_prompt=False)
    assert text == ('[f// d|True|{"type": "object", "properties": {"x": {}}}|x|1|True]'
                    "<bob:q>")


def test_other_undefined_values_and_refusals_still_fail() -> None:
    """Only the request's optional fields are absent-safe: a field no request shape has,
    a variable nobody passes, arithmetic on an absent field, and the template's own
    refusals stay 400s."""
    user = [{"role": "user", "content": "q"}]
    for source, error in (
            ("{% for m in messages %}{{ m.nickname + '!' }}{% endfor %}", "nickname"),
            ("{{ undeclared + '!' }}", "undeclared"),
            ("{% for m in messages %}{{ m.name + 1 }}{% endfor %}", "name"),
            ("{% for m in messages %}{% if m.name is not defined %}"
             "{{ raise_exception('who is speaking?') }}{% endif %}{% endfor %}",
             "who is speaking")):
        template = ChatTemplate(TemplateChoice(source, "x"), bos_token="", eos_token="")
        with pytest.raises(InvalidRequest, match=error):
            template.render(user)


def test_a_call_result_keeps_the_id_it_was_sent_with() -> None:
    """Ids are given only where none was sent; a result that names its call keeps it, and
    the next result without one answers the next call."""
    template = ChatTemplate(TemplateChoice(READS_OPTIONAL_FIELDS, "x"), bos_token="",
                            eos_token="")
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}},
             {"type": "function", "function": {"name": "f", "arguments": {}}}]
    text = template.render([{"role": "user", "content": "q"},
                            {"role": "assistant", "content": None, "tool_calls": calls},
                            {"role": "tool", "content": "r1", "tool_call_id": "a"},
                            {"role": "tool", "content": "r2"}], add_generation_prompt=False)
    assert text.endswith("<anon: f{} a f{} call_1_1><anon:r1 answers a>"
                         "<anon:r2 answers call_1_1>")


def test_safe_does_not_html_escape_the_text_joined_to_it() -> None:
    """A prompt is not HTML: Functionary v3.1 writes `"..."|safe + t | tojson`, and the
    tool's JSON must reach the model with its quotes, not `&#34;`."""
    source = "{{ 'Use: '|safe + messages[0]['content'] + ' '|safe + messages | tojson }}"
    template = ChatTemplate(TemplateChoice(source, "x"), bos_token="", eos_token="")
    assert template.render([{"role": "user", "content": 'say "<hi>" & go'}]) == (
        'Use: say "<hi>" & go [{"role": "user", "content": "say \\"<hi>\\" & go"}]')


# ---------------------------------------------------------------- continue_final_message

PREFILLED = [{"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]


@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_continue_final_message_ends_the_prompt_inside_it(name: str) -> None:
    """The text stops right after the final assistant message's content: no end of turn,
    no new turn, and everything before it as the template renders it."""
    template = _template(name, bos="<s>", eos="</s>")
    closed = template.render(PREFILLED, add_generation_prompt=False)
    text = template.render(PREFILLED, add_generation_prompt=False,
                           continue_final_message=True)
    assert text.endswith("The capital of France is")
    assert closed.startswith(text) and len(closed) > len(text)


def test_continue_final_message_on_chatml_and_its_trailing_space() -> None:
    template = _template("chatml")
    assert template.render(PREFILLED, add_generation_prompt=False,
                           continue_final_message=True) == (
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nThe capital of France is")
    # ChatML keeps the content as it came, trailing space included (HF's rule: kept where
    # the template kept it).
    spaced = [PREFILLED[0], {"role": "assistant", "content": "The capital is "}]
    assert template.render(spaced, add_generation_prompt=False,
                           continue_final_message=True).endswith("assistant\nThe capital is ")


def test_continue_final_message_where_the_template_trims_the_content() -> None:
    trimming = ChatTemplate(TemplateChoice(
        "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}[/]{% endfor %}",
        "trimming"), bos_token="", eos_token="")
    spaced = [PREFILLED[0], {"role": "assistant", "content": " The capital is \n"}]
    assert trimming.render(spaced, add_generation_prompt=False,
                           continue_final_message=True) == (
        "[user]Capital of France?[/][assistant]The capital is")


def test_continue_final_message_refusals() -> None:
    template = _template("chatml")
    upper = ChatTemplate(TemplateChoice(
        "{% for m in messages %}{{ m.content | upper }}|{% endfor %}", "upper"),
        bos_token="", eos_token="")
    cases: list[tuple[ChatTemplate, list[dict[str, Any]], bool]] = [
        (template, PREFILLED, True),  # with add_generation_prompt
        (template, PREFILLED[:1], False),  # the final message is the user's
        (template, [PREFILLED[0], {"role": "assistant", "content": " "}], False),  # empty
        (upper, PREFILLED, False),  # the template changes the content
    ]
    for chat_template, messages, generation_prompt in cases:
        with pytest.raises(InvalidRequest) as refused:
            chat_template.render(messages, add_generation_prompt=generation_prompt,
                                 continue_final_message=True)
        assert refused.value.param == "continue_final_message"
