/*
 * prompt_attention.h's tiles on AVX-512 CPUs: the same per-cell operations, so the same bits
 * (each row's result is what decode_attention.h gives that row alone), in a shape that keeps
 * the FMA units busy.
 *
 * Why: prompt_attention.h's AVX2 tiles load and widen a key (f16 to f32) for every three
 * pairs and a value for every four, each from its place in the cache: cells lie a cache row
 * apart (all KV heads of a cell side by side), so a tile's scan of a KV head touches one
 * cache line per cell per pass and spends most of its time waiting on memory.
 *
 * How: a tile's union of cells is taken in blocks. For scores, 16 cells' keys are widened and
 * transposed once (dimension t of the 16 cells in one 512-bit register); each pair's 8
 * partial sums of attention_dots8 (lane j: dimensions j, j + 8, ... in order, the first a
 * product, then fused multiply-adds) become 8 registers of 16 cells, summed in
 * attention_hsum8's order. For values, 128 cells' values are widened once into 16-column
 * slices; each pair's weighted values are rounded to integer units by the same fused
 * multiply-add and summed as integers, which add up to the same in any order. The next
 * block's keys and values are fetched while this one is used.
 *
 * Everything here is static: attention.cpp includes it after prompt_attention.h.
 */
#ifndef BUTTER_PROMPT_ATTENTION_AVX512_H
#define BUTTER_PROMPT_ATTENTION_AVX512_H

#include "prompt_attention.h"

#ifdef BUTTER_X86

#define WIDE_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#define WIDE_PAIRS_AT_ONCE 3 /* pairs scored together: 8 partial sums each, in registers */
#define WIDE_VALUE_PAIRS 4   /* pairs weighing a block's values together */
#define WIDE_VALUE_SLICES 4  /* 16-column slices of values a pass holds in registers */

/* Whether the AVX-512 tiles take a view (whole 16-wide slices of keys and values). */
static inline bool wide_takes(const AttentionView &a) {
    return a.dk % 16 == 0 && a.dv % 16 == 0;
}

/* 16x16 f32 transpose of r[0..15] in place. */
WIDE_TARGET static inline void wide_transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* The keys of 16 listed cells (at `cells`), widened to f32 and transposed: kt[t * 16 + c] is
 * dimension t of cell c. dk is a multiple of 16. */
WIDE_TARGET static inline void wide_pack_keys(const AttentionView &a, const char *k,
                                              const int32_t *cells, float *kt, bool more) {
    if (more) { /* the next block's keys, while these are scored */
        for (int c = 16; c < 32; c++) {
            const char *key = k + cells[c] * a.k_cell;
            for (int64_t line = 0; line < a.dk * (a.k_f16 ? 2 : 4); line += 64) {
                _mm_prefetch(key + line, _MM_HINT_T0);
            }
        }
    }
    for (int64_t t0 = 0; t0 < a.dk; t0 += 16) {
        __m512 r[16];
        for (int c = 0; c < 16; c++) {
            const char *key = k + cells[c] * a.k_cell;
            r[c] = a.k_f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(key + 2 * t0)))
                           : _mm512_loadu_ps((const float *)key + t0);
        }
        wide_transpose16(r);
        for (int t = 0; t < 16; t++) {
            _mm512_store_ps(kt + (t0 + t) * 16, r[t]);
        }
    }
}

/* The dot products of R queries with the 16 packed keys, each summed as attention_dots8 and
 * attention_hsum8 sum it: lane j of 8 partial sums takes dimensions j, j + 8, ... in order
 * (the first a product, then fused multiply-adds), then ((s0 + s1) + (s2 + s3)) + ((s4 + s5)
 * + (s6 + s7)). */
template <int R>
WIDE_TARGET static inline void wide_dots16(const float *const *q, const float *kt, int64_t dk,
                                           __m512 *dots) {
    __m512 acc[R][8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m512 k = _mm512_load_ps(kt + j * 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[r][j] = _mm512_mul_ps(_mm512_set1_ps(q[r][j]), k);
        }
    }
    for (int64_t i = 8; i < dk; i += 8) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512 k = _mm512_load_ps(kt + (i + j) * 16);
            /* Loaded once for the R pairs: otherwise GCC reads it again into every FMA and
             * broadcasts each query element by a load of its own, two loads an FMA. Kept in
             * a register, the query element comes in as the FMA's broadcast operand. */
            __asm__("" : "+v"(k));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][i + j]), k, acc[r][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        dots[r] = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])),
            _mm512_add_ps(_mm512_add_ps(acc[r][4], acc[r][5]), _mm512_add_ps(acc[r][6], acc[r][7])));
    }
}

/* Scores of R pairs over 16 packed keys, as prompt_scores8 makes them. */
template <int R>
WIDE_TARGET static inline void wide_scores16(const AttentionView &a, bool capped,
                                             const float *const *q, const float *kt,
                                             const __m512 *const *biases, float *const *out,
                                             __m512 *best) {
    __m512 dots[R];
    wide_dots16<R>(q, kt, a.dk, dots);
    for (int r = 0; r < R; r++) {
        __m512 s = _mm512_mul_ps(dots[r], _mm512_set1_ps(a.scale));
        if (capped) {
            float lanes[16];
            _mm512_storeu_ps(lanes, s);
            for (float &x : lanes) {
                x = a.softcap * tanhf(x);
            }
            s = _mm512_loadu_ps(lanes);
        }
        s = _mm512_add_ps(s, *biases[r]);
        _mm512_storeu_ps(out[r], s);
        best[r] = _mm512_max_ps(best[r], s);
    }
}

/* prompt_tile_scores with 16 cells a block, the keys packed once for every pair. The list at
 * s.cells is padded to a multiple of 16. */
WIDE_TARGET static void wide_tile_scores(const AttentionView &a, const PromptPlan &p,
                                         const PromptScratch &s, int64_t seq,
                                         int64_t first, int64_t rows, int64_t kv_head, int64_t n,
                                         float *tops, float *ranges) {
    const int64_t pairs = rows * p.group;
    const char *k = a.k + kv_head * a.k_head + seq * a.k_seq;
    const float *q[PROMPT_TILE_PAIRS];
    float slopes[PROMPT_TILE_PAIRS];
    int64_t row_of[PROMPT_TILE_PAIRS];
    __m512 best[PROMPT_TILE_PAIRS], largest[PROMPT_TILE_PAIRS];
    const bool alibi = a.max_bias > 0.0f, capped = a.softcap != 0.0f;
    for (int64_t pair = 0; pair < pairs; pair++) {
        row_of[pair] = pair / p.group;
        const int64_t row = first + pair / p.group, head = kv_head * p.group + pair % p.group;
        q[pair] = (const float *)(a.q + row * a.q_row + head * a.q_head + seq * a.q_seq);
        slopes[pair] = attention_slope(a, head);
        best[pair] = _mm512_set1_ps(-INFINITY);
    }
    for (int64_t r = 0; r < rows; r++) {
        largest[r] = _mm512_setzero_ps();
    }
    const __m512 hidden = _mm512_set1_ps(-INFINITY);
    __m512 row_masks[PROMPT_TILE_PAIRS], pair_biases[PROMPT_TILE_PAIRS];
    const __m512 *biases[PROMPT_TILE_PAIRS];
    float *out[PROMPT_TILE_PAIRS];
    for (int64_t c = 0; c < n; c += 16) {
        const int32_t *at = s.cells + c;
        wide_pack_keys(a, k, at, s.keys, c + 16 < n);
        const __m512 cell_ranges = _mm512_loadu_ps(s.ranges + c);
        const bool in_a_run = at[15] - at[0] == 15;
        for (int64_t r = 0; r < rows; r++) {
            if (a.mask == nullptr) {
                row_masks[r] = _mm512_setzero_ps();
                largest[r] = _mm512_max_ps(largest[r], cell_ranges);
                continue;
            }
            const uint16_t *mask = attention_mask_row(a, seq, first + r);
            __m256i values;
            if (in_a_run) {
                values = _mm256_loadu_si256((const __m256i *)(mask + at[0]));
            } else {
                alignas(32) uint16_t gathered[16];
                for (int i = 0; i < 16; i++) {
                    gathered[i] = mask[at[i]];
                }
                values = _mm256_load_si256((const __m256i *)gathered);
            }
            row_masks[r] = _mm512_cvtph_ps(values);
            const __mmask16 seen = _mm512_cmp_ps_mask(row_masks[r], hidden, _CMP_NEQ_OQ);
            largest[r] = _mm512_mask_max_ps(largest[r], seen, largest[r], cell_ranges);
        }
        for (int64_t pair = 0; pair < pairs; pair++) {
            const __m512 *row_mask = &row_masks[row_of[pair]];
            if (alibi) {
                pair_biases[pair] = _mm512_mul_ps(_mm512_set1_ps(slopes[pair]), *row_mask);
                row_mask = &pair_biases[pair];
            }
            biases[pair] = row_mask;
            out[pair] = s.scores + pair * p.stride + c;
        }
        int64_t pair = 0;
        for (; pair + WIDE_PAIRS_AT_ONCE <= pairs; pair += WIDE_PAIRS_AT_ONCE) {
            wide_scores16<WIDE_PAIRS_AT_ONCE>(a, capped, q + pair, s.keys, biases + pair,
                                              out + pair, best + pair);
        }
        for (; pair < pairs; pair++) {
            wide_scores16<1>(a, capped, q + pair, s.keys, biases + pair, out + pair, best + pair);
        }
        if (c + 16 > n) { /* the padding's places: unseen (their lanes of `best` and
                           * `largest` repeat the last cell's, which changes no maximum) */
            for (int64_t pr = 0; pr < pairs; pr++) {
                for (int64_t i = n - c; i < 16; i++) {
                    out[pr][i] = -INFINITY;
                }
            }
        }
    }
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t head = kv_head * p.group + pair % p.group;
        const float sink = a.sinks != nullptr ? a.sinks[head] : -INFINITY;
        tops[pair] = _mm512_reduce_max_ps(_mm512_max_ps(best[pair], _mm512_set1_ps(sink)));
    }
    for (int64_t r = 0; r < rows; r++) {
        ranges[r] = _mm512_reduce_max_ps(largest[r]);
    }
}

/* The values of `here` listed cells, widened to f32, as dv / 16 slices: vp[(slice x
 * PROMPT_VALUE_CELLS + c) x 16 + i] is dimension slice x 16 + i of cell c. */
WIDE_TARGET static inline void wide_pack_values(const AttentionView &a, const char *v,
                                                const int32_t *cells, int64_t here, float *vp,
                                                int64_t next) {
    for (int64_t c = here; c < here + next; c++) { /* the next block's, while these are used */
        const char *value = v + cells[c] * a.v_cell;
        for (int64_t line = 0; line < a.dv * (a.v_f16 ? 2 : 4); line += 64) {
            _mm_prefetch(value + line, _MM_HINT_T1);
        }
    }
    for (int64_t c = 0; c < here; c++) {
        const char *value = v + cells[c] * a.v_cell;
        for (int64_t slice = 0; slice < a.dv / 16; slice++) {
            const __m512 x =
                a.v_f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(value + 32 * slice)))
                        : _mm512_loadu_ps((const float *)value + 16 * slice);
            _mm512_store_ps(vp + (slice * PROMPT_VALUE_CELLS + c) * 16, x);
        }
    }
}

/* attention_value_units_group over packed values: units[g][d] for G pairs, B slices (16
 * columns each) from `slice` on, over `here` cells. */
template <int G, int B>
KEEP_IN_REGISTERS WIDE_TARGET static inline void wide_value_units(const float *vp, int64_t slice,
                                                 int64_t here, const float *const *weights,
                                                 int32_t *const *units) {
    const __m512 magic = _mm512_set1_ps(VALUE_MAGIC);
    __m512i sum[G][B];
    for (int g = 0; g < G; g++) {
        for (int b = 0; b < B; b++) {
            sum[g][b] = _mm512_setzero_si512();
        }
    }
    const float *at = vp + slice * PROMPT_VALUE_CELLS * 16;
    for (int64_t c = 0; c < here; c++) {
        __m512 value[B];
        for (int b = 0; b < B; b++) {
            value[b] = _mm512_load_ps(at + (b * PROMPT_VALUE_CELLS + c) * 16);
        }
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(weights[g][c]);
            for (int b = 0; b < B; b++) {
                sum[g][b] = _mm512_add_epi32(sum[g][b],
                                             _mm512_castps_si512(_mm512_fmadd_ps(w, value[b], magic)));
            }
        }
    }
    const __m512i taken = _mm512_set1_epi32((int32_t)((uint32_t)here * VALUE_MAGIC_BITS));
    for (int g = 0; g < G; g++) {
        for (int b = 0; b < B; b++) {
            _mm512_storeu_si512((__m512i *)(units[g] + (slice + b) * 16),
                                _mm512_sub_epi32(sum[g][b], taken));
        }
    }
}

/* wide_value_units for G pairs over all dv columns: WIDE_VALUE_SLICES slices a pass, then one. */
template <int G>
WIDE_TARGET static inline void wide_value_units_all(const AttentionView &a, const float *vp,
                                                    int64_t here, const float *const *weights,
                                                    int32_t *const *units) {
    const int64_t slices = a.dv / 16;
    int64_t slice = 0;
    for (; slice + WIDE_VALUE_SLICES <= slices; slice += WIDE_VALUE_SLICES) {
        wide_value_units<G, WIDE_VALUE_SLICES>(vp, slice, here, weights, units);
    }
    for (; slice < slices; slice++) {
        wide_value_units<G, 1>(vp, slice, here, weights, units);
    }
}

/* The weighted values of the `active` pairs in `seen`: each block of PROMPT_VALUE_CELLS
 * values packed once (the next one fetched meanwhile), WIDE_VALUE_PAIRS pairs weighing it
 * together. */
WIDE_TARGET static void wide_tile_values(const AttentionView &a, const PromptPlan &p,
                                         const PromptScratch &s, const char *v, int64_t n,
                                         const int64_t *seen, int active) {
    for (int64_t b = 0; b < n; b += PROMPT_VALUE_CELLS) {
        const int64_t here = n - b < PROMPT_VALUE_CELLS ? n - b : PROMPT_VALUE_CELLS;
        const int64_t next = n - b - here < PROMPT_VALUE_CELLS ? n - b - here : PROMPT_VALUE_CELLS;
        wide_pack_values(a, v, s.cells + b, here, s.values, next);
        for (int i = 0; i < active; i += WIDE_VALUE_PAIRS) {
            const int count = active - i < WIDE_VALUE_PAIRS ? active - i : WIDE_VALUE_PAIRS;
            const float *weights[WIDE_VALUE_PAIRS];
            int32_t *units[WIDE_VALUE_PAIRS];
            for (int g = 0; g < count; g++) {
                weights[g] = s.scores + seen[i + g] * p.stride + b;
                units[g] = s.units + g * a.dv;
            }
            switch (count) {
            case 1: wide_value_units_all<1>(a, s.values, here, weights, units); break;
            case 2: wide_value_units_all<2>(a, s.values, here, weights, units); break;
            case 3: wide_value_units_all<3>(a, s.values, here, weights, units); break;
            default: wide_value_units_all<4>(a, s.values, here, weights, units); break;
            }
            for (int g = 0; g < count; g++) {
                prompt_add_units(s.totals + seen[i + g] * a.dv, units[g], a.dv);
            }
        }
    }
}

/* prompt_tile_with's passes on AVX-512: keys and values packed once per block for every
 * pair of the tile. */
struct WideTiles {
    static constexpr int64_t CELL_BLOCK = 16;

    WIDE_TARGET static void scores(const AttentionView &a, const PromptPlan &p,
                                   const PromptScratch &s, int64_t seq, int64_t first,
                                   int64_t rows, int64_t kv_head, int64_t n, float *tops,
                                   float *ranges) {
        wide_tile_scores(a, p, s, seq, first, rows, kv_head, n, tops, ranges);
    }

    WIDE_TARGET static void values(const AttentionView &a, const PromptPlan &p,
                                   const PromptScratch &s, const char *v, int64_t n,
                                   const int64_t *seen, int active) {
        wide_tile_values(a, p, s, v, n, seen, active);
    }
};

/* prompt_tile on AVX-512: the same result. */
WIDE_TARGET static void wide_tile(const AttentionView &a, const PromptPlan &p,
                                  const PromptScratch &s, const float *ranges_of, int64_t seq,
                                  int64_t tile) {
    prompt_tile_with<WideTiles>(a, p, s, ranges_of, seq, tile);
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_PROMPT_ATTENTION_AVX512_H */
