/*
 * butter's attention for prompt steps (ATTENTION_MAX_ROWS query rows or more): each row's
 * result is, bit for bit, what decode_attention.h gives that row alone.
 *
 * Why: llama.cpp's CPU flash attention evaluates a prompt's rows in tiles and sums the
 * cache's cells in blocks of the places they lie in, rescaling as it goes. So a prompt
 * prefilled beside other prompts, after another history, or in a step a row longer or
 * shorter, ends in other last bits, and greedy texts part where two tokens were close
 * (several clients' prompts arriving together are one such step). With every row computed
 * as decode_attention.h computes it, a request's bits depend only on its own tokens.
 *
 * How: decode_attention.h's result for a row is a function of per-cell quantities (each
 * cell's score, its weight and its weighted values rounded to integer units), of the row's
 * largest score and largest |value|, and of integer sums, which add up to the same in any
 * order. Any schedule that computes each per-cell quantity with the same operations gives
 * the same bits. Here a task is a tile of consecutive query rows of one stream, all on the
 * thread that takes it (attention.cpp's attend_prompt hands them out one at a time, so
 * which thread took a tile changes nothing): the cells any of its rows sees are listed
 * once (the tile's union);
 * for each KV head, the scores of every (row, query head) pair over the union are computed
 * with each key loaded and widened once for several pairs (decode_attention.h widens it
 * for each query head of each row), a cell the row does not see scoring -inf as its mask
 * says, so that it weighs exactly 0 and adds 0 units; each cell's largest |value| is found
 * once per step for every tile (decode_attention.h: once per row). A tile's union is its
 * last row's cells for a causal prompt, a few more on a sliding window.
 *
 * On AVX-512 CPUs prompt_attention_avx512.h computes the same tiles with each block of keys
 * and values widened and packed once for all of a tile's pairs: the same operations on
 * every per-cell quantity, so the same bits.
 *
 * Everything here is static: attention.cpp includes it after decode_attention.h.
 */
#ifndef BUTTER_PROMPT_ATTENTION_H
#define BUTTER_PROMPT_ATTENTION_H

#include "decode_attention.h"

#define PROMPT_TILE_PAIRS 64 /* (query row, query head) pairs a task scores together: each
                              * key and value is read from memory once for all of them */
#define PROMPT_PAIRS_AT_ONCE 3 /* pairs whose dot products share each key's load */

/* How a prompt step's rows are cut into tasks. */
struct PromptPlan {
    int64_t group;     /* query heads per KV head */
    int64_t tile_rows; /* query rows of a task (stepping.PROMPT_TILE_ROWS cuts prompts
                        * from one another at multiples of 64 rows) */
    int64_t tiles;     /* tasks per stream */
    int64_t stride;    /* a pair's scores: the view's cells, rounded up to 16 */
    int64_t pairs;     /* tile_rows x group */

    explicit PromptPlan(const AttentionView &a) {
        group = a.heads / a.kv_heads;
        tile_rows = 1; /* a power of 2, so that tiles never straddle the planner's 64-row cuts */
        while (tile_rows * 2 * group <= PROMPT_TILE_PAIRS) {
            tile_rows *= 2;
        }
        tiles = (a.rows + tile_rows - 1) / tile_rows;
        stride = (a.cells + 15) / 16 * 16;
        pairs = tile_rows * group;
    }
};

/* Cells a packed value block holds (prompt_attention_avx512.h; at most ATTENTION_CHUNK, so
 * that a block's int32 sums cannot overflow). */
#define PROMPT_VALUE_CELLS 128

/* One thread's room for a task: the union's cells (padded to a multiple of 16 by repeating
 * the last) and their largest |value|, each pair's scores (then weights), its weighted
 * values' sums, one block's int32 sums for up to 4 pairs, and (for the AVX-512 tiles) one
 * block of keys and one of values widened and packed. */
struct PromptScratch {
    int32_t *cells;
    float *ranges;
    float *scores;
    int64_t *totals;
    int32_t *units;
    float *keys;
    float *values;

    static size_t bytes(const AttentionView &a, const PromptPlan &p, size_t align) {
        const auto round = [align](size_t n) { return (n + align - 1) / align * align; };
        return round((size_t)(p.stride + 16) * sizeof(int32_t)) +
               round((size_t)(p.stride + 16) * sizeof(float)) +
               round((size_t)(p.pairs * p.stride) * sizeof(float)) +
               round((size_t)(p.pairs * a.dv) * sizeof(int64_t)) +
               round((size_t)(4 * a.dv) * sizeof(int32_t)) +
               round((size_t)(16 * a.dk) * sizeof(float)) +
               round((size_t)(PROMPT_VALUE_CELLS * a.dv) * sizeof(float));
    }

    PromptScratch(char *at, const AttentionView &a, const PromptPlan &p, size_t align) {
        const auto round = [align](size_t n) { return (n + align - 1) / align * align; };
        cells = (int32_t *)at, at += round((size_t)(p.stride + 16) * sizeof(int32_t));
        ranges = (float *)at, at += round((size_t)(p.stride + 16) * sizeof(float));
        scores = (float *)at, at += round((size_t)(p.pairs * p.stride) * sizeof(float));
        totals = (int64_t *)at, at += round((size_t)(p.pairs * a.dv) * sizeof(int64_t));
        units = (int32_t *)at, at += round((size_t)(4 * a.dv) * sizeof(int32_t));
        keys = (float *)at, at += round((size_t)(16 * a.dk) * sizeof(float));
        values = (float *)at;
    }
};

/* Each cell's largest |value| under each KV head of each stream, found once per step for
 * every tile: ranges[(seq x kv_heads + kv_head) x cells + cell]. */
inline size_t prompt_ranges_bytes(const AttentionView &a) {
    return (size_t)(a.seqs * a.kv_heads * a.cells) * sizeof(float);
}

#ifdef BUTTER_X86

/* Whether a row sees a cell: its mask is not f16 -inf there (no mask: every cell). */
static inline bool prompt_sees(const uint16_t *mask, int64_t cell) {
    return mask == nullptr || mask[cell] != 0xFC00;
}

/* The cells any of the rows [first, first + rows) of stream `seq` sees, in cell order, into
 * `cells`; returns how many. */
AVX2_TARGET static int64_t prompt_union(const AttentionView &a, int64_t seq, int64_t first,
                                        int64_t rows, int32_t *cells) {
    if (a.mask == nullptr) {
        for (int64_t c = 0; c < a.cells; c++) {
            cells[c] = (int32_t)c;
        }
        return a.cells;
    }
    const __m256i hidden = _mm256_set1_epi16((short)0xFC00);
    int64_t n = 0, c = 0;
    for (; c + 16 <= a.cells; c += 16) {
        __m256i seen = _mm256_setzero_si256();
        for (int64_t r = first; r < first + rows; r++) {
            const __m256i m =
                _mm256_loadu_si256((const __m256i *)(attention_mask_row(a, seq, r) + c));
            seen = _mm256_or_si256(seen, _mm256_xor_si256(_mm256_cmpeq_epi16(m, hidden),
                                                          _mm256_set1_epi16(-1)));
        }
        uint32_t bits = (uint32_t)_mm256_movemask_epi8(seen);
        while (bits != 0) { /* two bits per cell */
            const int bit = __builtin_ctz(bits);
            cells[n++] = (int32_t)(c + bit / 2);
            bits &= ~(3u << bit);
        }
    }
    for (; c < a.cells; c++) {
        for (int64_t r = first; r < first + rows; r++) {
            if (prompt_sees(attention_mask_row(a, seq, r), c)) {
                cells[n++] = (int32_t)c;
                break;
            }
        }
    }
    return n;
}

/* The 8-lane partial dot products of R queries with 4 keys, as attention_dots8 forms each
 * (the first 8 lanes multiplied, then one FMA per 8 more in order), into acc[r][at + c]. */
template <int R>
AVX2_TARGET static inline void prompt_dots4(const float *const *q, const char *const *keys,
                                            int64_t dk, bool f16, __m256 (*acc)[8], int at) {
    const size_t step = f16 ? 16 : 32; /* bytes of 8 values */
    __m256 d[R][4];
    for (int c = 0; c < 4; c++) {
        const __m256 k = attention_load8(keys[c], f16);
        for (int r = 0; r < R; r++) {
            d[r][c] = _mm256_mul_ps(_mm256_loadu_ps(q[r]), k);
        }
    }
    for (int64_t i = 8; i < dk; i += 8) {
        for (int c = 0; c < 4; c++) {
            const __m256 k = attention_load8(keys[c] + i / 8 * step, f16);
            for (int r = 0; r < R; r++) {
                d[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), k, d[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < 4; c++) {
            acc[r][at + c] = d[r][c];
        }
    }
}

/* The scores of R pairs over 8 cells (keys at `keys`): each dot product summed as
 * attention_dots8 sums it, then scaled, capped and biased as attention_scores does (`biases`:
 * per pair, its row's mask values at the cells times its head's slope); each pair's running
 * largest in `best`. */
template <int R>
AVX2_TARGET static inline void prompt_scores8(const AttentionView &a, bool capped,
                                              const float *const *q, const char *const *keys,
                                              const __m256 *const *biases, float *const *out,
                                              __m256 *best) {
    __m256 acc[R][8];
    prompt_dots4<R>(q, keys, a.dk, a.k_f16, acc, 0);
    prompt_dots4<R>(q, keys + 4, a.dk, a.k_f16, acc, 4);
    for (int r = 0; r < R; r++) {
        __m256 s = _mm256_mul_ps(attention_hsum8(acc[r]), _mm256_set1_ps(a.scale));
        if (capped) { /* (Gemma 2's: rare, so scalar) */
            float capped[8];
            _mm256_storeu_ps(capped, s);
            for (float &x : capped) {
                x = a.softcap * tanhf(x);
            }
            s = _mm256_loadu_ps(capped);
        }
        s = _mm256_add_ps(s, *biases[r]);
        _mm256_storeu_ps(out[r], s);
        best[r] = _mm256_max_ps(best[r], s);
    }
}

/* The lanes' largest. */
AVX2_TARGET static inline float prompt_lanes_max(__m256 v, float start) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return attention_largest(lanes, 8, start);
}

/* Every pair's scores over the tile's n listed cells (padded to 8 with -inf), for one KV
 * head, into scratch.scores (a pair's at pair x stride), and each pair's largest score, the
 * sink included (attention_top), into `tops`; each row's largest |value| over the cells it
 * sees (attention_row_shift's) into `ranges`, from the cells' own in scratch.ranges. Pair p
 * is row first + p / group, query head kv_head x group + p % group. */
KEEP_IN_REGISTERS AVX2_TARGET static void prompt_tile_scores(
    const AttentionView &a, const PromptPlan &p, const PromptScratch &s, int64_t seq,
    int64_t first, int64_t rows, int64_t kv_head, int64_t n, float *tops, float *ranges) {
    const int64_t pairs = rows * p.group;
    const char *k = a.k + kv_head * a.k_head + seq * a.k_seq;
    const float *q[PROMPT_TILE_PAIRS];
    float slopes[PROMPT_TILE_PAIRS];
    __m256 best[PROMPT_TILE_PAIRS], largest[PROMPT_TILE_PAIRS];
    const bool alibi = a.max_bias > 0.0f; /* (else every slope is 1: x 1 changes nothing) */
    const bool capped = a.softcap != 0.0f;
    int64_t row_of[PROMPT_TILE_PAIRS]; /* a pair's row in the tile */
    for (int64_t pair = 0; pair < pairs; pair++) {
        row_of[pair] = pair / p.group;
        const int64_t row = first + pair / p.group, head = kv_head * p.group + pair % p.group;
        q[pair] = (const float *)(a.q + row * a.q_row + head * a.q_head + seq * a.q_seq);
        slopes[pair] = attention_slope(a, head);
        best[pair] = _mm256_set1_ps(-INFINITY);
    }
    for (int64_t r = 0; r < rows; r++) {
        largest[r] = _mm256_setzero_ps();
    }
    const __m256 hidden = _mm256_set1_ps(-INFINITY);
    __m256 row_masks[PROMPT_TILE_PAIRS]; /* per row: the mask at the 8 cells */
    __m256 pair_biases[PROMPT_TILE_PAIRS];
    const __m256 *biases[PROMPT_TILE_PAIRS];
    float *out[PROMPT_TILE_PAIRS];
    for (int64_t c = 0; c < n; c += 8) {
        const char *keys[8];
        for (int i = 0; i < 8; i++) {
            keys[i] = k + s.cells[c + i] * a.k_cell; /* (the list is padded to 8) */
        }
        const __m256 cell_ranges = _mm256_loadu_ps(s.ranges + c);
        const int32_t *at = s.cells + c;
        const bool in_a_run = at[7] - at[0] == 7; /* (the usual case: cells listed in order) */
        for (int64_t r = 0; r < rows; r++) {
            if (a.mask == nullptr) {
                row_masks[r] = _mm256_setzero_ps();
                largest[r] = _mm256_max_ps(largest[r], cell_ranges);
                continue;
            }
            const uint16_t *mask = attention_mask_row(a, seq, first + r);
            const __m128i values =
                in_a_run ? _mm_loadu_si128((const __m128i *)(mask + at[0]))
                         : _mm_setr_epi16((short)mask[at[0]], (short)mask[at[1]],
                                          (short)mask[at[2]], (short)mask[at[3]],
                                          (short)mask[at[4]], (short)mask[at[5]],
                                          (short)mask[at[6]], (short)mask[at[7]]);
            row_masks[r] = _mm256_cvtph_ps(values);
            const __m256 seen = _mm256_cmp_ps(row_masks[r], hidden, _CMP_NEQ_OQ);
            largest[r] = _mm256_max_ps(largest[r], _mm256_and_ps(seen, cell_ranges));
        }
        for (int64_t pair = 0; pair < pairs; pair++) {
            const __m256 *row_mask = &row_masks[row_of[pair]];
            if (alibi) { /* slope x mask value, as attention_scores multiplies it */
                pair_biases[pair] = _mm256_mul_ps(_mm256_set1_ps(slopes[pair]), *row_mask);
                row_mask = &pair_biases[pair];
            }
            biases[pair] = row_mask;
            out[pair] = s.scores + pair * p.stride + c;
        }
        int64_t pair = 0;
        for (; pair + PROMPT_PAIRS_AT_ONCE <= pairs; pair += PROMPT_PAIRS_AT_ONCE) {
            prompt_scores8<PROMPT_PAIRS_AT_ONCE>(a, capped, q + pair, keys, biases + pair,
                                                 out + pair, best + pair);
        }
        for (; pair < pairs; pair++) {
            prompt_scores8<1>(a, capped, q + pair, keys, biases + pair, out + pair, best + pair);
        }
        if (c + 8 > n) { /* the padding's places: unseen (their lanes of `best` and
                          * `largest` repeat the last cell's, which changes no maximum) */
            for (int64_t pr = 0; pr < pairs; pr++) {
                for (int64_t i = n - c; i < 8; i++) {
                    out[pr][i] = -INFINITY;
                }
            }
        }
    }
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t head = kv_head * p.group + pair % p.group;
        tops[pair] = prompt_lanes_max(best[pair], a.sinks != nullptr ? a.sinks[head] : -INFINITY);
    }
    for (int64_t r = 0; r < rows; r++) {
        ranges[r] = prompt_lanes_max(largest[r], 0.0f);
    }
}

/* totals[d] += units[d] for d < dv (a multiple of 8). */
AVX2_TARGET static inline void prompt_add_units(int64_t *totals, const int32_t *units,
                                                int64_t dv) {
    for (int64_t d = 0; d < dv; d += 4) {
        const __m256i wide = _mm256_cvtepi32_epi64(_mm_loadu_si128((const __m128i *)(units + d)));
        _mm256_storeu_si256((__m256i *)(totals + d),
                            _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(totals + d)), wide));
    }
}

/* Each cell's largest |value| (attention_value_range's) into `ranges` (prompt_ranges_bytes),
 * this thread's share of the (stream, KV head)s' cells. */
AVX2_TARGET static void prompt_cell_ranges(const AttentionView &a, float *ranges, int ith,
                                           int nth) {
    const int64_t lists = a.seqs * a.kv_heads, all = lists * a.cells;
    for (int64_t i = all * ith / nth; i < all * (ith + 1) / nth; i++) {
        const int64_t list = i / a.cells, seq = list / a.kv_heads, kv_head = list % a.kv_heads;
        const int32_t cell = (int32_t)(i % a.cells);
        ranges[i] = attention_value_range(a, a.v + kv_head * a.v_head + seq * a.v_seq, &cell, 1);
    }
}

/* The weighted values of the `active` pairs listed in `seen` (those that see a cell), in
 * blocks of ATTENTION_CHUNK cells (int32 sums), up to 4 pairs sharing each value's load,
 * added to their totals. */
AVX2_TARGET static void prompt_tile_values(const AttentionView &a, const PromptPlan &p,
                                           const PromptScratch &s, const char *v, int64_t n,
                                           const int64_t *seen, int active) {
    for (int64_t b = 0; b < n; b += ATTENTION_CHUNK) {
        const int64_t here = n - b < ATTENTION_CHUNK ? n - b : ATTENTION_CHUNK;
        for (int i = 0; i < active; i += 4) {
            const int count = active - i < 4 ? active - i : 4;
            const float *weights[4];
            int32_t *units[4];
            for (int g = 0; g < count; g++) {
                weights[g] = s.scores + seen[i + g] * p.stride + b;
                units[g] = s.units + g * a.dv;
            }
            switch (count) {
            case 1: attention_value_units_heads<1>(a, v, s.cells + b, here, weights, units); break;
            case 2: attention_value_units_heads<2>(a, v, s.cells + b, here, weights, units); break;
            case 3: attention_value_units_heads<3>(a, v, s.cells + b, here, weights, units); break;
            default: attention_value_units_heads<4>(a, v, s.cells + b, here, weights, units); break;
            }
            for (int g = 0; g < count; g++) {
                prompt_add_units(s.totals + seen[i + g] * a.dv, units[g], a.dv);
            }
        }
    }
}

/* prompt_tile_with's passes on AVX2: scores 8 cells at a time. */
struct NarrowTiles {
    static constexpr int64_t CELL_BLOCK = 8; /* the union is padded to a multiple of it */

    AVX2_TARGET static void scores(const AttentionView &a, const PromptPlan &p,
                                   const PromptScratch &s, int64_t seq, int64_t first,
                                   int64_t rows, int64_t kv_head, int64_t n, float *tops,
                                   float *ranges) {
        prompt_tile_scores(a, p, s, seq, first, rows, kv_head, n, tops, ranges);
    }

    AVX2_TARGET static void values(const AttentionView &a, const PromptPlan &p,
                                   const PromptScratch &s, const char *v, int64_t n,
                                   const int64_t *seen, int active) {
        prompt_tile_values(a, p, s, v, n, seen, active);
    }
};

/* Each pair's output from its value totals, as attention_finish writes it (a pair that sees
 * no cell: zeros). */
AVX2_TARGET static void prompt_tile_finish(const AttentionView &a, const PromptPlan &p,
                                           const PromptScratch &s, int64_t seq, int64_t first,
                                           int64_t pairs, int64_t kv_head, const float *tops,
                                           const int *shifts, const int64_t *weight_units) {
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t row = first + pair / p.group, head = kv_head * p.group + pair % p.group;
        float *out = (float *)(a.dst + (size_t)(seq * a.rows * a.heads + head +
                                                row * a.heads) * a.dst_row);
        const float top = tops[pair];
        if (top == -INFINITY) {
            memset(out, 0, (size_t)a.dv * sizeof(float));
            continue;
        }
        int64_t units = weight_units[pair];
        if (a.sinks != nullptr) {
            units += (int64_t)nearbyint(ldexp((double)expf(a.sinks[head] - top), WEIGHT_BITS));
        }
        const double per_unit =
            units == 0 ? 0.0 : ldexp(1.0, WEIGHT_BITS - shifts[pair]) / (double)units;
        const int64_t *total = s.totals + pair * a.dv;
        for (int64_t d = 0; d < a.dv; d++) {
            out[d] = (float)((double)total[d] * per_unit);
        }
    }
}

/* One tile, every KV head: what attention_finish writes for each of its (row, query head)s.
 * `ranges_of`: the stream's cells' largest |value|s (prompt_cell_ranges). `Tiles` gives the
 * instruction set's score and value passes (NarrowTiles, or prompt_attention_avx512.h's
 * WideTiles); everything else is the same for both. */
template <class Tiles>
AVX2_TARGET static void prompt_tile_with(const AttentionView &a, const PromptPlan &p,
                                         const PromptScratch &s, const float *ranges_of,
                                         int64_t seq, int64_t tile) {
    const int64_t first = tile * p.tile_rows;
    const int64_t rows = a.rows - first < p.tile_rows ? a.rows - first : p.tile_rows;
    const int64_t pairs = rows * p.group;
    const int64_t n = prompt_union(a, seq, first, rows, s.cells);
    const int64_t padded = (n + Tiles::CELL_BLOCK - 1) / Tiles::CELL_BLOCK * Tiles::CELL_BLOCK;
    for (int64_t c = n; c < padded; c++) {
        s.cells[c] = s.cells[n - 1]; /* (n > 0 here) */
    }
    for (int64_t kv_head = 0; kv_head < a.kv_heads; kv_head++) {
        float tops[PROMPT_TILE_PAIRS], ranges[PROMPT_TILE_PAIRS];
        if (n > 0) {
            const float *cell_ranges = ranges_of + kv_head * a.cells;
            for (int64_t c = 0; c < padded; c++) {
                s.ranges[c] = cell_ranges[s.cells[c]];
            }
            Tiles::scores(a, p, s, seq, first, rows, kv_head, n, tops, ranges);
        } else {
            for (int64_t pair = 0; pair < pairs; pair++) {
                const int64_t head = kv_head * p.group + pair % p.group;
                tops[pair] = a.sinks != nullptr ? a.sinks[head] : -INFINITY;
            }
        }
        int64_t weight_units[PROMPT_TILE_PAIRS];
        int shifts[PROMPT_TILE_PAIRS];
        int64_t seen[PROMPT_TILE_PAIRS]; /* the pairs that see a cell */
        int active = 0;
        for (int64_t pair = 0; pair < pairs; pair++) {
            shifts[pair] = n > 0 ? attention_value_shift(ranges[pair / p.group]) : 0;
            weight_units[pair] = tops[pair] == -INFINITY || n == 0
                                     ? 0
                                     : attention_weights(s.scores + pair * p.stride, padded,
                                                         tops[pair], ldexpf(1.0f, shifts[pair]));
            if (tops[pair] != -INFINITY && n > 0) {
                seen[active++] = pair;
            }
        }
        memset(s.totals, 0, (size_t)(pairs * a.dv) * sizeof(int64_t));
        Tiles::values(a, p, s, a.v + kv_head * a.v_head + seq * a.v_seq, n, seen, active);
        prompt_tile_finish(a, p, s, seq, first, pairs, kv_head, tops, shifts, weight_units);
    }
}

/* prompt_tile_with on AVX2. */
AVX2_TARGET static void prompt_tile(const AttentionView &a, const PromptPlan &p,
                                    const PromptScratch &s, const float *ranges_of, int64_t seq,
                                    int64_t tile) {
    prompt_tile_with<NarrowTiles>(a, p, s, ranges_of, seq, tile);
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_PROMPT_ATTENTION_H */
