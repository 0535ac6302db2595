"""What both backends offer through the Backend contract, on the tiny models: output
constraints (compiled by each backend from the same neutral value), diagnostics, and
refusing every use once closed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from butter.backends.base import Backend, BackendError, RemoveTokens, SeqWork, SetSampler
from butter.chat.grammar import json_object_grammar, json_schema_grammar, tool_call_grammar
from butter.errors import InvalidRequest
from butter.sampling import OutputConstraint, SamplingParams

NOOP = {"type": "function", "function": {"name": "noop", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"side": {"enum": ["left", "right"]}},
    "required": ["side"], "additionalProperties": False}}}
AGE = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
       "additionalProperties": False}


def _load(kind: str, path: Path) -> Backend:
    if kind == "gguf":
        from butter.backends.llama_cpp import LlamaCppBackend

        return LlamaCppBackend(path, n_cells=512, n_seq=2, n_batch=128, threads=2)
    from butter.backends.mlx import MlxBackend

    return MlxBackend(path, n_cells=512, n_seq=2)


@pytest.fixture(scope="module", params=["gguf", "mlx"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    path: Path = request.getfixturevalue(f"tiny_{request.param}")
    backend = _load(request.param, path)
    yield backend
    backend.close()


def _generate(backend: Backend, params: SamplingParams, steps: int) -> bytes:
    """Greedy-or-seeded tokens of one fresh sequence until it ends (or `steps` run out)."""
    prompt = tuple(backend.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                    add_bos=False))
    sampled = backend.step([RemoveTokens(0, -1), SetSampler(0, params)],
                           [SeqWork(0, prompt, 0, sample=True, prompt=True)])
    pieces, position = [], len(prompt)
    for _ in range(steps):
        (token,) = sampled
        assert token.error is None, token.error
        if token.end_of_generation:
            break
        pieces.append(token.piece)
        sampled = backend.step([], [SeqWork(0, (token.token,), position, sample=True)])
        position += 1
    return b"".join(pieces)


def test_the_grammar_module_builds_neutral_values() -> None:
    call = tool_call_grammar([NOOP, PICK], only="pick")
    assert call == OutputConstraint.of(call.schema, tool_call=True)
    assert call.schema["properties"]["name"] == {"const": "pick"}
    assert json_schema_grammar(AGE) == OutputConstraint.of(AGE)
    assert not json_object_grammar().tool_call
    with pytest.raises(InvalidRequest, match="not in tools"):
        tool_call_grammar([NOOP], "launch")


def test_each_distinct_constraint_compiles_once() -> None:
    from llguidance import LLMatcher

    from butter.backends.constraints import (
        CompiledConstraints,
        constraint_grammar,
        schema_problem,
    )

    compiled: list[OutputConstraint] = []

    def compile(constraint: OutputConstraint) -> str:
        compiled.append(constraint)
        grammar = constraint_grammar(constraint)
        problem = LLMatcher.validate_grammar(grammar)
        if problem:
            raise ValueError(f"cannot turn this JSON schema into a grammar: "
                             f"{schema_problem(problem)}")
        return grammar

    cache = CompiledConstraints(compile, size=2)
    call, age, anything = tool_call_grammar([NOOP]), json_schema_grammar(AGE), \
        json_object_grammar()
    first = cache.get(call)
    assert first.startswith('start: "<tool_call>" "\\n" call "\\n" "</tool_call>"')
    assert cache.get(tool_call_grammar([NOOP])) is first  # an equal value, built anew
    cache.get(age)
    cache.get(call)
    cache.get(anything)  # the third: the least recently used one (age) goes
    cache.get(call)
    assert compiled == [call, age, anything]
    cache.get(age)
    assert compiled == [call, age, anything, age]
    broken = json_schema_grammar({"$ref": "#/definitions/missing"})
    for _ in range(2):  # errors are not kept
        with pytest.raises(ValueError, match="cannot turn this JSON schema into a grammar"):
            cache.get(broken)
    assert compiled[-2:] == [broken, broken]


def test_text_layers_never_import_llama_cpp() -> None:
    code = ("import sys, butter.backends, butter.backends.base, butter.chat.grammar, "
            "butter.chat.template, butter.sampling, butter.backends.llama_cpp, "
            "butter.backends.mlx; assert 'llama_cpp' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_forced_tool_call_is_one_valid_call(backend: Backend, seed: int) -> None:
    params = SamplingParams(seed=seed, temperature=0.8,
                            grammar=tool_call_grammar([NOOP, PICK]))
    text = _generate(backend, params, 120)
    assert text.startswith(b"<tool_call>\n") and text.endswith(b"\n</tool_call>")
    call = json.loads(text.removeprefix(b"<tool_call>\n").removesuffix(b"\n</tool_call>"))
    assert call in ({"name": "noop", "arguments": {}},
                    {"name": "pick", "arguments": {"side": "left"}},
                    {"name": "pick", "arguments": {"side": "right"}})


def test_a_json_schema_is_followed(backend: Backend) -> None:
    text = _generate(backend, SamplingParams(seed=3, grammar=json_schema_grammar(AGE)), 60)
    body = json.loads(text)  # (the tiny models end once the object is complete)
    assert set(body) == {"age"} and isinstance(body["age"], int)


def test_an_unusable_schema_is_a_value_error(backend: Backend) -> None:
    broken = json_schema_grammar({"$ref": "#/definitions/missing"})
    with pytest.raises(ValueError, match="JSON schema"):
        backend.check_sampling(SamplingParams(grammar=broken))
    backend.check_sampling(SamplingParams(grammar=json_schema_grammar(AGE)))  # still serves


def test_diagnostics_say_what_the_server_shows(backend: Backend) -> None:
    shown = backend.diagnostics()
    json.dumps(shown)  # plain JSON values
    if backend.info.description.endswith("(MLX)"):
        assert shown["step_shapes"] is None and shown["lm_head"] is None
        assert isinstance(shown["decode_batch"], list)
    else:
        shapes = shown["step_shapes"]  # shaping is on: verdicts by output rows so far
        assert isinstance(shapes, dict) and set(shapes.values()) <= {"plain", "padded", "split"}
        assert shown["lm_head"]["by"].startswith(("butter (", "llama.cpp ("))
        assert shown["lm_head"]["redone_steps"] == 0
        assert shown["weight_repacking"] is False  # the class's default (the server's: on)


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
def test_a_closed_backend_refuses_every_use(kind: str, request: pytest.FixtureRequest) -> None:
    backend = _load(kind, request.getfixturevalue(f"tiny_{kind}"))
    backend.close()
    backend.close()  # idempotent
    unloaded = pytest.raises(BackendError, match="the model was unloaded")
    with unloaded:
        backend.tokenize("hello", add_bos=False)
    with unloaded:
        backend.check_sampling(SamplingParams(grammar=json_object_grammar()))
    with unloaded:
        backend.submit_step([], [])


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
def test_control_tokens_written_out_come_out_as_their_text(
        kind: str, request: pytest.FixtureRequest) -> None:
    """A family's tool-call markers are control tokens, which generate as empty pieces;
    the markers a backend is told to write out come out as text. `<|im_start|>` (a
    control token of the tiny vocabulary) stands for them; logit_bias makes it the
    greedy choice."""
    backend = _load(kind, request.getfixturevalue(f"tiny_{kind}"))
    try:
        (marker,) = backend.tokenize("<|im_start|>", add_bos=False)
        forced = SamplingParams(temperature=0.0, logit_bias=((marker, 100.0),))
        assert _generate(backend, forced, 3) == b""
        backend.write_out(["<|im_start|>", "not one token", "<tool_call>"])
        assert _generate(backend, forced, 3) == b"<|im_start|>" * 3
    finally:
        backend.close()
