/*
 * butter's layer matmuls: the tile layout of each weight type (q8_0_tiles.h, q6_k_tiles.h,
 * q4_k_q5_k_tiles.h, q4_1_q5_0_tiles.h), and the dispatch of a matmul whose weight is
 * stored in it to the type's kernel for the registered instruction set, on llama.cpp's own
 * threads, work buffer and barrier.
 *
 * Same numbers as llama.cpp: see the headers (exact integer block dot products, the same
 * activation quantization, float sums over blocks in another order). A row's result never
 * depends on the other rows of the batch.
 */
#include "layer_matmul.h"
#include "q4_1_q5_0_tiles.h"
#include "q4_k_q5_k_tiles.h"
#include "q6_k_tiles.h"
#include "q8_0_tiles.h"

namespace butter {

namespace {

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

bool is_k_quant(int type) {
    return type == ggml_mirror::TYPE_Q6_K || type == ggml_mirror::TYPE_Q5_K ||
           type == ggml_mirror::TYPE_Q4_K;
}

/* Q4_1 and Q5_0: 32-weight blocks of 4-bit values (q4_1_q5_0_tiles.h). */
bool is_nibble_type(int type) {
    return type == ggml_mirror::TYPE_Q4_1 || type == ggml_mirror::TYPE_Q5_0;
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

/* Whether the AVX2 kernels read a weight type's values unpacked once per tile
 * (q6_unpack_tile_avx2, qk45_unpack_tile_avx2) instead of again for every 4 rows: Q5_K's and
 * Q6_K's, whose unpacking is a large part of the loop, in steps of UNPACK_MIN_ROWS or more
 * (fewer rows pass over a tile too few times to repay it). Loading Q4_K's values unpacked
 * measured no faster than its two instructions a group. */
#define UNPACK_MIN_ROWS 16

bool unpacks(int type) {
    return kernel_isa == BUTTER_ISA_AVX2 &&
           (type == ggml_mirror::TYPE_Q6_K || type == ggml_mirror::TYPE_Q5_K);
}

/* One thread's room for a tile's values unpacked. */
size_t unpacked_tile_bytes(const tensor *w) {
    return aligned((size_t)(w->ne[0] / QK_K) * UNPACK_BLOCK_BYTES);
}

/* Work buffer: the quantized rows, one row of floats per thread to gather a row that is not
 * contiguous, and (AVX2, Q5_K and Q6_K) one unpacked tile per thread. */
size_t work_bytes(int n_threads, const tensor *op) {
    const tensor *w = op->src[0], *x = op->src[1];
    return aligned((size_t)activation_rows(x) * quantized_row_bytes(w)) +
           (size_t)n_threads * aligned((size_t)x->ne[0] * sizeof(float)) +
           (unpacks(w->type) ? (size_t)n_threads * unpacked_tile_bytes(w) : 0) + ALIGN;
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

    void begin(int64_t /*t*/) const {}

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

    void begin(int64_t /*t*/) const {}

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

/* The AVX2 kernels' variant that reads a tile's values from `u` (its unpacked bytes), and
 * the unpacking (UNPACK_MIN_ROWS). */
typedef void (*KQuantUnpackedPass)(const uint8_t *w, const uint8_t *u, int64_t nbk, int64_t t,
                                   int R, const uint8_t *x, int64_t x_stride, float *out,
                                   int64_t out_stride, int lanes);
typedef void (*KQuantUnpack)(const uint8_t *w, int64_t nbk, int64_t t, uint8_t *u);

struct KQuantPass {
    KQuantTilePass tile_pass;
    const uint8_t *w;
    const uint8_t *xq;
    int64_t nbk;
    int64_t row_bytes;
    /* null: the tile's values unpacked in tile_pass; else unpack into `unpacked` first */
    KQuantUnpack unpack = nullptr;
    KQuantUnpackedPass unpacked_pass = nullptr;
    uint8_t *unpacked = nullptr; /* this thread's */

    void begin(int64_t t) const {
        if (unpack != nullptr) {
            unpack(w, nbk, t, unpacked);
        }
    }

    void operator()(int64_t t, int64_t r, int R, float *out, int64_t out_stride,
                    int lanes) const {
        if (unpack != nullptr) {
            unpacked_pass(w, unpacked, nbk, t, R, xq + r * row_bytes, row_bytes, out,
                          out_stride, lanes);
        } else {
            tile_pass(w, nbk, t, R, xq + r * row_bytes, row_bytes, out, out_stride, lanes);
        }
    }
};

/* This thread's share of the tiles, for every activation row: a tile's weights stay in
 * cache across the passes of 8 rows (`begin` readies a tile for them). */
template <class Pass>
void multiply_tiles(const compute_params *params, tensor *dst, int64_t rows, const Pass &pass) {
    const tensor *x = dst->src[1];
    const int64_t n = dst->src[0]->ne[1], n_tiles = (n + LANES - 1) / LANES;
    const int64_t first = n_tiles * params->ith / params->nth;
    const int64_t last = n_tiles * (params->ith + 1) / params->nth;
    for (int64_t t = first; t < last; t++) {
        const int lanes = (int)(n - t * LANES < LANES ? n - t * LANES : LANES);
        pass.begin(t);
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
    const bool vnni = kernel_isa == BUTTER_ISA_AVX512_VNNI;
    if (type == ggml_mirror::TYPE_Q6_K) {
        return vnni ? q6_tile_pass : q6_tile_pass_avx2;
    }
    if (type == ggml_mirror::TYPE_Q5_K) {
        return vnni ? qk45_tile_pass<5> : qk45_tile_pass_avx2<5>;
    }
    return vnni ? qk45_tile_pass<4> : qk45_tile_pass_avx2<4>;
}

/* dst = x * w^T, shared by the CPU backend's threads (each calls this with its ith): the
 * activations are quantized by all threads, then each multiplies its share of the tiles. */
void multiply(compute_params *params, tensor *dst) {
    const tensor *w = dst->src[0];
    const tensor *x = dst->src[1];
    const int64_t k = w->ne[0], rows = activation_rows(x);
    uint8_t *xq = (uint8_t *)aligned_work(params);
    uint8_t *gathers = xq + aligned((size_t)rows * quantized_row_bytes(w));
    const size_t gather_bytes = aligned((size_t)k * sizeof(float));
    float *gather = (float *)(gathers + (size_t)params->ith * gather_bytes);
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
                                  kernel_isa == BUTTER_ISA_AVX512_VNNI});
    } else if (is_k_quant(w->type)) {
        const int64_t row_bytes = (int64_t)quantized_row_bytes(w);
        for (int64_t r = params->ith; r < rows; r += params->nth) {
            q8_k_quantize_row(activation_row(x, r, gather), xq + r * row_bytes, k);
        }
        barrier(params);
        KQuantPass pass{k_quant_tile_pass(w->type), (const uint8_t *)w->data, xq, k / QK_K,
                        row_bytes};
        if (unpacks(w->type) && rows >= UNPACK_MIN_ROWS) {
            const bool q6 = w->type == ggml_mirror::TYPE_Q6_K;
            pass.unpack = q6 ? q6_unpack_tile_avx2 : qk45_unpack_tile_avx2<5>;
            pass.unpacked_pass = q6 ? q6_tile_pass_unpacked_avx2 : qk45_tile_pass_unpacked_avx2<5>;
            pass.unpacked = gathers + (size_t)params->nth * gather_bytes +
                            (size_t)params->ith * unpacked_tile_bytes(w);
        }
        multiply_tiles(params, dst, rows, pass);
    } else {
        const int64_t nb = k / QK;
        const bool vnni = kernel_isa == BUTTER_ISA_AVX512_VNNI;
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

    bool compute_forward(compute_params *params, tensor *op) override {
        if (op->op != ggml_mirror::OP_MUL_MAT) {
            return false;
        }
#ifdef BUTTER_X86
        multiply(params, op);
        return true;
#else
        (void)params;
        return false;
#endif
    }
};

Traits traits;

}  // namespace

/* The best kernel this CPU runs. */
int best_isa() {
#ifdef BUTTER_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c")) {
        return BUTTER_ISA_NONE;
    }
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni")) {
        return BUTTER_ISA_AVX512_VNNI;
    }
    return BUTTER_ISA_AVX2;
#else
    return BUTTER_ISA_NONE;
#endif
}

int type_bit(int type) {
    switch (type) {
    case ggml_mirror::TYPE_Q8_0: return BUTTER_TYPE_BIT_Q8_0;
    case ggml_mirror::TYPE_Q6_K: return BUTTER_TYPE_BIT_Q6_K;
    case ggml_mirror::TYPE_Q5_K: return BUTTER_TYPE_BIT_Q5_K;
    case ggml_mirror::TYPE_Q4_K: return BUTTER_TYPE_BIT_Q4_K;
    case ggml_mirror::TYPE_Q4_1: return BUTTER_TYPE_BIT_Q4_1;
    case ggml_mirror::TYPE_Q5_0: return BUTTER_TYPE_BIT_Q5_0;
    default: return 0;
    }
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

std::atomic<int64_t> *pack_weight(tensor *t, const void *data) {
    if (t->type == ggml_mirror::TYPE_Q6_K) {
        q6_tiles_pack((const uint8_t *)data, t->ne[1], t->ne[0] / QK_K, (uint8_t *)t->data);
        return &q6_k_matrices;
    }
    if (t->type == ggml_mirror::TYPE_Q5_K) {
        qk45_tiles_pack<5>((const uint8_t *)data, t->ne[1], t->ne[0] / QK_K, (uint8_t *)t->data);
        return &q5_k_matrices;
    }
    if (t->type == ggml_mirror::TYPE_Q4_K) {
        qk45_tiles_pack<4>((const uint8_t *)data, t->ne[1], t->ne[0] / QK_K, (uint8_t *)t->data);
        return &q4_k_matrices;
    }
    if (is_nibble_type(t->type)) {
        const bool q4_1 = t->type == ggml_mirror::TYPE_Q4_1;
        q4_1_q5_0_tiles_pack((const uint8_t *)data, t->ne[1], t->ne[0] / QK, q4_1,
                             (uint8_t *)t->data);
        return q4_1 ? &q4_1_matrices : &q5_0_matrices;
    }
    const Q8Layout layout(t, t->data);
    q8_tiles_pack((const uint8_t *)data, t->ne[1], layout.nb, layout.wq, layout.wd, layout.wsum);
    return &q8_0_matrices;
}

ggml_mirror::tensor_traits *matmul_traits() { return &traits; }

}  // namespace butter
