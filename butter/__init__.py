"""butter: an OpenAI- and Anthropic-compatible HTTP server for local LLMs.

The library API (see the README): `Model`, `generate`, `ButterServeBackend`,
`ResidentServeBackend`, `ServeServer`.
"""

__version__ = "0.1.0"  # first: modules imported below read it

from butter.model import Model, Piece, generate
from butter.server.backends import ButterServeBackend, ResidentServeBackend
from butter.server.serve import ServeServer

__all__ = [
    "ButterServeBackend",
    "Model",
    "Piece",
    "ResidentServeBackend",
    "ServeServer",
    "__version__",
    "generate",
]
