"""butter: an OpenAI- and Anthropic-compatible HTTP server for local LLMs."""

__version__ = "0.1.0"
