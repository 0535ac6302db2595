"""The probes of issue #30 against a real `butter serve`: what a web page, a DNS-rebinding
page or a request's `model` could do at the defaults (refused, leaking nothing), and the
same probes where the flags allow them (docs/security.md)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from butter.testing.tiny_gguf import write_tiny_qwen3_gguf
from tests.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "hello"}]
CHAT = {"messages": MESSAGES, "max_tokens": 2}
EVIL = "https://evil.example"
# The model ids of the table: files any process can read, and one that is not there.
DISK_PROBES = ("/etc/passwd", "/proc/self/environ", "~/.bashrc", "/etc/hostname",
               "/no/such/file.gguf", "../../../../etc/shadow")
# What those files begin with, and what the old answers said about them.
LEAKS = ("root:", "SHEL", "# ~/", "magic", "exist", "readable", "is not a file")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("listed")
    write_tiny_qwen3_gguf(folder / "listed-model.gguf", seed=3, name="listed")
    return folder


@pytest.fixture(scope="module")
def unlisted_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("unlisted") / "unlisted.gguf",
                                 seed=4, name="unlisted")


@pytest.fixture(scope="module")
def default_server(tiny_gguf: Path, models_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny",
                            "--models-dir", str(models_dir), "--max-context", "512"])
    yield server
    server.stop()


def port_of(server: ServerProcess) -> str:
    return server.base_url.rpartition(":")[2]


def prompt_tokens(server: ServerProcess) -> float:
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    line = next(line for line in metrics.splitlines()
                if line.startswith("butter_prompt_tokens_total "))
    return float(line.split()[1])


# ---------------------------------------------------------------- the defaults

@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_a_requests_model_reads_no_file(default_server: ServerProcess, route: str) -> None:
    messages: list[str] = []
    for probe in DISK_PROBES:
        body = ({"prompt": "x", "max_tokens": 1} if route == "/v1/completions"
                else {**CHAT, "max_tokens": 1})
        response = httpx.post(f"{default_server.base_url}{route}",
                              json={**body, "model": probe}, timeout=30)
        assert response.status_code == 404, (probe, response.text)
        payload = response.json()
        error = payload["error"]
        assert error["type"] == ("not_found_error" if route == "/v1/messages"
                                 else "invalid_request_error")
        for leak in LEAKS:
            assert leak not in response.text, (probe, response.text)
        messages.append(error["message"].replace(repr(probe), "ID"))
    assert len(set(messages)) == 1, messages  # existing or not: one answer
    assert httpx.get(f"{default_server.api}/models").json()["data"][0]["id"] == "tiny"


def test_models_lists_what_may_be_swapped_to(default_server: ServerProcess) -> None:
    cards = httpx.get(f"{default_server.api}/models", timeout=30).json()["data"]
    assert (cards[0]["id"], cards[0]["loaded"]) == ("tiny", True)
    listed = {card["id"]: card["loaded"] for card in cards[1:]}
    assert listed.get("listed-model") is False
    assert "tiny-qwen3" not in listed  # the resident model, listed once under its id
    for card in cards:
        assert not card["id"].startswith("/")


def test_a_cross_site_simple_request_never_runs(default_server: ServerProcess) -> None:
    """text/plain with an Origin skips the browser's preflight: refused before it runs."""
    before = prompt_tokens(default_server)
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/completions"):
        response = httpx.post(f"{default_server.base_url}{route}", content=json.dumps(CHAT),
                              headers={"Content-Type": "text/plain", "Origin": EVIL},
                              timeout=30)
        assert response.status_code == 403, response.text
        assert "access-control-allow-origin" not in response.headers
        body = response.json()
        if route == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "permission_error"
        else:
            assert body["error"]["code"] == "forbidden"
    for origin in ("null", "http://0.0.0.0:3000", "http://localhost.evil.example"):
        refused = httpx.post(f"{default_server.api}/chat/completions", json=CHAT,
                             headers={"Origin": origin}, timeout=30)
        assert refused.status_code == 403, origin
    assert prompt_tokens(default_server) == before  # nothing was generated


def test_dns_rebinding_gets_403(default_server: ServerProcess) -> None:
    before = prompt_tokens(default_server)
    for host in (f"evil.example:{port_of(default_server)}", f"0.0.0.0:{port_of(default_server)}"):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/metrics"), ("GET", "/v1/server")):
            response = httpx.request(method, f"{default_server.base_url}{path}", json=CHAT,
                                     headers={"Host": host, "Origin": f"http://{host}"},
                                     timeout=30)
            assert response.status_code == 403, (host, path, response.text)
            assert "tiny" not in response.text
    assert prompt_tokens(default_server) == before
    # Probes stay open for load balancers, whatever name they use.
    probe = httpx.get(f"{default_server.base_url}/health", headers={"Host": "lb.internal"})
    assert probe.status_code == 200


def test_a_page_on_a_loopback_origin_can_use_the_server(default_server: ServerProcess) -> None:
    origin = "http://localhost:3000"
    preflight = httpx.options(f"{default_server.api}/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"}, timeout=30)
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
    answer = httpx.post(f"{default_server.api}/chat/completions", json=CHAT,
                        headers={"Origin": origin}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == origin
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"
    refused = httpx.options(f"{default_server.api}/chat/completions", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST"}, timeout=30)
    assert refused.status_code == 403
    assert "access-control-allow-origin" not in refused.headers


def test_the_sdks_still_work_at_the_defaults(default_server: ServerProcess) -> None:
    """They send no Origin and a loopback Host."""
    chat = openai.OpenAI(base_url=default_server.api, api_key="unused", max_retries=0)
    assert chat.chat.completions.create(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                        max_tokens=2).choices
    claude = anthropic.Anthropic(base_url=default_server.base_url, api_key="unused",
                                 max_retries=0)
    assert claude.messages.create(model="tiny", max_tokens=2, messages=MESSAGES).content  # type: ignore[arg-type]


# ---------------------------------------------------------------- where flags allow it

def test_the_flags_allow_each_probe(tiny_gguf: Path, models_dir: Path,
                                    unlisted_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny",
                            "--models-dir", str(models_dir), "--max-context", "512",
                            "--allowed-hosts", "evil.example", "--cors-origins", EVIL,
                            "--allow-model-paths"])
    try:
        host = f"evil.example:{port_of(server)}"
        answer = httpx.post(f"{server.api}/chat/completions", content=json.dumps(CHAT),
                            headers={"Host": host, "Origin": EVIL,
                                     "Content-Type": "text/plain"}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == EVIL
        swapped = httpx.post(f"{server.api}/chat/completions",
                             json={**CHAT, "model": str(unlisted_gguf)}, timeout=60)
        assert swapped.status_code == 200, swapped.text
        assert swapped.json()["model"] == str(unlisted_gguf)
        # Any path may be named now, but the answer still never quotes the file.
        passwd = httpx.post(f"{server.api}/chat/completions",
                            json={**CHAT, "model": "/etc/passwd"}, timeout=30)
        assert passwd.status_code == 404 and "root" not in passwd.text
        assert "not a GGUF file" in passwd.json()["error"]["message"]
    finally:
        server.stop()


def test_cors_any_origin_warns_without_a_key(tiny_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--cors-origins", "*"])
    try:
        assert any("WARNING: --cors-origins '*' with no API key" in line
                   for line in server.output)
        answer = httpx.post(f"{server.api}/chat/completions", json=CHAT,
                            headers={"Origin": EVIL}, timeout=60)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == EVIL
    finally:
        server.stop()


def wait_for_log(server: ServerProcess, text: str, timeout: float = 30) -> None:
    """The server's own log line says the event happened (bounded wait)."""
    deadline = time.monotonic() + timeout
    while not any(text in line for line in server.output):
        assert time.monotonic() < deadline, f"no log line with {text!r}"
        time.sleep(0.05)


def test_api_key_file_with_several_keys_reloaded_on_sighup(tiny_gguf: Path,
                                                           tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# one per client\nkey-alice\nkey-bob\n")
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny",
                            "--api-key-file", str(key_file)])
    try:
        def works(key: str) -> bool:
            client = openai.OpenAI(base_url=server.api, api_key=key, max_retries=0)
            try:
                client.models.list()
            except openai.AuthenticationError:
                return False
            return True

        assert works("key-alice") and works("key-bob") and not works("key-carol")
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="key-bob",
                                     max_retries=0)
        assert claude.messages.create(model="tiny", max_tokens=2,
                                      messages=MESSAGES).content  # type: ignore[arg-type]
        assert httpx.get(f"{server.base_url}/health").status_code == 200  # probes stay open
        assert httpx.get(f"{server.base_url}/ready").status_code == 200
        # A preflight carries no credentials: answered without a key.
        preflight = httpx.options(f"{server.api}/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 204

        key_file.write_text("key-carol\n")
        os.kill(server.process.pid, signal.SIGHUP)
        wait_for_log(server, "reloaded --api-key-file")
        assert works("key-carol") and not works("key-alice")
        assert server.process.poll() is None  # SIGHUP reloads, it does not stop
    finally:
        server.stop()


@pytest.mark.parametrize(("content", "reason"), [("", "holds no key"),
                                                 (None, "No such file")])
def test_a_bad_key_file_stops_the_boot(tiny_gguf: Path, tmp_path: Path,
                                       content: str | None, reason: str) -> None:
    import subprocess
    import sys

    key_file = tmp_path / "keys"
    if content is not None:
        key_file.write_text(content)
    done = subprocess.run([sys.executable, "-m", "butter.cli", "serve", "--model",
                           str(tiny_gguf), "--port", "0", "--api-key-file", str(key_file)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert reason in done.stderr
