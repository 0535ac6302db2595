"""The chat page at `/`, in a real headless Chromium against a real `butter serve` on the
instruct model (SmolLM2-135M-Instruct, the `demo` extra): an answer streams and ends with
its stats, Stop cancels the request on the server, the picker swaps models, the engine
view follows the server, errors show the API's message, and the API-key rules hold.
Screenshots of the finished page are kept in the test's tmp dir."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import INSTRUCT_MODEL, ServerProcess, start_instruct_server

INSTRUCT = INSTRUCT_MODEL
BASE_MODEL = "gemma-3-270m"  # a base model: it never ends a turn, so an answer to stop
TIMEOUT_MS = 120_000
# Every text change of the answer while it streams, read in the page.
RECORD_TEXT = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const text = document.querySelector("#log li.assistant:last-child .text");
    const stats = document.querySelector("#log li.assistant:last-child .stats");
    if (text && !stats) window.seen.push(text.textContent.length);
  }).observe(document.getElementById("log"), {subtree: true, childList: true,
                                              characterData: true});
}"""


@pytest.fixture(scope="module")
def ui_server() -> Iterator[ServerProcess]:
    # Every token its own frame, so the page sees the answer grow token by token.
    server = start_instruct_server("--stream-flush-ms", "0")
    yield server
    server.stop()


@pytest.fixture
def page(browser: Any, ui_server: ServerProcess, tmp_path: Path) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    opened = context.new_page()
    opened.goto(f"{ui_server.base_url}/", timeout=TIMEOUT_MS)
    opened.wait_for_selector("#model option[value]", state="attached", timeout=TIMEOUT_MS)
    yield opened
    opened.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    context.close()


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.keyboard.press("Enter")


def last_answer(page: Any) -> Any:
    return page.locator("#log li.assistant").last


def settings(page: Any, **values: str) -> None:
    if not page.locator("#settings").evaluate("node => node.open"):
        page.click("#settings summary")
    for field, value in values.items():
        page.fill(f"#{field.replace('_', '-')}", value)


def test_api_clients_keep_their_answer_at_the_base_url(ui_server: ServerProcess) -> None:
    for accept in (None, "*/*", "application/json"):
        headers = {"Accept": accept} if accept else {}
        answer = httpx.get(f"{ui_server.base_url}/", headers=headers)
        assert answer.status_code == 200 and answer.text.startswith("butter ")
    assert httpx.head(f"{ui_server.base_url}/").status_code == 200  # Claude Code's probe
    page = httpx.get(f"{ui_server.base_url}/", headers={"Accept": "text/html,*/*;q=0.8"})
    assert page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert httpx.get(f"{ui_server.base_url}/ui/ui.js").status_code == 200
    assert httpx.get(f"{ui_server.base_url}/ui/..%2fapp.py").status_code == 404
    assert httpx.get(f"{ui_server.base_url}/ui/index.html").status_code == 404


def test_an_answer_streams_and_ends_with_its_stats(page: Any, ui_server: ServerProcess,
                                                   tmp_path: Path) -> None:
    page.evaluate(RECORD_TEXT)
    settings(page, temperature="0", max_tokens="64")
    send(page, "Write a haiku about butter.")
    stats = last_answer(page).locator(".stats")
    stats.wait_for(timeout=TIMEOUT_MS)
    lengths = [n for n in page.evaluate("window.seen") if n]
    assert len(set(lengths)) >= 3, lengths  # the text grew while it streamed
    text = last_answer(page).locator(".text").inner_text()
    assert re.search(r"[A-Za-z]{3,}", text), text
    line = stats.inner_text()
    assert re.search(r"\d+ tokens · [\d.]+ tokens/s · \d+ of \d+ prompt tokens cached", line)
    assert "finish: stop" in line  # the instruct model ends its turn
    # The engine view follows the server: the request is counted, nothing is left active.
    page.wait_for_function(
        """() => Number(document.querySelector('[data-stat="requests done"]')?.textContent) >= 1
                 && document.querySelector('[data-stat="active requests"]')
                    ?.textContent.startsWith("0 of")""", timeout=TIMEOUT_MS)
    # A second turn reuses the first one's prompt from the cache.
    send(page, "Now one about bread.")
    second = last_answer(page).locator(".stats")
    second.wait_for(timeout=TIMEOUT_MS)
    cached = int(re.search(r"(\d+) of \d+ prompt tokens cached", second.inner_text())[1])
    assert cached > 0
    page.screenshot(path=str(tmp_path / "answered.png"), full_page=True)


def test_errors_show_the_apis_message(page: Any) -> None:
    settings(page, temperature="-1")
    send(page, "hi")
    error = last_answer(page).locator(".error")
    error.wait_for(timeout=TIMEOUT_MS)
    assert error.inner_text().startswith("400: ") and "temperature" in error.inner_text()


def test_stop_ends_the_request_on_the_server(page: Any, ui_server: ServerProcess) -> None:
    """Picked in the page, the base model writes until max_tokens; Stop closes the stream and
    the server cancels the request and frees its slot."""
    page.select_option("#model", BASE_MODEL)
    settings(page, temperature="0.7", max_tokens="3000")
    log_start = len(ui_server.output)
    send(page, "Once upon a time")
    page.wait_for_function(
        """() => document.querySelector("#log li.assistant:last-child .text")
                 ?.textContent.length > 40""", timeout=TIMEOUT_MS)
    page.keyboard.press("Escape")
    stats = last_answer(page).locator(".stats")
    stats.wait_for(timeout=TIMEOUT_MS)
    assert "finish: stopped" in stats.inner_text()
    deadline = time.monotonic() + 60
    while not any("/v1/chat/completions" in line and "cancelled=True" in line
                  for line in ui_server.output[log_start:]):
        assert time.monotonic() < deadline, "the server logged no cancelled request"
        time.sleep(0.05)
    assert ui_server.engine_stats()["active"] == 0
    picked = page.locator("#model option:checked").inner_text()
    assert picked == f"{BASE_MODEL} (loaded)"  # the request swapped the model


def test_the_page_asks_for_the_key_a_server_needs(browser: Any) -> None:
    server = start_instruct_server("--api-key", "s3cret")
    try:
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"{server.base_url}/", timeout=TIMEOUT_MS)  # the page itself needs no key
        settings(page, max_tokens="8")
        send(page, "hi")
        error = last_answer(page).locator(".error")
        error.wait_for(timeout=TIMEOUT_MS)
        assert error.inner_text().startswith("401: ") and "API key" in error.inner_text()
        settings(page, api_key="s3cret")
        send(page, "hi")
        last_answer(page).locator(".stats").wait_for(timeout=TIMEOUT_MS)
        assert last_answer(page).locator(".error").count() == 0
        context.close()
    finally:
        server.stop()


def test_no_ui(tiny_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--no-ui"])
    try:
        root = httpx.get(f"{server.base_url}/", headers={"Accept": "text/html"})
        assert root.text.startswith("butter ")
        assert httpx.get(f"{server.base_url}/ui/ui.js").status_code == 404
        assert not any("chat page" in line for line in server.output)
    finally:
        server.stop()


def test_reasoning_and_tool_calls_show_as_their_own_blocks(page: Any) -> None:
    """The page's rendering of what the instruct model here never sends: an answer with
    reasoning and a tool call. The stream is butter's own encoder's chunks, served to the
    page in place of the server's (the model, not the wire, is what is missing)."""
    from butter.protocol import openai
    from butter.protocol.sse import DONE, data_event

    def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
        return data_event(openai.chunk_body(completion_id="chatcmpl-x", model=INSTRUCT,
                                            created=0, delta=delta,
                                            finish_reason=reason))  # type: ignore[arg-type]

    body = b"".join([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "The user wants the weather.",
               "reasoning": "The user wants the weather."}),
        chunk({"content": "Let me check."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}),
        chunk({}, "tool_calls"), DONE])
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, body=body, headers={"Content-Type": "text/event-stream"}))
    send(page, "Weather in Paris?")
    answer = last_answer(page)
    answer.locator(".stats").wait_for(timeout=TIMEOUT_MS)
    reasoning = answer.locator("details.reasoning")
    assert reasoning.locator("summary").inner_text() == "Reasoning"  # folded until opened
    assert reasoning.locator("pre").text_content() == "The user wants the weather."
    assert answer.locator(".text").inner_text() == "Let me check."
    assert answer.locator(".tool-call strong").inner_text() == "tool call: get_weather"
    assert answer.locator(".tool-call pre").inner_text() == '{"city": "Paris"}'
    assert "finish: tool_calls" in answer.locator(".stats").inner_text()


def test_only_the_messages_scroll_in_a_long_conversation(browser: Any, ui_server: ServerProcess,
                                                         tmp_path: Path) -> None:
    # A short window, so that two answers overflow it: the header, the composer and the
    # engine panel stay where they are, the page itself does not scroll, the message list
    # does, and it follows the answer to its end.
    context = browser.new_context(viewport={"width": 1000, "height": 420})
    page = context.new_page()
    page.goto(f"{ui_server.base_url}/", timeout=TIMEOUT_MS)
    page.wait_for_selector("#model option[value]", state="attached", timeout=TIMEOUT_MS)
    settings(page, temperature="0", max_tokens="160")
    page.click("#settings summary")  # (closed again: the settings take no room)
    for ask in ("Write a long story about a lighthouse.", "Now one about a bakery."):
        send(page, ask)
        page.wait_for_function(
            "n => document.querySelectorAll('#log li.assistant .stats').length >= n",
            arg=page.locator("#log li.user").count(), timeout=TIMEOUT_MS)
    layout = page.evaluate("""() => {
        const box = id => document.getElementById(id).getBoundingClientRect();
        const log = document.getElementById("log");
        const last = document.querySelector("#log li:last-child").getBoundingClientRect();
        return {page: document.scrollingElement.scrollHeight - window.innerHeight,
                scrolled: window.scrollY, header: document.querySelector("header")
                    .getBoundingClientRect().top,
                composer: box("composer").bottom, engine: box("engine").top,
                overflow: log.scrollHeight - log.clientHeight, at: log.scrollTop,
                lastBottom: last.bottom, logBottom: box("log").bottom,
                height: window.innerHeight};
    }""")
    page.screenshot(path=str(tmp_path / "long.png"))
    context.close()
    assert layout["overflow"] > 0, layout  # the conversation is taller than its list
    assert layout["page"] <= 0 and layout["scrolled"] == 0, layout  # the page does not scroll
    assert layout["header"] == 0 and layout["engine"] < layout["height"], layout
    assert layout["composer"] <= layout["height"], layout  # the composer is in view
    assert layout["at"] > 0 and layout["lastBottom"] <= layout["logBottom"] + 1, layout
