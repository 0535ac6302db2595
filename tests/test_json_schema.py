"""Output constraints follow the whole JSON schema, never an approximation of it, on both
backends (one engine, llguidance: butter/backends/constraints.py).

A matrix of schemas (const, enum, nested objects, arrays, $ref/$defs, recursion, anyOf,
oneOf, allOf, top-level non-objects, pattern, format, number bounds) generated on the tiny
random models and on the demo model: every output must complete (the grammar allows the
end of generation only once the JSON is whole, and every schema here is bounded) and
validate with `jsonschema`. Keywords llguidance cannot enforce are refused, naming the
keyword, and the same goes through a real `butter serve`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from butter.backends.base import Backend, RemoveTokens, SeqWork, SetSampler
from butter.chat.grammar import closed_objects, json_schema_grammar, tool_call_grammar
from butter.model import Model
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from tests.conftest import ServerProcess

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9,
                                                "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}

SCHEMAS: dict[str, Any] = {
    "const": {"const": "42"},
    "const_object": {"const": {"a": [1, 2], "b": None}},
    "enum": {"enum": ["red", "green", 3, None, {"x": True}]},
    "nested_objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {"type": "object", "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "zip": {"type": "string", "pattern": "^[0-9]{4}$"},
            }, "required": ["city", "zip"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 2, "maxItems": 4},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "boolean"},
                                                      {"enum": ["a", "b"]}],
                     "items": False, "minItems": 2},
    "ref_defs": {"$defs": {"point": POINT}, "type": "object",
                 "properties": {"from": {"$ref": "#/$defs/point"},
                                "to": {"$ref": "#/$defs/point"}},
                 "required": ["from", "to"], "additionalProperties": False},
    "recursive": {"$defs": {"node": {
        "type": "object",
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                       "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}},
        "$ref": "#/$defs/node"},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                         {"type": "string", "maxLength": 3},
                         {"type": "object", "properties": {"k": {"type": "boolean"}},
                          "required": ["k"], "additionalProperties": False}]},
    "one_of": {"oneOf": [{"type": "boolean"}, {"type": "null"},
                         {"type": "string", "enum": ["x", "y"]}]},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}},
                          "additionalProperties": False},
                         {"required": ["a"]}]},
    "integer": {"type": "integer", "minimum": 10, "maximum": 60, "multipleOf": 5},
    "boolean": {"type": "boolean"},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{2}$"},
    "format": {"type": "string", "format": "uuid"},
    "pattern_properties": {"type": "object", "maxProperties": 2,
                           "patternProperties": {"^[a-z]$": {"type": "integer", "minimum": 0,
                                                             "maximum": 9}},
                           "additionalProperties": False},
}

# Bounded only by the model's choices: a real model may go on with the pattern it started.
UNBOUNDED = {"recursive"}

# What llguidance cannot enforce, and the word the refusal must name.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "not": ({"not": {"type": "null"}}, '"not"'),
    "if_then_else": ({"if": {"type": "string"}, "then": {"minLength": 2},
                      "else": {"type": "integer"}}, '"if"'),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, '"uniqueItems"'),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, '"contains"'),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
                         '"dependentSchemas"'),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 3}},
                      '"propertyNames"'),
    "unevaluatedProperties": ({"type": "object", "unevaluatedProperties": False},
                              '"unevaluatedProperties"'),
    "nested": ({"type": "object", "properties": {"a": {"type": "array", "items": {
        "not": {"const": 1}}}}}, '"not"'),
    "format": ({"type": "string", "format": "uri-reference"}, "'uri-reference'"),
    "overlapping_oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    "look_around_pattern": ({"type": "string", "pattern": "^(?=a)."}, "look-around"),
    # llguidance's own options are butter's: a client's `lenient` would skip `not`.
    "client_lenient": ({"x-guidance": {"lenient": True}, "not": {"type": "null"}}, '"not"'),
}

TINY_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
DEMO_PROMPT = "<start_of_turn>user\nAnswer in JSON.<end_of_turn>\n<start_of_turn>model\n"


def _load(kind: str, path: Path) -> Backend:
    if kind == "mlx":
        from butter.backends.mlx import MlxBackend

        return MlxBackend(path, n_cells=1024, n_seq=1)
    from butter.backends.llama_cpp import LlamaCppBackend

    return LlamaCppBackend(path, n_cells=1024, n_seq=1, n_batch=128, threads=2)


@pytest.fixture(scope="module", params=["gguf", "mlx", "demo"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    fixture = "demo_gguf" if request.param == "demo" else f"tiny_{request.param}"
    backend = _load(request.param, request.getfixturevalue(fixture))
    yield backend
    backend.close()


def _prompt(backend: Backend) -> tuple[int, ...]:
    demo = backend.info.architecture.startswith("gemma")
    text = DEMO_PROMPT if demo else TINY_PROMPT
    return tuple(backend.tokenize(text, add_bos=demo))


def _generate(backend: Backend, params: SamplingParams, steps: int) -> tuple[list[bytes], bool]:
    """The pieces one fresh sequence generates, and whether it ended (end of generation)
    within `steps` tokens."""
    prompt = _prompt(backend)
    (sampled,) = backend.step([RemoveTokens(0, -1), SetSampler(0, params)],
                              [SeqWork(0, prompt, 0, sample=True, prompt=True)])
    pieces, position = [], len(prompt)
    for _ in range(steps):
        assert sampled.error is None, sampled.error
        if sampled.end_of_generation:
            return pieces, True
        pieces.append(sampled.piece)
        (sampled,) = backend.step([], [SeqWork(0, (sampled.token,), position, sample=True)])
        position += 1
    return pieces, False


def _validate(schema: Any, text: bytes) -> None:
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(json.loads(text))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_completes_and_follows_the_schema(backend: Backend, name: str) -> None:
    schema = SCHEMAS[name]
    seeds = (1,) if backend.info.architecture.startswith("gemma") else (1, 2, 3)
    for seed in seeds:
        params = SamplingParams(seed=seed, temperature=1.0,
                                grammar=json_schema_grammar(schema))
        steps = 100 if name in UNBOUNDED else 300
        pieces, ended = _generate(backend, params, steps)
        text = b"".join(pieces)
        if ended:
            _validate(schema, text)
            continue
        assert name in UNBOUNDED, f"seed {seed}: no end after {steps} tokens: {text[:200]!r}"
        with pytest.raises(json.JSONDecodeError) as cut:  # JSON cut off, only at the end
            json.loads(text)
        assert cut.value.msg.startswith("Unterminated") or cut.value.pos == len(text.decode())


def test_top_level_const_is_exact_within_six_tokens(backend: Backend) -> None:
    """The issue's case: `"42"` (the llama.cpp backend's GBNF once gave `{ }`)."""
    for params in (SamplingParams(temperature=0, grammar=json_schema_grammar({"const": "42"})),
                   SamplingParams(seed=5, grammar=json_schema_grammar({"const": "42"}))):
        pieces, ended = _generate(backend, params, 6)
        assert ended and b"".join(pieces) == b'"42"'


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_an_unenforceable_keyword_is_refused_by_name(backend: Backend, name: str) -> None:
    schema, named = UNSUPPORTED[name]
    with pytest.raises(ValueError, match="cannot turn this JSON schema into a grammar") as err:
        backend.check_sampling(SamplingParams(grammar=json_schema_grammar(schema)))
    assert named in str(err.value)


def test_tool_parameters_are_held_to_the_same_rules(backend: Backend) -> None:
    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(ValueError, match='not supported: "uniqueItems"'):
        backend.check_sampling(SamplingParams(grammar=tool_call_grammar([tool])))


def test_a_forced_tool_call_uses_the_vocabularys_marker_tokens(backend: Backend) -> None:
    """Where the vocabulary has `<tool_call>` as one special token (the tiny Qwen3
    vocabularies), the call opens and closes with that token, as the model would write it."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"side": {"enum": ["left", "right"]}},
        "required": ["side"], "additionalProperties": False}}}
    params = SamplingParams(seed=4, grammar=tool_call_grammar([tool]))
    pieces, ended = _generate(backend, params, 300)
    text = b"".join(pieces)
    assert ended and text.startswith(b"<tool_call>\n") and text.endswith(b"\n</tool_call>")
    call = json.loads(text.removeprefix(b"<tool_call>\n").removesuffix(b"\n</tool_call>"))
    assert call["name"] == "pick" and call["arguments"]["side"] in ("left", "right")
    if len(backend.tokenize("<tool_call>", add_bos=False)) == 1:
        assert pieces[0] == b"<tool_call>" and pieces[-1] == b"</tool_call>"


def test_a_forced_calls_arguments_carry_only_the_declared_keys(backend: Backend) -> None:
    """Tools rarely say `additionalProperties: false`; JSON Schema would then allow any
    other key, and random weights (or a small model) invent them. The call's arguments
    hold the declared keys only, and the call ends."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city"]}}}
    seeds = (1, 2) if backend.info.architecture.startswith("gemma") else (1, 2, 3, 4, 5)
    for seed in seeds:
        params = SamplingParams(seed=seed, temperature=1.0, grammar=tool_call_grammar([tool]))
        pieces, ended = _generate(backend, params, 200)
        text = b"".join(pieces)
        assert ended, f"seed {seed}: no end after 200 tokens: {text[:200]!r}"
        call = json.loads(text.removeprefix(b"<tool_call>\n").removesuffix(b"\n</tool_call>"))
        assert set(call["arguments"]) <= {"city", "unit"} and "city" in call["arguments"]


def test_closing_objects_keeps_what_the_schema_says_outright() -> None:
    """Closed: objects that list properties and are silent about others, wherever they
    nest. Kept: an explicit `additionalProperties`, the members of `allOf` (closing each
    would forbid the keys the other adds), and a property that is itself named
    `properties`."""
    schema = {"type": "object", "$defs": {"point": {"properties": {"x": {}}}},
              "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                             "at": {"$ref": "#/$defs/point"},
                             "list": {"items": {"properties": {"b": {}}}},
                             "open": {"properties": {"c": {}}, "additionalProperties": True},
                             "both": {"allOf": [{"properties": {"d": {}}},
                                                {"properties": {"e": {}}}]}}}
    validator = jsonschema.Draft202012Validator(closed_objects(schema))
    assert validator.is_valid({"properties": {"a": 1}, "at": {"x": 1}, "list": [{"b": 1}],
                               "open": {"c": 1, "z": 1}, "both": {"d": 1, "e": 2}})
    for extra in ({"z": 1}, {"properties": {"a": 1, "z": 1}}, {"at": {"x": 1, "z": 1}},
                  {"list": [{"b": 1, "z": 1}]}):
        assert not validator.is_valid(extra), extra
    assert closed_objects(schema)["properties"]["properties"]["properties"] == {"a": {}}


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
async def test_a_complete_output_finishes_with_stop(kind: str,
                                                    request: pytest.FixtureRequest) -> None:
    """Through the engine: the grammar completes, the model's end of generation is the only
    token left, and the request finishes `stop`, not `length`."""
    path: Path = request.getfixturevalue(f"tiny_{kind}")
    model = await Model.from_settings(ServeSettings(model=str(path), parallel=1,
                                                    max_context=512))
    try:
        backend = model.resident.backend
        prompt = backend.tokenize(TINY_PROMPT, add_bos=False)
        params = SamplingParams(seed=7, grammar=json_schema_grammar(SCHEMAS["ref_defs"]))
        async with model.resident.engine.generate(prompt, params, 200) as gen:
            text = b"".join([p async for batch in gen.pieces() for p in batch])
        assert gen.finish_reason == "stop"
        _validate(SCHEMAS["ref_defs"], text)
    finally:
        await model.aclose()


def test_a_failing_grammar_ends_its_request_with_an_error(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the matcher refuses a token it did not veto (llguidance hit a limit, say), the
    request ends with an error instead of leaving the schema."""
    backend = _load("gguf", tiny_gguf)
    try:
        samplers = backend.samplers  # type: ignore[attr-defined]
        monkeypatch.setattr(samplers.grammars, "permits", lambda matcher, token: True)
        prompt = _prompt(backend)
        params = SamplingParams(temperature=0, grammar=json_schema_grammar({"const": "42"}))
        (sampled,) = backend.step([RemoveTokens(0, -1), SetSampler(0, params)],
                                  [SeqWork(0, prompt, 0, sample=True, prompt=True)])
        position = len(prompt)
        for _ in range(20):
            if sampled.error is not None or sampled.end_of_generation:
                break
            (sampled,) = backend.step([], [SeqWork(0, (sampled.token,), position,
                                                   sample=True)])
            position += 1
        assert sampled.error == "the output grammar could not be followed (see the server log)"
    finally:
        backend.close()


# ---------------------------------------------------------------- through a real server

@pytest.fixture
def client(demo_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.api, api_key="unused", max_retries=0, timeout=120)


def test_response_format_const_over_http(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "What is 6 x 7?"}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "strict": True, "schema": {"const": "42"}}},
        max_tokens=6,
    )
    assert result.choices[0].message.content == '"42"'
    assert result.choices[0].finish_reason == "stop"


def test_an_unenforceable_schema_is_a_400_naming_the_keyword(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as err:
        client.chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "List colours."}],
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": {
                "type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
            max_tokens=6,
        )
    assert err.value.status_code == 400


# ---------------------------------------------------------------- objects closed

# What `llm --schema 'name, age int'` sends: properties and required, nothing else.
LLM_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}


def test_a_response_format_schema_is_closed_unless_it_says_otherwise() -> None:
    assert json_schema_grammar(LLM_SCHEMA).schema == {**LLM_SCHEMA,
                                                      "additionalProperties": False}
    for said in (True, {"type": "integer"}):
        schema = {**LLM_SCHEMA, "additionalProperties": said}
        assert json_schema_grammar(schema).schema == schema


def test_the_closed_grammar_refuses_another_key_and_the_open_one_takes_it(
        tiny_gguf: Path) -> None:
    """The compiled constraint itself, token by token (no model's choice involved): with
    the schema as `llm` sends it, the object ends after its keys; with
    `additionalProperties: true` it takes another one."""
    backend = _load("gguf", tiny_gguf)
    try:
        grammars = backend.samplers.grammars  # type: ignore[attr-defined]

        def accepts(schema: Any, text: str) -> bool:
            matcher = grammars.matcher(json_schema_grammar(schema))
            tokens = backend.tokenize(text, add_bos=False)
            return bool(matcher.validate_tokens(tokens) == len(tokens)
                        and matcher.consume_tokens(tokens) and matcher.is_accepting())

        exact, extra = '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36, "gender": "f"}'
        assert accepts(LLM_SCHEMA, exact) and not accepts(LLM_SCHEMA, extra)
        open_schema = {**LLM_SCHEMA, "additionalProperties": True}
        assert accepts(open_schema, exact) and accepts(open_schema, extra)
    finally:
        backend.close()


def test_a_loaded_model_has_read_its_vocabulary_for_constraints(demo_gguf: Path) -> None:
    """The vocabulary llguidance needs is read while the model loads, and the load returns
    only once it is: read beside the first request's steps, it took a core from them (the
    demo's 262k tokens take about 1.5 s, longer than the rest of its load)."""
    from butter.backends.llama_cpp import LlamaCppBackend

    backend = LlamaCppBackend(demo_gguf, n_cells=256, n_seq=1, n_batch=64, threads=2)
    try:
        grammars = backend.samplers.grammars
        assert not grammars._builder.is_alive()
        assert grammars._tokenizer is not None
    finally:
        backend.close()
