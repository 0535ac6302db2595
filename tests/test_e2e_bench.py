"""serve-bench against a real butter server on the tiny GGUF."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import ServerProcess


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "butter.cli", "serve-bench", *args],
                          capture_output=True, text=True, timeout=300)


def engine_totals(server: ServerProcess) -> dict[str, int]:
    stats: dict[str, int] = httpx.get(f"{server.api}/server").json()["engine"]
    return stats


def test_report_totals_match_the_server(tiny_server: ServerProcess, tmp_path: Path) -> None:
    before = engine_totals(tiny_server)
    out = tmp_path / "bench.json"
    result = bench("--model", "tiny", "--base-url", tiny_server.api, "--concurrency", "1,3",
                   "--waves", "2", "--max-tokens", "16", "--shared-prompt", "--json", str(out))
    assert result.returncode == 0, result.stderr
    after = engine_totals(tiny_server)
    records = json.loads(out.read_text())
    assert [r["concurrency"] for r in records] == [1, 3]
    assert sum(r["requests"] for r in records) == 2 * 1 + 2 * 3
    for key in ("completion_tokens", "prompt_tokens", "cached_tokens"):
        assert sum(r[key] for r in records) == after[key] - before[key], key
    assert after["requests_done"] - before["requests_done"] == 8
    assert all(r["http_errors"] == 0 and r["marker_leaks"] == 0 for r in records)
    assert records[1]["cached_tokens"] > 0  # the shared stem is reused
    assert records[0]["server"]["data"][0]["id"] == "tiny"
    assert "butter serve-bench" in result.stdout


def test_refuses_a_model_that_is_not_resident(tiny_server: ServerProcess) -> None:
    result = bench("--model", "some-other-model", "--base-url", tiny_server.api)
    assert result.returncode == 2
    assert "never triggers a swap" in result.stderr and "--model 'tiny'" in result.stderr


def test_unreachable_server_is_a_clear_error() -> None:
    result = bench("--model", "x", "--base-url", "http://127.0.0.1:9/v1")
    assert result.returncode == 2
    assert "cannot reach" in result.stderr and "Traceback" not in result.stderr


def test_plot_is_written(tiny_server: ServerProcess, tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = bench("--model", "tiny", "--base-url", tiny_server.api, "--concurrency", "1,2",
                   "--waves", "1", "--max-tokens", "4", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert plot.read_bytes().startswith(b"\x89PNG")
