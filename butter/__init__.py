"""butter: an OpenAI- and Anthropic-compatible HTTP server for local LLMs.

The library API (see docs/library.md): `Model`, `generate`, `FixedHolder`,
`SwappableHolder`, `ServeServer`.
"""

from __future__ import annotations

import warnings
from typing import Any

from butter.model import Model, Piece, generate
from butter.server.holders import FixedHolder, SwappableHolder
from butter.server.serve import ServeServer
from butter.version import __version__

__all__ = [
    "FixedHolder",
    "Model",
    "Piece",
    "ServeServer",
    "SwappableHolder",
    "__version__",
    "generate",
]

# The model holders' earlier names: before they were told apart from the model backends,
# then from the model they hold.
_RENAMED = {"ButterServeBackend": FixedHolder, "ResidentServeBackend": SwappableHolder,
            "FixedModel": FixedHolder, "SwappableModel": SwappableHolder}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"butter.{name} is now butter.{new.__name__}", DeprecationWarning,
                      stacklevel=2)
        return new
    raise AttributeError(f"module 'butter' has no attribute {name!r}")
