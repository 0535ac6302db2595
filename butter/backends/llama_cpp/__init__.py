"""GGUF models through llama-cpp-python's low-level ctypes API.

- `loading`: the model, its context and batch, what it is, its text, and who computes
  its logits (butter's output projection, checked against llama.cpp's at load).
- `batch`: a step's works laid into the batch, shaped, evaluated, redone if split.
- `sampling`: per-sequence sampler chains, the grammar veto, the candidates.
- `grammars`: output constraints as llguidance matchers, compiled once each.
- `backend`: `LlamaCppBackend`, the `Backend` these make, on its own thread.

llama_cpp (and its shared library) loads on first use of `LlamaCppBackend`, not when this
package is imported. `check_gguf_file` (butter/models.py, re-exported) needs none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from butter.models import check_gguf_file

if TYPE_CHECKING:
    from butter.backends.llama_cpp.backend import LlamaCppBackend

__all__ = ["LlamaCppBackend", "check_gguf_file"]


def __getattr__(name: str) -> Any:
    if name == "LlamaCppBackend":
        from butter.backends.llama_cpp.backend import LlamaCppBackend

        return LlamaCppBackend
    if name == "ll":  # the llama_cpp module itself (tests patch its functions)
        import llama_cpp

        return llama_cpp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
