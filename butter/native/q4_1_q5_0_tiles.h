/*
 * Q4_1 and Q5_0 matrices laid out for AVX512-VNNI and AVX2 (the layer matmuls of
 * layer_matmul.cpp). llama.cpp's x86 code repacks neither: Q4_1 is what some small models
 * ship in (SmolLM2's instruct GGUFs), and llama.cpp's quantizer writes Q5_0 wherever a
 * K-quant does not fit a row (rows not a multiple of 256: most of Gemma 3 270M's layers in
 * its Q4_K_M file).
 *
 * Both store 32 weights per block as 4-bit values (Q5_0: plus a fifth bit each) and fp16
 * scales: Q4_1 w = d * q + m (q 0..15), Q5_0 w = d * (q - 16) (q 0..31). Laid out like the
 * other tiles, 16 matrix rows side by side, the values kept packed: for each tile and block,
 *
 *   4 x 64 bytes: part k holds, for each row, the block's bytes qs[4k..4k+3] as the file
 *                 has them: low nibbles are columns 4k..4k+3 (group k), high nibbles
 *                 columns 16+4k..16+4k+3 (group k+4);
 *   Q5_0:  64 bytes: the fifth bits, byte i of a row holding column 4g+i's bit at bit g;
 *   16 fp16 d, then (Q4_1) 16 fp16 m, one per row.
 *
 * So a tile block is 20 (Q4_1) or 22 (Q5_0) bytes per row, the file's sizes.
 *
 * Same arithmetic as llama.cpp: the activations are quantized per 32 exactly as ggml's x86
 * quantize_row_q8_0 / quantize_row_q8_1 do (the same integers and fp16 scale), with each
 * block's integer sum; a block's product is the exact integer sum(q * x), then
 * Q4_1: d_w d_x sum + m_w s_x, where s_x is ggml's fp16 of d_x (unrounded) times the sum;
 * Q5_0: d_w d_x (sum - 16 sum(x)), the integer llama.cpp forms with q - 16.
 * Only the float sums over blocks may differ in order.
 */
#ifndef BUTTER_Q4_1_Q5_0_TILES_H
#define BUTTER_Q4_1_Q5_0_TILES_H

#include "q6_k_tiles.h" /* QK, LANES, ROWS_PER_PASS, AVX2_ROWS, the targets */

#define Q4_1_BLOCK_BYTES 20 /* fp16 d, fp16 m, qs[16] */
#define Q5_0_BLOCK_BYTES 22 /* fp16 d, qh[4], qs[16] */
#define NIBBLE_PARTS 4
#define Q4_1_TILE_BLOCK_BYTES (NIBBLE_PARTS * 64 + 2 * LANES * 2)
#define Q5_0_TILE_BLOCK_BYTES (NIBBLE_PARTS * 64 + 64 + LANES * 2)

/* Packs `n_rows` rows of `nb` blocks (Q4_1 if `q4_1`, else Q5_0), as stored in a GGUF, into
 * whole tiles ([tile][block]); rows past n_rows (up to a whole tile) are zero. */
static inline void q4_1_q5_0_tiles_pack(const uint8_t *rows, int64_t n_rows, int64_t nb,
                                        int q4_1, uint8_t *dst) {
    const int64_t block_bytes = q4_1 ? Q4_1_BLOCK_BYTES : Q5_0_BLOCK_BYTES;
    const int64_t tile_bytes = q4_1 ? Q4_1_TILE_BLOCK_BYTES : Q5_0_TILE_BLOCK_BYTES;
    const int64_t n_tiles = (n_rows + LANES - 1) / LANES;
    memset(dst, 0, (size_t)(n_tiles * nb * tile_bytes));
    for (int64_t v = 0; v < n_rows; v++) {
        const int64_t t = v / LANES;
        const int lane = (int)(v % LANES);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = rows + (v * nb + b) * block_bytes;
            uint8_t *tile = dst + (t * nb + b) * tile_bytes;
            const uint8_t *qs = block + (q4_1 ? 4 : 6);
            for (int k = 0; k < NIBBLE_PARTS; k++) {
                memcpy(tile + k * 64 + lane * 4, qs + 4 * k, 4);
            }
            uint8_t *scales = tile + NIBBLE_PARTS * 64;
            if (!q4_1) {
                uint32_t qh;
                memcpy(&qh, block + 2, 4);
                for (int i = 0; i < 4; i++) {
                    uint8_t high = 0;
                    for (int g = 0; g < 8; g++) {
                        high |= (uint8_t)(((qh >> (4 * g + i)) & 1u) << g);
                    }
                    scales[lane * 4 + i] = high;
                }
                scales += 64;
            }
            memcpy(scales + lane * 2, block, 2); /* d */
            if (q4_1) {
                memcpy(scales + LANES * 2 + lane * 2, block + 2, 2); /* m */
            }
        }
    }
}

#ifdef BUTTER_X86

/* ggml's quantize_row_q8_0 / _q8_1 for one row of `n` floats (offset 0: signed bytes), the
 * fp16 scale of each block in `xd` and, in `xs`, what the weight type adds per block:
 * Q4_1 ggml's fp16 s (the unrounded scale times the block's integer sum), Q5_0 the sum. */
AVX2_TARGET static inline void q8_quantize_row_sums(const float *x, int64_t n, int q4_1,
                                                    uint8_t *xq, float *xd, float *xs) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        xd[b] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
        int8_t *q = (int8_t *)(xq + b * QK);
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            q[j] = (int8_t)(int)nearbyintf(v[j] * id);
            sum += q[j];
        }
        xs[b] = q4_1 ? _cvtsh_ss(_cvtss_sh(d * (float)sum, _MM_FROUND_TO_NEAREST_INT))
                     : (float)sum;
    }
}

/* Group g (0..7) of a Q5_0 block's fifth bits, at bit 4 of each byte (512 / 256 bits). */
#define FIFTH_BIT_512(high, g)                                                               \
    _mm512_and_si512((g) <= 4 ? _mm512_slli_epi16((high), 4 - (g))                          \
                              : _mm512_srli_epi16((high), (g) - 4),                          \
                     bit4)
#define FIFTH_BIT_256(high, g)                                                               \
    _mm256_and_si256((g) <= 4 ? _mm256_slli_epi16((high), 4 - (g))                          \
                              : _mm256_srli_epi16((high), (g) - 4),                          \
                     bit4)

/* Tile t's 16 outputs for R activation rows (row r's bytes at xq + r * nb * 32, its scales
 * and sums at xd, xs + r * nb), stored at out + r * out_stride; only the first `lanes`. */
VNNI_BW_TARGET static inline __attribute__((always_inline)) void
q4_1_q5_0_tile_rows(const uint8_t *w, int64_t nb, int64_t t, const int R, const int q4_1,
                    const uint8_t *xq, const float *xd, const float *xs, float *out,
                    int64_t out_stride, int lanes) {
    const int64_t tile_bytes = q4_1 ? Q4_1_TILE_BLOCK_BYTES : Q5_0_TILE_BLOCK_BYTES;
    const int64_t n = nb * QK;
    const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[ROWS_PER_PASS];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = w + (t * nb + b) * tile_bytes;
        _mm_prefetch((const char *)(tile + tile_bytes * 2), _MM_HINT_T0);
        _mm_prefetch((const char *)(tile + tile_bytes * 2 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(tile + tile_bytes * 2 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(tile + tile_bytes * 2 + 192), _MM_HINT_T0);
        _mm_prefetch((const char *)(tile + tile_bytes * 2 + 256), _MM_HINT_T0);
        const __m512i high = q4_1 ? _mm512_setzero_si512()
                                  : _mm512_loadu_si512((const void *)(tile + NIBBLE_PARTS * 64));
        __m512i dot[ROWS_PER_PASS];
        for (int r = 0; r < R; r++) {
            dot[r] = _mm512_setzero_si512();
        }
        for (int k = 0; k < NIBBLE_PARTS; k++) {
            const __m512i part = _mm512_loadu_si512((const void *)(tile + k * 64));
            __m512i lo = _mm512_and_si512(part, nibble);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(part, 4), nibble);
            if (!q4_1) {
                lo = _mm512_or_si512(lo, FIFTH_BIT_512(high, k));
                hi = _mm512_or_si512(hi, FIFTH_BIT_512(high, k + 4));
            }
            for (int r = 0; r < R; r++) {
                const uint8_t *x = xq + r * n + b * QK;
                int32_t a, c;
                memcpy(&a, x + 4 * k, 4);
                memcpy(&c, x + 16 + 4 * k, 4);
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(a));
                dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(c));
            }
        }
        const uint8_t *scales = tile + NIBBLE_PARTS * 64 + (q4_1 ? 0 : 64);
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
        const __m512 wm = q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)))
                               : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const float d = xd[r * nb + b], s = xs[r * nb + b];
            if (q4_1) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                         _mm512_mul_ps(wd, _mm512_set1_ps(d)), acc[r]);
                acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(s), acc[r]);
            } else {
                const __m512i offset = _mm512_set1_epi32(16 * (int32_t)s);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r], offset)),
                                         _mm512_mul_ps(wd, _mm512_set1_ps(d)), acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << lanes) - 1u);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(out + r * out_stride, keep, acc[r]);
    }
}

/* q4_1_q5_0_tile_rows for any R from 1 to 8, each count and type compiled on its own. */
VNNI_BW_TARGET static inline void q4_1_q5_0_tile_pass(const uint8_t *w, int64_t nb, int64_t t,
                                                      int R, int q4_1, const uint8_t *xq,
                                                      const float *xd, const float *xs,
                                                      float *out, int64_t out_stride,
                                                      int lanes) {
#define Q45_CASE(rows)                                                                        \
    case rows:                                                                                \
        if (q4_1) {                                                                           \
            q4_1_q5_0_tile_rows(w, nb, t, rows, 1, xq, xd, xs, out, out_stride, lanes);       \
        } else {                                                                              \
            q4_1_q5_0_tile_rows(w, nb, t, rows, 0, xq, xd, xs, out, out_stride, lanes);       \
        }                                                                                     \
        break;
    switch (R) {
    Q45_CASE(1)
    Q45_CASE(2)
    Q45_CASE(3)
    Q45_CASE(4)
    Q45_CASE(5)
    Q45_CASE(6)
    Q45_CASE(7)
    default: Q45_CASE(8)
    }
#undef Q45_CASE
}

/* The AVX2 kernel over the same tiles: half `half` (8 lanes) of tile t for R (up to
 * AVX2_ROWS) rows. maddubs pairs of the unsigned values (at most 31) and the signed
 * activations are at most 2 x 31 x 128, so two groups' pairs add in 16 bits; madd with
 * ones then gives each lane's int32 sum. The integers are the VNNI kernel's. */
AVX2_TARGET static inline __attribute__((always_inline)) void
q4_1_q5_0_half_rows_avx2(const uint8_t *w, int64_t nb, int64_t t, int half, const int R,
                         const int q4_1, const uint8_t *xq, const float *xd, const float *xs,
                         float *out, int64_t out_stride, int keep) {
    const int64_t tile_bytes = q4_1 ? Q4_1_TILE_BLOCK_BYTES : Q5_0_TILE_BLOCK_BYTES;
    const int64_t n = nb * QK;
    const int h32 = half * 32;
    const __m256i nibble = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[AVX2_ROWS];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = w + (t * nb + b) * tile_bytes;
        for (int p = 0; p < (q4_1 ? 4 : 5); p++) {
            _mm_prefetch((const char *)(tile + tile_bytes * 2 + p * 64 + h32), _MM_HINT_T0);
        }
        const __m256i high =
            q4_1 ? _mm256_setzero_si256()
                 : _mm256_loadu_si256((const __m256i *)(tile + NIBBLE_PARTS * 64 + h32));
        __m256i dot[AVX2_ROWS];
        for (int r = 0; r < R; r++) {
            dot[r] = _mm256_setzero_si256();
        }
        for (int k = 0; k < NIBBLE_PARTS; k++) {
            const __m256i part = _mm256_loadu_si256((const __m256i *)(tile + k * 64 + h32));
            __m256i lo = _mm256_and_si256(part, nibble);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(part, 4), nibble);
            if (!q4_1) {
                lo = _mm256_or_si256(lo, FIFTH_BIT_256(high, k));
                hi = _mm256_or_si256(hi, FIFTH_BIT_256(high, k + 4));
            }
            for (int r = 0; r < R; r++) {
                const uint8_t *x = xq + r * n + b * QK;
                int32_t a, c;
                memcpy(&a, x + 4 * k, 4);
                memcpy(&c, x + 16 + 4 * k, 4);
                const __m256i pairs =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(c)));
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
            }
        }
        const uint8_t *scales = tile + NIBBLE_PARTS * 64 + (q4_1 ? 0 : 64);
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + half * 16)));
        const __m256 wm = q4_1 ? _mm256_cvtph_ps(
                                     _mm_loadu_si128((const __m128i *)(scales + 32 + half * 16)))
                               : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const float d = xd[r * nb + b], s = xs[r * nb + b];
            if (q4_1) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                         _mm256_mul_ps(wd, _mm256_set1_ps(d)), acc[r]);
                acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(s), acc[r]);
            } else {
                const __m256i offset = _mm256_set1_epi32(16 * (int32_t)s);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[r], offset)),
                                         _mm256_mul_ps(wd, _mm256_set1_ps(d)), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        store_lanes_avx2(out + r * out_stride + half * (LANES / 2), acc[r], keep);
    }
}

/* q4_1_q5_0_tile_pass with the AVX2 kernel, for any R from 1 to 8. */
AVX2_TARGET static inline void q4_1_q5_0_tile_pass_avx2(const uint8_t *w, int64_t nb, int64_t t,
                                                       int R, int q4_1, const uint8_t *xq,
                                                       const float *xd, const float *xs,
                                                       float *out, int64_t out_stride,
                                                       int lanes) {
    const int64_t n = nb * QK;
    for (int r0 = 0; r0 < R; r0 += AVX2_ROWS) {
        const uint8_t *x = xq + r0 * n;
        const float *d = xd + r0 * nb, *s = xs + r0 * nb;
        float *o = out + r0 * out_stride;
        const int rows = R - r0 < AVX2_ROWS ? R - r0 : AVX2_ROWS;
        for (int half = 0; half < 2; half++) {
            const int keep = lanes - half * (LANES / 2);
#define Q45_AVX2_CASE(count)                                                                   \
    case count:                                                                                \
        if (q4_1) {                                                                            \
            q4_1_q5_0_half_rows_avx2(w, nb, t, half, count, 1, x, d, s, o, out_stride, keep);  \
        } else {                                                                               \
            q4_1_q5_0_half_rows_avx2(w, nb, t, half, count, 0, x, d, s, o, out_stride, keep);  \
        }                                                                                      \
        break;
            switch (rows) {
            Q45_AVX2_CASE(1)
            Q45_AVX2_CASE(2)
            Q45_AVX2_CASE(3)
            default: Q45_AVX2_CASE(4)
            }
#undef Q45_AVX2_CASE
        }
    }
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_Q4_1_Q5_0_TILES_H */
