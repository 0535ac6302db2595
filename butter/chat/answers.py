"""The parser of a chat answer: harmony's messages for gpt-oss, addressed messages for
Functionary v3.2, markup for the rest.

A forced tool call (`tool_choice` required or named) is one `<tool_call>` whatever the
family, from the answer's first character (the grammar's form, chat/grammar.py), or, where
the prompt opened a `<think>` block, right after the `</think>` that ends it: an answer of
messages that begins with `<tool_call>` is read as that markup."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from butter.chat.harmony import HarmonyParser
from butter.chat.markup import CALL_OPEN, Event, MarkupParser
from butter.chat.recipients import RecipientParser
from butter.chat.tool_calls import TOOL_CALL, CallSyntax, ToolSchemas

HARMONY = "harmony"
RECIPIENTS = "functionary-v3.2"


class AnswerParser(Protocol):
    """Generated text in, content / reasoning / tool-call events out. `finish(cut=True)`:
    max_tokens ended the answer, and a call it cut comes back as far as it was written
    once its function's name is complete, else not at all (`cut_inside_call` then)."""

    @property
    def tool_calls(self) -> int: ...

    @property
    def cut_inside_call(self) -> bool: ...

    def feed(self, text: str) -> list[Event]: ...

    def finish(self, *, cut: bool = False) -> list[Event]: ...


def answer_parser(
    tools: ToolSchemas | None, *, syntaxes: Sequence[CallSyntax] = (TOOL_CALL,),
    start_in_reasoning: bool = False, bare_json_calls: bool = False,
    new_call_id: Callable[[int], str] = lambda index: f"call_{index}",
) -> AnswerParser:
    families = {syntax.family for syntax in syntaxes}
    messages: AnswerParser | None = None
    if HARMONY in families:
        messages = HarmonyParser(tools, new_call_id=new_call_id)
    elif RECIPIENTS in families:
        messages = RecipientParser(tools, new_call_id=new_call_id)
    if messages is not None:
        return MessagesOrCall(messages, MarkupParser(tools, new_call_id=new_call_id))
    return MarkupParser(tools, start_in_reasoning=start_in_reasoning,
                        new_call_id=new_call_id, bare_json_calls=bare_json_calls,
                        syntaxes=syntaxes)


class MessagesOrCall:
    """An answer of addressed messages, or a `<tool_call>` (a forced call): which one, its
    first characters say; until they do, they are held."""

    def __init__(self, messages: AnswerParser, markup: MarkupParser) -> None:
        self.messages, self._markup = messages, markup  # (the family's, `<tool_call>`)
        self._chosen: AnswerParser | None = None
        self._held = ""

    @property
    def tool_calls(self) -> int:
        return 0 if self._chosen is None else self._chosen.tool_calls

    @property
    def cut_inside_call(self) -> bool:
        return self._chosen is not None and self._chosen.cut_inside_call

    def feed(self, text: str) -> list[Event]:
        if self._chosen is None:
            self._held += text
            start = self._held.lstrip()
            if len(start) < len(CALL_OPEN) and CALL_OPEN.startswith(start):
                return []  # may still be `<tool_call>`
            self._chosen = self._markup if start.startswith(CALL_OPEN) else self.messages
            text, self._held = self._held, ""
        return self._chosen.feed(text)

    def finish(self, *, cut: bool = False) -> list[Event]:
        if self._chosen is None:  # (the start of `<tool_call>`, or nothing but blanks)
            self._chosen = self._markup
            held, self._held = self._held, ""
            return self._markup.feed(held) + self._markup.finish(cut=cut)
        return self._chosen.finish(cut=cut)
