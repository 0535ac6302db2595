"""A real browser (Debian's Chromium, driven by Playwright) against a real `butter serve`:
a page on a loopback origin can use the API; the same page on another site cannot, not
even with a "simple" request that skips the preflight; and a page reached through DNS
rebinding cannot read the server (docs/security.md).

Chromium's --host-resolver-rules maps `evil.example` to 127.0.0.1: what a rebinding or a
hostile site's DNS does, without a network.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess

PAGE_TIMEOUT_MS = 60_000

# The page calls the butter URL it is given: a JSON request (preflighted) whose answer it
# reads, then a text/plain one (a "simple" request: sent without a preflight, unreadable).
PAGE = b"""<!doctype html><meta charset="utf-8"><title>client</title>
<script>
async function callButter(base) {
  const body = JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 2});
  const out = {};
  try {
    const answer = await fetch(base + "/v1/chat/completions", {method: "POST", body,
      headers: {"Content-Type": "application/json", "Authorization": "Bearer unused"}});
    out.read = answer.status + " " + (await answer.json()).object;
  } catch (error) {
    out.read = "blocked";
  }
  try {
    await fetch(base + "/v1/chat/completions", {method: "POST", mode: "no-cors", body,
      headers: {"Content-Type": "text/plain"}});
    out.simple = "sent";
  } catch (error) {
    out.simple = "failed";
  }
  return out;
}
</script>"""


class PageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture(scope="module")
def page_port() -> Iterator[int]:
    """Another web site on this machine: the page above, on its own port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PageHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def butter(tiny_gguf: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--max-context",
                            "512"])
    yield server
    server.stop()


def counter(server: ServerProcess, name: str, **labels: str) -> float:
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    prefix = f"{name}{{{wanted}}} " if labels else f"{name} "
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith(prefix))


def call_from(browser: Any, page_url: str, butter: ServerProcess) -> dict[str, str]:
    page = browser.new_page()
    try:
        page.goto(page_url, timeout=PAGE_TIMEOUT_MS)
        result: dict[str, str] = page.evaluate("base => callButter(base)", butter.base_url)
        return result
    finally:
        page.close()


def test_a_page_on_a_loopback_origin_uses_the_api(browser: Any, page_port: int,
                                                  butter: ServerProcess) -> None:
    result = call_from(browser, f"http://localhost:{page_port}/", butter)
    assert result == {"read": "200 chat.completion", "simple": "sent"}


def test_a_page_on_another_site_cannot_drive_the_server(browser: Any, page_port: int,
                                                       butter: ServerProcess) -> None:
    generated = counter(butter, "butter_prompt_tokens_total")
    refused = counter(butter, "butter_requests_total", route="unmatched", status="403")
    refused += counter(butter, "butter_requests_total", route="/v1/chat/completions",
                       status="403")
    result = call_from(browser, f"http://evil.example:{page_port}/", butter)
    assert result == {"read": "blocked", "simple": "sent"}
    # The simple request reached the server, which refused it before anything ran.
    after = counter(butter, "butter_requests_total", route="unmatched", status="403")
    after += counter(butter, "butter_requests_total", route="/v1/chat/completions",
                     status="403")
    assert after >= refused + 2  # the preflight and the simple request
    assert counter(butter, "butter_prompt_tokens_total") == generated


def test_a_rebound_name_cannot_read_the_server(browser: Any, butter: ServerProcess) -> None:
    """The page's own origin is butter's address under another name: same-origin for the
    browser, so only the server's Host check stands in the way."""
    port = butter.base_url.rpartition(":")[2]
    page = browser.new_page()
    try:
        for path in ("/v1/models", "/v1/server", "/metrics"):
            response = page.goto(f"http://evil.example:{port}{path}", timeout=PAGE_TIMEOUT_MS)
            assert response is not None and response.status == 403, path
            assert "tiny" not in page.content()
    finally:
        page.close()
