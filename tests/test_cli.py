"""Boot behaviour of `butter serve`: clear one-line failures, real shutdown on signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import ServerProcess


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "butter.cli", "serve", "--port", "0", *args],
        capture_output=True, text=True, timeout=60,
    )


def test_missing_model_fails_with_one_line(tmp_path: Path) -> None:
    result = _serve("--model", str(tmp_path / "nope.gguf"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "not found" in result.stderr


def test_not_a_gguf_fails_with_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not a model")
    result = _serve("--model", str(fake))
    assert result.returncode == 1
    assert "not a GGUF" in result.stderr and "Traceback" not in result.stderr


def test_truncated_gguf_fails_with_one_line(tmp_path: Path, tiny_gguf: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[:5000])
    result = _serve("--model", str(broken))
    assert result.returncode == 1
    assert "could not load" in result.stderr and "Traceback" not in result.stderr


def test_bad_chat_template_flag(tiny_gguf: Path) -> None:
    result = _serve("--model", str(tiny_gguf), "--chat-template", "no-such-template")
    assert result.returncode == 2
    assert "chat-template" in result.stderr


def test_sigterm_shuts_down_cleanly(tiny_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf)])
    assert httpx.get(f"{server.base_url}/health").text == "ok"
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0


def test_shutdown_finishes_streams_and_does_not_wait_for_idle_connections(
        tiny_gguf: Path) -> None:
    grace = 30.0
    server = ServerProcess(["--model", str(tiny_gguf), "--shutdown-grace", str(grace)])
    with httpx.Client(base_url=server.api, timeout=60) as idle, \
            httpx.Client(base_url=server.api, timeout=60) as streaming:
        assert idle.get("/models").status_code == 200  # leaves a keep-alive connection open
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100,
                "stream": True}  # (a long stream is not the point: it is slow on a busy CPU)
        with streaming.stream("POST", "/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            started = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]  # the stream in flight runs to its end
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in "".join(rest)
        assert server.process.wait(grace) == 0
        # Not held until the grace deadline by the idle keep-alive connection.
        assert time.monotonic() - started < grace / 2


def test_access_flags_and_the_warnings_the_banner_gives() -> None:
    from butter.cli import access_warnings, build_parser, settings_from_args
    from butter.server.access import ApiKeys

    args = build_parser().parse_args([
        "serve", "--model", "m", "--allowed-hosts", "a.lan, b.lan", "--allowed-hosts", "c",
        "--cors-origins", "https://ui.example", "--allow-model-paths"])
    settings = settings_from_args(args)
    assert settings.allowed_hosts == ("a.lan", "b.lan", "c")
    assert settings.cors_origins == ("https://ui.example",)
    assert settings.allow_model_paths
    defaults = settings_from_args(build_parser().parse_args(["serve", "--model", "m"]))
    assert (defaults.allowed_hosts, defaults.cors_origins) == ((), ())
    assert not defaults.allow_model_paths
    assert access_warnings(defaults, ApiKeys()) == []  # loopback, no key: fine
    exposed = settings_from_args(build_parser().parse_args(
        ["serve", "--model", "m", "--host", "0.0.0.0", "--cors-origins", "*"]))
    warnings = access_warnings(exposed, ApiKeys())
    assert len(warnings) == 2 and "0.0.0.0" in warnings[0] and "'*'" in warnings[1]
    assert access_warnings(exposed, ApiKeys(["key"])) == []


def test_the_flag_reference_is_the_parsers_own() -> None:
    """docs/flags.md is written from the parsers; regenerate it when a flag changes:
    python -m butter.flags_doc > docs/flags.md"""
    from butter.flags_doc import flags_markdown

    written = (Path(__file__).parent.parent / "docs" / "flags.md").read_text("utf-8")
    assert written == flags_markdown(), "docs/flags.md is stale: python -m butter.flags_doc"
    assert "`--api-key-file`" in written and "`--interleave`" in written
    assert "### Access" in written  # serve's argument groups are its sub-headings
