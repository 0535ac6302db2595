"""Readiness (/ready), drain on SIGTERM, /get_load and the vLLM-named metrics that routers
read (docs/scale-out.md). The router itself is in tests/test_scale_out.py."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from butter.errors import ModelLoadError, ModelNotFound, NoModelLoaded
from butter.server.holders import SwappableHolder
from butter.server.readiness import Readiness
from tests.conftest import ServerProcess

# ---------------------------------------------------------------- the checks, on fakes


@attrs.define
class FakeEngine:
    running: bool = True
    step_started: float | None = None


@attrs.define
class FakeResident:
    model_id: str
    engine: FakeEngine = attrs.Factory(FakeEngine)
    is_boot_model: bool = True

    @property
    def names(self) -> set[str]:
        return {self.model_id}


@attrs.define
class FakeBackend:
    resident: FakeResident | None
    swapping: bool = False

    @property
    def current(self) -> FakeResident:
        if self.resident is None:
            raise RuntimeError("no model is resident")
        return self.resident


def _readiness(backend: FakeBackend, stall_after: float = 60.0) -> Readiness:
    return Readiness(backend, stall_after=stall_after)  # type: ignore[arg-type]


def test_ready_only_with_a_model_whose_engine_steps() -> None:
    engine = FakeEngine()
    backend = FakeBackend(FakeResident("m", engine))
    readiness = _readiness(backend, stall_after=30.0)
    assert readiness.state().body() == {"status": "ready", "reason": "ready",
                                        "detail": "serving", "model": "m", "in_flight": 0}
    engine.step_started = time.perf_counter()  # a step in flight is normal
    assert readiness.state().ready
    engine.step_started = time.perf_counter() - 31.0
    assert readiness.state().reason == "engine_stalled"
    engine.running = False
    assert readiness.state().reason == "engine_stopped"
    backend.resident = None
    assert (readiness.state().reason, readiness.state().model) == ("no_model", None)


def test_draining_is_said_first_then_a_swap() -> None:
    backend = FakeBackend(FakeResident("m", FakeEngine(running=False)), swapping=True)
    readiness = _readiness(backend)
    assert readiness.state().reason == "swapping"
    readiness.start_draining()
    assert not readiness.state().ready
    assert readiness.state().reason == "draining"


async def test_wait_idle_returns_when_the_last_request_ends() -> None:
    readiness = _readiness(FakeBackend(FakeResident("m")))
    await readiness.wait_idle()  # none in flight: at once
    finished: list[str] = []

    async def request(name: str, done: trio.Event) -> None:
        with readiness.in_flight():
            await done.wait()
        finished.append(name)

    first, second = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "first", first)
        nursery.start_soon(request, "second", second)
        await trio.testing.wait_all_tasks_blocked()
        assert readiness.state().in_flight == 2
        first.set()
        second.set()
        await readiness.wait_idle()
        assert sorted(finished) == ["first", "second"]


@attrs.define
class FakeLoaded:
    id: str
    resident: FakeResident = attrs.field()

    @resident.default
    def _resident(self) -> FakeResident:
        return FakeResident(self.id)

    async def aclose(self, reason: str = "") -> None:
        self.resident.engine.running = False


def _backend_whose_loads_wait() -> tuple[SwappableHolder, trio.Event]:
    """A backend serving "old" whose loads finish once the event is set."""
    release = trio.Event()

    async def load(model_id: str) -> FakeLoaded:
        await release.wait()
        return FakeLoaded(model_id)

    backend = SwappableHolder(loader=load, initial=FakeLoaded("old"))  # type: ignore[arg-type]
    return backend, release


async def test_a_swap_makes_the_replica_unready_until_the_new_model_runs() -> None:
    backend, release = _backend_whose_loads_wait()
    readiness = Readiness(backend)
    assert readiness.state().ready
    async with trio.open_nursery() as nursery:
        nursery.start_soon(backend.resident_for, "new")
        await trio.testing.wait_all_tasks_blocked()
        assert readiness.state().reason == "swapping"
        release.set()
    assert (readiness.state().ready, readiness.state().model) == (True, "new")


async def test_asking_for_whichever_model_during_a_swap_waits_for_the_new_one() -> None:
    backend, release = _backend_whose_loads_wait()
    answers: list[str] = []

    async def whichever() -> None:  # what GET /v1/models and count_tokens ask
        answers.append((await backend.resident_for(None)).model_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(backend.resident_for, "new")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(whichever)
        await trio.testing.wait_all_tasks_blocked()
        assert answers == []  # neither the old model nor an error: it waits
        release.set()
    assert answers == ["new"]


async def test_a_failed_swap_and_restore_leave_no_model_until_one_loads() -> None:
    loadable = {"good"}

    async def load(model_id: str) -> FakeLoaded:
        if model_id not in loadable:
            raise ModelLoadError(f"{model_id} is gone")
        return FakeLoaded(model_id)

    backend = SwappableHolder(loader=load, initial=FakeLoaded("old"))  # type: ignore[arg-type]
    readiness = Readiness(backend)
    with pytest.raises(NoModelLoaded, match="'old' could not be reloaded"):
        await backend.resident_for("bad")
    assert readiness.state().reason == "no_model"
    with pytest.raises(NoModelLoaded):
        await backend.resident_for(None)
    with pytest.raises(ModelNotFound, match="bad is gone"):
        await backend.resident_for("bad")
    assert (await backend.resident_for("good")).model_id == "good"
    assert (readiness.state().ready, readiness.state().model) == (True, "good")


# ---------------------------------------------------------------- a real server

API_KEY = "drain-key"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _slow_request(base_url: str, body: bytes) -> socket.socket:
    """A chat request whose body is still arriving: in flight, and kept so by the test."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=30)
    connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                       b"Content-Type: application/json\r\nAuthorization: Bearer "
                       + API_KEY.encode() + b"\r\nContent-Length: "
                       + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
    return connection


def _until_in_flight(base_url: str) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{base_url}/ready", timeout=5).json()["in_flight"] < 1:
        assert time.monotonic() < deadline, "the slow request never arrived"
        time.sleep(0.02)


def _response_of(connection: socket.socket) -> tuple[int, dict[str, Any]]:
    raw = b""
    while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
        chunk = connection.recv(65536)
        if not chunk:
            break
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_sigterm_drains_probes_say_so_and_in_flight_work_finishes(tiny_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--api-key", API_KEY,
                            "--shutdown-grace", "30"])
    key = {"Authorization": f"Bearer {API_KEY}"}
    try:
        ready_before = httpx.get(f"{server.base_url}/ready", timeout=5)  # probes need no key
        body = json.dumps(CHAT).encode()
        slow = _slow_request(server.base_url, body)
        _until_in_flight(server.base_url)
        server.process.send_signal(signal.SIGTERM)
        while httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200:
            time.sleep(0.02)
        ready = httpx.get(f"{server.base_url}/ready", timeout=5)
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        models = httpx.get(f"{server.api}/models", headers=key, timeout=5)
        refused_openai = httpx.post(f"{server.api}/chat/completions", json=CHAT, headers=key,
                                    timeout=5)
        refused_anthropic = httpx.post(f"{server.api}/messages", headers=key, timeout=5,
                                       json={"model": "tiny", **CHAT})
        slow.sendall(body[5:])  # it arrived before the signal: it is served
        status, answer = _response_of(slow)
        slow.close()
        exit_code = server.process.wait(30)
    finally:
        server.stop()
    assert ready_before.status_code == 200
    assert ready.status_code == 503
    assert ready.json() == {"status": "unready", "reason": "draining",
                            "detail": "the server is shutting down", "model": "tiny",
                            "in_flight": 1}
    assert (health.status_code, health.text) == (200, "ok")
    assert models.status_code == 200  # reads still answer while it drains
    assert refused_openai.status_code == 503
    assert refused_openai.headers["Retry-After"] == "1"
    assert refused_openai.json()["error"]["code"] == "server_draining"
    assert refused_anthropic.status_code == 503  # not 529: routers retry 503
    assert refused_anthropic.headers["Retry-After"] == "1"
    assert refused_anthropic.json()["error"]["type"] == "overloaded_error"
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert exit_code == 0


# ---------------------------------------------------------------- what routers read


def _families(server: ServerProcess) -> dict[str, Any]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], name: str) -> float:
    (sample,) = [s for s in families[name].samples if s.name.endswith(("_total", name))]
    return float(sample.value)


@pytest.mark.parametrize("name", [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
])
def test_vllm_series_carry_vllms_labels(tiny_server: ServerProcess, name: str) -> None:
    (sample,) = [s for s in _families(tiny_server)[name].samples
                 if not s.name.endswith("_created")]
    assert sample.labels == {"model_name": "tiny", "engine": "0"}


def test_prefix_cache_counters_count_prompt_and_cached_tokens(tiny_server: ServerProcess
                                                              ) -> None:
    before = _families(tiny_server)
    usages = []
    for _ in range(2):  # the same prompt twice: the second reuses the first's cache
        reply = httpx.post(f"{tiny_server.api}/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "the same words, twice over"}],
            "max_tokens": 2, "temperature": 0})
        usages.append(reply.json()["usage"])
    after = _families(tiny_server)

    def moved(name: str) -> float:
        return _value(after, name) - _value(before, name)

    assert moved("vllm:prefix_cache_queries") == sum(u["prompt_tokens"] for u in usages)
    assert moved("vllm:prefix_cache_hits") == sum(u["cached_tokens"] for u in usages)
    assert moved("vllm:prefix_cache_hits") > 0
    # production-stack reads the pre-0.9 names as sample names, `_total` included.
    assert "vllm:gpu_prefix_cache_hits_total" in {
        s.name for s in after["vllm:gpu_prefix_cache_hits"].samples}
    assert moved("vllm:gpu_prefix_cache_hits") == moved("vllm:prefix_cache_hits")


def test_cache_config_gives_the_pool_in_blocks_and_load_is_idle(tiny_server: ServerProcess
                                                                 ) -> None:
    families = _families(tiny_server)
    (info,) = families["vllm:cache_config_info"].samples
    cells = httpx.get(f"{tiny_server.api}/models", timeout=10).json()["data"][0]["meta"][
        "kv_cells"]
    assert info.value == 1
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("16", str(cells // 16))
    assert _value(families, "vllm:kv_cache_usage_perc") == 0.0  # idle: nothing reserved
    assert _value(families, "vllm:num_requests_running") == 0.0
    assert httpx.get(f"{tiny_server.base_url}/get_load", timeout=10).json() == {"load": 0}


def test_session_ids_and_users_change_nothing_on_one_replica(tiny_server: ServerProcess
                                                             ) -> None:
    """What routers key affinity on is accepted and ignored: same answer, same status."""
    greedy = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 6,
              "temperature": 0}
    sticky = {"X-Session-ID": "conversation-1", "X-User-ID": "user-1"}
    answers = [
        httpx.post(f"{tiny_server.api}/chat/completions", json=body, headers=headers,
                   timeout=30).json()["choices"][0]["message"]["content"]
        for body, headers in [(greedy, {}), ({**greedy, "user": "user-1"}, sticky)]
    ]
    messages = [
        httpx.post(f"{tiny_server.api}/messages", json=body, headers=headers,
                   timeout=30).json()["content"]
        for body, headers in [({"model": "tiny", **greedy}, {}),
                              ({"model": "tiny", **greedy,
                                "metadata": {"user_id": "user-1"}}, sticky)]
    ]
    assert answers[0] == answers[1]
    assert messages[0] == messages[1]
