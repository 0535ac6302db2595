"""What forced tool calls and JSON output must look like, as a neutral constraint (pure).

This module only chooses the JSON schema and whether the output is that JSON alone or one
call wrapped in the `<tool_call>` markup that the markup parser recovers. Every schema it
is given has its objects closed (`closed_objects`): a forced call's arguments, a
`response_format` schema, Ollama's `format`. The backends
compile the constraint with llguidance, which follows the whole JSON schema
(butter/backends/constraints.py), and say through `check_sampling` (ValueError, naming the
keyword) when a schema cannot be followed exactly: never approximated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from butter.errors import InvalidRequest
from butter.sampling import OutputConstraint

__all__ = [
    "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "OutputConstraint", "closed_objects",
    "json_object_grammar", "json_schema_grammar", "tool_call_grammar",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]], only: str | None = None
) -> OutputConstraint:
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
    return OutputConstraint.of(schema, tool_call=True)


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = closed_objects(function.get("parameters") or {"type": "object"})
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        # The call object itself has no other keys (the JSON-schema default would allow
        # them); `arguments` is the tool's parameters schema with its objects closed.
        "additionalProperties": False,
    }


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that lists `properties` and says nothing about
    `additionalProperties` closed to the keys it lists.

    JSON Schema allows unlisted keys by default, and a small model fills them with keys
    the schema never declared (`"temperature": 24.8` beside `"city"`, `"gender"` beside
    `"name"` and `"age"`), often until max_tokens; the code on the other end rejects them.
    llama.cpp's schema converter, Ollama and vLLM (xgrammar) close such objects the same
    way, and OpenAI's strict mode accepts only closed ones. Members of `allOf` are left as
    they are: closing each would forbid the keys the others add. Anything the schema says
    outright (`additionalProperties: true` or a schema) is kept: that is the way to ask
    for an open object."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            closed[key] = closed_objects(value)
        else:  # data (const, enum, required...) and allOf: kept as sent
            closed[key] = value
    if "properties" in schema and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


# Keywords whose value maps names to subschemas, and those whose value is a subschema or a
# list of them.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
# (`not`, `if` and `contains` are refused by the backends anyway.)
_SUBSCHEMAS = frozenset({"items", "prefixItems", "additionalProperties", "anyOf", "oneOf"})


def json_object_grammar() -> OutputConstraint:
    return OutputConstraint.of({"type": "object"})


def json_schema_grammar(schema: Mapping[str, Any]) -> OutputConstraint:
    """JSON that follows `schema`, its objects closed (`closed_objects`), strict or not."""
    return OutputConstraint.of(closed_objects(schema))
