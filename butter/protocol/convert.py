"""A strict cattrs converter shared by the wire formats.

cattrs' defaults coerce (`int("12")`, `int(1.9)`, `str(5)`); an API server must not:
a client that sends `"max_tokens": "12"` gets a 400 naming the field instead.
Unknown fields are ignored, as both APIs' clients send vendor extras.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.v import format_exception, transform_error

from butter.errors import InvalidRequest

T = TypeVar("T")


def _strict_int(value: Any, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # JSON has one number type: accept 12.0 but never silently truncate 12.5.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return float(value)


def _strict_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _strict_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, got {type(value).__name__}")
    return value


def _passthrough(value: Any, _: type) -> Any:
    return value


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _json_kind_matches(member: Any, value: Any) -> bool:
    """Does this union member accept a JSON value of this kind? (no coercion across kinds)"""
    origin = typing.get_origin(member) or member
    if value is None:
        return member is type(None)
    if isinstance(value, bool):
        return origin is bool
    if isinstance(value, int | float):
        return origin in (int, float)
    if isinstance(value, str):
        return origin is str or typing.get_origin(member) is typing.Literal
    if isinstance(value, list):
        return origin in (list, tuple)
    if isinstance(value, dict):
        return origin is dict or attrs.has(origin)
    return False


def _union_hook_factory(
    union: Any, converter: cattrs.Converter
) -> Callable[[Any, Any], Any]:
    members = typing.get_args(union)

    def structure_union(value: Any, _: Any) -> Any:
        for member in members:
            if _json_kind_matches(member, value):
                return None if value is None else converter.structure(value, member)
        expected = " or ".join(_describe(m) for m in members)
        raise TypeError(f"expected {expected}, got {_json_name(value)}")

    return structure_union


def _describe(member: Any) -> str:
    origin = typing.get_origin(member) or member
    names = {type(None): "null", str: "a string", int: "an integer", float: "a number",
             bool: "a boolean", list: "an array", dict: "an object"}
    if attrs.has(origin):
        return "an object"
    return names.get(origin, getattr(origin, "__name__", str(origin)))


def _json_name(value: Any) -> str:
    return _describe(type(value)) if not isinstance(value, bool) else "a boolean"


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list


def _is_dict(tp: Any) -> bool:
    return typing.get_origin(tp) is dict or tp is dict


def _list_hook_factory(list_type: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    # cattrs would happily iterate a string into a list of characters.
    structure_items = list_structure_factory(list_type, converter)

    def structure_list(value: Any, type_: Any) -> Any:
        if not isinstance(value, list):
            raise TypeError(f"expected an array, got {_json_name(value)}")
        return structure_items(value, type_)

    return structure_list


def _structure_dict(value: Any, _: Any) -> Any:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {_json_name(value)}")
    return value


def make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=False)
    converter.register_structure_hook_factory(
        _is_list, lambda tp: _list_hook_factory(tp, converter)
    )
    converter.register_structure_hook_func(_is_dict, _structure_dict)
    converter.register_structure_hook_factory(
        _is_union, lambda tp: _union_hook_factory(tp, converter)
    )
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook(Any, _passthrough)
    return converter


def structure_request(converter: cattrs.Converter, payload: Any, cls: type[T]) -> T:
    """Structure a decoded JSON body, turning cattrs' error tree into one readable 400."""
    if not isinstance(payload, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return converter.structure(payload, cls)
    except cattrs.BaseValidationError as exc:
        messages = transform_error(exc, path="body", format_exception=_readable)
        param = _first_param(messages)
        raise InvalidRequest("; ".join(messages), param=param) from None
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None


def _readable(exc: BaseException, type_: type | None) -> str:
    """Our hooks raise messages written for people; keep them, else use cattrs' wording."""
    if isinstance(exc, TypeError | ValueError) and str(exc).startswith("expected"):
        return str(exc)
    return format_exception(exc, type_)


def _first_param(messages: list[str]) -> str | None:
    """`... @ body.messages[0].role` → `messages[0].role` (OpenAI's `param` field)."""
    for message in messages:
        _, sep, where = message.rpartition(" @ body")
        if sep and where:
            return where.lstrip(".")
    return None
