"""A hybrid model served over HTTP (#51): returning chat turns and forks of a
conversation are served from context checkpoints. A real `butter serve` process on the
tiny random-weight qwen35 GGUF (ChatML template), driven by the official OpenAI SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

MODEL = "tiny-hybrid"
SYSTEM = {"role": "system", "content": "You are a terse assistant who answers about boats."}


@pytest.fixture(scope="module")
def server(tiny_qwen35_gguf: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(["--model", str(tiny_qwen35_gguf), "--alias", MODEL,
                             "--parallel", "2", "--max-context", "2048", "--cache-ram", "256"])
    yield process
    process.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused")


def ask(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, int, int]:
    """The answer, the prompt's tokens and how many of them came from the cache."""
    result = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=8, temperature=0)
    usage = result.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return (result.choices[0].message.content or "", usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens or 0)


def user(topic: str) -> dict[str, str]:
    return {"role": "user", "content": f"Tell me about {topic}, " + "in detail " * 30}


def checkpoints(server: ServerProcess) -> dict[str, Any]:
    info: dict[str, Any] = httpx.get(f"{server.api}/server", timeout=10).json()
    return info["prefix_cache"]["checkpoints"]  # type: ignore[no-any-return]


def test_returning_turns_and_a_fork_come_from_checkpoints(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    first = [SYSTEM, user("sails")]
    answer, first_prompt, cold = ask(client, first)
    assert cold == 0
    second = [*first, {"role": "assistant", "content": answer}, user("keels")]
    answer2, second_prompt, cached = ask(client, second)
    # The answer comes back as text: everything before it is served from a checkpoint
    # (the answer's header, or 4 tokens before the first prompt's end).
    assert first_prompt - 4 <= cached < second_prompt
    # An edited last message forks the conversation: its stem (up to where that message
    # starts) comes from the checkpoint taken there, past the whole first turn.
    fork = [*first, {"role": "assistant", "content": answer}, user("rudders")]
    _, fork_prompt, fork_cached = ask(client, fork)
    assert first_prompt < fork_cached < fork_prompt - 30
    # ... and the original branch goes on from its own cache.
    third = [*second, {"role": "assistant", "content": answer2}, user("masts")]
    _, _, third_cached = ask(client, third)
    assert third_cached >= second_prompt - 4
    stats = checkpoints(server)
    assert stats["restored"] >= 3 and stats["taken"] >= stats["held"] > 0
    assert stats["bytes"] == stats["held"] * stats["bytes_each"] > 0


def test_server_info_says_what_checkpoints_hold(server: ServerProcess) -> None:
    stats = checkpoints(server)
    assert stats["per_sequence"] == 8 and stats["bytes_each"] > 0
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert "butter_checkpoints_taken_total" in metrics
    assert "butter_checkpoint_bytes" in metrics
