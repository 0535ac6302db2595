"""JSON cut short: what the start of a JSON text holds so far (pure).

A tool call that max_tokens cut off ends in the middle of its JSON. `read_prefix` walks
such a text once, left to right (linear in its length: no backtracking, each string found
with `str.find`), and says whether it is the start of a JSON text at all, the value as far
as it was written, and where each member of its top-level object begins and ends.

"As far as it was written" is what Anthropic's SDK makes of a partial `input_json` (jiter's
partial mode), so that a streamed call and a whole one agree: complete members are kept,
open arrays and objects are closed where they stand, and a key, string or literal cut short
is dropped with its member; a number cut short is kept as it stands where it is a number.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

__all__ = ["JsonPrefix", "partial_string", "read_prefix"]

_SPACE = frozenset(" \t\n\r")
_NUMBER_START = frozenset("-0123456789")
_NUMBER_CHARS = frozenset("-+0123456789.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None}

# What may come next.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE, _END = range(7)


class _NotJson(Exception):
    """The text is not the start of a JSON text."""


class _Cut(Exception):
    """The text ends inside a token."""


@attrs.frozen
class JsonPrefix:
    """The start of a JSON text, read."""

    value: Any  # as far as it was written (None where nothing was: see `empty`)
    empty: bool  # nothing but white space, or only a cut key, string or literal
    complete: bool  # the whole text is one JSON value, white space aside
    # The top-level object's members: key → (start, end) of its value's text in the text
    # read; end None where the text ends inside that value (which `value` may then leave
    # out: a string cut short).
    members: dict[str, tuple[int, int | None]]


def read_prefix(text: str) -> JsonPrefix | None:
    """`text` read as the start of a JSON text; None where it is not one (a wrong token, or
    more than one value)."""
    try:
        return _Reader(text).read()
    except _NotJson:
        return None


def partial_string(token: str) -> str | None:
    """The text of a JSON string literal `token` (from its opening quote), or of as much of
    it as was written where it was cut short (a cut escape dropped); None if it is not
    one."""
    if not token.startswith('"'):
        return None
    try:
        value = json.loads(token)
        return value if isinstance(value, str) else None
    except ValueError:
        pass
    inside = token[1:]
    for trim in range(6):  # a cut escape is at most `\uXXX`
        try:
            value = json.loads('"' + inside[:len(inside) - trim] + '"')
        except ValueError:
            continue
        return value if isinstance(value, str) else None
    return None


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.position = 0
        self.stack: list[dict[str, Any] | list[Any]] = []
        self.key: list[str | None] = []  # each open object's key waiting for its value
        self.root: Any = None
        self.has_root = False
        self.state = _VALUE
        self.members: dict[str, tuple[int, int | None]] = {}

    def read(self) -> JsonPrefix:
        cut = False
        try:
            while self._step():
                pass
        except _Cut:
            cut = True
        return JsonPrefix(value=self.root, empty=not self.has_root,
                          complete=not cut and self.state == _END, members=self.members)

    def _step(self) -> bool:
        """Read one token; False at the end of the text."""
        text, n = self.text, len(self.text)
        while self.position < n and text[self.position] in _SPACE:
            self.position += 1
        if self.position == n:
            return False
        char, state = text[self.position], self.state
        if state == _END:
            raise _NotJson
        if state in (_VALUE, _VALUE_OR_CLOSE):
            if char == "]" and state == _VALUE_OR_CLOSE:
                self._close("]")
            else:
                self._value(char)
        elif state in (_KEY, _KEY_OR_CLOSE):
            if char == "}" and state == _KEY_OR_CLOSE:
                self._close("}")
            elif char == '"':
                self.key[-1] = self._string()
                self.state = _COLON
            else:
                raise _NotJson
        elif state == _COLON:
            if char != ":":
                raise _NotJson
            self.position += 1
            self.state = _VALUE
        elif char == ",":
            self.position += 1
            self.state = _KEY if isinstance(self.stack[-1], dict) else _VALUE
        elif char in "}]":
            self._close(char)
        else:
            raise _NotJson
        return True

    def _value(self, char: str) -> None:
        start = self.position
        if len(self.stack) == 1 and isinstance(self.stack[0], dict):
            key = self.key[-1]
            assert key is not None
            self.members[key] = (start, None)  # (until the value ends)
        if char in "{[":
            container: dict[str, Any] | list[Any] = {} if char == "{" else []
            self.position += 1
            self._attach(container, start, None)
            self.stack.append(container)
            self.key.append(None)
            self.state = _KEY_OR_CLOSE if char == "{" else _VALUE_OR_CLOSE
        elif char == '"':
            self._attach(self._string(), start, self.position)
        elif char in _NUMBER_START:
            self._attach(*self._number(start))
        else:
            self._attach(self._literal(), start, self.position)

    def _attach(self, value: Any, start: int, end: int | None) -> None:
        """A value read (a container: opened) where the open container, or the root, takes
        it."""
        if not self.stack:
            self.root, self.has_root = value, True
            self.state = _END
            return
        parent = self.stack[-1]
        if isinstance(parent, list):
            parent.append(value)
        else:
            key = self.key[-1]
            assert key is not None
            parent[key] = value
            if len(self.stack) == 1:
                self.members[key] = (start, end)
        self.state = _COMMA_OR_CLOSE

    def _close(self, char: str) -> None:
        container = self.stack.pop()
        self.key.pop()
        if (char == "}") != isinstance(container, dict):
            raise _NotJson
        self.position += 1
        if len(self.stack) == 1:  # a member of the top-level object ends here
            parent_key = self.key[-1]
            if parent_key is not None and parent_key in self.members:
                start, _ = self.members[parent_key]
                self.members[parent_key] = (start, self.position)
        self.state = _END if not self.stack else _COMMA_OR_CLOSE

    def _string(self) -> str:
        """The string literal at the position (which it moves past); _Cut if it is not
        closed."""
        text, start = self.text, self.position
        search = start + 1
        while True:
            quote = text.find('"', search)
            if quote < 0:
                if partial_string(text[start:]) is None:
                    raise _NotJson
                raise _Cut
            backslashes = 0
            while text[quote - 1 - backslashes] == "\\":
                backslashes += 1
            if backslashes % 2 == 0:
                break
            search = quote + 1
        try:
            value = json.loads(text[start:quote + 1])
        except ValueError:
            raise _NotJson from None
        self.position = quote + 1
        return str(value)

    def _number(self, start: int) -> tuple[Any, int, int]:
        text, end = self.text, start
        while end < len(text) and text[end] in _NUMBER_CHARS:
            end += 1
        token = text[start:end]
        self.position = end
        if _NUMBER.fullmatch(token):
            return json.loads(token), start, end
        if end == len(text) and _NUMBER.fullmatch(token + "0"):
            raise _Cut  # `-`, `1.`, `1e`: no number yet
        raise _NotJson

    def _literal(self) -> Any:
        text, start = self.text, self.position
        rest = text[start:start + 5]
        for word, value in _LITERALS.items():
            if rest.startswith(word):
                self.position = start + len(word)
                return value
            if len(rest) < len(word) and word.startswith(rest):
                raise _Cut
        raise _NotJson
