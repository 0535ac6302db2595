/*
 * butter's Q8_0, Q6_K, Q5_K, Q4_K, Q4_1 and Q5_0 layer matmuls, plugged into llama.cpp's CPU
 * backend on x86 CPUs with AVX512-VNNI or AVX2 (one tile layout per type, one kernel per
 * instruction set).
 *
 * Why: with several sequences decoding at once, a step multiplies every layer matrix by 2-8
 * activation rows. For these types llama.cpp's x86 CPU code has no interleaved ("repacked")
 * kernel, and its generic paths (tinyBLAS, or one dot product per row and column) run those
 * small products far below what the cores can do: on Qwen3-0.6B's shape in Q8_0 the layer
 * matmuls were ~2/3 of an 8-row step. The tile layout that made butter's output projection
 * 4x faster at 8 rows (q8_0_tiles.h) serves any Q8_0 matrix, and the other types get the
 * same layout with their values kept packed (q6_k_tiles.h, q4_k_q5_k_tiles.h,
 * q4_1_q5_0_tiles.h).
 *
 * Q4_K is the one type here that llama.cpp's x86 code does repack: its interleaved kernel
 * is fast for one row, but multiplies rows four at a time from four rows on, rounding
 * otherwise than one by one, and its cost grows with every row. Here every row is computed
 * as it would be alone at any row count, and a few rows cost little more than one (which
 * is what verifying draft tokens and batching streams need); so this buffer type goes
 * before llama.cpp's repacking in its list, and takes the Q4_K layer weights first.
 *
 * How: the way llama.cpp's own repacked kernels plug in. The CPU backend keeps a list of
 * "extra" buffer types; when it loads a model, it offers each weight to them in order, and
 * the first whose `supports_op` accepts the weight's op gets to store it, in its own
 * layout (`set_tensor`). When the graph runs, the CPU backend asks the extra buffer types
 * first for every node, and a matmul whose weight lives here runs here, on the CPU
 * backend's own threads, with its own work buffer and barrier. So this file adds a buffer
 * type to that list, before the first model is loaded, and accepts exactly one thing: a
 * layer's plain 2-D weight of one of those types multiplied by f32 activations. Everything else
 * (other types, other ops, anything llama.cpp's repacking takes first) stays with
 * llama.cpp.
 *
 * Same numbers as llama.cpp: see the two headers (exact integer block dot products, the
 * same activation quantization, float sums over blocks in another order). A row's result
 * never depends on the other rows of the batch.
 *
 * The boundary (ctypes and C++ ABI, which check nothing themselves):
 * - No ggml header is needed to build this file: the few ggml structures it touches are
 *   mirrored below from the ggml that llama-cpp-python 0.3.36 vendors. Python
 *   (butter/backends/llama_cpp/layer_matmul.py) checks the mirror against the running
 *   library before registering anything: ggml's own type and op names for the enum
 *   values, its tensor size, and every field the kernel reads or writes, read through the
 *   mirror from tensors and buffers the running ggml made (butter_layer_matmul_check_mirror).
 *   Any mismatch and nothing is registered; llama.cpp computes as before.
 * - Once registered, every kernel computes probe products through a real ggml graph, the
 *   weight stored here, against the same product computed by llama.cpp
 *   (butter_layer_matmul_self_check); a type whose kernel disagrees is not accepted.
 * - ggml's functions come in as pointers from Python (resolved by the names
 *   butter_layer_matmul_function_names lists, in llama_cpp's own copies of the
 *   libraries), checked non-null.
 * - Change an exported signature or the counters and bump BUTTER_LAYER_MATMUL_ABI_VERSION.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "q4_1_q5_0_tiles.h"
#include "q4_k_q5_k_tiles.h"
#include "q6_k_tiles.h"
#include "q8_0_tiles.h"
#include "decode_attention.h"
#include "prompt_attention.h"

#define BUTTER_LAYER_MATMUL_ABI_VERSION 11

/* Status codes of the exported functions. */
#define BUTTER_OK 0
#define BUTTER_DECLINED 1      /* no kernel for this CPU: nothing registered */
#define BUTTER_E_ARGUMENT (-2) /* a pointer is null */
#define BUTTER_E_STATE (-3)    /* registered already, or not bound/registered yet */

/* Instruction sets of the kernels (butter_layer_matmul_best_isa, _register). */
#define ISA_NONE 0
#define ISA_AVX2 1
#define ISA_AVX512_VNNI 2

/* Weight types, as bits of the masks of _register and _enable_types. */
#define TYPE_BIT_Q8_0 1
#define TYPE_BIT_Q6_K 2
#define TYPE_BIT_Q5_K 4
#define TYPE_BIT_Q4_1 8
#define TYPE_BIT_Q5_0 16
#define TYPE_BIT_Q4_K 32

/* butter_layer_matmul_counters: Q8_0, Q6_K and Q5_K matrices, packed bytes, matmuls, rows,
 * Q4_1, Q5_0 and Q4_K matrices, attentions computed and their query rows */
#define COUNTERS 11

namespace ggml_mirror {

/* ggml.h (llama-cpp-python 0.3.36's vendored ggml). */
constexpr int MAX_DIMS = 4;
constexpr int MAX_OP_PARAMS = 64;
constexpr int MAX_SRC = 10;
constexpr int MAX_NAME = 64;
constexpr int TYPE_F32 = 0;
constexpr int TYPE_F16 = 1;
constexpr int TYPE_Q8_0 = 8;
constexpr int TYPE_Q5_K = 13;
constexpr int TYPE_Q4_K = 12;
constexpr int TYPE_Q4_1 = 3;
constexpr int TYPE_Q5_0 = 6;
constexpr int TYPE_Q6_K = 14;
constexpr int OP_MUL_MAT = 29;
constexpr int OP_FLASH_ATTN_EXT = 74;
constexpr int STATUS_SUCCESS = 0;

struct backend_buffer;
struct backend_buffer_type;

struct tensor {
    int type;
    backend_buffer *buffer;
    int64_t ne[MAX_DIMS];
    size_t nb[MAX_DIMS];
    int op;
    int32_t op_params[MAX_OP_PARAMS / sizeof(int32_t)];
    int32_t flags;
    tensor *src[MAX_SRC];
    tensor *view_src;
    size_t view_offs;
    void *data;
    char name[MAX_NAME];
    void *extra;
    char padding[8];
};

/* ggml-backend-impl.h */
struct backend_buffer_type_i {
    const char *(*get_name)(backend_buffer_type *buft);
    backend_buffer *(*alloc_buffer)(backend_buffer_type *buft, size_t size);
    size_t (*get_alignment)(backend_buffer_type *buft);
    size_t (*get_max_size)(backend_buffer_type *buft);
    size_t (*get_alloc_size)(backend_buffer_type *buft, const tensor *t);
    bool (*is_host)(backend_buffer_type *buft);
};

struct backend_buffer_type {
    backend_buffer_type_i iface;
    void *device;
    void *context;
};

struct backend_buffer_i {
    void (*free_buffer)(backend_buffer *buffer);
    void *(*get_base)(backend_buffer *buffer);
    int (*init_tensor)(backend_buffer *buffer, tensor *t);
    void (*memset_tensor)(backend_buffer *buffer, tensor *t, uint8_t value, size_t offset,
                          size_t size);
    void (*set_tensor)(backend_buffer *buffer, tensor *t, const void *data, size_t offset,
                       size_t size);
    void (*get_tensor)(backend_buffer *buffer, const tensor *t, void *data, size_t offset,
                       size_t size);
    void (*set_tensor_2d)(backend_buffer *buffer, tensor *t, const void *data, size_t offset,
                          size_t size, size_t n_copies, size_t stride_tensor,
                          size_t stride_data);
    void (*get_tensor_2d)(backend_buffer *buffer, const tensor *t, void *data, size_t offset,
                          size_t size, size_t n_copies, size_t stride_tensor,
                          size_t stride_data);
    bool (*cpy_tensor)(backend_buffer *buffer, const tensor *src, tensor *dst);
    void (*clear)(backend_buffer *buffer, uint8_t value);
    void (*reset)(backend_buffer *buffer);
};

struct backend_buffer {
    backend_buffer_i iface;
    backend_buffer_type *buft;
    void *context;
    size_t size;
    int usage;
};

/* ggml-cpu-impl.h */
struct compute_params {
    int ith, nth;
    size_t wsize;
    void *wdata;
    void *threadpool;
    bool use_ref;
};

/* ggml-cpu/traits.h: the two interfaces the CPU backend calls through (same virtual
 * functions in the same order, so the same vtable layout). */
class tensor_traits {
  public:
    virtual ~tensor_traits() {}
    virtual bool work_size(int n_threads, const tensor *op, size_t &size) = 0;
    virtual bool compute_forward(compute_params *params, tensor *op) = 0;
};

class extra_buffer_type {
  public:
    virtual ~extra_buffer_type() {}
    virtual bool supports_op(void *dev, const tensor *op) = 0;
    virtual tensor_traits *get_tensor_traits(const tensor *op) = 0;
};

}  // namespace ggml_mirror

namespace {

using ggml_mirror::backend_buffer;
using ggml_mirror::backend_buffer_type;
using ggml_mirror::tensor;

struct init_params {
    size_t mem_size;
    void *mem_buffer;
    bool no_alloc;
};

/* ggml's functions, from llama_cpp's libraries (butter_layer_matmul_bind), in the order of
 * FUNCTION_NAMES. */
#define FUNCTION_NAMES                                                                      \
    "_Z39ggml_backend_cpu_get_extra_buffer_typesv,ggml_backend_cpu_buffer_type,"            \
    "ggml_backend_buft_alloc_buffer,ggml_backend_buft_is_host,ggml_barrier,ggml_nbytes,"    \
    "quantize_row_q8_K,ggml_init,ggml_free,ggml_new_tensor_2d,ggml_set_name,ggml_view_2d,"  \
    "ggml_mul_mat,ggml_new_graph,ggml_build_forward_expand,ggml_graph_compute_with_ctx,"    \
    "ggml_get_data,ggml_row_size,ggml_quantize_chunk,"                                      \
    "ggml_backend_alloc_ctx_tensors_from_buft,ggml_backend_tensor_set,"                     \
    "ggml_backend_buffer_free,ggml_backend_buffer_get_base,ggml_backend_buffer_get_size,"   \
    "ggml_backend_buft_get_device,ggml_new_tensor_3d,ggml_flash_attn_ext,"                  \
    "ggml_fp32_to_fp16_row"
constexpr size_t FUNCTION_COUNT = 28;

struct Ggml {
    std::vector<backend_buffer_type *> &(*extra_buffer_types)();
    backend_buffer_type *(*cpu_buffer_type)();
    backend_buffer *(*buft_alloc_buffer)(backend_buffer_type *buft, size_t size);
    bool (*buft_is_host)(backend_buffer_type *buft);
    void (*barrier)(void *threadpool);
    size_t (*nbytes)(const tensor *t);
    void (*quantize_row_q8_k)(const float *x, void *y, int64_t k);
    /* for the mirror check and the self-check */
    void *(*init)(init_params params);
    void (*free)(void *ctx);
    tensor *(*new_tensor_2d)(void *ctx, int type, int64_t ne0, int64_t ne1);
    tensor *(*set_name)(tensor *t, const char *name);
    tensor *(*view_2d)(void *ctx, tensor *a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset);
    tensor *(*mul_mat)(void *ctx, tensor *a, tensor *b);
    void *(*new_graph)(void *ctx);
    void (*build_forward_expand)(void *graph, tensor *t);
    int (*graph_compute_with_ctx)(void *ctx, void *graph, int n_threads);
    void *(*get_data)(const tensor *t);
    size_t (*row_size)(int type, int64_t ne);
    size_t (*quantize_chunk)(int type, const float *src, void *dst, int64_t start, int64_t nrows,
                             int64_t n_per_row, const float *imatrix);
    backend_buffer *(*alloc_ctx_tensors_from_buft)(void *ctx, backend_buffer_type *buft);
    void (*tensor_set)(tensor *t, const void *data, size_t offset, size_t size);
    void (*buffer_free)(backend_buffer *buffer);
    void *(*buffer_get_base)(backend_buffer *buffer);
    size_t (*buffer_get_size)(backend_buffer *buffer);
    void *(*buft_get_device)(backend_buffer_type *buft);
    /* for the attention probe */
    tensor *(*new_tensor_3d)(void *ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2);
    tensor *(*flash_attn_ext)(void *ctx, tensor *q, tensor *k, tensor *v, tensor *mask,
                              float scale, float max_bias, float logit_softcap);
    void (*fp32_to_fp16_row)(const float *x, uint16_t *y, int64_t n);
};
static_assert(sizeof(Ggml) == FUNCTION_COUNT * sizeof(void *), "one pointer per name");

Ggml ggml;
bool bound = false;
bool registered = false;
int kernel_isa = ISA_NONE; /* the kernels that run (chosen at registration) */
/* The types whose new weights may be placed here (the self-checks narrow it). */
std::atomic<int> enabled_types{0};
/* While the self-check runs, what it stores and computes is not counted. */
std::atomic<bool> probing{false};
/* Whether new weights may be placed here (butter_layer_matmul_accept). Matmuls on weights
 * already here always run here: nothing else can read the layout. */
std::atomic<bool> accepting{false};

std::atomic<int64_t> q8_0_matrices{0}, q6_k_matrices{0}, q5_k_matrices{0}, q4_1_matrices{0},
    q5_0_matrices{0}, q4_k_matrices{0}, packed_bytes{0},
    matmuls{0}, matmul_rows{0}, probe_matmuls{0};

constexpr size_t ALIGN = 64;

size_t aligned(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/* The tiled layout of a K x N Q8_0 matrix (K columns per row, N rows), in one block of
 * memory: int8 weights, then fp16 scales, then int16 block sums (q8_0_tiles.h). */
struct Q8Layout {
    int64_t nb, n_tiles, padded_blocks;
    int8_t *wq;
    uint16_t *wd;
    int16_t *wsum;

    Q8Layout(const tensor *w, void *data) {
        nb = w->ne[0] / QK;
        n_tiles = (w->ne[1] + LANES - 1) / LANES;
        padded_blocks = n_tiles * LANES * nb;
        wq = (int8_t *)data;
        wd = (uint16_t *)(wq + aligned((size_t)padded_blocks * QK));
        wsum = (int16_t *)((char *)wd + aligned((size_t)padded_blocks * sizeof(uint16_t)));
    }

    size_t bytes() const {
        return aligned((size_t)padded_blocks * QK) +
               2 * aligned((size_t)padded_blocks * sizeof(uint16_t));
    }
};

/* The tiled layouts of a K x N Q4_1 or Q5_0 matrix (q4_1_q5_0_tiles.h). */
size_t nibble_bytes(const tensor *w, size_t tile_block_bytes) {
    return (size_t)((w->ne[1] + LANES - 1) / LANES * (w->ne[0] / QK)) * tile_block_bytes;
}

/* The tiled layouts of a K x N Q6_K, Q5_K or Q4_K matrix (q6_k_tiles.h, q4_k_q5_k_tiles.h). */
size_t k_quant_bytes(const tensor *w, size_t tile_block_bytes) {
    return (size_t)((w->ne[1] + LANES - 1) / LANES * (w->ne[0] / QK_K)) * tile_block_bytes;
}

/* The best kernel this CPU runs. */
int best_isa() {
#ifdef BUTTER_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c")) {
        return ISA_NONE;
    }
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni")) {
        return ISA_AVX512_VNNI;
    }
    return ISA_AVX2;
#else
    return ISA_NONE;
#endif
}

int type_bit(int type) {
    switch (type) {
    case ggml_mirror::TYPE_Q8_0: return TYPE_BIT_Q8_0;
    case ggml_mirror::TYPE_Q6_K: return TYPE_BIT_Q6_K;
    case ggml_mirror::TYPE_Q5_K: return TYPE_BIT_Q5_K;
    case ggml_mirror::TYPE_Q4_K: return TYPE_BIT_Q4_K;
    case ggml_mirror::TYPE_Q4_1: return TYPE_BIT_Q4_1;
    case ggml_mirror::TYPE_Q5_0: return TYPE_BIT_Q5_0;
    default: return 0;
    }
}

backend_buffer_type *buffer_type();

/* A layer's weight ("blk.N..."). The output matrix is left in llama.cpp's buffer, which maps
 * the file: butter's output projection (lmhead.c) computes the logits from its own copy,
 * and a second packed copy here would cost its size in memory for a path rarely taken. */
bool is_layer_weight(const tensor *w) { return strncmp(w->name, "blk.", 4) == 0; }

bool is_k_quant(int type) {
    return type == ggml_mirror::TYPE_Q6_K || type == ggml_mirror::TYPE_Q5_K ||
           type == ggml_mirror::TYPE_Q4_K;
}

/* Q4_1 and Q5_0: 32-weight blocks of 4-bit values (q4_1_q5_0_tiles.h). */
bool is_nibble_type(int type) {
    return type == ggml_mirror::TYPE_Q4_1 || type == ggml_mirror::TYPE_Q5_0;
}

/* A plain 2-D matrix of a type this file multiplies: Q8_0, Q6_K, Q5_K, Q4_K, Q4_1 or Q5_0. */
bool is_supported_weight(const tensor *w) {
    if (w == nullptr || w->ne[2] != 1 || w->ne[3] != 1 || w->view_src != nullptr) {
        return false;
    }
    return ((w->type == ggml_mirror::TYPE_Q8_0 || is_nibble_type(w->type)) &&
            w->ne[0] % QK == 0) ||
           (is_k_quant(w->type) && w->ne[0] % QK_K == 0);
}

/* The activation rows of a matmul: src1's ne[1] x ne[2] x ne[3] rows of K floats. */
int64_t activation_rows(const tensor *x) { return x->ne[1] * x->ne[2] * x->ne[3]; }

/* Bytes of one activation row once quantized for the weight's type: Q8_0 bytes and their
 * float scales (Q4_1, Q5_0: and a float per block more), or ggml's Q8_K blocks. */
size_t quantized_row_bytes(const tensor *w) {
    const int64_t k = w->ne[0];
    if (is_k_quant(w->type)) {
        return (size_t)(k / QK_K) * Q8_K_BLOCK_BYTES;
    }
    const size_t floats = is_nibble_type(w->type) ? 2 : 1;
    return (size_t)k + (size_t)(k / QK) * floats * sizeof(float);
}

/* Work buffer: the quantized rows, and one row of floats per thread to gather a row that
 * is not contiguous. */
size_t work_bytes(int n_threads, const tensor *op) {
    const tensor *x = op->src[1];
    return aligned((size_t)activation_rows(x) * quantized_row_bytes(op->src[0])) +
           (size_t)n_threads * aligned((size_t)x->ne[0] * sizeof(float)) + ALIGN;
}

#ifdef BUTTER_X86

const float *activation_row(const tensor *x, int64_t row, float *gather) {
    const int64_t i1 = row % x->ne[1], i2 = row / x->ne[1] % x->ne[2],
                  i3 = row / (x->ne[1] * x->ne[2]);
    const char *base = (const char *)x->data + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3];
    if (x->nb[0] == sizeof(float)) {
        return (const float *)base;
    }
    for (int64_t i = 0; i < x->ne[0]; i++) {
        gather[i] = *(const float *)(base + i * x->nb[0]);
    }
    return gather;
}

/* One pass of R activation rows (from row r) over tile t of a Q8_0 matrix, with the VNNI
 * kernel (rows quantized with offset 128) or the AVX2 kernel (offset 0). */
struct Q8Pass {
    Q8Layout layout;
    const uint8_t *xq; /* rows of k bytes */
    const float *xd;   /* their block scales, k / 32 per row */
    int64_t k;
    bool vnni;

    void operator()(int64_t t, int64_t r, int R, float *out, int64_t out_stride,
                    int lanes) const {
        if (vnni) {
            q8_tile_pass(layout.wq, layout.wd, layout.wsum, layout.nb, t, R, xq + r * k,
                         xd + r * layout.nb, out, out_stride, lanes);
        } else {
            q8_tile_pass_avx2(layout.wq, layout.wd, layout.nb, t, R, xq + r * k,
                              xd + r * layout.nb, out, out_stride, lanes);
        }
    }
};

/* The same over a Q4_1 or Q5_0 matrix: the rows' bytes, their scales and their sums. */
struct NibblePass {
    const uint8_t *w;
    const uint8_t *xq;
    const float *xd, *xs;
    int64_t nb;
    bool q4_1, vnni;

    void operator()(int64_t t, int64_t r, int R, float *out, int64_t out_stride,
                    int lanes) const {
        const int64_t k = nb * QK;
        if (vnni) {
            q4_1_q5_0_tile_pass(w, nb, t, R, q4_1, xq + r * k, xd + r * nb, xs + r * nb, out,
                                out_stride, lanes);
        } else {
            q4_1_q5_0_tile_pass_avx2(w, nb, t, R, q4_1, xq + r * k, xd + r * nb, xs + r * nb,
                                     out, out_stride, lanes);
        }
    }
};

/* The same over a K-quant matrix (Q6_K, Q5_K or Q4_K: `tile_pass` is the type's kernel for the
 * instruction set), the activations as ggml's Q8_K rows. */
typedef void (*KQuantTilePass)(const uint8_t *w, int64_t nbk, int64_t t, int R,
                               const uint8_t *x, int64_t x_stride, float *out,
                               int64_t out_stride, int lanes);

struct KQuantPass {
    KQuantTilePass tile_pass;
    const uint8_t *w;
    const uint8_t *xq;
    int64_t nbk;
    int64_t row_bytes;

    void operator()(int64_t t, int64_t r, int R, float *out, int64_t out_stride,
                    int lanes) const {
        tile_pass(w, nbk, t, R, xq + r * row_bytes, row_bytes, out, out_stride, lanes);
    }
};

/* This thread's share of the tiles, for every activation row: a tile's weights stay in
 * cache across the passes of 8 rows. */
template <class Pass>
void multiply_tiles(const ggml_mirror::compute_params *params, tensor *dst,
                                int64_t rows, const Pass &pass) {
    const tensor *x = dst->src[1];
    const int64_t n = dst->src[0]->ne[1], n_tiles = (n + LANES - 1) / LANES;
    const int64_t first = n_tiles * params->ith / params->nth;
    const int64_t last = n_tiles * (params->ith + 1) / params->nth;
    for (int64_t t = first; t < last; t++) {
        const int lanes = (int)(n - t * LANES < LANES ? n - t * LANES : LANES);
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
            const int R = (int)(rows - r0 < ROWS_PER_PASS ? rows - r0 : ROWS_PER_PASS);
            /* Rows of dst are evenly spaced within one (i2, i3) slice only: a pass that
             * would cross slices takes each row on its own. */
            const int64_t i1 = r0 % x->ne[1];
            if (i1 + R <= x->ne[1]) {
                const int64_t slice = r0 / x->ne[1];
                char *out = (char *)dst->data + i1 * dst->nb[1] +
                            slice % dst->ne[2] * dst->nb[2] + slice / dst->ne[2] * dst->nb[3];
                pass(t, r0, R, (float *)out + t * LANES, (int64_t)(dst->nb[1] / sizeof(float)),
                     lanes);
                continue;
            }
            for (int64_t r = r0; r < r0 + R; r++) {
                const int64_t j1 = r % x->ne[1], slice = r / x->ne[1];
                char *out = (char *)dst->data + j1 * dst->nb[1] +
                            slice % dst->ne[2] * dst->nb[2] + slice / dst->ne[2] * dst->nb[3];
                pass(t, r, 1, (float *)out + t * LANES, 0, lanes);
            }
        }
    }
}

/* The K-quant kernel for a weight type and the registered instruction set. */
KQuantTilePass k_quant_tile_pass(int type) {
    const bool vnni = kernel_isa == ISA_AVX512_VNNI;
    if (type == ggml_mirror::TYPE_Q6_K) {
        return vnni ? q6_tile_pass : q6_tile_pass_avx2;
    }
    if (type == ggml_mirror::TYPE_Q5_K) {
        return vnni ? qk45_tile_pass<5> : qk45_tile_pass_avx2<5>;
    }
    return vnni ? qk45_tile_pass<4> : qk45_tile_pass_avx2<4>;
}

/* Waits for the other threads of this op (none when the op runs on one). */
void barrier(const ggml_mirror::compute_params *params) {
    if (params->nth > 1) {
        ggml.barrier(params->threadpool);
    }
}

/* dst = x * w^T, shared by the CPU backend's threads (each calls this with its ith): the
 * activations are quantized by all threads, then each multiplies its share of the tiles. */
void multiply(ggml_mirror::compute_params *params, tensor *dst) {
    const tensor *w = dst->src[0];
    const tensor *x = dst->src[1];
    const int64_t k = w->ne[0], rows = activation_rows(x);
    uint8_t *xq = (uint8_t *)(((uintptr_t)params->wdata + ALIGN - 1) / ALIGN * ALIGN);
    float *gather = (float *)(xq + aligned((size_t)rows * quantized_row_bytes(w)) +
                              (size_t)params->ith * aligned((size_t)k * sizeof(float)));
    if (is_nibble_type(w->type)) {
        const int64_t nb = k / QK;
        const bool q4_1 = w->type == ggml_mirror::TYPE_Q4_1;
        float *xd = (float *)(xq + rows * k), *xs = xd + rows * nb;
        for (int64_t r = params->ith; r < rows; r += params->nth) {
            q8_quantize_row_sums(activation_row(x, r, gather), k, q4_1, xq + r * k, xd + r * nb,
                                 xs + r * nb);
        }
        barrier(params);
        multiply_tiles(params, dst, rows,
                       NibblePass{(const uint8_t *)w->data, xq, xd, xs, nb, q4_1,
                                  kernel_isa == ISA_AVX512_VNNI});
    } else if (is_k_quant(w->type)) {
        const int64_t row_bytes = (int64_t)quantized_row_bytes(w);
        for (int64_t r = params->ith; r < rows; r += params->nth) {
            ggml.quantize_row_q8_k(activation_row(x, r, gather), xq + r * row_bytes, k);
        }
        barrier(params);
        multiply_tiles(params, dst, rows,
                       KQuantPass{k_quant_tile_pass(w->type), (const uint8_t *)w->data, xq,
                                  k / QK_K, row_bytes});
    } else {
        const int64_t nb = k / QK;
        const bool vnni = kernel_isa == ISA_AVX512_VNNI;
        float *xd = (float *)(xq + rows * k); /* (k is a multiple of 32: 4-byte aligned) */
        for (int64_t r = params->ith; r < rows; r += params->nth) {
            q8_quantize_row(activation_row(x, r, gather), k, vnni ? 128 : 0, xq + r * k,
                            xd + r * nb);
        }
        barrier(params);
        multiply_tiles(params, dst, rows, Q8Pass{Q8Layout(w, w->data), xq, xd, k, vnni});
    }
    if (params->ith == 0) {
        if (probing.load()) {
            probe_matmuls.fetch_add(1, std::memory_order_relaxed);
        } else {
            matmuls.fetch_add(1, std::memory_order_relaxed);
            matmul_rows.fetch_add(rows, std::memory_order_relaxed);
        }
    }
}

#endif /* BUTTER_X86 */

class Traits : public ggml_mirror::tensor_traits {
    bool work_size(int n_threads, const tensor *op, size_t &size) override {
        size = work_bytes(n_threads, op);
        return true;
    }

    bool compute_forward(ggml_mirror::compute_params *params, tensor *op) override {
        if (op->op != ggml_mirror::OP_MUL_MAT) {
            return false;
        }
#ifdef BUTTER_X86
        multiply(params, op);
        return true;
#else
        return false;
#endif
    }
};

Traits traits;

/* Decode attention (decode_attention.h): with `decode_attention` on, a flash attention of
 * fewer than ATTENTION_MAX_ROWS query rows over an f16 or f32 cache is computed here, every
 * row the same way whatever the step holds; anything else stays with llama.cpp. Turned on
 * and off between graph computations (a graph is planned and computed under one setting). */
std::atomic<bool> decode_attention{false};
/* Prompt attention (prompt_attention.h): with `prompt_attention` on, one of ATTENTION_MAX_ROWS
 * query rows or more, each row's bits those decode_attention.h gives it alone. */
std::atomic<bool> prompt_attention{false};
std::atomic<int64_t> attentions{0}, attention_rows{0}, probe_attentions{0};

bool is_f16_or_f32(const tensor *t) {
    return t->type == ggml_mirror::TYPE_F16 || t->type == ggml_mirror::TYPE_F32;
}

size_t element_bytes(const tensor *t) { return t->type == ggml_mirror::TYPE_F16 ? 2 : 4; }

/* Whether butter can compute this op (any row count): shapes and types decode_attention.h
 * and prompt_attention.h handle. */
bool takes_attention(const tensor *op) {
    if (op->op != ggml_mirror::OP_FLASH_ATTN_EXT || kernel_isa == ISA_NONE) {
        return false;
    }
    const tensor *q = op->src[0], *k = op->src[1], *v = op->src[2], *mask = op->src[3],
                 *sinks = op->src[4];
    if (q == nullptr || k == nullptr || v == nullptr || q->type != ggml_mirror::TYPE_F32 ||
        !is_f16_or_f32(k) || !is_f16_or_f32(v)) {
        return false;
    }
    const int64_t dk = k->ne[0], dv = v->ne[0];
    return dk % 8 == 0 && dv % 8 == 0 && q->ne[0] == dk &&
           k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0 && v->ne[2] == k->ne[2] &&
           v->ne[1] == k->ne[1] && q->ne[3] == k->ne[3] && v->ne[3] == k->ne[3] &&
           q->nb[0] == sizeof(float) && k->nb[0] == element_bytes(k) &&
           v->nb[0] == element_bytes(v) &&
           (mask == nullptr || (mask->type == ggml_mirror::TYPE_F16 &&
                                mask->nb[0] == sizeof(uint16_t) && mask->ne[0] >= k->ne[1] &&
                                mask->ne[1] >= q->ne[1] && mask->ne[2] == 1)) &&
           (sinks == nullptr || sinks->type == ggml_mirror::TYPE_F32) &&
           op->nb[0] == sizeof(float) && op->ne[0] == dv;
}

AttentionView attention_view(const tensor *op) {
    const tensor *q = op->src[0], *k = op->src[1], *v = op->src[2], *mask = op->src[3],
                 *sinks = op->src[4];
    AttentionView a{};
    a.dk = k->ne[0], a.dv = v->ne[0];
    a.rows = q->ne[1], a.heads = q->ne[2], a.kv_heads = k->ne[2], a.cells = k->ne[1];
    a.seqs = q->ne[3];
    a.q = (const char *)q->data, a.q_row = q->nb[1], a.q_head = q->nb[2], a.q_seq = q->nb[3];
    a.k = (const char *)k->data, a.k_cell = k->nb[1], a.k_head = k->nb[2], a.k_seq = k->nb[3];
    a.v = (const char *)v->data, a.v_cell = v->nb[1], a.v_head = v->nb[2], a.v_seq = v->nb[3];
    a.k_f16 = k->type == ggml_mirror::TYPE_F16, a.v_f16 = v->type == ggml_mirror::TYPE_F16;
    if (mask != nullptr) {
        a.mask = (const uint16_t *)mask->data;
        a.mask_row = mask->nb[1], a.mask_seq = mask->nb[3], a.mask_seqs = mask->ne[3];
    }
    a.sinks = sinks != nullptr ? (const float *)sinks->data : nullptr;
    a.dst = (char *)op->data, a.dst_row = op->nb[1];
    memcpy(&a.scale, (const float *)op->op_params + 0, sizeof(float));
    memcpy(&a.max_bias, (const float *)op->op_params + 1, sizeof(float));
    memcpy(&a.softcap, (const float *)op->op_params + 2, sizeof(float));
    if (a.softcap != 0.0f) {
        a.scale /= a.softcap; /* llama.cpp's order: tanh of the scaled score, times the cap */
    }
    return a;
}

/* The work buffer holds the cells each row sees and, for a wave of rows (as many as fit in
 * ATTENTION_WAVE_BYTES, at least one: more rows take more waves), decode_attention.h's
 * AttentionWave. */
constexpr size_t ATTENTION_WAVE_BYTES = (size_t)16 << 20;

struct AttentionWork {
    int64_t rows, heads, kv_heads, dv, cells, stride, chunks, wave_rows;
    size_t cells_bytes, scores_bytes, maxima_bytes, ranges_bytes, weight_bytes, value_bytes;

    explicit AttentionWork(const tensor *op) {
        const tensor *q = op->src[0], *k = op->src[1], *v = op->src[2];
        rows = q->ne[3] * q->ne[1];
        heads = q->ne[2], kv_heads = k->ne[2], dv = v->ne[0];
        cells = k->ne[1];
        chunks = attention_chunks(cells);
        stride = chunks * ATTENTION_CHUNK;
        cells_bytes = aligned((size_t)rows * (cells * sizeof(int32_t) + sizeof(int64_t)));
        const int64_t fit = (int64_t)(ATTENTION_WAVE_BYTES / wave_bytes_per_row());
        wave_rows = fit < 1 ? 1 : fit > rows ? rows : fit;
        scores_bytes = aligned((size_t)(wave_rows * heads * stride) * sizeof(float));
        maxima_bytes = aligned((size_t)(wave_rows * heads * chunks) * sizeof(float));
        ranges_bytes = aligned((size_t)(wave_rows * kv_heads * chunks) * sizeof(float));
        weight_bytes = aligned((size_t)(wave_rows * heads * chunks) * sizeof(int64_t));
        value_bytes = aligned((size_t)(wave_rows * heads * chunks * dv) * sizeof(int32_t));
    }

    /* One row's share of a wave: its scores, maxima, ranges and sums. */
    size_t wave_bytes_per_row() const {
        return (size_t)(heads * stride) * sizeof(float) +
               (size_t)(heads * chunks) * (sizeof(float) + sizeof(int64_t)) +
               (size_t)(kv_heads * chunks) * sizeof(float) +
               (size_t)(heads * chunks * dv) * sizeof(int32_t);
    }

    size_t bytes() const {
        return cells_bytes + scores_bytes + maxima_bytes + ranges_bytes + weight_bytes +
               value_bytes + ALIGN;
    }

    AttentionWave wave(char *base) const {
        char *at = base + cells_bytes;
        AttentionWave w{};
        w.scores = (float *)at, at += scores_bytes;
        w.maxima = (float *)at, at += maxima_bytes;
        w.ranges = (float *)at, at += ranges_bytes;
        w.weight_units = (int64_t *)at, at += weight_bytes;
        w.value_units = (int32_t *)at;
        w.stride = stride, w.chunks = chunks, w.heads = heads, w.kv_heads = kv_heads;
        w.dv = dv;
        return w;
    }
};

#ifdef BUTTER_X86

/* A run of a wave's tasks (row, chunk, KV head; KV heads of a chunk next to each other: a
 * cache stores a cell's heads side by side, so they share cache lines) in one phase. Only
 * the chunks a row sees are tasks, shared evenly: the view spans every stream's cells (and
 * cached prefixes'), so splitting all of its chunks would leave a thread whose share of the
 * view no row sees with nothing to do. */
template <typename Phase>
void attention_tasks(const ggml_mirror::compute_params *params, const AttentionView &a,
                     const AttentionWork &work, int64_t first_row, int64_t wave_rows,
                     const int64_t *seen, const int32_t *cells, Phase phase) {
    int64_t tasks = 0;
    for (int64_t row = 0; row < wave_rows; row++) {
        tasks += attention_chunks(seen[first_row + row]) * a.kv_heads;
    }
    const int64_t first_task = tasks * params->ith / params->nth,
                  end_task = tasks * (params->ith + 1) / params->nth;
    int64_t row = 0, row_first_task = 0; /* the row holding task t, and its first task */
    for (int64_t t = first_task; t < end_task; t++) {
        int64_t r = first_row + row;
        while (t >= row_first_task + attention_chunks(seen[r]) * a.kv_heads) {
            row_first_task += attention_chunks(seen[r]) * a.kv_heads;
            r = first_row + ++row;
        }
        const int64_t kv_head = (t - row_first_task) % a.kv_heads,
                      c = (t - row_first_task) / a.kv_heads;
        const int64_t first = c * ATTENTION_CHUNK;
        const int64_t n = seen[r] - first < ATTENTION_CHUNK ? seen[r] - first : ATTENTION_CHUNK;
        phase(r / a.rows, r % a.rows, row, kv_head, c, attention_chunks(seen[r]),
              cells + r * work.cells + first, n);
    }
}

/* Each row over the cells it sees, in three phases with a barrier after each: scores (and
 * each chunk's largest score and |value|), then each chunk's weights and fixed-point sums
 * (the row's largest score and |value| known by then), then each (row, head)'s result from
 * the sums of its chunks. Integers add up to the same in any order, so where in the cache
 * a row's cells lie, and in which order, changes no bit of its result. */
void attend(ggml_mirror::compute_params *params, tensor *op) {
    const AttentionView a = attention_view(op);
    const AttentionWork work(op);
    const int ith = params->ith, nth = params->nth;
    char *base = (char *)(((uintptr_t)params->wdata + ALIGN - 1) / ALIGN * ALIGN);
    int64_t *seen = (int64_t *)base;           /* per row: how many cells */
    int32_t *cells = (int32_t *)(seen + work.rows); /* per row: which, in order */
    const AttentionWave wave = work.wave(base);
    for (int64_t r = ith; r < work.rows; r += nth) {
        seen[r] = attention_visible(a, r / a.rows, r % a.rows, cells + r * work.cells);
    }
    barrier(params);
    for (int64_t first_row = 0; first_row < work.rows; first_row += work.wave_rows) {
        const int64_t rows = work.rows - first_row < work.wave_rows ? work.rows - first_row
                                                                    : work.wave_rows;
        attention_tasks(params, a, work, first_row, rows, seen, cells,
                        [&](int64_t seq, int64_t query_row, int64_t row, int64_t kv_head,
                            int64_t chunk, int64_t, const int32_t *listed, int64_t n) {
                            attention_score_chunk(a, wave, seq, query_row, row, kv_head, chunk,
                                                  listed, n);
                        });
        barrier(params);
        attention_tasks(params, a, work, first_row, rows, seen, cells,
                        [&](int64_t seq, int64_t, int64_t row, int64_t kv_head, int64_t chunk,
                            int64_t chunks, const int32_t *listed, int64_t n) {
                            attention_weigh_chunk(a, wave, seq, row, kv_head, chunk, chunks,
                                                  listed, n);
                        });
        barrier(params);
        for (int64_t p = ith; p < rows * a.heads; p += nth) {
            const int64_t row = p / a.heads, r = first_row + row;
            attention_finish(a, wave, r / a.rows, r % a.rows, row, p % a.heads,
                             attention_chunks(seen[r]));
        }
        if (first_row + work.wave_rows < work.rows) {
            barrier(params); /* the next wave writes over this one's work */
        }
    }
    if (ith == 0) {
        if (probing.load()) {
            probe_attentions.fetch_add(1, std::memory_order_relaxed);
        } else {
            attentions.fetch_add(1, std::memory_order_relaxed);
            attention_rows.fetch_add(work.rows, std::memory_order_relaxed);
        }
    }
}

#endif /* BUTTER_X86 */

class DecodeAttention : public ggml_mirror::tensor_traits {
    bool work_size(int /*n_threads*/, const tensor *op, size_t &size) override {
        size = AttentionWork(op).bytes();
        return true;
    }

    bool compute_forward(ggml_mirror::compute_params *params, tensor *op) override {
#ifdef BUTTER_X86
        if (params->wsize < AttentionWork(op).bytes()) {
            return false; /* planned under the other setting: llama.cpp computes it */
        }
        attend(params, op);
        return true;
#else
        (void)params, (void)op;
        return false;
#endif
    }
};

DecodeAttention decode_attention_traits;

/* The bytes a prompt attention's threads work in: the next tile to take, then each
 * thread's own PromptScratch. */
size_t prompt_work_bytes(const tensor *op, int n_threads) {
    const AttentionView a = attention_view(op);
    return ALIGN + (size_t)n_threads * PromptScratch::bytes(a, PromptPlan(a), ALIGN) + ALIGN;
}

#ifdef BUTTER_X86

/* The threads take tiles (of every stream) one at a time, the last rows' first (a causal
 * prompt's later rows see more cells), until none is left: a tile is one thread's from
 * start to end, so which thread took it changes no bit. */
void attend_prompt(ggml_mirror::compute_params *params, tensor *op) {
    const AttentionView a = attention_view(op);
    const PromptPlan plan(a);
    char *base = (char *)(((uintptr_t)params->wdata + ALIGN - 1) / ALIGN * ALIGN);
    int64_t *taken = (int64_t *)base;
    const PromptScratch scratch(
        base + ALIGN + (size_t)params->ith * PromptScratch::bytes(a, plan, ALIGN), a, plan, ALIGN);
    if (params->ith == 0) {
        __atomic_store_n(taken, 0, __ATOMIC_RELAXED);
    }
    barrier(params);
    const int64_t tasks = a.seqs * plan.tiles;
    for (int64_t t = __atomic_fetch_add(taken, 1, __ATOMIC_RELAXED); t < tasks;
         t = __atomic_fetch_add(taken, 1, __ATOMIC_RELAXED)) {
        const int64_t last_first = tasks - 1 - t;
        prompt_tile(a, plan, scratch, last_first / plan.tiles, last_first % plan.tiles);
    }
    if (params->ith == 0) {
        if (probing.load()) {
            probe_attentions.fetch_add(1, std::memory_order_relaxed);
        } else {
            attentions.fetch_add(1, std::memory_order_relaxed);
            attention_rows.fetch_add(a.seqs * a.rows, std::memory_order_relaxed);
        }
    }
}

#endif /* BUTTER_X86 */

class PromptAttention : public ggml_mirror::tensor_traits {
    bool work_size(int n_threads, const tensor *op, size_t &size) override {
        size = prompt_work_bytes(op, n_threads);
        return true;
    }

    bool compute_forward(ggml_mirror::compute_params *params, tensor *op) override {
#ifdef BUTTER_X86
        if (params->wsize < prompt_work_bytes(op, params->nth)) {
            return false; /* planned under the other setting: llama.cpp computes it */
        }
        attend_prompt(params, op);
        return true;
#else
        (void)params, (void)op;
        return false;
#endif
    }
};

PromptAttention prompt_attention_traits;

ggml_mirror::tensor_traits *attention_path(const tensor *op) {
    if (!takes_attention(op)) {
        return nullptr;
    }
    const tensor *q = op->src[0], *k = op->src[1];
    if (q->ne[1] < ATTENTION_MAX_ROWS) {
        return decode_attention.load(std::memory_order_relaxed) ? &decode_attention_traits
                                                                : nullptr;
    }
    const bool fits = q->ne[2] / k->ne[2] <= PROMPT_TILE_PAIRS; /* a tile's pairs: on the stack */
    return fits && prompt_attention.load(std::memory_order_relaxed) ? &prompt_attention_traits
                                                                    : nullptr;
}

class TileBufferType : public ggml_mirror::extra_buffer_type {
    /* Asked at load (the weight has no data yet: may it live here?) and when the graph is
     * scheduled (it lives here: can this op run on it?). */
    bool supports_op(void *dev, const tensor *op) override {
        (void)dev;
        const tensor *w = op->src[0];
        const tensor *x = op->src[1];
        if (op->op != ggml_mirror::OP_MUL_MAT || !is_supported_weight(w) || x == nullptr ||
            x->type != ggml_mirror::TYPE_F32) {
            return false;
        }
        if (x->buffer != nullptr && !ggml.buft_is_host(x->buffer->buft)) {
            return false;
        }
        if (w->data != nullptr) {
            return true; /* stored here already: nothing else can compute with it */
        }
        return accepting.load() && is_layer_weight(w) && (enabled_types.load() & type_bit(w->type));
    }

    /* Asked for every op the CPU backend plans or computes, whatever holds its tensors. */
    ggml_mirror::tensor_traits *get_tensor_traits(const tensor *op) override {
        const tensor *w = op->src[0];
        if (op->op == ggml_mirror::OP_MUL_MAT && w != nullptr && w->buffer != nullptr &&
            w->buffer->buft == buffer_type()) {
            return (ggml_mirror::tensor_traits *)w->extra;
        }
        return attention_path(op);
    }
};

void fail(const char *what) {
    /* ggml's own answer to a broken invariant (GGML_ABORT): a weight that cannot be stored
     * would compute garbage. */
    fprintf(stderr, "butter layer matmul: %s\n", what);
    abort();
}

int init_tensor(backend_buffer *buffer, tensor *t) {
    (void)buffer;
    t->extra = &traits;
    return ggml_mirror::STATUS_SUCCESS;
}

size_t tiled_bytes(const tensor *t) {
    switch (t->type) {
    case ggml_mirror::TYPE_Q6_K: return k_quant_bytes(t, Q6_TILE_BLOCK_BYTES);
    case ggml_mirror::TYPE_Q5_K: return k_quant_bytes(t, QK45<5>::TILE_BLOCK_BYTES);
    case ggml_mirror::TYPE_Q4_K: return k_quant_bytes(t, QK45<4>::TILE_BLOCK_BYTES);
    case ggml_mirror::TYPE_Q4_1: return nibble_bytes(t, Q4_1_TILE_BLOCK_BYTES);
    case ggml_mirror::TYPE_Q5_0: return nibble_bytes(t, Q5_0_TILE_BLOCK_BYTES);
    default: return Q8Layout(t, nullptr).bytes();
    }
}

void set_tensor(backend_buffer *buffer, tensor *t, const void *data, size_t offset,
                size_t size) {
    (void)buffer;
    if (!is_supported_weight(t)) {
        fail("a tensor that is not a plain 2-D matrix of a type butter multiplies was stored");
    }
    if (offset != 0 || size != ggml.nbytes(t)) {
        fail("a weight was stored in parts");
    }
    std::atomic<int64_t> *stored = &q8_0_matrices;
    if (t->type == ggml_mirror::TYPE_Q6_K) {
        q6_tiles_pack((const uint8_t *)data, t->ne[1], t->ne[0] / QK_K, (uint8_t *)t->data);
        stored = &q6_k_matrices;
    } else if (t->type == ggml_mirror::TYPE_Q5_K) {
        qk45_tiles_pack<5>((const uint8_t *)data, t->ne[1], t->ne[0] / QK_K, (uint8_t *)t->data);
        stored = &q5_k_matrices;
    } else if (t->type == ggml_mirror::TYPE_Q4_K) {
        qk45_tiles_pack<4>((const uint8_t *)data, t->ne[1], t->ne[0] / QK_K, (uint8_t *)t->data);
        stored = &q4_k_matrices;
    } else if (is_nibble_type(t->type)) {
        const bool q4_1 = t->type == ggml_mirror::TYPE_Q4_1;
        q4_1_q5_0_tiles_pack((const uint8_t *)data, t->ne[1], t->ne[0] / QK, q4_1,
                             (uint8_t *)t->data);
        stored = q4_1 ? &q4_1_matrices : &q5_0_matrices;
    } else {
        const Q8Layout layout(t, t->data);
        q8_tiles_pack((const uint8_t *)data, t->ne[1], layout.nb, layout.wq, layout.wd,
                      layout.wsum);
    }
    if (!probing.load()) {
        stored->fetch_add(1, std::memory_order_relaxed);
        packed_bytes.fetch_add((int64_t)tiled_bytes(t), std::memory_order_relaxed);
    }
}

const char *get_name(backend_buffer_type *buft) {
    (void)buft;
    return "BUTTER_TILES";
}

backend_buffer *alloc_buffer(backend_buffer_type *buft, size_t size) {
    backend_buffer *buffer = ggml.buft_alloc_buffer(ggml.cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
    /* A CPU buffer whose tensors are stored in the tile layout: nothing may read or copy
     * them as ggml tensors. */
    buffer->buft = buft;
    buffer->iface.init_tensor = init_tensor;
    buffer->iface.set_tensor = set_tensor;
    buffer->iface.memset_tensor = nullptr;
    buffer->iface.get_tensor = nullptr;
    buffer->iface.set_tensor_2d = nullptr;
    buffer->iface.get_tensor_2d = nullptr;
    buffer->iface.cpy_tensor = nullptr;
    return buffer;
}

size_t get_alignment(backend_buffer_type *buft) {
    (void)buft;
    return ALIGN;
}

size_t get_alloc_size(backend_buffer_type *buft, const tensor *t) {
    (void)buft;
    return is_supported_weight(t) ? tiled_bytes(t) : ggml.nbytes(t);
}

TileBufferType tile_buffer_type_context;

backend_buffer_type tile_buffer_type = {
    {get_name, alloc_buffer, get_alignment, nullptr, get_alloc_size, nullptr},
    nullptr, /* the CPU device, set at registration */
    &tile_buffer_type_context,
};

backend_buffer_type *buffer_type() { return &tile_buffer_type; }

/* Fields of the mirror that disagree with the running ggml (butter_layer_matmul_check_mirror),
 * as bits. */
enum MirrorField {
    FIELD_TYPE = 1 << 0,
    FIELD_NE = 1 << 1,
    FIELD_NB = 1 << 2,
    FIELD_DATA = 1 << 3,
    FIELD_NAME = 1 << 4,
    FIELD_VIEW = 1 << 5, /* view_src, view_offs */
    FIELD_OP = 1 << 6,   /* op, src */
    FIELD_BUFFER = 1 << 7, /* tensor.buffer, and the buffer's buft, size and get_base */
    FIELD_BUFT = 1 << 8,   /* the buffer type's get_name and device */
    FIELD_EXTRA = 1 << 9,
    FIELD_SETUP = 1 << 10, /* ggml could not make the probe tensors */
};

/* A ggml context of `bytes` (freed with it). */
struct Context {
    void *ctx;
    Context(size_t bytes, bool no_alloc) : ctx(ggml.init(init_params{bytes, nullptr, no_alloc})) {}
    ~Context() {
        if (ctx != nullptr) {
            ggml.free(ctx);
        }
    }
    Context(const Context &) = delete;
    Context &operator=(const Context &) = delete;
};

/* A ggml buffer (freed with it). */
struct Buffer {
    backend_buffer *buffer;
    explicit Buffer(backend_buffer *b) : buffer(b) {}
    ~Buffer() {
        if (buffer != nullptr) {
            ggml.buffer_free(buffer);
        }
    }
    Buffer(const Buffer &) = delete;
    Buffer &operator=(const Buffer &) = delete;
};

/* Tensors and a buffer made by the running ggml, read through the mirror. */
int mirror_disagreements() {
    int wrong = 0;
    Context host(1 << 20, false);
    if (host.ctx == nullptr) {
        return FIELD_SETUP;
    }
    tensor *w = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_Q8_0, 4 * QK, 3);
    tensor *x = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_F32, 4 * QK, 2);
    if (w == nullptr || x == nullptr) {
        return FIELD_SETUP;
    }
    ggml.set_name(w, "blk.0.mirror_check");
    const size_t row = ggml.row_size(ggml_mirror::TYPE_Q8_0, 4 * QK);
    if (w->type != ggml_mirror::TYPE_Q8_0 || x->type != ggml_mirror::TYPE_F32) {
        wrong |= FIELD_TYPE;
    }
    if (w->ne[0] != 4 * QK || w->ne[1] != 3 || w->ne[2] != 1 || w->ne[3] != 1) {
        wrong |= FIELD_NE;
    }
    if (w->nb[0] != Q8_0_BLOCK_BYTES || w->nb[1] != row || w->nb[2] != 3 * row ||
        x->nb[0] != sizeof(float)) {
        wrong |= FIELD_NB;
    }
    if (w->data == nullptr || w->data != ggml.get_data(w)) {
        wrong |= FIELD_DATA;
    }
    if (strcmp(w->name, "blk.0.mirror_check") != 0) {
        wrong |= FIELD_NAME;
    }
    tensor *view = ggml.view_2d(host.ctx, w, 4 * QK, 2, row, row);
    if (view == nullptr || w->view_src != nullptr || view->view_src != w ||
        view->view_offs != row) {
        wrong |= FIELD_VIEW;
    }
    tensor *y = ggml.mul_mat(host.ctx, w, x);
    if (y == nullptr || y->op != ggml_mirror::OP_MUL_MAT || y->src[0] != w || y->src[1] != x ||
        y->src[2] != nullptr || y->ne[0] != 3 || y->ne[1] != 2) {
        wrong |= FIELD_OP;
    }
    /* a flash attention: its sources and parameters where decode_attention.h reads them */
    tensor *q = ggml.new_tensor_3d(host.ctx, ggml_mirror::TYPE_F32, 64, 3, 4);
    tensor *k = ggml.new_tensor_3d(host.ctx, ggml_mirror::TYPE_F16, 64, 256, 2);
    tensor *mask = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_F16, 256, 3);
    tensor *a = q == nullptr || k == nullptr || mask == nullptr
                    ? nullptr
                    : ggml.flash_attn_ext(host.ctx, q, k, k, mask, 0.125f, 0.5f, 30.0f);
    if (a == nullptr) {
        return wrong | FIELD_SETUP;
    }
    const float *params = (const float *)a->op_params;
    if (a->op != ggml_mirror::OP_FLASH_ATTN_EXT || a->src[0] != q || a->src[1] != k ||
        a->src[2] != k || a->src[3] != mask || a->src[4] != nullptr || params[0] != 0.125f ||
        params[1] != 0.5f || params[2] != 30.0f || a->ne[0] != 64 || a->ne[1] != 4 ||
        a->ne[2] != 3 || a->ne[3] != 1) {
        wrong |= FIELD_OP;
    }
    if (k->type != ggml_mirror::TYPE_F16 || k->nb[0] != 2 || k->nb[1] != 128) {
        wrong |= FIELD_TYPE | FIELD_NB;
    }
    if (w->buffer != nullptr || w->extra != nullptr) {
        wrong |= FIELD_BUFFER | FIELD_EXTRA;
    }
    Context placed(1 << 16, true);
    if (placed.ctx == nullptr) {
        return wrong | FIELD_SETUP;
    }
    tensor *t = ggml.new_tensor_2d(placed.ctx, ggml_mirror::TYPE_F32, 64, 4);
    backend_buffer_type *cpu = ggml.cpu_buffer_type();
    Buffer buffer(t == nullptr ? nullptr : ggml.alloc_ctx_tensors_from_buft(placed.ctx, cpu));
    if (buffer.buffer == nullptr) {
        return wrong | FIELD_SETUP;
    }
    backend_buffer *b = buffer.buffer;
    if (t->buffer != b || b->buft != cpu || b->size != ggml.buffer_get_size(b) ||
        b->iface.get_base == nullptr || b->iface.get_base(b) != ggml.buffer_get_base(b) ||
        t->data != ggml.buffer_get_base(b)) {
        wrong |= FIELD_BUFFER;
    }
    if (strcmp(cpu->iface.get_name(cpu), "CPU") != 0 || cpu->device != ggml.buft_get_device(cpu)) {
        wrong |= FIELD_BUFT;
    }
    if (t->extra != nullptr) {
        wrong |= FIELD_EXTRA;
    }
    return wrong;
}

/* Floats in [-1, 1), the same for the same seed. */
void probe_values(uint64_t seed, float *out, int64_t n) {
    uint64_t state = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        out[i] = (float)((double)(state >> 40) / (double)(1ull << 23) - 1.0);
    }
}

/* y = x * w^T for a `type` matrix of n rows of k, by ggml on `threads` threads: with the
 * weight stored in `buft` (butter's buffer type), or in plain memory (null: llama.cpp's
 * own kernels). The result goes to `out` (rows x n floats). */
bool graph_product(backend_buffer_type *buft, int type, const std::vector<uint8_t> &weight,
                   int64_t k, int64_t n, const std::vector<float> &x, int64_t rows,
                   int threads, std::vector<float> &out) {
    Context weights(1 << 16, true);
    Context compute(weight.size() + x.size() * sizeof(float) + rows * n * sizeof(float) +
                        ((size_t)64 << 20),
                    false);
    if (weights.ctx == nullptr || compute.ctx == nullptr) {
        return false;
    }
    tensor *w = ggml.new_tensor_2d(buft != nullptr ? weights.ctx : compute.ctx, type, k, n);
    if (w == nullptr) {
        return false;
    }
    ggml.set_name(w, "blk.0.self_check");
    Buffer buffer(buft != nullptr ? ggml.alloc_ctx_tensors_from_buft(weights.ctx, buft) : nullptr);
    if (buft != nullptr) {
        if (buffer.buffer == nullptr) {
            return false;
        }
        ggml.tensor_set(w, weight.data(), 0, weight.size());
    } else {
        memcpy(ggml.get_data(w), weight.data(), weight.size());
    }
    tensor *xt = ggml.new_tensor_2d(compute.ctx, ggml_mirror::TYPE_F32, k, rows);
    tensor *y = xt == nullptr ? nullptr : ggml.mul_mat(compute.ctx, w, xt);
    void *graph = y == nullptr ? nullptr : ggml.new_graph(compute.ctx);
    if (graph == nullptr) {
        return false;
    }
    memcpy(ggml.get_data(xt), x.data(), x.size() * sizeof(float));
    ggml.build_forward_expand(graph, y);
    if (ggml.graph_compute_with_ctx(compute.ctx, graph, threads) != ggml_mirror::STATUS_SUCCESS) {
        return false;
    }
    out.assign((const float *)ggml.get_data(y), (const float *)ggml.get_data(y) + rows * n);
    return true;
}

}  // namespace

extern "C" {

int32_t butter_layer_matmul_abi_version(void) { return BUTTER_LAYER_MATMUL_ABI_VERSION; }

/* The mirror's figures, for Python to check against the running ggml: sizeof(tensor),
 * the F32, Q8_0, Q6_K and Q5_K type numbers, the MUL_MAT op number, the Q4_1, Q5_0 and Q4_K
 * type numbers, the FLASH_ATTN_EXT op number, the F16 type number. */
int32_t butter_layer_matmul_mirror(int64_t *out, size_t out_bytes) {
    if (out == nullptr || out_bytes < 11 * sizeof(int64_t)) {
        return BUTTER_E_ARGUMENT;
    }
    out[0] = (int64_t)sizeof(tensor);
    out[1] = ggml_mirror::TYPE_F32;
    out[2] = ggml_mirror::TYPE_Q8_0;
    out[3] = ggml_mirror::TYPE_Q6_K;
    out[4] = ggml_mirror::TYPE_Q5_K;
    out[5] = ggml_mirror::OP_MUL_MAT;
    out[6] = ggml_mirror::TYPE_Q4_1;
    out[7] = ggml_mirror::TYPE_Q5_0;
    out[8] = ggml_mirror::TYPE_Q4_K;
    out[9] = ggml_mirror::OP_FLASH_ATTN_EXT;
    out[10] = ggml_mirror::TYPE_F16;
    return BUTTER_OK;
}

/* The name of a buffer type, read through the mirrored struct (Python checks that the CPU
 * buffer type reads as "CPU"). */
const char *butter_layer_matmul_buffer_type_name(void *buft) {
    backend_buffer_type *b = (backend_buffer_type *)buft;
    return b == nullptr ? nullptr : b->iface.get_name(b);
}

/* The best kernel this CPU runs: ISA_AVX512_VNNI, ISA_AVX2 or ISA_NONE. */
int32_t butter_layer_matmul_best_isa(void) { return best_isa(); }

/* The ggml functions butter_layer_matmul_bind takes, comma-separated, in its order. */
const char *butter_layer_matmul_function_names(void) { return FUNCTION_NAMES; }

/* ggml's functions, one pointer per name of butter_layer_matmul_function_names. */
int32_t butter_layer_matmul_bind(void *const *functions, size_t count) {
    if (functions == nullptr || count != FUNCTION_COUNT) {
        return BUTTER_E_ARGUMENT;
    }
    for (size_t i = 0; i < count; i++) {
        if (functions[i] == nullptr) {
            return BUTTER_E_ARGUMENT;
        }
    }
    if (registered) {
        return BUTTER_E_STATE;
    }
    memcpy((void *)&ggml, functions, sizeof ggml);
    bound = true;
    return BUTTER_OK;
}

/* Reads tensors and a buffer the running ggml made through the mirror: *wrong gets the
 * MirrorField bits of every field that disagrees (0: the mirror is this ggml's). */
int32_t butter_layer_matmul_check_mirror(int32_t *wrong) {
    if (wrong == nullptr) {
        return BUTTER_E_ARGUMENT;
    }
    if (!bound) {
        return BUTTER_E_STATE;
    }
    *wrong = mirror_disagreements();
    return BUTTER_OK;
}

/* Adds butter's buffer type to the CPU backend's extra buffer types (once per process, and
 * before llama.cpp first lists them, which it does at its first model load), with the
 * kernels of `isa` (at most this CPU's best) for the `types` (TYPE_BIT_*). */
int32_t butter_layer_matmul_register(void *cpu_device, int32_t isa, int32_t types) {
    if (!cpu_device) {
        return BUTTER_E_ARGUMENT;
    }
    if (!bound || registered) {
        return BUTTER_E_STATE;
    }
    if (isa == ISA_NONE || isa > best_isa()) {
        return BUTTER_DECLINED;
    }
    kernel_isa = isa;
    enabled_types.store(types);
    tile_buffer_type.device = cpu_device;
    /* First in the list: the types enabled here are the ones butter's table gives butter
     * (Q4_K before llama.cpp's repacking takes it); anything else falls through. */
    auto &listed = ggml.extra_buffer_types();
    listed.insert(listed.begin(), &tile_buffer_type);
    registered = true;
    return BUTTER_OK;
}

/* Whether butter computes the decode steps' attention (decode_attention.h), from the next
 * graph on. */
int32_t butter_layer_matmul_decode_attention(int32_t on) {
    decode_attention.store(on != 0);
    return BUTTER_OK;
}

/* Whether butter computes the prompt steps' attention (prompt_attention.h), from the next
 * graph on. */
int32_t butter_layer_matmul_prompt_attention(int32_t on) {
    prompt_attention.store(on != 0);
    return BUTTER_OK;
}

/* The types whose new weights may be stored here from now on (TYPE_BIT_*). */
int32_t butter_layer_matmul_enable_types(int32_t types) {
    enabled_types.store(types);
    return BUTTER_OK;
}

/* One probe product through a real ggml graph on `threads` threads: a random `type`
 * matrix of n rows of k (k a multiple of 256) times `rows` random activation rows, once with
 * the weight stored here (butter's kernel) and once as llama.cpp computes it. out[0]: the
 * largest difference, out[1]: the largest of llama.cpp's values, out[2]: 1 if butter's
 * kernel computed the product. `perturb` adds perturb x out[1] to butter's first value
 * before comparing (a wrong kernel, for the tests of the fallback; 0 otherwise). */
int32_t butter_layer_matmul_self_check(int32_t type, int64_t k, int64_t n, int64_t rows,
                                       int32_t threads, double perturb, double *out,
                                       size_t out_bytes) {
    if (out == nullptr || out_bytes < 3 * sizeof(double) || type_bit(type) == 0 ||
        k <= 0 || k % QK_K != 0 || n <= 0 || rows <= 0 || threads <= 0) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    std::vector<float> w(k * n), x(k * rows), ours, theirs;
    probe_values(1000 + (uint64_t)type, w.data(), (int64_t)w.size());
    probe_values(2000 + (uint64_t)rows, x.data(), (int64_t)x.size());
    std::vector<uint8_t> weight(ggml.row_size(type, k) * n);
    ggml.quantize_chunk(type, w.data(), weight.data(), 0, n, k, nullptr);
    probing.store(true);
    const int64_t ran_before = probe_matmuls.load();
    const bool done = graph_product(&tile_buffer_type, type, weight, k, n, x, rows, threads, ours);
    const bool ran = probe_matmuls.load() > ran_before;
    probing.store(false);
    if (!done || !graph_product(nullptr, type, weight, k, n, x, rows, threads, theirs)) {
        return BUTTER_E_STATE;
    }
    double largest = 0.0, worst = 0.0;
    for (float v : theirs) {
        largest = fabs(v) > largest ? fabs(v) : largest;
    }
    ours[0] += (float)(perturb * largest);
    for (size_t i = 0; i < ours.size(); i++) {
        const double d = fabs((double)ours[i] - (double)theirs[i]);
        worst = d > worst || d != d ? d : worst; /* (a NaN counts as the worst) */
    }
    out[0] = worst;
    out[1] = largest;
    out[2] = ran ? 1.0 : 0.0;
    return BUTTER_OK;
}

/* Where the probe's cells lie in a view of `view` slots: cell c at slot[c]. Placement 0
 * keeps them in order at the start; any other value scatters them over the view in an order
 * of its own (a Fisher-Yates shuffle drawn from probe_values). */
std::vector<int64_t> probe_slots(int64_t cells, int64_t view, int64_t placement) {
    std::vector<int64_t> slots(view);
    for (int64_t i = 0; i < view; i++) {
        slots[i] = i;
    }
    if (placement != 0) {
        std::vector<float> draws(view);
        probe_values((uint64_t)placement * 7919, draws.data(), view);
        for (int64_t i = view - 1; i > 0; i--) {
            const int64_t j = (int64_t)((draws[i] + 1.0f) * 0.5f * (float)(i + 1)) % (i + 1);
            std::swap(slots[i], slots[j]);
        }
    }
    slots.resize(cells);
    return slots;
}

/* One flash attention through a real ggml graph on `threads` threads, with butter's decode
 * attention on (`butter` 1) or llama.cpp's own: `rows` query rows of `heads` heads over
 * `cells` f16 cells of `kv_heads` heads, `dim` wide, scaled by 1/sqrt(dim). The keys and
 * values come from `seed`, query row r from `seed` + 1 + r, and row r sees every cell but
 * those c with c % 5 == r % 5, so the first rows of a bigger probe are those of a smaller one.
 * The cells lie in a view of `view` slots (>= cells) as `placement` puts them
 * (probe_slots); the other slots hold other values, hidden from every row.
 * out: the rows x heads x dim results; *ran: 1 if butter computed them. */
int32_t butter_layer_matmul_attention_probe(int32_t butter, int64_t rows, int64_t cells,
                                            int64_t view, int64_t placement, int64_t heads,
                                            int64_t kv_heads, int64_t dim, int32_t threads,
                                            int64_t seed, float *out, size_t out_bytes,
                                            int32_t *ran) {
    if (out == nullptr || ran == nullptr || rows <= 0 || cells <= 0 || view < cells ||
        kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || threads <= 0 ||
        out_bytes < (size_t)(rows * heads * dim) * sizeof(float)) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    const size_t kv_floats = (size_t)(dim * view * kv_heads);
    Context compute(2 * kv_floats * sizeof(float) + (size_t)(rows * (heads * dim * 2 + view)) *
                        sizeof(float) + ((size_t)16 << 20), false);
    if (compute.ctx == nullptr) {
        return BUTTER_E_STATE;
    }
    tensor *q = ggml.new_tensor_3d(compute.ctx, ggml_mirror::TYPE_F32, dim, rows, heads);
    tensor *k = ggml.new_tensor_3d(compute.ctx, ggml_mirror::TYPE_F16, dim, view, kv_heads);
    tensor *v = ggml.new_tensor_3d(compute.ctx, ggml_mirror::TYPE_F16, dim, view, kv_heads);
    tensor *mask = ggml.new_tensor_2d(compute.ctx, ggml_mirror::TYPE_F16, view, rows);
    if (q == nullptr || k == nullptr || v == nullptr || mask == nullptr) {
        return BUTTER_E_STATE;
    }
    const std::vector<int64_t> slots = probe_slots(cells, view, placement);
    std::vector<float> values((size_t)(dim * cells * kv_heads)), placed(kv_floats);
    for (int which = 0; which < 2; which++) {
        /* the other slots' values first, then the cells' over their slots */
        probe_values((uint64_t)seed + 77 + (uint64_t)which, placed.data(), (int64_t)kv_floats);
        probe_values((uint64_t)seed + (which ? 1000003 : 0), values.data(),
                     (int64_t)values.size());
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t c = 0; c < cells; c++) {
                memcpy(placed.data() + (h * view + slots[c]) * dim,
                       values.data() + (h * cells + c) * dim, (size_t)dim * sizeof(float));
            }
        }
        ggml.fp32_to_fp16_row(placed.data(), (uint16_t *)ggml.get_data(which ? v : k),
                              (int64_t)kv_floats);
    }
    std::vector<float> row(dim), hidden(view);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            probe_values((uint64_t)(seed + 1 + r) * 131 + (uint64_t)h, row.data(), dim);
            for (int64_t d = 0; d < dim; d++) {
                row[d] *= 4.0f; /* scores spread enough that the softmax is not flat */
            }
            memcpy((char *)ggml.get_data(q) + r * q->nb[1] + h * q->nb[2], row.data(),
                   (size_t)dim * sizeof(float));
        }
        std::fill(hidden.begin(), hidden.end(), -INFINITY);
        for (int64_t c = 0; c < cells; c++) {
            hidden[slots[c]] = c % 5 == r % 5 ? -INFINITY : 0.0f;
        }
        ggml.fp32_to_fp16_row(hidden.data(),
                              (uint16_t *)((char *)ggml.get_data(mask) + r * mask->nb[1]), view);
    }
    tensor *y = ggml.flash_attn_ext(compute.ctx, q, k, v, mask, 1.0f / sqrtf((float)dim), 0.0f,
                                    0.0f);
    void *graph = y == nullptr ? nullptr : ggml.new_graph(compute.ctx);
    if (graph == nullptr) {
        return BUTTER_E_STATE;
    }
    ggml.build_forward_expand(graph, y);
    const bool was_on = decode_attention.load(), prompts_were_on = prompt_attention.load();
    decode_attention.store(butter != 0);
    prompt_attention.store(butter != 0);
    probing.store(true);
    const int64_t ran_before = probe_attentions.load();
    const int status = ggml.graph_compute_with_ctx(compute.ctx, graph, threads);
    *ran = probe_attentions.load() > ran_before ? 1 : 0;
    probing.store(false);
    decode_attention.store(was_on);
    prompt_attention.store(prompts_were_on);
    if (status != ggml_mirror::STATUS_SUCCESS) {
        return BUTTER_E_STATE;
    }
    memcpy(out, ggml.get_data(y), (size_t)(rows * heads * dim) * sizeof(float));
    return BUTTER_OK;
}

/* Takes the buffer type called `name` out of the CPU backend's extra buffer types, so that
 * llama.cpp never offers weights to it (before llama.cpp first lists them, like register).
 * BUTTER_DECLINED: none has that name. */
int32_t butter_layer_matmul_drop_buffer_type(void *extra_buffer_types, const char *name) {
    if (!extra_buffer_types || !name) {
        return BUTTER_E_ARGUMENT;
    }
    auto &types = ((std::vector<backend_buffer_type *> & (*)()) extra_buffer_types)();
    for (auto it = types.begin(); it != types.end(); ++it) {
        backend_buffer_type *type = *it;
        if (type != nullptr && strcmp(type->iface.get_name(type), name) == 0) {
            types.erase(it);
            return BUTTER_OK;
        }
    }
    return BUTTER_DECLINED;
}

/* The registered buffer type (to find it in llama.cpp's list), or null. */
void *butter_layer_matmul_buffer_type(void) { return registered ? &tile_buffer_type : nullptr; }

/* Whether the next model loads may place their layers' weights here (of the enabled types). */
int32_t butter_layer_matmul_accept(int32_t accept) {
    accepting.store(accept != 0);
    return BUTTER_OK;
}

/* Matrices stored here (by type) and their bytes, since the process started; matmuls
 * computed here and their activation rows. */
int32_t butter_layer_matmul_counters(int64_t *out, size_t out_bytes) {
    if (out == nullptr || out_bytes < COUNTERS * sizeof(int64_t)) {
        return BUTTER_E_ARGUMENT;
    }
    out[0] = q8_0_matrices.load();
    out[1] = q6_k_matrices.load();
    out[2] = q5_k_matrices.load();
    out[6] = q4_1_matrices.load();
    out[7] = q5_0_matrices.load();
    out[8] = q4_k_matrices.load();
    out[3] = packed_bytes.load();
    out[4] = matmuls.load();
    out[5] = matmul_rows.load();
    out[9] = attentions.load();
    out[10] = attention_rows.load();
    return BUTTER_OK;
}

}  // extern "C"

static struct PyModuleDef layer_matmul_module = {
    PyModuleDef_HEAD_INIT, "_layer_matmul",
    "butter's Q8_0, Q6_K, Q5_K, Q4_K, Q4_1 and Q5_0 layer matmuls for llama.cpp (loaded with ctypes, see "
    "butter/backends/llama_cpp/layer_matmul.py)",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__layer_matmul(void) { return PyModule_Create(&layer_matmul_module); }
