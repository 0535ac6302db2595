"""A tiny random-weight vision projector (an "mmproj" GGUF) for libmtmd tests.

No real projector is small enough to ship with the tests, so this writes one that
llama.cpp's libmtmd (tools/mtmd at the pinned llama-cpp-python) loads next to the tiny
Qwen3 of tiny_gguf.py: LLaVA-1.5's layout (``clip.projector_type = "mlp"``), a CLIP-style
vision transformer whose patch embeddings a two-layer MLP (``mm.0``, GELU, ``mm.2``) maps
to the text model's width. It is the plainest projector libmtmd has:

- the image is padded to a square and resized to IMAGE_SIZE (mtmd's fixed-size
  preprocessor), so every image, whatever its size, becomes (IMAGE_SIZE // PATCH_SIZE)^2
  embeddings: 16 with the defaults (``image_tokens()``);
- libmtmd wraps those in no begin/end text (gemma3 adds ``<start_of_image>``, Qwen-VL
  ``<|vision_start|>``): the prompt's media marker becomes the image chunk and nothing else;
- the text model decodes the embeddings causally (gemma3's are decoded with a non-causal
  mask) at one position each (Qwen-VL's M-RoPE gives an image fewer positions than tokens).

The graph is llama.cpp's (tools/mtmd/models/llava.cpp): patch convolution plus bias, learned
position embeddings, a pre-layernorm, then the transformer blocks up to the second-to-last
(LLaVA takes the penultimate layer's features, so of the two blocks written only the first
runs), then the MLP. Weights are float32 (a few hundred KB in all) and come from a seeded
generator: the same arguments give the same bytes.
"""

from __future__ import annotations

import os
import pathlib
from typing import Final

import gguf
import numpy as np

from butter.testing.gguf_writer import F32Array
from butter.testing.tiny_gguf import N_EMBD, finish_file, norm_weight, random_normal

PROJECTOR_TYPE: Final = "mlp"  # LLaVA-1.5's projector, as libmtmd names it
IMAGE_SIZE: Final = 32  # pixels a side, after mtmd's resize
PATCH_SIZE: Final = 8
V_EMBD: Final = 32  # the vision transformer's width
V_HEAD: Final = 2
V_FF: Final = 64  # must differ from V_EMBD: libmtmd swaps ffn_up/ffn_down of a file whose
# ffn_down has V_EMBD inputs (old LLaVA conversions wrote them swapped)
V_LAYER: Final = 2  # the graph runs V_LAYER - 1 of them
V_EPS: Final = 1e-6
# CLIP's normalisation (OpenAI's image_mean/image_std), as LLaVA-1.5's processor has it.
IMAGE_MEAN: Final = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD: Final = (0.26862954, 0.26130258, 0.27577711)


def image_tokens(*, image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE) -> int:
    """How many embeddings (text positions) libmtmd makes of one image, of any size: mtmd
    resizes it to image_size a side; each patch_size square is one embedding."""
    return (image_size // patch_size) ** 2


def _vision_tensors(rng: np.random.Generator, *, n_embd_text: int, n_pos: int,
                    patch_size: int) -> dict[str, F32Array]:
    """Every tensor, named as libmtmd loads them (clip-impl.h's TN_*); numpy shapes are the
    GGUF's ne reversed ((out, in) for a matrix)."""
    in_std = V_EMBD**-0.5
    tensors: dict[str, F32Array] = {
        # ggml_conv_2d's kernel: ne [patch, patch, 3, V_EMBD]
        "v.patch_embd.weight": random_normal(rng, (V_EMBD, 3, patch_size, patch_size),
                                             (3 * patch_size * patch_size) ** -0.5),
        "v.patch_embd.bias": random_normal(rng, (V_EMBD,), 0.1),
        "v.position_embd.weight": random_normal(rng, (n_pos, V_EMBD), 0.5),
        "v.pre_ln.weight": norm_weight(rng, V_EMBD),
        "v.pre_ln.bias": random_normal(rng, (V_EMBD,), 0.1),
    }
    for layer in range(V_LAYER):
        prefix = f"v.blk.{layer}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[f"{prefix}{name}.weight"] = random_normal(rng, (V_EMBD, V_EMBD), in_std)
            tensors[f"{prefix}{name}.bias"] = random_normal(rng, (V_EMBD,), 0.1)
        for name in ("ln1", "ln2"):
            tensors[f"{prefix}{name}.weight"] = norm_weight(rng, V_EMBD)
            tensors[f"{prefix}{name}.bias"] = random_normal(rng, (V_EMBD,), 0.1)
        tensors[f"{prefix}ffn_up.weight"] = random_normal(rng, (V_FF, V_EMBD), in_std)
        tensors[f"{prefix}ffn_up.bias"] = random_normal(rng, (V_FF,), 0.1)
        tensors[f"{prefix}ffn_down.weight"] = random_normal(rng, (V_EMBD, V_FF), V_FF**-0.5)
        tensors[f"{prefix}ffn_down.bias"] = random_normal(rng, (V_EMBD,), 0.1)
    # The projector: its output width is what libmtmd checks against the text model's
    # llama_model_n_embd_inp (clip_n_mmproj_embd reads mm.2's rows).
    tensors["mm.0.weight"] = random_normal(rng, (n_embd_text, V_EMBD), in_std)
    tensors["mm.0.bias"] = random_normal(rng, (n_embd_text,), 0.1)
    tensors["mm.2.weight"] = random_normal(rng, (n_embd_text, n_embd_text), n_embd_text**-0.5)
    tensors["mm.2.bias"] = random_normal(rng, (n_embd_text,), 0.1)
    return tensors


def write_tiny_mmproj_gguf(
    path: str | os.PathLike[str],
    *,
    n_embd_text: int = N_EMBD,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
    patch_size: int = PATCH_SIZE,
    name: str = "tiny-mmproj",
) -> pathlib.Path:
    """Write the tiny projector to ``path`` and return it as a Path (renamed into place
    when whole). ``n_embd_text`` must be the text model's width (64 for the tiny Qwen3):
    libmtmd refuses a projector of another width. ``image_size`` must be a multiple of
    ``patch_size``; an image becomes ``image_tokens(image_size=..., patch_size=...)``
    embeddings."""
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is no multiple of patch_size {patch_size}")
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_projector_type(PROJECTOR_TYPE)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(n_embd_text)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_embedding_length(V_EMBD)
    writer.add_vision_feed_forward_length(V_FF)
    writer.add_vision_block_count(V_LAYER)
    writer.add_vision_head_count(V_HEAD)
    writer.add_vision_attention_layernorm_eps(V_EPS)
    writer.add_vision_image_mean(list(IMAGE_MEAN))
    writer.add_vision_image_std(list(IMAGE_STD))
    writer.add_vision_use_gelu(False)  # CLIP's quick GELU inside the vision blocks
    rng = np.random.default_rng(seed)
    n_pos = image_tokens(image_size=image_size, patch_size=patch_size)
    for tensor_name, tensor in _vision_tensors(rng, n_embd_text=n_embd_text, n_pos=n_pos,
                                               patch_size=patch_size).items():
        writer.add_tensor(tensor_name, tensor)
    return finish_file(writer, partial, target)
