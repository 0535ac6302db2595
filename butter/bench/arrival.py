"""`serve-bench --long-arrival TOKENS`: one long prompt arrives while sessions stream.

C sessions stream long answers (each sends its next request as soon as one ends, so C
streams run throughout). Once every session has output and `settle` seconds passed, one
request with a unique prompt of about TOKENS tokens and a short answer is sent. The
sessions' output rate before it, during its prefill (its send to its first token) and
after, and the sessions that received nothing during the prefill, show whether a server
keeps decoding while it prefills (chunked prefill) or stalls everyone.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio

from butter.bench.client import BenchConfig, sampling_fields, server_info, stream_chat
from butter.bench.metrics import ArrivalMarks, Timeline

SESSION_TASK = (
    "{marker}: write a long, detailed story about a lighthouse keeper, a storm and a lost "
    "ship, in many paragraphs, starting with that tag."
)
LONG_QUESTION = "\n\nIn one sentence: what is the text above about?"
# Common words: random sequences of them cost about one token per word on real
# tokenizers; the count is calibrated against the server's usage anyway.
WORDS = (
    "the of and to in is was for that with as on by at from his her they this which "
    "are be had not but have one were all there when their more will would can been "
    "into time only new some could these two may first then do any like my now over "
    "such our man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three house river window "
    "garden market winter letter engine harbor valley silver paper morning evening "
    "station bridge village mountain forest kitchen doctor teacher captain lantern"
).split()
PROBE_CHARS = 4000
FALLBACK_CHARS_PER_TOKEN = 4.0
ERROR_BACKOFF_S = 0.2


@attrs.frozen
class ArrivalConfig:
    tokens: int  # the long prompt's size, about
    max_tokens: int = 16  # the long request's answer
    settle: float = 1.0  # seconds between every session's first output and the arrival
    after: float = 2.0  # seconds measured after the long request's first token


@attrs.define
class ArrivalRun:
    """One level's raw record: each session's requests, the long request, the moments."""

    sessions: list[list[Timeline]]
    long: Timeline
    marks: ArrivalMarks


def filler_text(chars: int, rng: random.Random) -> str:
    """About `chars` characters of word salad in sentences, unique per `rng`."""
    words: list[str] = []
    size = 0
    while size < chars:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
        text = " ".join(sentence).capitalize() + "."
        words.append(text)
        size += len(text) + 1
    return " ".join(words)[:max(chars, 0)]


async def prompt_tokens(client: httpx.AsyncClient, config: BenchConfig, text: str) -> int | None:
    """The server's usage.prompt_tokens for one user message (a one-token answer)."""
    payload = {**sampling_fields(config), "stream": False, "max_tokens": 1,
               "messages": [{"role": "user", "content": text}]}
    payload.pop("stream_options")
    try:
        with trio.fail_after(config.timeout):
            response = await client.post(f"{config.base_url}/chat/completions", json=payload)
        usage = response.json().get("usage") or {}
        value = usage.get("prompt_tokens")
    except (httpx.HTTPError, trio.TooSlowError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and response.status_code == 200 else None


async def calibrate(
    client: httpx.AsyncClient, config: BenchConfig, target: int
) -> tuple[float, int]:
    """(characters per token of filler text, tokens of an almost empty prompt) on this
    server's tokenizer and template, from two probes; chars/4 if it reports no usage."""
    rng = random.Random(secrets.randbits(64))
    sample = min(PROBE_CHARS, max(400, target * 2))
    marker = secrets.token_hex(8)
    base = await prompt_tokens(client, config, marker)
    full = await prompt_tokens(client, config, f"{marker} {filler_text(sample, rng)}")
    if base is None or full is None or full <= base:
        return FALLBACK_CHARS_PER_TOKEN, base or 0
    return sample / (full - base), base


def long_messages(target: int, chars_per_token: float, base: int) -> list[dict[str, str]]:
    marker = secrets.token_hex(8)  # first, so that nothing of it can be cached
    rng = random.Random(secrets.randbits(64))
    chars = int(max(target - base - 12, 1) * chars_per_token)
    return [{"role": "user", "content": f"{marker} {filler_text(chars, rng)}{LONG_QUESTION}"}]


async def session(
    client: httpx.AsyncClient, config: BenchConfig, lane: int, out: list[Timeline],
    started: trio.Event, stop: trio.Event,
) -> None:
    """One session: long answers back to back until `stop`; `started` is set at its
    first output."""
    url = f"{config.base_url}/chat/completions"
    number = 0
    while not stop.is_set():
        timeline = Timeline(lane=lane, wave=number,
                            marker=f"{secrets.token_hex(4)}-s{lane}r{number}")
        out.append(timeline)
        payload = {**sampling_fields(config), "max_tokens": config.max_tokens,
                   "messages": [{"role": "user",
                                 "content": SESSION_TASK.format(marker=timeline.marker)}]}
        await stream_chat(client, url, payload, timeline, config.timeout, started)
        if not timeline.ok:
            await trio.sleep(ERROR_BACKOFF_S)
        number += 1


def _first_outputs(sessions: list[list[Timeline]]) -> float:
    """When the last session received its first output."""
    return max(min(t.first_token for t in s if t.first_token is not None) for s in sessions)


async def _sleep_perf(until: float) -> None:
    await trio.sleep(max(0.0, until - time.perf_counter()))


async def arrival_level(
    client: httpx.AsyncClient, config: BenchConfig, arrival: ArrivalConfig, level: int,
    calibration: tuple[float, int], on_phase: Callable[[str], None],
) -> ArrivalRun:
    sessions: list[list[Timeline]] = [[] for _ in range(level)]
    long = Timeline(lane=level, wave=0, marker="long", long_prompt=True)
    stop = trio.Event()
    started = [trio.Event() for _ in range(level)]
    messages = long_messages(arrival.tokens, *calibration)
    async with trio.open_nursery() as nursery:
        for lane in range(level):
            nursery.start_soon(session, client, config, lane, sessions[lane], started[lane],
                               stop)
        on_phase(f"c={level}: waiting for every session's first token")
        try:
            with trio.fail_after(config.timeout):
                for event in started:
                    await event.wait()
        except trio.TooSlowError:
            stop.set()
            long.error = f"not sent: a session had no output after {config.timeout:.0f} s"
            now = time.perf_counter()
            return ArrivalRun(sessions, long, ArrivalMarks(now, now, now))
        all_first = _first_outputs(sessions)
        await _sleep_perf(all_first + arrival.settle)
        on_phase(f"c={level}: long prompt sent (~{arrival.tokens} tokens)")
        payload = {**sampling_fields(config), "max_tokens": arrival.max_tokens,
                   "messages": messages}
        await stream_chat(client, f"{config.base_url}/chat/completions", payload, long,
                          config.timeout)
        prefill_end = long.first_token if long.first_token is not None else long.end
        on_phase(f"c={level}: measuring {arrival.after:.0f} s after the prefill")
        await _sleep_perf(prefill_end + arrival.after)
        stop.set()
        on_phase(f"c={level}: waiting for the sessions' last answers")
    return ArrivalRun(sessions, long, ArrivalMarks(all_first, long.start,
                                                   prefill_end + arrival.after))


async def run_arrival(
    config: BenchConfig, arrival: ArrivalConfig, on_phase: Callable[[str], None]
) -> tuple[dict[str, Any], tuple[float, int], dict[int, ArrivalRun]]:
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    async with httpx.AsyncClient(timeout=config.timeout, limits=limits) as client:
        info = await server_info(client, config)
        on_phase("calibrating characters per token")
        calibration = await calibrate(client, config, arrival.tokens)
        runs = {
            level: await arrival_level(client, config, arrival, level, calibration, on_phase)
            for level in config.concurrency
        }
    return info, calibration, runs
