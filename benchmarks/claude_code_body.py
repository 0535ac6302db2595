#!/usr/bin/env python3
"""Capture Claude Code's real first request: the body of the `POST /v1/messages` that a
print-mode turn of the pinned CLI sends (its system prompt, environment reminder, tool
schemas and the user's words), for benchmarks that replay it (cold_prefill.py
--claude-code).

The CLI is the one tests/test_claude_code.py installs (npm, @anthropic-ai/claude-code at
its pinned version, under ~/.cache/butter-tests). It runs with a scratch HOME in a scratch
project against a loopback endpoint that records the first request and answers it with an
error, so the turn ends at once and nothing leaves the machine. The body is written as it
came, and is not kept in the repository (it is Anthropic's text)::

    python benchmarks/claude_code_body.py --out /tmp/claude-code-body.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

CLAUDE_CODE_VERSION = "2.1.332"  # (tests/test_claude_code.py's)
INSTALL_DIR = Path(os.environ.get("BUTTER_TEST_CACHE", Path.home() / ".cache" / "butter-tests")
                   ) / f"claude-code-{CLAUDE_CODE_VERSION}"
PROMPT = "Read README.md and tell me what this project does, then list its tests."


def claude_binary() -> Path:
    modules = INSTALL_DIR / "node_modules"
    for candidate in [modules / ".bin" / "claude",
                      *sorted(modules.glob("@anthropic-ai/claude-code-*/claude"))]:
        if candidate.is_file():
            return candidate
    raise SystemExit(f"no Claude Code under {INSTALL_DIR}: run tests/test_claude_code.py once "
                     "(it installs the pinned package with npm)")


class Capture(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path.startswith("/v1/messages") and "count_tokens" not in self.path:
            Capture.bodies.append(body)
        reply = json.dumps({"type": "error", "error": {
            "type": "invalid_request_error", "message": "captured"}}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        pass


def capture(prompt: str) -> dict[str, object]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    with tempfile.TemporaryDirectory() as scratch:
        home, project = Path(scratch) / "home", Path(scratch) / "project"
        home.mkdir()
        project.mkdir()
        (project / "README.md").write_text("# demo\n\nA small project.\n")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
               "LANG": "C.UTF-8", "TERM": "dumb", "CLAUDE_CONFIG_DIR": str(home / ".claude"),
               "ANTHROPIC_BASE_URL": base, "ANTHROPIC_AUTH_TOKEN": "unused",
               "ANTHROPIC_MODEL": "local", "ANTHROPIC_SMALL_FAST_MODEL": "local",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
               "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_MAX_RETRIES": "0"}
        subprocess.run([str(claude_binary()), "-p", prompt, "--max-turns", "1",
                        "--output-format", "json"], cwd=project, env=env,
                       capture_output=True, timeout=120, check=False)
    server.shutdown()
    turns = [body for body in Capture.bodies if body.get("tools")]
    if not turns:
        raise SystemExit(f"Claude Code sent no turn with tools ({len(Capture.bodies)} requests)")
    return turns[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    body = capture(args.prompt)
    args.out.write_text(json.dumps(body, indent=1))
    tools = body.get("tools")
    print(f"{args.out}: {len(json.dumps(body))} bytes, "
          f"{len(tools) if isinstance(tools, list) else 0} tools")


if __name__ == "__main__":
    main()
