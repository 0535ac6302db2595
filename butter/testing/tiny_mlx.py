"""Tiny random-weight Qwen3, Gemma 3 text and Qwen3.5 models in MLX / HuggingFace layout, for
MLX backend tests (Gemma 3's sliding-window layers get mlx-lm's rotating caches, Qwen3.5's
linear-attention layers recurrent state).

config.json + model.safetensors (saved by mlx from `mlx_lm.models.qwen3.Model`'s own
parameters) + the same byte-level BPE tokenizer as the tiny GGUF, with ChatML specials and
a tools-aware chat template in tokenizer_config.json. Builds in milliseconds; needs the
`mlx` extra.
"""

from __future__ import annotations

import json
import os
import pathlib

from butter.testing.tiny_gguf import (
    CHAT_TEMPLATE,
    HEAD_DIM,
    N_EMBD,
    N_FF,
    N_HEAD,
    N_HEAD_KV,
    N_LAYER,
    RMS_EPS,
    ROPE_THETA,
    build_tiny_tokenizer,
    tiny_vocab,
)


def tiny_config(n_ctx_train: int = 4096) -> dict[str, object]:
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": N_EMBD, "num_hidden_layers": N_LAYER, "intermediate_size": N_FF,
        "num_attention_heads": N_HEAD, "num_key_value_heads": N_HEAD_KV, "head_dim": HEAD_DIM,
        "rms_norm_eps": RMS_EPS, "vocab_size": len(tiny_vocab()), "rope_theta": ROPE_THETA,
        "max_position_embeddings": n_ctx_train, "tie_word_embeddings": False,
    }


def tiny_gemma3_config(sliding_window: int = 16) -> dict[str, object]:
    """Gemma 3 text layout: every other layer attends over a sliding window (mlx-lm gives
    those layers rotating caches)."""
    return {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": N_EMBD, "num_hidden_layers": 4, "intermediate_size": N_FF,
        "num_attention_heads": N_HEAD, "num_key_value_heads": N_HEAD_KV, "head_dim": HEAD_DIM,
        "rms_norm_eps": RMS_EPS, "vocab_size": len(tiny_vocab()), "rope_theta": ROPE_THETA,
        "sliding_window": sliding_window, "sliding_window_pattern": 2,
        "query_pre_attn_scalar": HEAD_DIM, "max_position_embeddings": 4096,
    }


def tiny_qwen35_config() -> dict[str, object]:
    """Qwen3.5's hybrid layout, text config nested as in the hub's checkpoints: linear
    attention layers (recurrent state, mlx-lm's ArraysCache) between full attention ones."""
    return {"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": N_EMBD, "num_hidden_layers": 4,
        "intermediate_size": N_FF, "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_HEAD_KV, "head_dim": HEAD_DIM, "rms_norm_eps": RMS_EPS,
        "vocab_size": len(tiny_vocab()), "linear_num_value_heads": N_HEAD,
        "linear_num_key_heads": N_HEAD_KV, "linear_key_head_dim": HEAD_DIM,
        "linear_value_head_dim": HEAD_DIM, "full_attention_interval": 2,
        "max_position_embeddings": 4096,
    }}


def write_tiny_qwen3_mlx(path: str | os.PathLike[str], *, seed: int = 0) -> pathlib.Path:
    """Write the model directory and return it."""
    from mlx_lm.models.qwen3 import Model, ModelArgs

    return _write(pathlib.Path(path), tiny_config(), Model, ModelArgs, seed)


def write_tiny_gemma3_mlx(path: str | os.PathLike[str], *, seed: int = 0,
                          sliding_window: int = 16) -> pathlib.Path:
    """A tiny random Gemma 3 text model (sliding-window layers), same tokenizer."""
    from mlx_lm.models.gemma3_text import Model, ModelArgs

    return _write(pathlib.Path(path), tiny_gemma3_config(sliding_window), Model, ModelArgs,
                  seed)


def write_tiny_qwen35_mlx(path: str | os.PathLike[str], *, seed: int = 0) -> pathlib.Path:
    """A tiny random Qwen3.5 model (hybrid: recurrent and attention layers)."""
    from mlx_lm.models.qwen3_5 import Model, ModelArgs

    return _write(pathlib.Path(path), tiny_qwen35_config(), Model, ModelArgs, seed)


def _write(target: pathlib.Path, config: dict[str, object], model_class: type,
           args_class: type, seed: int) -> pathlib.Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    target.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))  # type: ignore[attr-defined]
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (target / "config.json").write_text(json.dumps(config, indent=1))
    build_tiny_tokenizer().save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "add_bos_token": False, "model_max_length": 4096,
        # As Qwen's own config lists them: the tokenizer then counts them as special, so
        # they generate as empty pieces, as llama.cpp's control tokens do.
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }, indent=1))
    (target / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tiny_special("<|im_end|>"), tiny_special("<|endoftext|>")]}))
    return target


def tiny_special(token: str) -> int:
    return tiny_vocab().index(token)
