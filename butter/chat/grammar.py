"""GBNF grammars that force valid tool calls and JSON output (pure text).

The JSON-schema → GBNF conversion is llama-cpp-python's pure-Python converter (the
same one llama.cpp's server ships); this module only chooses the schema and wraps the
result in the `<tool_call>` markup that the markup parser recovers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from butter.errors import InvalidRequest

_ROOT_RULE = re.compile(r"^root ::=", re.MULTILINE)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def _schema_to_gbnf(schema: Mapping[str, Any], param: str) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except (ValueError, KeyError, TypeError, RecursionError, NotImplementedError) as exc:
        raise InvalidRequest(f"cannot turn this JSON schema into a grammar: {exc}",
                             param=param) from None


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], only: str | None = None) -> str:
    """Exactly one `<tool_call>` of one of `tools` (or of the one named `only`)."""
    functions = [tool["function"] for tool in tools if "function" in tool]
    if only is not None:
        functions = [f for f in functions if f.get("name") == only]
        if not functions:
            raise InvalidRequest(f"tool_choice names {only!r}, which is not in tools",
                                 param="tool_choice")
    if not functions:
        raise InvalidRequest("tool_choice requires at least one tool", param="tool_choice")
    variants = [_call_schema(f) for f in functions]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = _ROOT_RULE.sub("call ::=", _schema_to_gbnf(schema, "tools"))
    # The markers stand as literals of their own, so a backend can match them as the
    # single tokens many vocabularies have for them (see backends/mlx.py).
    return f'root ::= "{TOOL_CALL_OPEN}" "\\n" call "\\n" "{TOOL_CALL_CLOSE}"\n' + body


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
    }


def json_object_grammar() -> str:
    return _schema_to_gbnf({"type": "object"}, "response_format")


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    return _schema_to_gbnf(schema, "response_format.json_schema")
