/*
 * butter's Gated DeltaNet recurrence inside llama.cpp's CPU backend (ggml's GATED_DELTA_NET
 * op: the linear-attention layers of Qwen3.5, Qwen3-Next, Kimi Linear), taken from llama.cpp
 * by the buffer type as attention.cpp takes flash attention, giving llama.cpp's bits.
 *
 * Why: llama.cpp updates a head's state S (S_v x S_v floats, 64 KiB at S_v = 128) once per
 * token in four passes over all of it (decay, S^T k, the rank-1 update, S^T q), so every
 * token streams the state through the caches four times. But each row of S evolves on its
 * own: row j's update needs only row j, the token's k, q, gate and beta, and v[j]. So here
 * each pair of rows is held in registers for the whole step, token after token, and the
 * state is read once and written once a step.
 *
 * The bits: every element sees the same operations in the same order as in llama.cpp's
 * ggml_compute_forward_gated_delta_net (a multiply by e^g, an FMA for the update) and each
 * dot product is summed as ggml_vec_dot_f32 sums it, whose order depends on the vector width
 * ggml was compiled for (GGML_F32_STEP: 4 accumulators of 16 lanes with AVX-512, of 8 lanes
 * with AVX2, then ggml's reduction). Python tries each width this CPU runs and keeps the one
 * whose probe (butter_layer_matmul_delta_net_probe) gives llama.cpp's bits exactly, or none.
 */
#include <cmath>
#include <cstring>

#include "layer_matmul.h"
#include "q8_0_tiles.h" /* BUTTER_X86, AVX2_TARGET, immintrin.h */

namespace butter {

std::atomic<int> delta_net_width{0};
std::atomic<int64_t> delta_nets{0}, probe_delta_nets{0};
std::atomic<int> short_conv_width{0}, short_conv_rounding{0};
std::atomic<int64_t> short_convs{0}, probe_short_convs{0};

namespace {
std::atomic<int64_t> probe_concats{0}; /* (the short convolution probe's CONCATs) */
}  // namespace

namespace {

#define DELTA_WIDE_TARGET __attribute__((target("avx512f,avx2,fma")))
#define DELTA_INLINE __attribute__((always_inline))
#define DELTA_ROWS 2    /* rows of the state a task carries through the tokens together */
#define DELTA_TOKENS 64 /* tokens whose k and q every row of a share passes over in turn */

/* What one GATED_DELTA_NET op reads and writes (ggml.c's ggml_gated_delta_net). */
struct DeltaView {
    const tensor *q, *k, *v, *g, *beta, *state;
    int64_t dim;    /* S_v: a head's state is dim x dim */
    int64_t heads;  /* H_v */
    int64_t tokens; /* per sequence */
    int64_t seqs;
    int64_t snapshots; /* K: the states after the last K tokens are written, newest first */
    bool per_column;   /* the gate has dim values a head (Kimi's KDA), not one */
    float *out;        /* attention outputs [dim, heads, tokens, seqs], then the snapshots */

    explicit DeltaView(tensor *op)
        : q(op->src[0]), k(op->src[1]), v(op->src[2]), g(op->src[3]), beta(op->src[4]),
          state(op->src[5]), dim(v->ne[0]), heads(v->ne[1]), tokens(v->ne[2]), seqs(v->ne[3]),
          snapshots(op->op_params[0]), per_column(g->ne[0] == v->ne[0]),
          out((float *)op->data) {}

    /* Floats of a thread's gate factors: e^g for every token of one head. */
    int64_t gate_floats() const { return tokens * (per_column ? dim : 1); }
};

bool is_f32(const tensor *t) { return t != nullptr && t->type == ggml_mirror::TYPE_F32; }

/* Rows of floats one after another (ggml_is_contiguous_rows). */
bool rows_contiguous(const tensor *t) { return t->nb[0] == sizeof(float); }

bool contiguous(const tensor *t) {
    size_t expect = sizeof(float);
    for (int d = 0; d < ggml_mirror::MAX_DIMS; d++) {
        if (t->ne[d] != 1 && t->nb[d] != expect) {
            return false;
        }
        expect *= (size_t)t->ne[d];
    }
    return true;
}

/* Whether butter computes this op at the width chosen: the shapes llama.cpp's op takes
 * (q and k heads broadcast over v's), with state rows of whole vectors that fit the
 * registers. */
bool takes_delta_net(const tensor *op, int width) {
    if (op->op != ggml_mirror::OP_GATED_DELTA_NET || width == 0) {
        return false;
    }
    const tensor *q = op->src[0], *k = op->src[1], *v = op->src[2], *g = op->src[3],
                 *beta = op->src[4], *state = op->src[5];
    if (!is_f32(q) || !is_f32(k) || !is_f32(v) || !is_f32(g) || !is_f32(beta) ||
        !is_f32(state) || !is_f32(op)) {
        return false;
    }
    const int64_t dim = v->ne[0];
    return (dim == 32 || dim == 64 || dim == 128 || dim == 256) && dim % width == 0 &&
           q->ne[0] == dim &&
           k->ne[0] == dim && q->ne[1] > 0 && k->ne[1] > 0 && v->ne[1] % q->ne[1] == 0 &&
           v->ne[1] % k->ne[1] == 0 && q->ne[2] == v->ne[2] && k->ne[2] == v->ne[2] &&
           q->ne[3] > 0 && k->ne[3] > 0 && v->ne[3] % q->ne[3] == 0 &&
           v->ne[3] % k->ne[3] == 0 && rows_contiguous(q) && rows_contiguous(k) &&
           rows_contiguous(v) && contiguous(g) && contiguous(beta) && contiguous(state) &&
           (g->ne[0] == 1 || g->ne[0] == dim) && g->ne[1] == v->ne[1] && g->ne[2] == v->ne[2] &&
           g->ne[3] == v->ne[3] && beta->ne[0] == 1 && beta->ne[1] == v->ne[1] &&
           beta->ne[2] == v->ne[2] && beta->ne[3] == v->ne[3] && state->ne[0] == dim &&
           state->ne[1] == dim && state->ne[2] == v->ne[1] && state->ne[3] == v->ne[3] &&
           op->op_params[0] >= 1 && op->ne[0] == dim * v->ne[1] &&
           op->ne[1] == v->ne[2] * v->ne[3] + op->op_params[0] * dim * v->ne[3];
}

/* A thread's work bytes: its gate factors, aligned. */
size_t delta_thread_bytes(const DeltaView &d) {
    return aligned((size_t)d.gate_floats() * sizeof(float));
}

/* At least what llama.cpp's own op asks for (ggml_graph_plan), should it compute the op
 * planned here after all. */
size_t delta_work_bytes(const tensor *op, int n_threads) {
    const DeltaView d((tensor *)op);
    const size_t ours = ALIGN + (size_t)n_threads * delta_thread_bytes(d);
    const size_t per_thread = (size_t)(d.dim + (d.snapshots > 1 ? d.dim * d.dim : 0));
    const size_t theirs = per_thread * sizeof(float) * (size_t)n_threads + ALIGN;
    return ours > theirs ? ours : theirs;
}

#ifdef BUTTER_X86

/* ggml's vectors at each width: load, multiply, FMA (a x b + c), and ggml_vec_dot_f32's
 * reduction of its 4 accumulators (GGML_F32x16_REDUCE / GGML_F32x8_REDUCE). */
struct Wide {
    static constexpr int FLOATS = 16;
    using V = __m512;
    DELTA_WIDE_TARGET DELTA_INLINE static V load(const float *p) { return _mm512_loadu_ps(p); }
    DELTA_WIDE_TARGET DELTA_INLINE static void store(float *p, V x) { _mm512_storeu_ps(p, x); }
    DELTA_WIDE_TARGET DELTA_INLINE static V set1(float x) { return _mm512_set1_ps(x); }
    DELTA_WIDE_TARGET DELTA_INLINE static V zero() { return _mm512_setzero_ps(); }
    DELTA_WIDE_TARGET DELTA_INLINE static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    DELTA_WIDE_TARGET DELTA_INLINE static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    DELTA_WIDE_TARGET DELTA_INLINE static V add(V a, V b) { return _mm512_add_ps(a, b); }
    DELTA_WIDE_TARGET DELTA_INLINE static float reduce(V *x) {
        x[0] = _mm512_add_ps(x[0], x[2]);
        x[1] = _mm512_add_ps(x[1], x[3]);
        x[0] = _mm512_add_ps(x[0], x[1]);
        return _mm512_reduce_add_ps(x[0]);
    }
    /* A 16 x 16 block transposed in registers: four rounds, each swapping one bit of the
     * row number with the same bit of the column number between pairs of rows. */
    DELTA_WIDE_TARGET DELTA_INLINE static void transpose(V (&rows)[FLOATS]) {
        for (int bit = 0; bit < 4; bit++) {
            const int m = 1 << bit;
            alignas(64) int32_t low[16], high[16];
            for (int j = 0; j < 16; j++) { /* (16 + j: the partner row's lane j) */
                low[j] = (j & m) == 0 ? j : 16 + (j ^ m);
                high[j] = (j & m) == 0 ? (j ^ m) : 16 + j;
            }
            const __m512i take_low = _mm512_load_si512(low), take_high = _mm512_load_si512(high);
            for (int i = 0; i < 16; i++) {
                if ((i & m) == 0) {
                    const __m512 a = rows[i], b = rows[i | m];
                    rows[i] = _mm512_permutex2var_ps(a, take_low, b);
                    rows[i | m] = _mm512_permutex2var_ps(a, take_high, b);
                }
            }
        }
    }
};

struct Narrow {
    static constexpr int FLOATS = 8;
    using V = __m256;
    AVX2_TARGET DELTA_INLINE static V load(const float *p) { return _mm256_loadu_ps(p); }
    AVX2_TARGET DELTA_INLINE static void store(float *p, V x) { _mm256_storeu_ps(p, x); }
    AVX2_TARGET DELTA_INLINE static V set1(float x) { return _mm256_set1_ps(x); }
    AVX2_TARGET DELTA_INLINE static V zero() { return _mm256_setzero_ps(); }
    AVX2_TARGET DELTA_INLINE static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    AVX2_TARGET DELTA_INLINE static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    AVX2_TARGET DELTA_INLINE static V add(V a, V b) { return _mm256_add_ps(a, b); }
    AVX2_TARGET DELTA_INLINE static float reduce(V *x) {
        x[0] = _mm256_add_ps(x[0], x[2]);
        x[1] = _mm256_add_ps(x[1], x[3]);
        x[0] = _mm256_add_ps(x[0], x[1]);
        const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x[0]), _mm256_extractf128_ps(x[0], 1));
        const __m128 t1 = _mm_hadd_ps(t0, t0);
        return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    }
    /* An 8 x 8 block transposed in registers: pairs of rows interleaved, then pairs of
     * pairs, then the 128-bit halves exchanged. */
    AVX2_TARGET DELTA_INLINE static void transpose(V (&rows)[FLOATS]) {
        V pairs[8], quads[8];
        for (int i = 0; i < 8; i += 2) {
            pairs[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
            pairs[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            quads[i] = _mm256_shuffle_ps(pairs[i], pairs[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
            quads[i + 1] = _mm256_shuffle_ps(pairs[i], pairs[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
            quads[i + 2] = _mm256_shuffle_ps(pairs[i + 1], pairs[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
            quads[i + 3] = _mm256_shuffle_ps(pairs[i + 1], pairs[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        for (int i = 0; i < 4; i++) {
            rows[i] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x20);
            rows[i + 4] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x31);
        }
    }
};

/* Where a head's inputs for token t lie. */
struct DeltaHead {
    const DeltaView &d;
    int64_t head, seq, iq1, ik1, iq3, ik3;

    DeltaHead(const DeltaView &view, int64_t h, int64_t s)
        : d(view), head(h), seq(s), iq1(h % view.q->ne[1]), ik1(h % view.k->ne[1]),
          iq3(s / (view.seqs / view.q->ne[3])), ik3(s / (view.seqs / view.k->ne[3])) {}

    const float *q(int64_t t) const {
        return (const float *)((const char *)d.q->data + iq3 * d.q->nb[3] + t * d.q->nb[2] +
                               iq1 * d.q->nb[1]);
    }
    const float *k(int64_t t) const {
        return (const float *)((const char *)d.k->data + ik3 * d.k->nb[3] + t * d.k->nb[2] +
                               ik1 * d.k->nb[1]);
    }
    const float *v(int64_t t) const {
        return (const float *)((const char *)d.v->data + seq * d.v->nb[3] + t * d.v->nb[2] +
                               head * d.v->nb[1]);
    }
    float beta(int64_t t) const {
        return *(const float *)((const char *)d.beta->data + seq * d.beta->nb[3] +
                                t * d.beta->nb[2] + head * d.beta->nb[1]);
    }
    const float *g(int64_t t) const {
        return (const float *)((const char *)d.g->data + seq * d.g->nb[3] + t * d.g->nb[2] +
                               head * d.g->nb[1]);
    }
    /* The state the step starts from, and where the snapshot of `slot` goes. */
    const float *state_in() const {
        return (const float *)d.state->data + seq * (int64_t)(d.state->nb[3] / sizeof(float)) +
               head * d.dim * d.dim;
    }
    float *state_out(int64_t slot) const {
        return d.out + d.dim * d.heads * d.tokens * d.seqs +
               slot * d.dim * d.dim * d.heads * d.seqs + (seq * d.heads + head) * d.dim * d.dim;
    }
    float *attention_out(int64_t t) const {
        return d.out + (seq * d.tokens * d.heads + head) * d.dim + t * d.dim * d.heads;
    }
};

/* e^g of every token of a head (per column for KDA), as llama.cpp's op computes it. */
void delta_gates(const DeltaHead &h, float *gates) {
    const int64_t per = h.d.per_column ? h.d.dim : 1;
    for (int64_t t = 0; t < h.d.tokens; t++) {
        const float *g = h.g(t);
        for (int64_t i = 0; i < per; i++) {
            gates[t * per + i] = expf(g[i]);
        }
    }
}

/* Element (i0, i1, i2, i3) of a tensor. */
inline const float *element(const tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return (const float *)((const char *)t->data + i0 * t->nb[0] + i1 * t->nb[1] +
                           i2 * t->nb[2] + i3 * t->nb[3]);
}

#define DELTA_TARGET DELTA_WIDE_TARGET
#define DELTA_LANES Wide
namespace wide {
#include "delta_net_rows.h"
#include "conv_tiles.h"
}  // namespace wide
#undef DELTA_TARGET
#undef DELTA_LANES

#define DELTA_TARGET AVX2_TARGET
#define DELTA_LANES Narrow
namespace narrow {
#include "delta_net_rows.h"
#include "conv_tiles.h"
}  // namespace narrow
#undef DELTA_TARGET
#undef DELTA_LANES

template <int DIM>
void delta_share_at(int width, const DeltaView &d, float *gates, int ith, int nth) {
    if (width == Wide::FLOATS) {
        wide::delta_share<DIM>(d, gates, ith, nth);
    } else {
        narrow::delta_share<DIM>(d, gates, ith, nth);
    }
}

void delta_net(compute_params *params, tensor *op, int width) {
    const DeltaView d(op);
    float *gates = (float *)(aligned_work(params) + (size_t)params->ith * delta_thread_bytes(d));
    switch (d.dim) {
    case 32: delta_share_at<32>(width, d, gates, params->ith, params->nth); break;
    case 64: delta_share_at<64>(width, d, gates, params->ith, params->nth); break;
    case 128: delta_share_at<128>(width, d, gates, params->ith, params->nth); break;
    default: delta_share_at<256>(width, d, gates, params->ith, params->nth); break;
    }
    if (params->ith == 0) {
        (probing.load() ? probe_delta_nets : delta_nets).fetch_add(1, std::memory_order_relaxed);
    }
}

#endif /* BUTTER_X86 */

class DeltaNet : public ggml_mirror::tensor_traits {
    bool work_size(int n_threads, const tensor *op, size_t &size) override {
        size = delta_work_bytes(op, n_threads);
        return true;
    }

    bool compute_forward(compute_params *params, tensor *op) override {
#ifdef BUTTER_X86
        const int width = delta_net_width.load(std::memory_order_relaxed);
        if (!takes_delta_net(op, width) || params->wsize < delta_work_bytes(op, params->nth)) {
            return false; /* planned under another setting: llama.cpp computes it */
        }
        delta_net(params, op, width);
        return true;
#else
        (void)params, (void)op;
        return false;
#endif
    }
};

DeltaNet delta_net_traits;

/* The short causal convolution before a recurrent layer (ggml's SSM_CONV: Qwen3.5's and
 * Mamba's conv1d, LFM2's short conv): out[t][c] = sum over i < d_conv of
 * x[c][t + i] x w[c][i], x being the layer's last d_conv - 1 inputs and the step's, one row
 * per channel. llama.cpp walks the channels for each token, a row of x (a cache line) apart
 * each; here a channel's tokens are one vector (16 floats with AVX-512, 8 with AVX2) per
 * weight, and a square tile of channels x tokens is transposed in registers and goes out
 * token by token (conv_tiles.h). Each output is summed in the same order with the same
 * roundings as llama.cpp's `sumf += s * c` was compiled to, so the same bits: a native build
 * contracts it into a chain of FMAs, unless the compiler vectorized the loop over the
 * weights (GCC for AVX2 takes 4 or 8 products at a time, rounds them, and adds them in
 * order, fusing only the leftovers). butter sums the first rounded_products() terms
 * unfused and the rest fused; which rounding matches is found at registration
 * (butter_layer_matmul_conv_probe). */
bool takes_short_conv(const tensor *op, int lanes) {
    if (op->op != ggml_mirror::OP_SSM_CONV || lanes == 0) {
        return false;
    }
    const tensor *x = op->src[0], *w = op->src[1];
    /* (widths past the registration probes' 6 may meet a compiler's wider chunks: models
     * have 3 or 4) */
    return is_f32(x) && is_f32(w) && is_f32(op) && w->ne[0] >= 1 && w->ne[0] <= 6 &&
           x->ne[0] == w->ne[0] - 1 + op->ne[1] && x->ne[1] == w->ne[1] &&
           op->ne[0] == x->ne[1] && op->ne[2] == x->ne[2] && x->ne[1] % lanes == 0 &&
           x->nb[0] == sizeof(float) && x->nb[1] == (size_t)x->ne[0] * sizeof(float) &&
           w->nb[0] == sizeof(float) && op->nb[0] == sizeof(float);
}

/* How many of a convolution's leading `width` terms are summed as rounded products: none
 * (short_conv_rounding 0), or the whole multiples of short_conv_rounding. */
int64_t rounded_products(int64_t width) {
    const int64_t block = short_conv_rounding.load(std::memory_order_relaxed);
    return block == 0 ? 0 : width / block * block;
}

#ifdef BUTTER_X86

/* Tokens past the last whole tile, one output at a time, as llama.cpp sums each: the first
 * `rounded` products rounded, then added, the rest fused. */
void short_conv_tail(const tensor *op, int64_t seq, int64_t c0, int64_t c1, int64_t t0,
                     int64_t rounded) {
    const tensor *x = op->src[0], *w = op->src[1];
    for (int64_t c = c0; c < c1; c++) {
        const float *row = (const float *)((const char *)x->data + c * x->nb[1] + seq * x->nb[2]);
        const float *weights = (const float *)((const char *)w->data + c * w->nb[1]);
        for (int64_t t = t0; t < op->ne[1]; t++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < rounded; i++) {
                float product = row[t + i] * weights[i];
                __asm__("" : "+x"(product)); /* (kept from being fused into the add) */
                sum += product;
            }
            for (int64_t i = rounded; i < w->ne[0]; i++) {
                sum = fmaf(row[t + i], weights[i], sum);
            }
            *((float *)((char *)op->data + t * op->nb[1] + seq * op->nb[2]) + c) = sum;
        }
    }
}

/* This thread's share: blocks of `lanes` channels of a sequence, cut evenly. */
void convolve(compute_params *params, tensor *op, int lanes) {
    const int64_t blocks = op->ne[0] / lanes, tasks = op->ne[2] * blocks, tokens = op->ne[1];
    const int64_t rounded = rounded_products(op->src[1]->ne[0]);
    for (int64_t task = tasks * params->ith / params->nth;
         task < tasks * (params->ith + 1) / params->nth; task++) {
        const int64_t seq = task / blocks, c0 = task % blocks * lanes;
        int64_t t0 = 0;
        for (; t0 + lanes <= tokens; t0 += lanes) {
            if (lanes == Wide::FLOATS) {
                wide::short_conv_tile(op, seq, c0, t0, rounded);
            } else {
                narrow::short_conv_tile(op, seq, c0, t0, rounded);
            }
        }
        short_conv_tail(op, seq, c0, c0 + lanes, t0, rounded);
    }
    if (params->ith == 0) {
        (probing.load() ? probe_short_convs : short_convs).fetch_add(1, std::memory_order_relaxed);
    }
}

#endif /* BUTTER_X86 */

class ShortConv : public ggml_mirror::tensor_traits {
    bool work_size(int /*n_threads*/, const tensor * /*op*/, size_t &size) override {
        size = 0;
        return true;
    }

    bool compute_forward(compute_params *params, tensor *op) override {
#ifdef BUTTER_X86
        const int lanes = short_conv_width.load(std::memory_order_relaxed);
        if (!takes_short_conv(op, lanes)) {
            return false;
        }
        convolve(params, op, lanes);
        return true;
#else
        (void)params, (void)op;
        return false;
#endif
    }
};

ShortConv short_conv_traits;

/* The concatenation before each short convolution (ggml's CONCAT along dim 0: the layer's
 * last d_conv - 1 inputs, then the step's, transposed to one row per channel). llama.cpp's
 * CONCAT shares out only dim 2 (sequences), so with one sequence a thread copies it all,
 * float by float, while the others wait. Here every thread takes blocks of rows (a vector's
 * floats each), and a source whose rows are its columns (a transposed view) is copied a
 * square tile at a time. A copy: the same bits whatever the order. Taken with the short
 * convolution only, at its width. */
bool takes_concat(const tensor *op, int lanes) {
    if (op->op != ggml_mirror::OP_CONCAT || lanes == 0) {
        return false;
    }
    const tensor *a = op->src[0], *b = op->src[1];
    return is_f32(a) && is_f32(b) && is_f32(op) && op->op_params[0] == 0 &&
           op->nb[0] == sizeof(float) && op->ne[0] == a->ne[0] + b->ne[0] &&
           a->ne[1] == op->ne[1] && b->ne[1] == op->ne[1] && a->ne[2] == op->ne[2] &&
           b->ne[2] == op->ne[2] && a->ne[3] == op->ne[3] && b->ne[3] == op->ne[3];
}

#ifdef BUTTER_X86

/* Rows [r0, r1) of `from`, columns [c0, ne0), to `to` from column `at`, one float at a
 * time. */
void concat_floats(const tensor *from, tensor *to, int64_t at, int64_t r0, int64_t r1,
                   int64_t c0, int64_t i2, int64_t i3) {
    for (int64_t r = r0; r < r1; r++) {
        float *out = (float *)element(to, at, r, i2, i3);
        for (int64_t c = c0; c < from->ne[0]; c++) {
            out[c] = *element(from, c, r, i2, i3);
        }
    }
}

void concat_part(const tensor *from, tensor *to, int64_t at, int64_t r0, int64_t r1,
                 int64_t i2, int64_t i3, int lanes) {
    int64_t c0 = 0;
    if (from->nb[1] == sizeof(float) && r1 - r0 == lanes) {
        for (; c0 + lanes <= from->ne[0]; c0 += lanes) {
            if (lanes == Wide::FLOATS) {
                wide::concat_tile(from, to, at, r0, c0, i2, i3);
            } else {
                narrow::concat_tile(from, to, at, r0, c0, i2, i3);
            }
        }
    }
    concat_floats(from, to, at, r0, r1, c0, i2, i3);
}

void concatenate(compute_params *params, tensor *op, int lanes) {
    const tensor *a = op->src[0], *b = op->src[1];
    const int64_t per_matrix = (op->ne[1] + lanes - 1) / lanes;
    const int64_t tasks = op->ne[3] * op->ne[2] * per_matrix;
    for (int64_t task = tasks * params->ith / params->nth;
         task < tasks * (params->ith + 1) / params->nth; task++) {
        const int64_t matrix = task / per_matrix, i2 = matrix % op->ne[2], i3 = matrix / op->ne[2];
        const int64_t r0 = task % per_matrix * lanes;
        const int64_t r1 = r0 + lanes < op->ne[1] ? r0 + lanes : op->ne[1];
        concat_part(a, op, 0, r0, r1, i2, i3, lanes);
        concat_part(b, op, a->ne[0], r0, r1, i2, i3, lanes);
    }
    if (params->ith == 0 && probing.load()) {
        probe_concats.fetch_add(1, std::memory_order_relaxed);
    }
}

#endif /* BUTTER_X86 */

class Concat : public ggml_mirror::tensor_traits {
    bool work_size(int /*n_threads*/, const tensor * /*op*/, size_t &size) override {
        size = 0;
        return true;
    }

    bool compute_forward(compute_params *params, tensor *op) override {
#ifdef BUTTER_X86
        const int lanes = short_conv_width.load(std::memory_order_relaxed);
        if (!takes_concat(op, lanes)) {
            return false;
        }
        concatenate(params, op, lanes);
        return true;
#else
        (void)params, (void)op;
        return false;
#endif
    }
};

Concat concat_traits;

}  // namespace

ggml_mirror::tensor_traits *concat_path(const tensor *op) {
    return takes_concat(op, short_conv_width.load(std::memory_order_relaxed)) ? &concat_traits
                                                                               : nullptr;
}

ggml_mirror::tensor_traits *short_conv_path(const tensor *op) {
    return takes_short_conv(op, short_conv_width.load(std::memory_order_relaxed))
               ? &short_conv_traits
               : nullptr;
}

/* One short convolution probe (butter_layer_matmul_conv_probe, which checked the
 * arguments), built as llama.cpp builds a recurrent layer's: probe values for the last
 * `width` - 1 inputs of each of `channels` channels and for the step's `tokens` (token-major,
 * as the layer's input projection gives them), joined by a CONCAT of their transposed view,
 * then the SSM_CONV, for `seqs` sequences, through a real ggml graph computed by butter at
 * `lanes` floats a vector and `rounding` (short_conv_rounding's) or by llama.cpp (lanes 0).
 * out: channels x tokens x seqs floats. */
int32_t conv_probe(int lanes, int rounding, int64_t tokens, int64_t channels, int64_t width,
                   int64_t seqs, int threads, int64_t seed, float *out, int32_t *ran) {
    Context compute((size_t)((width - 1 + 3 * tokens) * channels * seqs + width * channels) *
                        sizeof(float) + ((size_t)4 << 20), false);
    if (compute.ctx == nullptr) {
        return BUTTER_E_STATE;
    }
    const int f32 = ggml_mirror::TYPE_F32;
    tensor *states = ggml.new_tensor_3d(compute.ctx, f32, width - 1, channels, seqs);
    tensor *steps = ggml.new_tensor_3d(compute.ctx, f32, channels, tokens, seqs);
    tensor *w = ggml.new_tensor_2d(compute.ctx, f32, width, channels);
    if (states == nullptr || steps == nullptr || w == nullptr) {
        return BUTTER_E_STATE;
    }
    tensor *flipped = ggml.transpose(compute.ctx, steps);
    tensor *x = flipped == nullptr ? nullptr : ggml.concat(compute.ctx, states, flipped, 0);
    tensor *y = x == nullptr ? nullptr : ggml.ssm_conv(compute.ctx, x, w);
    void *graph = y == nullptr ? nullptr : ggml.new_graph(compute.ctx);
    if (graph == nullptr) {
        return BUTTER_E_STATE;
    }
    tensor *inputs[] = {states, steps, w};
    for (size_t i = 0; i < sizeof(inputs) / sizeof(inputs[0]); i++) {
        probe_values((uint64_t)(seed + (int64_t)i), (float *)ggml.get_data(inputs[i]),
                     (int64_t)(ggml.nbytes(inputs[i]) / sizeof(float)));
    }
    ggml.build_forward_expand(graph, y);
    const int was = short_conv_width.load(), was_rounding = short_conv_rounding.load();
    short_conv_width.store(lanes);
    short_conv_rounding.store(rounding);
    probing.store(true);
    const int64_t convs_before = probe_short_convs.load(), concats_before = probe_concats.load();
    const int status = ggml.graph_compute_with_ctx(compute.ctx, graph, threads);
    *ran = probe_short_convs.load() > convs_before && probe_concats.load() > concats_before;
    probing.store(false);
    short_conv_width.store(was);
    short_conv_rounding.store(was_rounding);
    if (status != ggml_mirror::STATUS_SUCCESS) {
        return BUTTER_E_STATE;
    }
    memcpy(out, ggml.get_data(y), ggml.nbytes(y));
    return BUTTER_OK;
}

/* (BUTTER_KERNEL_ISA=avx2 keeps butter's native code to AVX2 here too.) */
int delta_net_widths() {
#ifdef BUTTER_X86
    __builtin_cpu_init();
    int widths = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        widths |= Narrow::FLOATS;
        if (__builtin_cpu_supports("avx512f") && kernel_isa != BUTTER_ISA_AVX2) {
            widths |= Wide::FLOATS;
        }
    }
    return widths;
#else
    return 0;
#endif
}

ggml_mirror::tensor_traits *delta_net_path(const tensor *op) {
    return takes_delta_net(op, delta_net_width.load(std::memory_order_relaxed)) ? &delta_net_traits
                                                                                : nullptr;
}

/* One Gated DeltaNet probe (butter_layer_matmul_delta_net_probe, which checked the
 * arguments): probe values for q, k, v, the gates (negative, as Qwen3.5's are), beta in
 * (0, 1) and the starting state, through a real ggml graph computed at `width` (0:
 * llama.cpp's own op). out: the op's whole result (outputs, then the K snapshots). */
int32_t delta_net_probe(int width, int64_t tokens, int64_t heads, int64_t dim, int64_t seqs,
                        int64_t snapshots, bool per_column, int threads, int64_t seed,
                        float *out, int32_t *ran) {
    const size_t floats = (size_t)(dim * heads * tokens * seqs);
    const size_t states = (size_t)(dim * dim * heads * seqs);
    Context compute((4 * floats + 2 * (size_t)(heads * tokens * seqs) * (size_t)dim +
                     (1 + (size_t)snapshots) * states) * sizeof(float) + ((size_t)16 << 20),
                    false);
    if (compute.ctx == nullptr) {
        return BUTTER_E_STATE;
    }
    const int f32 = ggml_mirror::TYPE_F32;
    tensor *q = ggml.new_tensor_4d(compute.ctx, f32, dim, heads, tokens, seqs);
    tensor *k = ggml.new_tensor_4d(compute.ctx, f32, dim, heads, tokens, seqs);
    tensor *v = ggml.new_tensor_4d(compute.ctx, f32, dim, heads, tokens, seqs);
    tensor *g = ggml.new_tensor_4d(compute.ctx, f32, per_column ? dim : 1, heads, tokens, seqs);
    tensor *beta = ggml.new_tensor_4d(compute.ctx, f32, 1, heads, tokens, seqs);
    tensor *state = ggml.new_tensor_4d(compute.ctx, f32, dim, dim, heads, seqs);
    if (q == nullptr || k == nullptr || v == nullptr || g == nullptr || beta == nullptr ||
        state == nullptr) {
        return BUTTER_E_STATE;
    }
    tensor *inputs[] = {q, k, v, g, beta, state};
    for (size_t i = 0; i < sizeof(inputs) / sizeof(inputs[0]); i++) {
        const int64_t n = (int64_t)(ggml.nbytes(inputs[i]) / sizeof(float));
        float *x = (float *)ggml.get_data(inputs[i]);
        probe_values((uint64_t)(seed + (int64_t)i), x, n);
        for (int64_t e = 0; e < n; e++) {
            if (inputs[i] == g) {
                x[e] = -0.05f - 0.5f * fabsf(x[e]); /* decays in (0.6, 0.95) */
            } else if (inputs[i] == beta) {
                x[e] = 0.5f + 0.5f * x[e];
            } else if (inputs[i] == q || inputs[i] == k) {
                x[e] *= 0.15f; /* about unit length, as after llama.cpp's L2 norm */
            }
        }
    }
    tensor *y = ggml.gated_delta_net(compute.ctx, q, k, v, g, beta, state, snapshots);
    void *graph = y == nullptr ? nullptr : ggml.new_graph(compute.ctx);
    if (graph == nullptr) {
        return BUTTER_E_STATE;
    }
    ggml.build_forward_expand(graph, y);
    memset(ggml.get_data(y), 0, ggml.nbytes(y)); /* (snapshot slots past the tokens stay so) */
    const int was = delta_net_width.load();
    delta_net_width.store(width);
    probing.store(true);
    const int64_t ran_before = probe_delta_nets.load();
    const int status = ggml.graph_compute_with_ctx(compute.ctx, graph, threads);
    *ran = probe_delta_nets.load() > ran_before ? 1 : 0;
    probing.store(false);
    delta_net_width.store(was);
    if (status != ggml_mirror::STATUS_SUCCESS) {
        return BUTTER_E_STATE;
    }
    memcpy(out, ggml.get_data(y), ggml.nbytes(y));
    return BUTTER_OK;
}

}  // namespace butter
