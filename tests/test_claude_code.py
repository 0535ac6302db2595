"""Claude Code, unmodified, against a real `butter serve` (issue #16).

The pinned npm package is installed once into a cache outside the repository; the demo
model is served with a context that holds Claude Code's whole prompt (system prompt,
environment reminder and a dozen tool schemas: ~12k tokens through butter's tool
preamble); two print-mode turns run with a scratch HOME (`-p`, then `--continue`), and
the second turn must find the first turn's prompt in the KV cache.

Claude Code talks to the server named by ANTHROPIC_BASE_URL only; with
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 a print-mode turn is one streamed
`POST /v1/messages?beta=true` (plus up to three "resume" requests when the answer hits
CLAUDE_CODE_MAX_OUTPUT_TOKENS, which the demo base model nearly always does), and nothing
reaches the internet. About 100 s on 2 cores, nearly all of it the first turn's prefill.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from butter.testing.tiny_mmproj import write_tiny_mmproj_gguf
from tests.conftest import ServerProcess

CLAUDE_CODE_VERSION = "2.1.332"
PACKAGE = f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"
CACHE_DIR = Path(os.environ.get("BUTTER_TEST_CACHE", Path.home() / ".cache" / "butter-tests"))
INSTALL_DIR = CACHE_DIR / f"claude-code-{CLAUDE_CODE_VERSION}"
INSTALL_TIMEOUT_S = 600

MODEL = "gemma-3-270m"
DEMO_WIDTH = 640  # the demo model's n_embd: a projector's output must match it
# Claude Code's first request renders to ~12k tokens on the demo model (measured with
# 2.1.332, default tools); 32768 leaves room for a few turns.
MAX_CONTEXT = 32768
MAX_OUTPUT_TOKENS = 32
# One turn: the first prefills ~12k tokens (~40-120 s on 2 cores, depending on load).
TURN_TIMEOUT_S = 480
CACHED_FRACTION = 0.9

# butter's request log (logger `butter.requests`), one line per finished request.
REQUEST_LINE = re.compile(
    r"/v1/messages\b.*?\bfinish=(\S+) prompt=(\d+) cached=(\d+) completion=(\d+)")


# ---------------------------------------------------------------- installing Claude Code

def _version_of(binary: Path, home: Path) -> str:
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                              timeout=60, env=_client_env(home))
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _installed_binary(prefix: Path, home: Path) -> Path | None:
    """The runnable `claude` in an npm prefix: the package's bin (the postinstall puts the
    native binary there), else the platform package's own binary."""
    modules = prefix / "node_modules"
    candidates = [modules / ".bin" / "claude",
                  *sorted(modules.glob("@anthropic-ai/claude-code-*/claude"))]
    for candidate in candidates:
        if candidate.is_file() and _version_of(candidate, home).startswith(CLAUDE_CODE_VERSION):
            return candidate
    return None


@pytest.fixture(scope="session")
def claude_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned Claude Code binary, installed with npm on first use."""
    home = tmp_path_factory.mktemp("claude-version-home")
    binary = _installed_binary(INSTALL_DIR, home)
    if binary is not None:
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: cannot install {PACKAGE} into {INSTALL_DIR}")
    # Install beside the final folder and rename, so an interrupted install never looks
    # like a finished one.
    staging = INSTALL_DIR.with_name(f"{INSTALL_DIR.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    command = [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", PACKAGE]
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.skip(f"`npm install {PACKAGE}` did not finish within {INSTALL_TIMEOUT_S} s "
                    "(npm registry unreachable?)")
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.skip(f"`npm install {PACKAGE}` failed with exit status {done.returncode} "
                    f"(npm registry unreachable?):\n{(done.stdout + done.stderr)[-2000:]}")
    shutil.rmtree(INSTALL_DIR, ignore_errors=True)
    staging.rename(INSTALL_DIR)
    binary = _installed_binary(INSTALL_DIR, home)
    if binary is None:
        pytest.fail(f"npm installed {PACKAGE} into {INSTALL_DIR}, but no `claude` there runs "
                    f"and reports version {CLAUDE_CODE_VERSION}:\n{done.stdout[-2000:]}")
    return binary


# ---------------------------------------------------------------- running it

def _client_env(home: Path, base_url: str = "http://127.0.0.1:9") -> dict[str, str]:
    """A clean environment: nothing from the caller's Claude Code setup leaks in, and all
    state stays under the scratch HOME."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": "butter-ignores-this",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        # A server error fails the turn at once instead of after ten backed-off retries.
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }


class Logged(NamedTuple):
    """One /v1/messages request as butter logged it."""

    finish: str
    prompt: int
    cached: int
    completion: int


class Turn(NamedTuple):
    result: dict[str, Any]  # Claude Code's JSON result
    requests: list[Logged]  # what butter served during the turn, in order
    seconds: float


def _request_lines(server: ServerProcess, start: int) -> list[Logged]:
    found = []
    for line in server.output[start:]:
        match = REQUEST_LINE.search(line)
        if match:
            finish, *counts = match.groups()
            found.append(Logged(finish, *map(int, counts)))
    return found


def _run_turn(claude: Path, server: ServerProcess, home: Path, project: Path,
              prompt: str, *flags: str) -> Turn:
    log_start = len(server.output)
    command = [str(claude), "-p", prompt, "--max-turns", "1", "--output-format", "json",
               *flags]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=project, capture_output=True, text=True,
                              timeout=TURN_TIMEOUT_S, env=_client_env(home, server.base_url))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"claude {' '.join(command[1:])} ran past {TURN_TIMEOUT_S} s\n"
                    f"stderr: {exc.stderr!r}\nserver log:\n{_tail(server)}")
    seconds = time.monotonic() - started
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"claude exited {done.returncode} without a JSON result\nstdout: "
                    f"{done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}\n"
                    f"server log:\n{_tail(server)}")
    # The request log line is written when the response ends; give the drain a moment.
    deadline = time.monotonic() + 10
    requests = _request_lines(server, log_start)
    while not requests and time.monotonic() < deadline:
        time.sleep(0.1)
        requests = _request_lines(server, log_start)
    return Turn(result, requests, seconds)


def _tail(server: ServerProcess, lines: int = 40) -> str:
    return "".join(server.output[-lines:])


def _check_answered(turn: Turn, server: ServerProcess, what: str) -> str:
    """No HTTP error and a turn that ended for a reason the model, not the server, gave.

    The demo model is a base model: it rarely ends its turn by itself, so a turn often
    ends at CLAUDE_CODE_MAX_OUTPUT_TOKENS. Claude Code reports that as an error of its own
    (`api_error: max_output_tokens`, after asking the model to resume up to three more
    times, each a request of its own); it is a correct answer from butter all the same.
    """
    result = turn.result
    context = f"{what}: {json.dumps(result)[:3000]}\nserver log:\n{_tail(server)}"
    assert result.get("type") == "result", context
    assert result.get("api_error_status") is None, context
    assert turn.requests, f"{what}: butter logged no /v1/messages request\n{context}"
    if result.get("is_error") is False:
        assert result.get("subtype") == "success", context
        return "answered"
    if result.get("api_error") == "max_output_tokens":
        assert all(r.finish == "length" and r.completion == MAX_OUTPUT_TOKENS
                   for r in turn.requests), context
        return "ran out of output tokens"
    # The model may answer with a tool call in the format butter's tool preamble
    # teaches; with --max-turns 1 Claude Code then stops before running the tool. Or the
    # call is cut by the output limit: Claude Code sends another request and stops on the
    # turn limit with stop_reason max_tokens (which path the base model takes changes with
    # the scratch directory's name in the prompt).
    assert result.get("subtype") == "error_max_turns", context
    if result.get("stop_reason") == "max_tokens":
        assert all(r.finish == "length" and r.completion == MAX_OUTPUT_TOKENS
                   for r in turn.requests), context
        return "called a tool, cut by the output limit"
    assert result.get("stop_reason") == "tool_use", context
    return "called a tool"


# ---------------------------------------------------------------- the test

@pytest.fixture(scope="module")
def claude_server(claude_code: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    # One session: Claude Code runs one request at a time, and the whole KV pool then
    # holds the conversation's cache. A random-weight projector as wide as the demo model
    # lets it take the pictures Claude Code sends (#55).
    projector = write_tiny_mmproj_gguf(tmp_path_factory.mktemp("mmproj") / "mmproj-640.gguf",
                                       n_embd_text=DEMO_WIDTH)
    server = ServerProcess(["--model", MODEL, "--max-context", str(MAX_CONTEXT),
                            "--mmproj", str(projector)])
    try:
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        yield server
    finally:
        server.stop()


def test_claude_code_two_turns_reuse_the_prefix(
    claude_code: Path, claude_server: ServerProcess, tmp_path: Path
) -> None:
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()

    first = _run_turn(claude_code, claude_server, home, project, "Say hi.")
    first_outcome = _check_answered(first, claude_server, "first turn")
    first_prompt = first.requests[0].prompt
    assert first_prompt > 2000, f"a suspiciously short prompt for Claude Code: {first.requests}"

    second = _run_turn(claude_code, claude_server, home, project, "Now say bye.",
                       "--continue")
    second_outcome = _check_answered(second, claude_server, "second turn (--continue)")
    assert second.result.get("session_id") == first.result.get("session_id"), (
        "--continue started a new conversation instead of continuing the first")
    # The main model's requests carry the whole conversation, so each is longer than the
    # first turn's first request; a side request (a title, a quota check on the small
    # model) would have a short prompt of its own and is not held to the cache check.
    main = [r for r in second.requests if r.prompt > first_prompt]
    assert main, f"no request of the second turn continues the first: {second.requests}"
    for request in main:
        assert request.cached >= CACHED_FRACTION * request.prompt, (
            f"a request of the second turn reused {request.cached} of {request.prompt} "
            f"prompt tokens (first turn: {first.requests}, second: {second.requests}); "
            f"Claude Code saw usage {second.result.get('usage')}")
    print(f"\nClaude Code {CLAUDE_CODE_VERSION} on butter: first turn {first.seconds:.1f} s, "
          f"{first_outcome}: {first.requests}\nsecond turn {second.seconds:.1f} s, "
          f"{second_outcome}: {second.requests}", file=sys.stderr)


def test_claude_code_sends_a_picture_and_the_turn_is_answered(
    claude_code: Path, claude_server: ServerProcess, tmp_path: Path
) -> None:
    """A picture in the working directory, named in the prompt: Claude Code reads it and
    sends it as an image (in a tool result), and the model, served with a projector,
    sees it: the turn is answered and the projector encoded an image."""
    from PIL import Image

    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    Image.new("RGB", (64, 48), (30, 120, 200)).save(project / "shot.png")
    before = _encoded_images(claude_server)
    turn = _run_turn(claude_code, claude_server, home, project,
                     "What colour is the picture @shot.png?")
    _check_answered(turn, claude_server, "a turn with a picture")
    assert _encoded_images(claude_server) > before, (
        f"no image reached the projector: {turn.requests}\n{_tail(claude_server)}")


def _encoded_images(server: ServerProcess) -> int:
    info = httpx.get(f"{server.api}/server", timeout=10).json()
    projector = info["model"]["meta"]["projector"]
    assert projector is not None, info["model"]
    return int(projector["encoded_images"])
