"""Backends own a model and its KV cache; they know nothing of HTTP or trio."""
