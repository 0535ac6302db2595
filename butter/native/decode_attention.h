/*
 * butter's attention for decode steps (fewer than ATTENTION_MAX_ROWS query rows): every row
 * computed the same way whatever else the step holds.
 *
 * Why: llama.cpp's CPU flash attention computes a one-row step by splitting the cells among
 * its threads (from 512 cells on, in as many pieces as there are threads, so the pieces move
 * as the cache's view grows) and each row of a bigger step over all its cells on one thread.
 * The two round differently, so a decode row verified beside draft rows, or beside another
 * request's rows, is not the lone row it stands for.
 *
 * Also: llama.cpp sums a row's cells in the order they lie in the cache, and where a
 * request's cells lie depends on what the cache held before (new cells go to the first free
 * ones from a head that removals move back, and whether the search starts over depends on
 * the step's token count): so the same request, or the same request with draft rows in its
 * steps, is summed in another order on a server with another history.
 *
 * How: each row first lists the cells its mask lets it see. Each (row, KV head, chunk of
 * ATTENTION_CHUNK of those cells) is then a task, in three phases: (1) its query heads'
 * scores, each chunk's largest, and the chunk's largest |value|; (2) with the row's largest
 * score and |value| known, the weights e^(score - largest) and the chunk's sums of them and
 * of the weighted values, in fixed point (integers); (3) per (row, head) the chunks' sums
 * added and divided. Integers add to the same total in any order, and maxima are the same
 * in any order, so a row's result depends only on its query and the set of cells it sees:
 * not on the other rows, the thread count, the view's size, nor where in the cache its
 * cells lie or in which order.
 *
 * Numbers: scores are dot products of the f32 query with the f32-widened key (llama.cpp
 * rounds the query to f16 first) in a fixed order of 8-lane vectors, and the exponentials a
 * fixed polynomial, whatever the instruction set (AVX2 and FMA code on AVX512 CPUs too).
 * The weights' sum counts units of 2^-40; each weighted value is rounded to units of
 * 2^-22 of the largest |value| the row sees under that KV head (so 256 of them fit an
 * int32; chunks add in int64): about f32's precision, where llama.cpp sums the values in f16.
 *
 * Everything here is static: layer_matmul.cpp includes it.
 */
#ifndef BUTTER_DECODE_ATTENTION_H
#define BUTTER_DECODE_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "q8_0_tiles.h" /* BUTTER_X86, AVX2_TARGET */

/* With GCC's partial redundancy elimination (tree-pre) the value kernel's loop ran short of
 * registers: two of its sums lived on the stack, each cell waiting on their stores (seen
 * with perf; without it every sum stays in a register). */
#if defined(__GNUC__) && !defined(__clang__)
#define KEEP_IN_REGISTERS __attribute__((optimize("no-tree-pre")))
#else
#define KEEP_IN_REGISTERS
#endif

#define ATTENTION_CHUNK 256   /* a row's cells per partial (a multiple of 8) */
#define ATTENTION_MAX_ROWS 64 /* from here on prompt_attention.h's tiles run */

/* One FLASH_ATTN_EXT op, as plain pointers and byte strides (ggml's ne / nb). */
struct AttentionView {
    int64_t dk, dv;          /* key and value widths */
    int64_t rows, heads;     /* query rows (tokens) and query heads */
    int64_t kv_heads, cells; /* KV heads and cells in the view */
    int64_t seqs;            /* ne[3] of the query (streams), one K/V per stream */
    const char *q;
    size_t q_row, q_head, q_seq;
    const char *k, *v;
    size_t k_cell, k_head, k_seq, v_cell, v_head, v_seq;
    bool k_f16, v_f16; /* else f32 */
    const uint16_t *mask; /* f16, or null: every cell is seen */
    size_t mask_row, mask_seq;
    int64_t mask_seqs; /* broadcast over streams (one mask row for every head) */
    const float *sinks;            /* one logit per query head, or null */
    char *dst;
    size_t dst_row; /* bytes of one output head row: dst is [dv, heads, rows, seqs] */
    float scale, max_bias, softcap;
};

/* Chunks of n cells. */
static inline int64_t attention_chunks(int64_t n) {
    return (n + ATTENTION_CHUNK - 1) / ATTENTION_CHUNK;
}

/* ALiBi's slope for a query head (1 without ALiBi), as llama.cpp computes it. */
static inline float attention_slope(const AttentionView &a, int64_t head) {
    if (a.max_bias <= 0.0f) {
        return 1.0f;
    }
    const uint32_t log2_heads = 1u << (uint32_t)floor(log2((double)a.heads));
    const float m0 = powf(2.0f, -(a.max_bias) / log2_heads);
    const float m1 = powf(2.0f, -(a.max_bias / 2.0f) / log2_heads);
    return (uint32_t)head < log2_heads ? powf(m0, (float)(head + 1))
                                       : powf(m1, (float)(2 * (head - log2_heads) + 1));
}

/* A row's mask: f16 values, one per cell (the same for every head). */
static inline const uint16_t *attention_mask_row(const AttentionView &a, int64_t seq,
                                                 int64_t row) {
    return (const uint16_t *)((const char *)a.mask + row * a.mask_row +
                              (seq % a.mask_seqs) * a.mask_seq);
}

#ifdef BUTTER_X86

AVX2_TARGET static inline __m256 attention_load8(const char *p, bool f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))
               : _mm256_loadu_ps((const float *)p);
}

/* The sum of a vector's 8 lanes, in the order attention_hsum8 sums each of its 8. */
AVX2_TARGET static inline float attention_hsum(__m256 v) {
    const __m256 pairs = _mm256_hadd_ps(v, v);
    const __m256 quads = _mm256_hadd_ps(pairs, pairs);
    return _mm_cvtss_f32(_mm256_castps256_ps128(quads)) +
           _mm_cvtss_f32(_mm256_extractf128_ps(quads, 1));
}

/* The lane sums of 8 vectors, as one vector (lane i: the sum of d[i], summed as
 * attention_hsum sums it). */
AVX2_TARGET static inline __m256 attention_hsum8(const __m256 *d) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The dot products of a query with 8 keys. */
AVX2_TARGET static inline __m256 attention_dots8(const float *q, const char *const *keys,
                                                 int64_t dk, bool f16) {
    __m256 d[8];
    const size_t step = f16 ? 16 : 32; /* bytes of 8 values */
    for (int c = 0; c < 8; c++) {
        d[c] = _mm256_mul_ps(_mm256_loadu_ps(q), attention_load8(keys[c], f16));
    }
    for (int64_t i = 8; i < dk; i += 8) {
        const __m256 qi = _mm256_loadu_ps(q + i);
        for (int c = 0; c < 8; c++) {
            d[c] = _mm256_fmadd_ps(qi, attention_load8(keys[c] + i / 8 * step, f16), d[c]);
        }
    }
    return attention_hsum8(d);
}

/* The dot product of a query with one key, summed as attention_dots8 sums each of its 8. */
AVX2_TARGET static inline float attention_dot(const float *q, const char *k, int64_t dk,
                                              bool f16) {
    const size_t step = f16 ? 16 : 32;
    __m256 d = _mm256_mul_ps(_mm256_loadu_ps(q), attention_load8(k, f16));
    for (int64_t i = 8; i < dk; i += 8) {
        d = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), attention_load8(k + i / 8 * step, f16), d);
    }
    return attention_hsum(d);
}

/* e^x for x <= 0 (Cephes' expf: range reduction by ln 2 and a degree-6 polynomial). */
AVX2_TARGET static inline __m256 attention_exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                               _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* The cells a row sees (its mask is not -inf there), in cell order, into `cells`; returns
 * how many. Without a mask it sees them all. */
AVX2_TARGET static inline int64_t attention_visible(const AttentionView &a, int64_t seq,
                                                    int64_t row, int32_t *cells) {
    if (a.mask == nullptr) {
        for (int64_t c = 0; c < a.cells; c++) {
            cells[c] = (int32_t)c;
        }
        return a.cells;
    }
    const uint16_t *mask = attention_mask_row(a, seq, row);
    const __m256i hidden = _mm256_set1_epi16((short)0xFC00); /* f16 -inf */
    int64_t n = 0, c = 0;
    for (; c + 16 <= a.cells; c += 16) {
        const __m256i m = _mm256_loadu_si256((const __m256i *)(mask + c));
        uint32_t seen = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(m, hidden));
        while (seen != 0) { /* two bits per cell */
            const int bit = __builtin_ctz(seen);
            cells[n++] = (int32_t)(c + bit / 2);
            seen &= ~(3u << bit);
        }
    }
    for (; c < a.cells; c++) {
        if (mask[c] != 0xFC00) {
            cells[n++] = (int32_t)c;
        }
    }
    return n;
}

/* The scores of a chunk's n cells for one query head: dot(q, key) x scale (capped), plus
 * the mask's value times the head's ALiBi slope; -inf for the chunk's places past n.
 * Returns the largest. */
AVX2_TARGET static inline float attention_scores(const AttentionView &a, const float *q,
                                                 const char *k, const uint16_t *mask,
                                                 float slope, const int32_t *cells, int64_t n,
                                                 float *scores) {
    const __m256 scale = _mm256_set1_ps(a.scale);
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < ATTENTION_CHUNK; c += 8) {
        if (c >= n) {
            _mm256_storeu_ps(scores + c, _mm256_set1_ps(-INFINITY));
            continue;
        }
        const int64_t here = n - c < 8 ? n - c : 8;
        float dots[8], biases[8];
        if (here == 8) {
            const char *keys[8];
            for (int i = 0; i < 8; i++) {
                keys[i] = k + cells[c + i] * a.k_cell;
            }
            _mm256_storeu_ps(dots, attention_dots8(q, keys, a.dk, a.k_f16));
        } else {
            for (int64_t i = 0; i < here; i++) {
                dots[i] = attention_dot(q, k + cells[c + i] * a.k_cell, a.dk, a.k_f16);
            }
        }
        for (int64_t i = 0; i < 8; i++) {
            biases[i] = i >= here ? -INFINITY
                        : mask == nullptr ? 0.0f
                                          : slope * _cvtsh_ss(mask[cells[c + i]]);
        }
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(dots), scale);
        if (a.softcap != 0.0f) { /* (Gemma 2's: rare, so scalar) */
            float capped[8];
            _mm256_storeu_ps(capped, s);
            for (float &x : capped) {
                x = a.softcap * tanhf(x);
            }
            s = _mm256_loadu_ps(capped);
        }
        s = _mm256_add_ps(s, _mm256_loadu_ps(biases));
        _mm256_storeu_ps(scores + c, s);
        best = _mm256_max_ps(best, s);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    float top = lanes[0];
    for (float x : lanes) {
        top = x > top ? x : top;
    }
    return top;
}

/* Where a row's fixed-point sums stand: the weights' sum counts units of 2^-WEIGHT_BITS; the
 * weighted values' units are 2^-s for the s of attention_value_shift. */
#define WEIGHT_BITS 40
#define VALUE_BITS 22 /* a weighted value is at most 2^22 units: 256 of them fit an int32 */

/* The largest |value| of a chunk's n cells (dv wide) under one KV head. An f16's magnitude
 * orders as its bits without the sign, so those are compared as integers, 16 at a time. */
AVX2_TARGET static inline float attention_value_range(const AttentionView &a, const char *v,
                                                      const int32_t *cells, int64_t n) {
    if (a.v_f16) {
        const __m256i magnitude = _mm256_set1_epi16(0x7fff);
        __m256i top = _mm256_setzero_si256();
        for (int64_t c = 0; c < n; c++) {
            const char *vc = v + cells[c] * a.v_cell;
            int64_t d = 0;
            for (; d + 16 <= a.dv; d += 16) {
                top = _mm256_max_epu16(top, _mm256_and_si256(magnitude,
                                                             _mm256_loadu_si256((const __m256i *)(vc + 2 * d))));
            }
            for (; d < a.dv; d += 8) {
                const __m128i half = _mm_and_si128(_mm256_castsi256_si128(magnitude),
                                                   _mm_loadu_si128((const __m128i *)(vc + 2 * d)));
                top = _mm256_max_epu16(top, _mm256_inserti128_si256(_mm256_setzero_si256(), half, 0));
            }
        }
        uint16_t lanes[16];
        _mm256_storeu_si256((__m256i *)lanes, top);
        uint16_t largest = 0;
        for (uint16_t x : lanes) {
            largest = x > largest ? x : largest;
        }
        return _cvtsh_ss(largest);
    }
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 top = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; c++) {
        const float *vc = (const float *)(v + cells[c] * a.v_cell);
        for (int64_t d = 0; d < a.dv; d += 8) {
            top = _mm256_max_ps(top, _mm256_and_ps(magnitude, _mm256_loadu_ps(vc + d)));
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    float largest = 0.0f;
    for (float x : lanes) {
        largest = x > largest ? x : largest;
    }
    return largest;
}

/* The power of two a row's weighted values are counted in, from the largest |value| the row
 * sees under that KV head: weights are at most 1, so every weighted value is then at most
 * 2^VALUE_BITS units. Clamped so that the scale stays a finite float. */
static inline int attention_value_shift(float largest) {
    int exponent = 0;
    frexpf(largest, &exponent); /* largest < 2^exponent */
    const int shift = VALUE_BITS - exponent;
    return shift > 100 ? 100 : shift < -100 ? -100 : shift;
}

/* A chunk's scores (n of them, -inf past n up to the next multiple of 8) become weights
 * e^(score - top), stored times `scale` (a power of 2, for the weighted values' units);
 * returns the weights' sum, each rounded to units of 2^-WEIGHT_BITS: an integer. */
AVX2_TARGET static inline int64_t attention_weights(float *scores, int64_t n, float top,
                                                    float scale) {
    const __m256 best = _mm256_set1_ps(top), unseen = _mm256_set1_ps(-INFINITY);
    const __m256 scaled = _mm256_set1_ps(scale);
    const __m256d units = _mm256_set1_pd(ldexp(1.0, WEIGHT_BITS));
    const __m256d magic = _mm256_set1_pd(6755399441055744.0); /* 1.5 x 2^52 */
    __m256i sum = _mm256_setzero_si256();
    for (int64_t c = 0; c < n; c += 8) {
        const __m256 s = _mm256_loadu_ps(scores + c);
        const __m256 p = _mm256_andnot_ps(_mm256_cmp_ps(s, unseen, _CMP_EQ_OQ),
                                          attention_exp(_mm256_sub_ps(s, best)));
        /* p x 2^40 + 1.5 x 2^52, rounded once to an integer: its low bits are that integer */
        for (int half = 0; half < 2; half++) {
            const __m128 four = half ? _mm256_extractf128_ps(p, 1) : _mm256_castps256_ps128(p);
            const __m256d rounded = _mm256_fmadd_pd(_mm256_cvtps_pd(four), units, magic);
            sum = _mm256_add_epi64(sum, _mm256_sub_epi64(_mm256_castpd_si256(rounded),
                                                         _mm256_castpd_si256(magic)));
        }
        _mm256_storeu_ps(scores + c, _mm256_mul_ps(p, scaled));
    }
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, sum);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* x + 1.5 x 2^23 in f32, for |x| <= 2^22, is x rounded to an integer in the low bits: one
 * fused multiply-add turns a weighted value into its units, and integer adds sum them (the
 * magic's own bits, added once per cell, are taken off at the end; int32 wraps exactly). */
#define VALUE_MAGIC 12582912.0f
#define VALUE_MAGIC_BITS 0x4B400000u

/* For G query heads sharing a KV head: units[g][d] = the sum over a chunk's n cells of
 * weights[g][c] (already times 2^shift) x the value of cells[c], each rounded to an integer, so
 * their sum is the same in any order. B x 8 columns at a time, every head's sums held in
 * registers, each value converted once for the G heads: G x B sums, B values, one weight,
 * the magic and a product in registers (AVX2 has 16). */
template <bool F16, int G, int B>
KEEP_IN_REGISTERS AVX2_TARGET static inline void attention_value_units_group(const AttentionView &a,
                                                           const char *v, const int32_t *cells,
                                                           int64_t n, int64_t d0, int64_t d1,
                                                           const float *const *weights,
                                                           int32_t *const *units) {
    constexpr size_t step = F16 ? 16 : 32;
    const __m256 magic = _mm256_set1_ps(VALUE_MAGIC);
    const __m256i taken = _mm256_set1_epi32((int32_t)((uint32_t)n * VALUE_MAGIC_BITS));
    for (int64_t d = d0; d + 8 * B <= d1; d += 8 * B) {
        __m256i sum[G][B];
        for (int g = 0; g < G; g++) {
            for (int b = 0; b < B; b++) {
                sum[g][b] = _mm256_setzero_si256();
            }
        }
        for (int64_t c = 0; c < n; c++) {
            const char *vc = v + cells[c] * a.v_cell + d / 8 * step;
            __m256 value[B];
            for (int b = 0; b < B; b++) {
                value[b] = attention_load8(vc + b * step, F16);
            }
            for (int g = 0; g < G; g++) {
                const __m256 w = _mm256_broadcast_ss(weights[g] + c);
                for (int b = 0; b < B; b++) {
                    sum[g][b] = _mm256_add_epi32(
                        sum[g][b], _mm256_castps_si256(_mm256_fmadd_ps(w, value[b], magic)));
                    /* Kept in a register. The library's build does so anyway; GCC's build of
                     * benchmarks/prompt_tiles.cpp kept two of the 4 x 2 sums on the stack, each
                     * cell waiting on a store and a load, and timed a slower loop than ships. */
                    __asm__("" : "+x"(sum[g][b]));
                }
            }
        }
        for (int g = 0; g < G; g++) {
            for (int b = 0; b < B; b++) {
                _mm256_storeu_si256((__m256i *)(units[g] + d + 8 * b),
                                    _mm256_sub_epi32(sum[g][b], taken));
            }
        }
    }
}

/* attention_value_units_group for G heads (1..4) over all dv columns: as many as fit the
 * registers at a time, then 8 at a time. */
template <bool F16, int G>
AVX2_TARGET static inline void attention_value_units_of(const AttentionView &a, const char *v,
                                                        const int32_t *cells, int64_t n,
                                                        const float *const *weights,
                                                        int32_t *const *units) {
    constexpr int B = G <= 2 ? 4 : 2;
    const int64_t wide = a.dv / (8 * B) * (8 * B);
    attention_value_units_group<F16, G, B>(a, v, cells, n, 0, wide, weights, units);
    attention_value_units_group<F16, G, 1>(a, v, cells, n, wide, a.dv, weights, units);
}

template <int G>
AVX2_TARGET static inline void attention_value_units_heads(const AttentionView &a,
                                                           const char *v, const int32_t *cells,
                                                           int64_t n, const float *const *weights,
                                                           int32_t *const *units) {
    if (a.v_f16) {
        attention_value_units_of<true, G>(a, v, cells, n, weights, units);
    } else {
        attention_value_units_of<false, G>(a, v, cells, n, weights, units);
    }
}

/* Where one wave of rows keeps its work: per (row, query head) every score the row sees
 * (`stride` floats, a multiple of ATTENTION_CHUNK) and each chunk's largest, per (row, KV
 * head) each chunk's largest |value|, and per (row, query head, chunk) the chunk's sums:
 * the weights' (int64) and the weighted values' (dv int32). */
struct AttentionWave {
    float *scores, *maxima, *ranges;
    int64_t *weight_units;
    int32_t *value_units;
    int64_t stride, chunks, heads, kv_heads, dv;

    float *scores_of(int64_t row, int64_t head) const {
        return scores + (row * heads + head) * stride;
    }
    float *maxima_of(int64_t row, int64_t head) const {
        return maxima + (row * heads + head) * chunks;
    }
    float *ranges_of(int64_t row, int64_t kv_head) const {
        return ranges + (row * kv_heads + kv_head) * chunks;
    }
    int64_t *weight_units_of(int64_t row, int64_t head) const {
        return weight_units + (row * heads + head) * chunks;
    }
    int32_t *value_units_of(int64_t row, int64_t head, int64_t chunk) const {
        return value_units + ((row * heads + head) * chunks + chunk) * dv;
    }
};

/* Phase 1 of a task (row `row` of the wave, stream `seq`, KV head `kv_head`, chunk `chunk`
 * of the n cells listed at `cells`): each query head's scores and their largest, and the
 * largest |value|. */
AVX2_TARGET static void attention_score_chunk(const AttentionView &a, const AttentionWave &w,
                                              int64_t seq, int64_t query_row, int64_t row,
                                              int64_t kv_head, int64_t chunk,
                                              const int32_t *cells, int64_t n) {
    const int64_t group = a.heads / a.kv_heads;
    const char *k = a.k + kv_head * a.k_head + seq * a.k_seq;
    const char *v = a.v + kv_head * a.v_head + seq * a.v_seq;
    const uint16_t *mask = a.mask == nullptr ? nullptr : attention_mask_row(a, seq, query_row);
    for (int64_t g = 0; g < group; g++) {
        const int64_t head = kv_head * group + g;
        const float *q =
            (const float *)(a.q + query_row * a.q_row + head * a.q_head + seq * a.q_seq);
        w.maxima_of(row, head)[chunk] =
            attention_scores(a, q, k, mask, attention_slope(a, head), cells, n,
                             w.scores_of(row, head) + chunk * ATTENTION_CHUNK);
    }
    w.ranges_of(row, kv_head)[chunk] = attention_value_range(a, v, cells, n);
}

/* The largest of `start` and the n values at xs (a row's per-chunk largest). */
static inline float attention_largest(const float *xs, int64_t n, float start) {
    for (int64_t c = 0; c < n; c++) {
        start = xs[c] > start ? xs[c] : start;
    }
    return start;
}

/* A row's largest score for one query head over its `chunks` chunks, the sink included. */
static inline float attention_top(const AttentionView &a, const AttentionWave &w, int64_t row,
                                  int64_t head, int64_t chunks) {
    return attention_largest(w.maxima_of(row, head), chunks,
                             a.sinks != nullptr ? a.sinks[head] : -INFINITY);
}

/* A row's value shift under one KV head, from its chunks' largest |value|. */
static inline int attention_row_shift(const AttentionWave &w, int64_t row, int64_t kv_head,
                                      int64_t chunks) {
    return attention_value_shift(attention_largest(w.ranges_of(row, kv_head), chunks, 0.0f));
}

/* Phase 2 of a task: its scores become weights e^(score - the row's top score), and the
 * chunk's fixed-point sums are written. `chunks`: how many the row has. */
AVX2_TARGET static void attention_weigh_chunk(const AttentionView &a, const AttentionWave &w,
                                              int64_t seq, int64_t row, int64_t kv_head,
                                              int64_t chunk, int64_t chunks,
                                              const int32_t *cells, int64_t n) {
    const int64_t group = a.heads / a.kv_heads;
    const char *v = a.v + kv_head * a.v_head + seq * a.v_seq;
    const float scale = ldexpf(1.0f, attention_row_shift(w, row, kv_head, chunks));
    const float *weights[4];
    int32_t *units[4];
    int heads = 0;
    for (int64_t g = 0; g < group; g++) {
        const int64_t head = kv_head * group + g;
        float *scores = w.scores_of(row, head) + chunk * ATTENTION_CHUNK;
        const float top = attention_top(a, w, row, head, chunks);
        if (top == -INFINITY || w.maxima_of(row, head)[chunk] == -INFINITY) {
            w.weight_units_of(row, head)[chunk] = 0; /* nothing seen here */
            memset(w.value_units_of(row, head, chunk), 0, (size_t)a.dv * sizeof(int32_t));
        } else {
            w.weight_units_of(row, head)[chunk] = attention_weights(scores, n, top, scale);
            weights[heads] = scores;
            units[heads++] = w.value_units_of(row, head, chunk);
        }
        if (heads == 4 || (g == group - 1 && heads > 0)) {
            switch (heads) {
            case 1: attention_value_units_heads<1>(a, v, cells, n, weights, units); break;
            case 2: attention_value_units_heads<2>(a, v, cells, n, weights, units); break;
            case 3: attention_value_units_heads<3>(a, v, cells, n, weights, units); break;
            default: attention_value_units_heads<4>(a, v, cells, n, weights, units); break;
            }
            heads = 0;
        }
    }
}

/* Phase 3: a row's result for one query head from its chunks' sums (added as integers, so
 * in any order to the same total), the sink's weight joining the weights', and the row goes
 * to its place in dst. */
AVX2_TARGET static inline void attention_finish(const AttentionView &a, const AttentionWave &w,
                                                int64_t seq, int64_t query_row, int64_t row,
                                                int64_t head, int64_t chunks) {
    const int64_t kv_head = head / (a.heads / a.kv_heads);
    const float top = attention_top(a, w, row, head, chunks);
    float *out = (float *)(a.dst + (size_t)(seq * a.rows * a.heads + head +
                                            query_row * a.heads) * a.dst_row);
    if (top == -INFINITY) {
        memset(out, 0, (size_t)a.dv * sizeof(float));
        return;
    }
    int64_t weight_units = 0;
    for (int64_t c = 0; c < chunks; c++) {
        weight_units += w.weight_units_of(row, head)[c];
    }
    if (a.sinks != nullptr) {
        weight_units += (int64_t)nearbyint(ldexp((double)expf(a.sinks[head] - top), WEIGHT_BITS));
    }
    const int shift = attention_row_shift(w, row, kv_head, chunks);
    /* value units x 2^-shift over weight units x 2^-WEIGHT_BITS */
    const double per_unit =
        weight_units == 0 ? 0.0 : ldexp(1.0, WEIGHT_BITS - shift) / (double)weight_units;
    for (int64_t d = 0; d < a.dv; d++) {
        int64_t units = 0;
        for (int64_t c = 0; c < chunks; c++) {
            units += w.value_units_of(row, head, c)[d];
        }
        out[d] = (float)((double)units * per_unit);
    }
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_DECODE_ATTENTION_H */
