"""The parser of a chat answer: harmony's messages for gpt-oss, addressed messages for
Functionary v3.2, markup for the rest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from butter.chat.harmony import HarmonyParser
from butter.chat.markup import Event, MarkupParser
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
    if HARMONY in families:
        return HarmonyParser(tools, new_call_id=new_call_id)
    if RECIPIENTS in families:
        return RecipientParser(tools, new_call_id=new_call_id)
    return MarkupParser(tools, start_in_reasoning=start_in_reasoning,
                        new_call_id=new_call_id, bare_json_calls=bare_json_calls,
                        syntaxes=syntaxes)
