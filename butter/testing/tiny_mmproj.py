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

``write_tiny_qwen_vl_mmproj_gguf`` writes a second kind, Qwen3-VL's (and Qwen3.5's) vision
tower (``qwen3vl_merger``), for M-RoPE text models: it keeps an image's aspect, and gives it
``qwen_vl_grid()`` columns x rows of embeddings at max(columns, rows) text positions.

``write_tiny_gemma3_mmproj_gguf`` writes a third kind, Gemma 3's (``gemma3``): a SigLIP tower
whose patch grid is average-pooled (4 x 4 patches per embedding, as in Gemma 3) before an
RMSNorm and one projection matrix. Like the LLaVA projector it resizes every image to one
square, so an image of any size becomes ``gemma3_image_tokens()`` embeddings (16 with the
defaults: 64 pixels, 4-pixel patches, 16 x 16 patches pooled to 4 x 4), one text position
each; unlike it, libmtmd wraps them in ``<start_of_image>`` ... ``<end_of_image>`` text (one
special token each in Gemma 3's vocabulary, spelled out byte by byte in the tiny Qwen3's) and
has the text model decode them with a non-causal mask (mtmd_decode_use_non_causal is true for
this projector type whatever the text model is), so it also loads next to the tiny Qwen3.
"""

from __future__ import annotations

import math
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


def _projector_writer(partial: pathlib.Path, *, name: str, projector_type: str,
                      n_embd_text: int, image_size: int, patch_size: int,
                      mean: tuple[float, ...], std: tuple[float, ...],
                      gelu: bool) -> gguf.GGUFWriter:
    """A projector GGUF's writer with the keys every tower here shares, in libmtmd's
    names: its type, the text model's width (what libmtmd checks the projector against),
    the image and patch sizes, the tower's shape (V_*), the pixel normalisation, and
    whether its MLP is GELU (tanh) or CLIP's quick GELU. Each writer adds its own keys."""
    writer = gguf.GGUFWriter(partial, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_projector_type(projector_type)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(n_embd_text)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_embedding_length(V_EMBD)
    writer.add_vision_feed_forward_length(V_FF)
    writer.add_vision_block_count(V_LAYER)
    writer.add_vision_head_count(V_HEAD)
    writer.add_vision_attention_layernorm_eps(V_EPS)
    writer.add_vision_image_mean(list(mean))
    writer.add_vision_image_std(list(std))
    writer.add_vision_use_gelu(gelu)
    return writer


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
    writer = _projector_writer(partial, name=name, projector_type=PROJECTOR_TYPE,
                               n_embd_text=n_embd_text, image_size=image_size,
                               patch_size=patch_size, mean=IMAGE_MEAN, std=IMAGE_STD,
                               gelu=False)  # CLIP's quick GELU inside the vision blocks
    rng = np.random.default_rng(seed)
    n_pos = image_tokens(image_size=image_size, patch_size=patch_size)
    for tensor_name, tensor in _vision_tensors(rng, n_embd_text=n_embd_text, n_pos=n_pos,
                                               patch_size=patch_size).items():
        writer.add_tensor(tensor_name, tensor)
    return finish_file(writer, partial, target)


# --- a Qwen-VL projector (M-RoPE) ---------------------------------------------------------
#
# Qwen3-VL's (and Qwen3.5's) vision tower, as libmtmd names it: ``qwen3vl_merger``
# (PROJECTOR_TYPE_QWEN3VL, tools/mtmd/models/qwen3vl.cpp), here with no deepstack layers, so
# its output is exactly the text model's width. Unlike the LLaVA projector above, libmtmd
# keeps the image's aspect: it resizes it to a multiple of 2 * patch_size a side (each 2x2
# block of patches merges into one embedding), rows x columns of embeddings that the text
# model decodes with M-RoPE positions: an image takes max(rows, columns) positions, fewer
# than its embeddings (``qwen_vl_grid()``).

QWEN_VL_PROJECTOR_TYPE: Final = "qwen3vl_merger"
QWEN_VL_PATCH_SIZE: Final = 8  # so one embedding is a 16-pixel square of the resized image
QWEN_VL_MERGE: Final = 2  # patches merged per side: qwen3vl.cpp's graph has 2 built in
QWEN_VL_POS_SIDE: Final = 4  # learned position embeddings: a 4x4 grid, interpolated
# (bilinear) to each image's patch grid
# libmtmd's bounds on a Qwen-VL image, in merged embeddings (clip.cpp load_hparams:
# set_limit_image_tokens(8, 4096)); a GGUF cannot change them (clip.cpp reads no
# image_min/max_pixels key for this type), only mtmd_context_params' image_min_tokens /
# image_max_tokens can.
QWEN_VL_MIN_TOKENS: Final = 8
QWEN_VL_MAX_TOKENS: Final = 4096
# Qwen3-VL's processor normalises to [-1, 1].
QWEN_VL_IMAGE_MEAN: Final = (0.5, 0.5, 0.5)
QWEN_VL_IMAGE_STD: Final = (0.5, 0.5, 0.5)


def qwen_vl_grid(width: int, height: int, *, patch_size: int = QWEN_VL_PATCH_SIZE,
                 min_tokens: int = QWEN_VL_MIN_TOKENS,
                 max_tokens: int = QWEN_VL_MAX_TOKENS) -> tuple[int, int]:
    """The (columns, rows) of merged embeddings libmtmd makes of a ``width`` x ``height``
    image with the Qwen-VL projector (mtmd_image_tokens_get_nx / _ny): the image has
    columns * rows embeddings and, under M-RoPE, max(columns, rows) text positions.

    libmtmd's dyn-size preprocessor (mtmd-image.cpp calc_size_preserved_ratio, float32
    arithmetic, reproduced here) rounds each side to the nearest multiple of
    ``align = 2 * patch_size`` (at least one); if that exceeds ``max_tokens`` merged
    embeddings it scales both sides down by sqrt(pixels / max_pixels) and floors them, and if
    it falls short of ``min_tokens`` it scales both up by sqrt(min_pixels / pixels) and ceils
    them (so a 32x32 image, 2x2 at first, becomes 48x48: 3x3). The picture is then resized
    (bicubic, no padding) to exactly that size."""
    align = patch_size * QWEN_VL_MERGE
    min_pixels = min_tokens * align * align
    max_pixels = max_tokens * align * align
    f32 = np.float32

    def round_by(x: np.float32) -> int:  # std::round: half away from zero
        return math.floor(float(f32(x) / f32(align)) + 0.5) * align

    def ceil_by(x: np.float32) -> int:
        return math.ceil(float(f32(x) / f32(align))) * align

    def floor_by(x: np.float32) -> int:
        return math.floor(float(f32(x) / f32(align))) * align

    if width <= 0 or height <= 0:
        raise ValueError(f"no image of {width}x{height} pixels")
    w_bar = max(align, round_by(f32(width)))
    h_bar = max(align, round_by(f32(height)))
    if max_pixels > 0 and w_bar * h_bar > max_pixels:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_pixels))
        h_bar = max(align, floor_by(f32(height) / beta))
        w_bar = max(align, floor_by(f32(width) / beta))
    elif min_pixels > 0 and w_bar * h_bar < min_pixels:
        beta = np.sqrt(f32(min_pixels) / (f32(height) * f32(width)))
        h_bar = ceil_by(f32(height) * beta)
        w_bar = ceil_by(f32(width) * beta)
    return w_bar // align, h_bar // align


def _qwen_vl_tensors(rng: np.random.Generator, *, n_embd_text: int,
                     patch_size: int) -> dict[str, F32Array]:
    """Every tensor of the Qwen3-VL vision tower, named as libmtmd loads them; numpy shapes
    are the GGUF's ne reversed ((out, in) for a matrix)."""
    in_std = V_EMBD**-0.5
    merged = V_EMBD * QWEN_VL_MERGE * QWEN_VL_MERGE  # a 2x2 block's features, concatenated
    kernel = (V_EMBD, 3, patch_size, patch_size)
    kernel_std = (2 * 3 * patch_size * patch_size) ** -0.5
    tensors: dict[str, F32Array] = {
        # HF's Conv3d over two frames, split into two Conv2d kernels (convert_hf_to_gguf):
        # a still image is both frames, so both convolve it and their sum is the patch.
        # qwen3vl.cpp needs both (the second loads as optional but the graph uses it), and
        # asserts the bias and the position embeddings.
        "v.patch_embd.weight": random_normal(rng, kernel, kernel_std),
        "v.patch_embd.weight.1": random_normal(rng, kernel, kernel_std),
        "v.patch_embd.bias": random_normal(rng, (V_EMBD,), 0.1),
        "v.position_embd.weight": random_normal(rng, (QWEN_VL_POS_SIDE**2, V_EMBD), 0.5),
    }
    for layer in range(V_LAYER):
        prefix = f"v.blk.{layer}."
        # one fused QKV projection (rows: q, then k, then v); the graph adds its bias
        # unconditionally, so the bias is needed too
        tensors[prefix + "attn_qkv.weight"] = random_normal(rng, (3 * V_EMBD, V_EMBD), in_std)
        tensors[prefix + "attn_qkv.bias"] = random_normal(rng, (3 * V_EMBD,), 0.1)
        tensors[prefix + "attn_out.weight"] = random_normal(rng, (V_EMBD, V_EMBD), in_std)
        tensors[prefix + "attn_out.bias"] = random_normal(rng, (V_EMBD,), 0.1)
        for name in ("ln1", "ln2"):
            tensors[f"{prefix}{name}.weight"] = norm_weight(rng, V_EMBD)
            tensors[f"{prefix}{name}.bias"] = random_normal(rng, (V_EMBD,), 0.1)
        tensors[prefix + "ffn_up.weight"] = random_normal(rng, (V_FF, V_EMBD), in_std)
        tensors[prefix + "ffn_up.bias"] = random_normal(rng, (V_FF,), 0.1)
        tensors[prefix + "ffn_down.weight"] = random_normal(rng, (V_EMBD, V_FF), V_FF**-0.5)
        tensors[prefix + "ffn_down.bias"] = random_normal(rng, (V_EMBD,), 0.1)
    # The merger: a LayerNorm per patch (HF's merger.norm), then each 2x2 block's features
    # through fc1 (mm.0), GELU, fc2 (mm.2) to the text model's width, which libmtmd checks
    # against llama_model_n_embd_inp (clip_n_mmproj_embd: mm.2's bias length times
    # 1 + the deepstack layers, none here).
    tensors["v.post_ln.weight"] = norm_weight(rng, V_EMBD)
    tensors["v.post_ln.bias"] = random_normal(rng, (V_EMBD,), 0.1)
    tensors["mm.0.weight"] = random_normal(rng, (merged, merged), merged**-0.5)
    tensors["mm.0.bias"] = random_normal(rng, (merged,), 0.1)
    tensors["mm.2.weight"] = random_normal(rng, (n_embd_text, merged), merged**-0.5)
    tensors["mm.2.bias"] = random_normal(rng, (n_embd_text,), 0.1)
    return tensors


def write_tiny_qwen_vl_mmproj_gguf(
    path: str | os.PathLike[str],
    *,
    n_embd_text: int = N_EMBD,
    seed: int = 0,
    patch_size: int = QWEN_VL_PATCH_SIZE,
    name: str = "tiny-qwen-vl-mmproj",
) -> pathlib.Path:
    """Write a tiny Qwen3-VL projector (``qwen3vl_merger``) to ``path`` and return it as a
    Path (renamed into place when whole; the same arguments give the same bytes).

    ``n_embd_text`` must be the text model's width (64 for the tiny Qwen3-VL of
    ``write_tiny_qwen3_gguf(m_rope=True)`` and for the tiny Qwen3.5 of tiny_hybrid.py),
    which must use M-RoPE for libmtmd to give images Qwen-VL positions. An image of any
    size becomes ``qwen_vl_grid(width, height, patch_size=...)`` columns x rows of
    embeddings: with the default 8-pixel patches, 16 pixels a side per embedding and at
    least 8 embeddings (64x48 gives 4x3: 12 embeddings at 4 positions)."""
    if patch_size <= 0:
        raise ValueError(f"patch_size {patch_size} is not positive")
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    # image_size: the side of the learned position grid, in pixels (as convert_hf_to_gguf
    # derives it); libmtmd only checks it, images keep their own size.
    writer = _projector_writer(partial, name=name, projector_type=QWEN_VL_PROJECTOR_TYPE,
                               n_embd_text=n_embd_text,
                               image_size=QWEN_VL_POS_SIDE * patch_size,
                               patch_size=patch_size, mean=QWEN_VL_IMAGE_MEAN,
                               std=QWEN_VL_IMAGE_STD, gelu=True)
    writer.add_vision_spatial_merge_size(QWEN_VL_MERGE)
    writer.add_vision_is_deepstack_layers([False] * V_LAYER)
    rng = np.random.default_rng(seed)
    for tensor_name, tensor in _qwen_vl_tensors(rng, n_embd_text=n_embd_text,
                                                patch_size=patch_size).items():
        writer.add_tensor(tensor_name, tensor)
    return finish_file(writer, partial, target)


# --- a Gemma 3 projector (non-causal image decoding) --------------------------------------
#
# Gemma 3's vision tower, as libmtmd names it: ``gemma3`` (PROJECTOR_TYPE_GEMMA3, built by
# tools/mtmd/models/siglip.cpp): a SigLIP transformer (patch convolution plus bias, learned
# position embeddings, no pre-layernorm, GELU (tanh) MLPs, a post-layernorm), then Gemma 3's
# multimodal projector: the patch grid average-pooled GEMMA3_POOL x GEMMA3_POOL
# (ggml_pool_2d, kernel = stride = clip.vision.projector.scale_factor), an RMSNorm
# (``mm.soft_emb_norm``) and one matrix (``mm.input_projection``) to the text model's width.
# libmtmd resizes every image (bilinear, padded to a square) to image_size a side, so an image
# of any size becomes the same (image_size // patch_size // pool)^2 embeddings, wrapped in
# ``<start_of_image>`` / ``<end_of_image>`` text, which the text model decodes with a
# non-causal mask (mtmd_decode_use_non_causal is true for this projector type, whatever the
# text model).

GEMMA3_PROJECTOR_TYPE: Final = "gemma3"
GEMMA3_IMAGE_SIZE: Final = 64  # pixels a side, after mtmd's resize (Gemma 3's: 896)
GEMMA3_PATCH_SIZE: Final = 4  # so 16 x 16 patches (Gemma 3's: 14 pixels, 64 x 64 patches)
GEMMA3_POOL: Final = 4  # patches pooled per side, Gemma 3's own (4 x 4): 4 x 4 embeddings
# Gemma 3's (SigLIP's) processor normalises to [-1, 1].
GEMMA3_IMAGE_MEAN: Final = (0.5, 0.5, 0.5)
GEMMA3_IMAGE_STD: Final = (0.5, 0.5, 0.5)


def gemma3_image_tokens(*, image_size: int = GEMMA3_IMAGE_SIZE,
                        patch_size: int = GEMMA3_PATCH_SIZE, pool: int = GEMMA3_POOL) -> int:
    """How many embeddings (text positions) libmtmd makes of one image, of any size, with the
    Gemma 3 projector: mtmd resizes it to image_size a side, cuts it into patch_size squares
    and average-pools each pool x pool block of them into one embedding. 16 with the defaults
    (Gemma 3's own: 896 // 14 // 4 = 16 a side, 256)."""
    return (image_size // patch_size // pool) ** 2


def _siglip_tower_tensors(rng: np.random.Generator, *, n_pos: int,
                          patch_size: int) -> dict[str, F32Array]:
    """A SigLIP vision transformer's tensors (siglip.cpp's build_vit: patch convolution plus
    bias, learned position embeddings, no pre-layernorm, the blocks, a post-layernorm), named
    as libmtmd loads them; numpy shapes are the GGUF's ne reversed ((out, in) for a matrix).
    Gemma 3's and Idefics3's towers are this; their projectors follow."""
    in_std = V_EMBD**-0.5
    tensors: dict[str, F32Array] = {
        # ggml_conv_2d's kernel: ne [patch, patch, 3, V_EMBD]
        "v.patch_embd.weight": random_normal(rng, (V_EMBD, 3, patch_size, patch_size),
                                             (3 * patch_size * patch_size) ** -0.5),
        "v.patch_embd.bias": random_normal(rng, (V_EMBD,), 0.1),
        # one per patch: siglip.cpp adds them as they are (no interpolation for gemma3 or
        # idefics3), so every image the tower sees is image_size a side
        "v.position_embd.weight": random_normal(rng, (n_pos, V_EMBD), 0.5),
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
    # SigLIP's post_layernorm
    tensors["v.post_ln.weight"] = norm_weight(rng, V_EMBD)
    tensors["v.post_ln.bias"] = random_normal(rng, (V_EMBD,), 0.1)
    return tensors


def _gemma3_tensors(rng: np.random.Generator, *, n_embd_text: int, n_pos: int,
                    patch_size: int) -> dict[str, F32Array]:
    """Every tensor of the Gemma 3 vision tower, named as libmtmd loads them; numpy shapes are
    the GGUF's ne reversed ((out, in) for a matrix, except mm.input_projection: see below)."""
    tensors = _siglip_tower_tensors(rng, n_pos=n_pos, patch_size=patch_size)
    # The projector. The norm's gain is stored as used (HF's Gemma3RMSNorm multiplies by
    # 1 + weight; convert_hf_to_gguf adds the 1).
    # mm.input_projection is HF's (vision, text) matrix as it is: ne [n_embd_text, V_EMBD]
    # (siglip.cpp transposes it before the matmul), and its ne[0] is the width libmtmd
    # checks against the text model's llama_model_n_embd_inp (clip_n_mmproj_embd).
    tensors["mm.soft_emb_norm.weight"] = norm_weight(rng, V_EMBD)
    tensors["mm.input_projection.weight"] = random_normal(rng, (V_EMBD, n_embd_text),
                                                          V_EMBD**-0.5)
    return tensors


def write_tiny_gemma3_mmproj_gguf(
    path: str | os.PathLike[str],
    *,
    n_embd_text: int = N_EMBD,
    seed: int = 0,
    image_size: int = GEMMA3_IMAGE_SIZE,
    patch_size: int = GEMMA3_PATCH_SIZE,
    pool: int = GEMMA3_POOL,
    name: str = "tiny-gemma3-mmproj",
) -> pathlib.Path:
    """Write a tiny Gemma 3 projector (``gemma3``) to ``path`` and return it as a Path
    (renamed into place when whole; the same arguments give the same bytes).

    ``n_embd_text`` must be the text model's width (64 for the tiny Qwen3, 640 for Gemma 3
    270M); libmtmd decodes this projector's images non-causally with any text model. An image
    of any size becomes ``gemma3_image_tokens(image_size=..., patch_size=..., pool=...)``
    embeddings (16 with the defaults). ``image_size`` must be a multiple of ``patch_size``
    and the patches a side a multiple of ``pool``: libmtmd loads a file where they are not,
    but its pooling drops the remainder rows and columns, so the graph makes fewer
    embeddings than libmtmd counts and the first encode aborts the process (GGML_ASSERT:
    "expected output 14 tokens, got 9" for 60 pixels in 4-pixel patches pooled 4 x 4)."""
    if min(image_size, patch_size, pool) <= 0:
        raise ValueError(f"image_size {image_size}, patch_size {patch_size} and pool {pool} "
                         "must be positive")
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is no multiple of patch_size {patch_size}")
    if image_size // patch_size % pool:
        raise ValueError(f"{image_size // patch_size} patches a side is no multiple of "
                         f"pool {pool}")
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    # (V_EPS is also the soft_emb_norm's epsilon)
    writer = _projector_writer(partial, name=name, projector_type=GEMMA3_PROJECTOR_TYPE,
                               n_embd_text=n_embd_text, image_size=image_size,
                               patch_size=patch_size, mean=GEMMA3_IMAGE_MEAN,
                               std=GEMMA3_IMAGE_STD, gelu=True)  # SigLIP's MLP
    # libmtmd defaults it to Gemma 3's 4 and reads it when present (convert_hf_to_gguf
    # writes it only for other values); written always, so the file says what it pools.
    writer.add_vision_projector_scale_factor(pool)
    rng = np.random.default_rng(seed)
    n_pos = (image_size // patch_size) ** 2
    for tensor_name, tensor in _gemma3_tensors(rng, n_embd_text=n_embd_text, n_pos=n_pos,
                                               patch_size=patch_size).items():
        writer.add_tensor(tensor_name, tensor)
    return finish_file(writer, partial, target)


# --- an Idefics3 / SmolVLM projector (an image sliced into several chunks) ----------------
#
# SmolVLM's (and Idefics3's) vision tower, as libmtmd names it: ``idefics3``
# (PROJECTOR_TYPE_IDEFICS3, built by tools/mtmd/models/siglip.cpp): the same SigLIP
# transformer as Gemma 3's, then a pixel shuffle (build_patch_merge_permute: each
# scale x scale block of patches concatenated into one vector of V_EMBD * scale^2) and one
# matrix without bias (``mm.model.fc``) to the text model's width.
#
# Unlike the three projectors above, libmtmd cuts an image into tiles of image_size a side
# (mtmd-image.cpp, mtmd_image_preprocessor_idefics3; how many: ``idefics3_grid()``) and makes
# each tile, and an overview (the whole image resized to one tile), an image chunk of its
# own, with text between them (mtmd.cpp, MTMD_SLICE_TMPL_IDEFICS3). For C columns x R rows
# of tiles the media marker becomes
#
#   <fake_token_around_image><row_1_col_1>  [image: tile (1, 1)]
#   <fake_token_around_image><row_1_col_2>  [image: tile (1, 2)]  ...  [image: tile (1, C)]
#   \n<fake_token_around_image><row_2_col_1>  [image: tile (2, 1)]  ...  [image: tile (R, C)]
#   \n\n<fake_token_around_image><global-img>  [image: the overview]
#   <fake_token_around_image>
#
# the tiles row by row, a "\n" before each row but the first, the overview LAST: C * R + 1
# image chunks, each with the bitmap's id, each idefics3_image_tokens() embeddings at one
# text position apiece (4 with the defaults), decoded causally (mtmd_decode_use_non_causal
# and mtmd_decode_use_mrope are false). libmtmd merges adjacent text into one chunk: the
# prompt's text before the marker and the first <row_1_col_1> text are one text chunk, as
# are the closing <fake_token_around_image> and the text after the marker (or the next
# image's first row/col text). There is always at least one tile: an image that fits one
# tile is still two image chunks, tile (1, 1) then the overview, and as the two are then
# the same pixels (image_size a side) their embeddings are the same too.
#
# The <row_r_col_c> texts are tokenized with special-token parsing (byte by byte in the
# tiny Qwen3's vocabulary). "\n", "\n\n", "<fake_token_around_image>" and "<global-img>",
# however, libmtmd looks up once, as single tokens, by their exact text in the text model's
# vocabulary, and one the vocabulary lacks is LLAMA_TOKEN_NULL (-1) in the text chunk: the
# tiny Qwen3 has only "\n", so the overview's text around it is [-1, -1, -1] and [-1, ...].
# mtmd_helper_eval_chunks then aborts the process (GGML_ASSERT(idx >= 0) in
# mtmd-helper.cpp) and llama_decode of such a batch returns -1. Decoding these images needs
# a text model whose vocabulary has the three: write_tiny_qwen3_gguf(added_tokens=
# IDEFICS3_MARKERS) appends them as user-defined tokens.

IDEFICS3_PROJECTOR_TYPE: Final = "idefics3"
# The texts libmtmd looks up as single tokens around an Idefics3 overview.
IDEFICS3_MARKERS: Final = ("\n\n", "<fake_token_around_image>", "<global-img>")
IDEFICS3_IMAGE_SIZE: Final = 32  # a tile's side, in pixels (SmolVLM's: 384 or 512)
IDEFICS3_PATCH_SIZE: Final = 8  # so 4 x 4 patches a tile (SmolVLM's: 16 pixels)
IDEFICS3_SCALE: Final = 2  # the pixel shuffle's factor (Idefics3's 2, SmolVLM's 3 or 4):
# 4 x 4 patches shuffled to 2 x 2, so 4 embeddings a tile
# SigLIP's processor normalises to [-1, 1].
IDEFICS3_IMAGE_MEAN: Final = (0.5, 0.5, 0.5)
IDEFICS3_IMAGE_STD: Final = (0.5, 0.5, 0.5)


def idefics3_image_tokens(*, image_size: int = IDEFICS3_IMAGE_SIZE,
                          patch_size: int = IDEFICS3_PATCH_SIZE,
                          scale: int = IDEFICS3_SCALE) -> int:
    """How many embeddings (text positions) libmtmd makes of each image chunk (every tile
    and the overview alike, all image_size a side) with the Idefics3 projector: 4 with the
    defaults (32 pixels, 8-pixel patches, 4 x 4 patches shuffled 2 x 2 into 2 x 2)."""
    return (image_size // patch_size // scale) ** 2


def idefics3_grid(width: int, height: int, *, image_size: int = IDEFICS3_IMAGE_SIZE,
                  longest_edge: int | None = None) -> tuple[int, int]:
    """The (columns, rows) of tiles libmtmd cuts a ``width`` x ``height`` image into with the
    Idefics3 projector; the image becomes columns * rows + 1 image chunks (the tiles, then
    the overview), never fewer than two.

    This assumes mtmd_context_params' image_min_tokens and image_max_tokens are left at -1
    (their default): either one makes libmtmd scale the image into those bounds instead.

    Without ``longest_edge`` (the file has no ``clip.vision.preproc_image_size``, the
    default here) libmtmd rounds each side to the NEAREST multiple of image_size, at
    least one (calc_size_preserved_ratio, float32 arithmetic, std::round: half away from
    zero), resizes the image to that and cuts it: with 32-pixel tiles, 32x32 (and anything
    up to 47x47) is one tile, 64x32 two, 96x64 three columns x two rows. The grid has no
    bound: keep test images small (640x480 would be 20 x 15 tiles).

    With ``longest_edge`` (SmolVLM's GGUFs have it: HF's size["longest_edge"]) the size no
    longer matters, only the aspect: libmtmd resizes the image so its longer side is
    exactly longest_edge (up or down), the shorter one in proportion (truncated, then
    rounded up to even), and takes ceil(side / image_size) tiles each way; with
    longest_edge == 2 * image_size a square of any size is 2 x 2 tiles. An aspect beyond
    longest_edge : 1 makes the shorter side 0 and libmtmd refuses the image (mtmd_tokenize
    returns 2); so does this, with ValueError."""
    if width <= 0 or height <= 0:
        raise ValueError(f"no image of {width}x{height} pixels")
    if longest_edge is None:
        f32 = np.float32

        def nearest(side: int) -> int:
            return max(1, math.floor(float(f32(side) / f32(image_size)) + 0.5))

        return nearest(width), nearest(height)
    aspect = width / height  # a double, as libmtmd computes it
    if width >= height:
        resized_w = longest_edge
        resized_h = int(longest_edge / aspect)
        resized_h += resized_h % 2
    else:
        resized_h = longest_edge
        resized_w = int(longest_edge * aspect)
        resized_w += resized_w % 2
    if not resized_w or not resized_h:  # mtmd_tokenize fails (returns 2): "resize target
        # 0x64 is out of range"
        raise ValueError(f"libmtmd refuses a {width}x{height} image with longest_edge "
                         f"{longest_edge}: it would resize it to {resized_w}x{resized_h}")
    return -(-resized_w // image_size), -(-resized_h // image_size)


def _idefics3_tensors(rng: np.random.Generator, *, n_embd_text: int, n_pos: int,
                      patch_size: int, scale: int) -> dict[str, F32Array]:
    """Every tensor of the Idefics3 vision tower, named as libmtmd loads them; numpy shapes
    are the GGUF's ne reversed ((out, in) for a matrix)."""
    tensors = _siglip_tower_tensors(rng, n_pos=n_pos, patch_size=patch_size)
    # The connector (HF's Idefics3Connector.modality_projection): no bias. Its output width,
    # mm.model.fc's ne[1], is what libmtmd checks against the text model's
    # llama_model_n_embd_inp (clip_n_mmproj_embd).
    shuffled = V_EMBD * scale * scale
    tensors["mm.model.fc.weight"] = random_normal(rng, (n_embd_text, shuffled),
                                                  shuffled**-0.5)
    return tensors


def write_tiny_idefics3_mmproj_gguf(
    path: str | os.PathLike[str],
    *,
    n_embd_text: int = N_EMBD,
    seed: int = 0,
    image_size: int = IDEFICS3_IMAGE_SIZE,
    patch_size: int = IDEFICS3_PATCH_SIZE,
    scale: int = IDEFICS3_SCALE,
    longest_edge: int | None = None,
    name: str = "tiny-idefics3-mmproj",
) -> pathlib.Path:
    """Write a tiny Idefics3 / SmolVLM projector (``idefics3``) to ``path`` and return it as
    a Path (renamed into place when whole; the same arguments give the same bytes).

    ``n_embd_text`` must be the text model's width (64 for the tiny Qwen3). libmtmd slices
    an image into ``idefics3_grid(width, height, image_size=..., longest_edge=...)`` tiles
    plus an overview, each an image chunk of ``idefics3_image_tokens(...)`` embeddings (4
    with the defaults) between text chunks of row/column markers (see the comment above
    IDEFICS3_PROJECTOR_TYPE). ``longest_edge`` writes ``clip.vision.preproc_image_size``
    (SmolVLM's way: every image resized to that longest side first); without it the tiles
    follow the image's size.

    It loads next to any tiny Qwen3, but its images decode only beside one written with
    ``added_tokens=IDEFICS3_MARKERS``: without them libmtmd puts LLAMA_TOKEN_NULL (-1) in
    the text chunks around the overview (see the comment above IDEFICS3_PROJECTOR_TYPE).

    ``image_size`` must be a multiple of ``patch_size`` and the patches a side a multiple of
    ``scale`` (at least 2: libmtmd asserts scale > 1): every tile and overview is
    image_size a side, and the position embeddings are one per patch of it."""
    if min(image_size, patch_size) <= 0 or scale < 2:
        raise ValueError(f"image_size {image_size} and patch_size {patch_size} must be "
                         f"positive and scale {scale} at least 2")
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is no multiple of patch_size {patch_size}")
    if image_size // patch_size % scale:
        raise ValueError(f"{image_size // patch_size} patches a side is no multiple of "
                         f"scale {scale}")
    if longest_edge is not None and longest_edge <= 0:
        raise ValueError(f"longest_edge {longest_edge} is not positive")
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    writer = _projector_writer(partial, name=name, projector_type=IDEFICS3_PROJECTOR_TYPE,
                               n_embd_text=n_embd_text, image_size=image_size,
                               patch_size=patch_size, mean=IDEFICS3_IMAGE_MEAN,
                               std=IDEFICS3_IMAGE_STD, gelu=True)  # SigLIP's MLP
    writer.add_vision_projector_scale_factor(scale)  # libmtmd's default would be 1
    if longest_edge is not None:
        writer.add_vision_preproc_image_size(longest_edge)
    rng = np.random.default_rng(seed)
    n_pos = (image_size // patch_size) ** 2
    for tensor_name, tensor in _idefics3_tensors(rng, n_embd_text=n_embd_text, n_pos=n_pos,
                                                 patch_size=patch_size,
                                                 scale=scale).items():
        writer.add_tensor(tensor_name, tensor)
    return finish_file(writer, partial, target)
