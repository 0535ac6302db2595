"""butter: an OpenAI- and Anthropic-compatible HTTP server for local LLMs.

The library API (see docs/library.md): `Model`, `generate`, `FixedModel`,
`SwappableModel`, `ServeServer`.
"""

from __future__ import annotations

import warnings
from typing import Any

from butter.model import Model, Piece, generate
from butter.server.holders import FixedModel, SwappableModel
from butter.server.serve import ServeServer
from butter.version import __version__

__all__ = [
    "FixedModel",
    "Model",
    "Piece",
    "ServeServer",
    "SwappableModel",
    "__version__",
    "generate",
]

# The model holders' names before they were told apart from the model backends.
_RENAMED = {"ButterServeBackend": FixedModel, "ResidentServeBackend": SwappableModel}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"butter.{name} is now butter.{new.__name__}", DeprecationWarning,
                      stacklevel=2)
        return new
    raise AttributeError(f"module 'butter' has no attribute {name!r}")
