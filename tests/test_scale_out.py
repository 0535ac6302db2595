"""Two butter replicas behind vllm-router (from PyPI), all on 127.0.0.1 (docs/scale-out.md).

- Affinity: 8 conversations of 4 turns, full history resent, through `consistent_hash`
  keyed by X-Session-ID, then through `round_robin`: the share of the prompt that the
  replicas' caches cover from turn 2 on, for both.
- Failover: a replica is killed mid-run; its streams fail at once, every later request
  succeeds on the other.
- Drain: SIGTERM to a replica under load; it turns unready, finishes its streams, and
  the requests sent meanwhile are served by the other.

The router is configured as docs/scale-out.md recommends: it health-checks /ready every
second and opens a replica's circuit on its first 5xx, so a retry goes elsewhere.
The figures are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from butter.server.readiness import READY_PATH
from tests.conftest import ServerProcess

MODEL = "gemma-3-270m"  # the demo GGUF
REPLICA_ARGS = ["--model", MODEL, "--threads", "1", "--parallel", "8", "--max-context", "1024",
                "--kv-pool", "4096", "--shutdown-grace", "30"]
ROUTER_FLAGS = [
    "--health-check-endpoint", READY_PATH, "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1", "--health-success-threshold", "1",
    "--cb-failure-threshold", "1", "--cb-success-threshold", "1",
    "--cb-timeout-duration-secs", "2",
    "--retry-max-retries", "4", "--retry-initial-backoff-ms", "100",
    "--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1",
    "--log-level", "warning",
]
ROUTER_BOOT_S = 60.0
REQUEST_TIMEOUT_S = 60.0
TEST_DEADLINE_S = 120.0  # every scenario ends well before; this only stops a hang

CONVERSATIONS, TURNS, CONTEXT_WORDS = 8, 4, 180
WORDS = ("apple river stone cloud garden window silver market yellow engine bridge candle "
         "forest mirror ocean pepper rocket saddle tunnel violin").split()
FOLLOW_UPS = ("Go on.", "And then?", "Say more.")

SESSIONS_PER_REPLICA = 4
STREAM_PROMPT = "Count from 1 to 200: 1, 2, 3, 4,"  # runs to max_tokens at temperature 0
STREAM_TOKENS = 40


@pytest.fixture(scope="module")
def router_binary() -> str:
    path = (shutil.which("vllm-router", path=str(Path(sys.executable).parent))
            or shutil.which("vllm-router"))
    if path is None:
        pytest.skip("vllm-router is not installed (`pip install vllm-router`; the test extra "
                    "installs it on Linux, the only platform it ships wheels for)")
    probe = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"vllm-router does not run here: {probe.stderr.strip()[-300:]}")
    return path


@pytest.fixture
def replicas(router_binary: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two fresh replicas (booted only where the router runs: else the test skips)."""
    first = ServerProcess(REPLICA_ARGS)
    try:
        second = ServerProcess(REPLICA_ARGS)
    except BaseException:
        first.stop()
        raise
    yield first, second
    for replica in (first, second):
        replica.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RouterProcess:
    """vllm-router on 127.0.0.1 in front of `workers`, with its log in `log`."""

    def __init__(self, binary: str, policy: str, workers: list[str], log: Path) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        command = [binary, "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                   "--policy", policy, "--worker-urls", *workers, *ROUTER_FLAGS]
        with log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        """It listens once its workers' health checks pass."""
        deadline = time.monotonic() + ROUTER_BOOT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vllm-router did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def start_router(router_binary: str, tmp_path: Path) -> Iterator[Any]:
    started: list[RouterProcess] = []

    def start(policy: str, replicas: tuple[ServerProcess, ...]) -> RouterProcess:
        router = RouterProcess(router_binary, policy, [r.base_url for r in replicas],
                               tmp_path / f"router-{policy}-{len(started)}.log")
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


async def _chat(client: httpx.AsyncClient, url: str, session: str,
                messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/chat/completions", headers={"X-Session-ID": session},
                                 json={"model": MODEL, "messages": messages,
                                       "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


# ---------------------------------------------------------------- affinity


@attrs.frozen
class CacheCover:
    prompt_tokens: int  # turns 2..4 of every conversation
    cached_tokens: int
    lowest: float  # the least-covered single request

    @property
    def ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens


async def _converse(url: str, tag: str) -> CacheCover:
    """CONVERSATIONS conversations at once, TURNS turns each, the whole history resent;
    each opens with its own text, so only its own earlier turns can be in a cache."""
    covers: list[tuple[int, int]] = []

    async def conversation(client: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(f"{tag}-{index}")
        history = [{"role": "user",
                    "content": " ".join(rng.choice(WORDS) for _ in range(CONTEXT_WORDS))}]
        for turn in range(TURNS):
            body = await _chat(client, url, f"{tag}-{index}", history, max_tokens=8)
            if turn:
                usage = body["usage"]
                covers.append((usage["prompt_tokens"],
                               usage["prompt_tokens_details"]["cached_tokens"]))
            history += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                        {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client, trio.open_nursery() as n:
        for index in range(CONVERSATIONS):
            n.start_soon(conversation, client, index)
    return CacheCover(prompt_tokens=sum(p for p, _ in covers),
                      cached_tokens=sum(c for _, c in covers),
                      lowest=min(c / p for p, c in covers))


async def test_consistent_hash_keeps_each_conversation_on_its_cache(
    replicas: tuple[ServerProcess, ServerProcess], start_router: Any,
) -> None:
    sticky, rotating = start_router("consistent_hash", replicas), start_router("round_robin",
                                                                               replicas)
    for router in (sticky, rotating):
        await trio.to_thread.run_sync(router.wait_ready)
    with trio.fail_after(TEST_DEADLINE_S):
        by_session = await _converse(sticky.url, "sticky")
        by_turn = await _converse(rotating.url, "rotating")
    requests = CONVERSATIONS * (TURNS - 1)
    print(f"\n{requests} requests of turns 2-{TURNS}, {by_session.prompt_tokens / requests:.0f} "
          f"prompt tokens on average")
    print(f"cached share of turns 2-{TURNS}: consistent_hash {by_session.ratio:.3f} "
          f"(lowest request {by_session.lowest:.3f}), round_robin {by_turn.ratio:.3f} "
          f"(lowest {by_turn.lowest:.3f})")
    assert by_session.ratio >= 0.9, by_session
    assert by_session.ratio > by_turn.ratio, (by_session, by_turn)


# ---------------------------------------------------------------- failover and drain


@attrs.define
class StreamEnd:
    complete: bool  # a finish_reason and [DONE] arrived
    ended: float  # time.monotonic()
    error: str | None = None


async def _balanced_sessions(url: str, replicas: tuple[ServerProcess, ...]
                             ) -> dict[str, ServerProcess]:
    """SESSIONS_PER_REPLICA session ids that the router sends to each replica, found by
    sending one request per candidate id, in turn, and seeing whose request count moved."""
    placed: dict[str, ServerProcess] = {}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for candidate in range(64):
            session = f"session-{candidate}"
            before = [await _done(client, r) for r in replicas]
            await _chat(client, url, session, [{"role": "user", "content": "Hi"}], max_tokens=1)
            after = [await _done(client, r) for r in replicas]
            (moved,) = [r for r, b, a in zip(replicas, before, after, strict=True) if a > b]
            if len(_sessions_on(placed, moved)) < SESSIONS_PER_REPLICA:
                placed[session] = moved
            if len(placed) == SESSIONS_PER_REPLICA * len(replicas):
                return placed
    raise AssertionError(f"64 session ids never reached both replicas: {placed}")


async def _done(client: httpx.AsyncClient, replica: ServerProcess) -> int:
    stats = (await client.get(f"{replica.api}/server")).json()["engine"]
    return int(stats["requests_done"])


async def _stream(client: httpx.AsyncClient, url: str, session: str,
                  ends: dict[str, StreamEnd]) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": STREAM_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": STREAM_PROMPT}]}
    lines: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"X-Session-ID": session}) as response:
            async for line in response.aiter_lines():
                lines.append(line)
    except httpx.HTTPError as exc:
        ends[session] = StreamEnd(False, time.monotonic(), repr(exc))
        return
    ends[session] = StreamEnd(_finished(lines) and "data: [DONE]" in lines, time.monotonic())


def _finished(lines: list[str]) -> bool:
    """A chunk carries a finish_reason (a chunk cut short is no chunk)."""
    for line in lines:
        if not line.startswith("data: {"):
            continue
        try:
            chunk = json.loads(line.removeprefix("data: "))
        except json.JSONDecodeError:
            return False
        if any(choice.get("finish_reason") for choice in chunk["choices"]):
            return True
    return False


async def _until_running(replica: ServerProcess) -> None:
    """Until the replica generates, read as a router reads it: vllm:num_requests_running."""
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            if _running((await client.get(f"{replica.base_url}/metrics")).text) >= 1:
                return
            await trio.sleep(0.05)


def _running(metrics: str) -> float:
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("vllm:num_requests_running{")]
    return value


def _sessions_on(placed: dict[str, ServerProcess], replica: ServerProcess) -> list[str]:
    return [session for session, where in placed.items() if where is replica]


async def test_killed_replica_fails_its_streams_and_the_other_serves_the_rest(
    replicas: tuple[ServerProcess, ServerProcess], start_router: Any,
) -> None:
    router = start_router("consistent_hash", replicas)
    await trio.to_thread.run_sync(router.wait_ready)
    victim, survivor = replicas
    ends: dict[str, StreamEnd] = {}
    later: list[int] = []
    with trio.fail_after(TEST_DEADLINE_S):
        placed = await _balanced_sessions(router.url, replicas)
        # Its sessions first: the router has not noticed the kill when they arrive.
        order = _sessions_on(placed, victim) + _sessions_on(placed, survivor)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client, \
                trio.open_nursery() as nursery:
            for session in placed:
                nursery.start_soon(_stream, client, router.url, session, ends)
            await _until_running(victim)
            victim.process.kill()
            killed_at = time.monotonic()
            for session in order:
                body = await _chat(client, router.url, session,
                                   [{"role": "user", "content": "Hello"}], max_tokens=2)
                later.append(len(body["choices"]))
    on_victim = [ends[s] for s in _sessions_on(placed, victim)]
    print(f"\nfailover: {sum(not e.complete for e in on_victim)} of {len(on_victim)} streams "
          f"on the killed replica failed ({on_victim[0].error}); {len(later)} later requests "
          f"all answered")
    assert all(ends[s].complete for s in _sessions_on(placed, survivor))
    # The victim's streams that were still running fail visibly: none looks complete.
    assert all(not e.complete or e.ended < killed_at for e in on_victim)
    assert any(not e.complete for e in on_victim)
    assert later == [1] * len(placed)  # raise_for_status passed for each; the victim is dead


@attrs.define
class ReadyWatch:
    """/ready's answers, polled until the replica stops listening."""

    seen: list[tuple[int, str]] = attrs.Factory(list)
    answered: trio.Event = attrs.Factory(trio.Event)
    draining: trio.Event = attrs.Factory(trio.Event)

    async def run(self, replica: ServerProcess) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                try:
                    response = await client.get(f"{replica.base_url}{READY_PATH}")
                except httpx.TransportError:
                    return
                self.seen.append((response.status_code, response.json()["reason"]))
                self.answered.set()
                if self.seen[-1] == (503, "draining"):
                    self.draining.set()
                await trio.sleep(0.05)


async def test_sigterm_drains_a_replica_while_the_router_moves_new_requests(
    replicas: tuple[ServerProcess, ServerProcess], start_router: Any,
) -> None:
    router = start_router("consistent_hash", replicas)
    await trio.to_thread.run_sync(router.wait_ready)
    victim = replicas[1]
    ends: dict[str, StreamEnd] = {}
    watch = ReadyWatch()
    later: list[int] = []
    with trio.fail_after(TEST_DEADLINE_S):
        placed = await _balanced_sessions(router.url, replicas)  # streams on each
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client, \
                trio.open_nursery() as nursery:
            for session in placed:
                nursery.start_soon(_stream, client, router.url, session, ends)
            await _until_running(victim)
            nursery.start_soon(watch.run, victim)
            await watch.answered.wait()  # a first answer, from before the signal
            victim.process.send_signal(signal.SIGTERM)
            await watch.draining.wait()
            health = (await client.get(f"{victim.base_url}/health")).status_code
            # Sent while it drains, which refuses all new work (or once it has exited):
            # a 200 came from the other replica.
            async with trio.open_nursery() as sending:
                for session in placed:
                    sending.start_soon(_answered, client, router.url, session, later)
            refused = await _refused(client, victim)
    exit_code = await trio.to_thread.run_sync(victim.process.wait, 30)
    seen = watch.seen
    print(f"\ndrain: /ready went {_changes(seen)}; {refused} requests refused with 503 and "
          f"retried by the router; {len(later)} later requests all answered; exit {exit_code}")
    assert health == 200  # liveness is not readiness
    assert all(end.complete for end in ends.values())  # its in-flight streams finished too
    assert later == [1] * len(placed)
    first_draining = seen.index((503, "draining"))
    assert seen[:first_draining] == [(200, "ready")] * first_draining
    assert set(seen[first_draining:]) == {(503, "draining")}
    assert exit_code == 0


async def _answered(client: httpx.AsyncClient, url: str, session: str, later: list[int]
                   ) -> None:
    body = await _chat(client, url, session, [{"role": "user", "content": "Hello"}],
                       max_tokens=2)
    later.append(len(body["choices"]))


async def _refused(client: httpx.AsyncClient, replica: ServerProcess) -> str:
    """Chat completions it answered 503, from butter_requests_total, for the report."""
    try:
        metrics = (await client.get(f"{replica.base_url}/metrics")).text
    except httpx.TransportError:
        return "? (it had exited)"
    return str(sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
                   if line.startswith('butter_requests_total{route="/v1/chat/completions"')
                   and 'status="503"' in line))


def _changes(seen: list[tuple[int, str]]) -> str:
    states = [f"{status} {reason}" for status, reason in seen]
    return " -> ".join(s for i, s in enumerate(states) if i == 0 or states[i - 1] != s)
