"""butter: an OpenAI- and Anthropic-compatible HTTP server for local LLMs.

The library API (see the README): `Model`, `generate`, `ButterServeBackend`,
`ResidentServeBackend`, `ServeServer`.
"""

from butter.model import Model, Piece, generate
from butter.server.backends import ButterServeBackend, ResidentServeBackend
from butter.server.serve import ServeServer
from butter.version import __version__

__all__ = [
    "ButterServeBackend",
    "Model",
    "Piece",
    "ResidentServeBackend",
    "ServeServer",
    "__version__",
    "generate",
]
