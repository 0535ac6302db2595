"""Real clients from their registries, unmodified, against a real `butter serve` on the
instruct model (SmolLM2-135M-Instruct): the cases where they tripped (#56).

- Simon Willison's `llm` CLI (a dependency of the demo extra's model wheel) with
  `--schema 'name, age int'`: a schema with properties and required keys but no
  `additionalProperties`, which used to leave the object open (extra keys, then an endless
  array).
- smolagents' OpenAIServerModel forcing a tool call with a small `max_tokens`: a call cut
  off by the limit used to come back as raw markup in `content`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import INSTRUCT_MODEL, ServerProcess, start_instruct_server


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    started = start_instruct_server()
    yield started
    started.stop()


def _llm(server: ServerProcess, home: Path, *args: str) -> str:
    """`llm` with butter as an OpenAI-compatible model named `butter` (its own config file,
    extra-openai-models.yaml, in a fresh LLM_USER_PATH)."""
    executable = shutil.which("llm", path=os.path.dirname(sys.executable)) or shutil.which("llm")
    if executable is None:
        pytest.skip("the llm CLI is not installed")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: butter\n  model_name: {INSTRUCT_MODEL}\n  api_base: {server.api}\n"
        "  supports_schema: true\n  supports_tools: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused"}
    run = subprocess.run([executable, "-m", "butter", *args], capture_output=True, text=True,
                         env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_llm_schema_gives_exactly_the_schemas_keys(server: ServerProcess,
                                                   tmp_path: Path) -> None:
    for seed in ("1", "2", "3"):
        out = _llm(server, tmp_path, "--schema", "name, age int", "-o", "seed", seed,
                   "-o", "max_tokens", "200", "Invent a person.")
        person = json.loads(out)
        assert set(person) == {"name", "age"}, out
        assert isinstance(person["name"], str) and isinstance(person["age"], int), out


def test_smolagents_gets_a_tool_call_cut_by_max_tokens_as_a_call(server: ServerProcess) -> None:
    smolagents = pytest.importorskip("smolagents")

    @smolagents.tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        return f"sunny in {city}"

    # smolagents forces a call (tool_choice "required") and reads `tool_calls`; with the
    # call cut short, the markup it used to get in `content` made it raise "The model output
    # does not contain any JSON blob". Across limits the cut lands before and after the
    # function's name is complete.
    seen_calls = 0
    for limit in (4, 8, 12, 16, 24):
        model = smolagents.OpenAIServerModel(model_id=INSTRUCT_MODEL, api_base=server.api,
                                             api_key="unused", max_tokens=limit,
                                             temperature=0.0)
        message = model.generate(
            [smolagents.ChatMessage(role=smolagents.MessageRole.USER,
                                    content=[{"type": "text",
                                              "text": "What is the weather in Paris?"}])],
            tools_to_call_from=[get_weather])
        assert "<tool_call>" not in (message.content or ""), (limit, message)
        calls = message.tool_calls or []
        assert all(call.function.name == "get_weather" for call in calls), (limit, message)
        seen_calls += len(calls)
    assert seen_calls > 0  # (a cut with the name complete came back as a call)
