"""HuggingFace / MLX checkpoints through mlx-lm (Apple Silicon; Linux CPU via mlx[cpu]).

Same contract as the llama.cpp backend: the engine's plans in, sampled tokens out. Each
session owns an mlx-lm prompt cache; prefix reuse trims it (`trim_prompt_cache`) and
sharing copies a donor's cache state. `--kv-cache affine8|affine4` use mlx-lm's
`QuantizedKVCache` for every layer whose cache is a plain KV cache.

- `loading`: the model, tokenizer and config, the KV cache they get, their text.
- `forward`: each sequence's cache, the decode batch, the forward passes.
- `sampling`: penalties, filters and the draw (butter/sampling.py's order), the grammar veto.
- `grammars`: output constraints as llguidance grammars, compiled once each.
- `backend`: `MlxBackend`, the `Backend` these make, on its own thread.

mlx itself is imported when a backend loads, not when this package is imported.
"""

from __future__ import annotations

from butter.backends.mlx.backend import MlxBackend
from butter.backends.mlx.sampling import filter_logits, penalize

__all__ = ["MlxBackend", "filter_logits", "penalize"]
