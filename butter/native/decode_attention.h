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
 * How: each row first lists the cells its mask lets it see, in cell order. Each (row, KV
 * head, chunk of ATTENTION_CHUNK of those cells) is then a task that computes, for the query
 * heads sharing that KV head, the chunk's largest score, the sum of its exponentials and
 * the exponential-weighted sum of its values. Tasks spread over the threads in any way; each
 * row's partials are then folded chunk after chunk. So a row's result depends only on its
 * query and the ordered cells it sees: not on the other rows, the thread count, the view's
 * size, or where in the cache its cells lie.
 *
 * Numbers: scores are dot products of the f32 query with the f32-widened key (llama.cpp
 * rounds the query to f16 first), and values are summed in f32 (llama.cpp sums in f16 for an
 * f16 cache): as exact or more so. Every sum runs in a fixed order of 8-lane vectors and
 * the chunks' exponentials are a fixed polynomial, whatever the instruction set (AVX2 and
 * FMA code on AVX512 CPUs too).
 *
 * Everything here is static: layer_matmul.cpp includes it.
 */
#ifndef BUTTER_DECODE_ATTENTION_H
#define BUTTER_DECODE_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "q8_0_tiles.h" /* BUTTER_X86, AVX2_TARGET */

#define ATTENTION_CHUNK 256   /* a row's cells per partial (a multiple of 8) */
#define ATTENTION_MAX_ROWS 64 /* from here on llama.cpp's tiled prompt path runs */

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

/* Floats of one partial: the maximum score, the sum of exponentials, dv weighted values. */
static inline int64_t attention_partial_floats(const AttentionView &a) { return 2 + a.dv; }

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

/* acc = the sum over a chunk's n cells of weights[c] x the value of cells[c] (dv wide), cell
 * after cell; 64 columns at a time, held in registers. */
AVX2_TARGET static inline void attention_weigh_values(const AttentionView &a, const char *v,
                                                      const int32_t *cells, int64_t n,
                                                      const float *weights, float *acc) {
    const size_t step = a.v_f16 ? 16 : 32;
    int64_t d = 0;
    for (; d + 64 <= a.dv; d += 64) {
        __m256 sum[8];
        for (int i = 0; i < 8; i++) {
            sum[i] = _mm256_setzero_ps();
        }
        for (int64_t c = 0; c < n; c++) {
            const __m256 w = _mm256_set1_ps(weights[c]);
            const char *vc = v + cells[c] * a.v_cell + d / 8 * step;
            for (int i = 0; i < 8; i++) {
                sum[i] = _mm256_fmadd_ps(w, attention_load8(vc + i * step, a.v_f16), sum[i]);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm256_storeu_ps(acc + d + 8 * i, sum[i]);
        }
    }
    for (; d < a.dv; d += 8) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t c = 0; c < n; c++) {
            sum = _mm256_fmadd_ps(_mm256_set1_ps(weights[c]),
                                  attention_load8(v + cells[c] * a.v_cell + d / 8 * step,
                                                  a.v_f16),
                                  sum);
        }
        _mm256_storeu_ps(acc + d, sum);
    }
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

/* One task: the partials of query row `row` of stream `seq`, for the query heads of KV head
 * `kv_head`, over one chunk of the cells it sees (`cells`, n of them, in cell order).
 * Partial g goes to out + g * out_stride floats. `scores`: ATTENTION_CHUNK floats. */
AVX2_TARGET static void attention_chunk(const AttentionView &a, int64_t seq, int64_t row,
                                        int64_t kv_head, const int32_t *cells, int64_t n,
                                        float *scores, float *out, int64_t out_stride) {
    const int64_t group = a.heads / a.kv_heads;
    const char *k = a.k + kv_head * a.k_head + seq * a.k_seq;
    const char *v = a.v + kv_head * a.v_head + seq * a.v_seq;
    const uint16_t *mask = a.mask == nullptr ? nullptr : attention_mask_row(a, seq, row);
    for (int64_t g = 0; g < group; g++) {
        const int64_t head = kv_head * group + g;
        const float *q = (const float *)(a.q + row * a.q_row + head * a.q_head + seq * a.q_seq);
        const float best =
            attention_scores(a, q, k, mask, attention_slope(a, head), cells, n, scores);
        float *partial = out + g * out_stride;
        partial[0] = best;
        partial[1] = 0.0f;
        if (best == -INFINITY) {
            continue; /* (every score -inf: the fold skips it) */
        }
        /* exponentials in place (0 past n), summed lane by lane over the whole chunk */
        const __m256 top = _mm256_set1_ps(best), unseen = _mm256_set1_ps(-INFINITY);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t c = 0; c < ATTENTION_CHUNK; c += 8) {
            const __m256 s = _mm256_loadu_ps(scores + c);
            const __m256 p = _mm256_andnot_ps(_mm256_cmp_ps(s, unseen, _CMP_EQ_OQ),
                                              attention_exp(_mm256_sub_ps(s, top)));
            _mm256_storeu_ps(scores + c, p);
            sum = _mm256_add_ps(sum, p);
        }
        partial[1] = attention_hsum(sum);
        attention_weigh_values(a, v, cells, n, scores, partial + 2);
    }
}

/* Folds one chunk's partial into a row's running one (both: max, sum, dv values). A chunk
 * with nothing in it changes nothing; the first one with something is copied exactly. */
AVX2_TARGET static inline void attention_fold(int64_t dv, float *into, const float *chunk) {
    if (chunk[1] == 0.0f) {
        return;
    }
    const float top = into[0] > chunk[0] ? into[0] : chunk[0];
    const float old_scale = expf(into[0] - top), new_scale = expf(chunk[0] - top);
    const __m256 a = _mm256_set1_ps(old_scale), b = _mm256_set1_ps(new_scale);
    for (int64_t d = 0; d < dv; d += 8) {
        const __m256 kept = _mm256_mul_ps(_mm256_loadu_ps(into + 2 + d), a);
        _mm256_storeu_ps(into + 2 + d, _mm256_fmadd_ps(_mm256_loadu_ps(chunk + 2 + d), b, kept));
    }
    into[1] = fmaf(chunk[1], new_scale, into[1] * old_scale);
    into[0] = top;
}

/* A row's result from its folded partial: the sink (if any) joins the softmax, the values
 * are divided by the sum, and the row goes to its place in dst. */
AVX2_TARGET static inline void attention_finish(const AttentionView &a, int64_t seq, int64_t row,
                                                int64_t head, float *folded) {
    float *acc = folded + 2;
    float top = folded[0], sum = folded[1];
    if (a.sinks != nullptr) {
        const float s = a.sinks[head];
        if (s > top) {
            const float shrink = expf(top - s);
            for (int64_t d = 0; d < a.dv; d++) {
                acc[d] *= shrink;
            }
            sum = sum * shrink + 1.0f;
        } else {
            sum += expf(s - top);
        }
    }
    const float inverse = sum == 0.0f ? 0.0f : 1.0f / sum;
    float *out = (float *)(a.dst + (size_t)(seq * a.rows * a.heads + head + row * a.heads) *
                                       a.dst_row);
    for (int64_t d = 0; d < a.dv; d++) {
        out[d] = acc[d] * inverse;
    }
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_DECODE_ATTENTION_H */
