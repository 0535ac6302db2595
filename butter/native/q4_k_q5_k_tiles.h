/*
 * Q4_K and Q5_K matrices laid out for AVX512-VNNI and AVX2 (the layer matmuls of
 * layer_matmul.cpp).
 *
 * Both store 256 weights per block, 8 sub-blocks of 32 weights each with a 6-bit scale and
 * a 6-bit min (packed in 12 bytes), and two fp16 block scales d and dmin:
 * weight = d * scale * q - dmin * min. Q4_K's values q are 4-bit (0..15, in `qs`); Q5_K's
 * are 5-bit (0..31: the low 4 bits in `qs`, the high bit in `qh`). Laid out like the Q6_K
 * tiles (q6_k_tiles.h): 16 matrix rows side by side, one chunk per sub-block read in order,
 *
 *   4 x 64 bytes: groups 8j+2k (low nibbles) and 8j+2k+1 (high nibbles), k = 0..3,
 *   64 bytes:     (Q5_K only) the high bit of groups 8j..8j+7 (bit g of each byte for
 *                 group 8j+g),
 *
 * then the scales and mins (8 x 16 bytes each, [sub-block][row]) and d and dmin (16 fp16
 * each). A group is 4 consecutive columns of the 16 rows ([row][4 bytes]). The two types
 * share every function here, with the value width (BITS, 4 or 5) as a template parameter.
 *
 * Same arithmetic as llama.cpp's Q4_K and Q5_K dot products: the activations are ggml's
 * Q8_K; each block's d * sum(scale * sum(q * x)) - dmin * sum(min * sum(x)) is formed from
 * the exact integers llama.cpp forms, times the same scales; only the float sums may differ
 * in order. Each activation row is computed on its own (llama.cpp's repacked Q4_K kernel
 * computes rows four at a time from four rows on, rounding otherwise than one by one), so a
 * row's result is the same at any row count.
 */
#ifndef BUTTER_Q4_K_Q5_K_TILES_H
#define BUTTER_Q4_K_Q5_K_TILES_H

#include "q6_k_tiles.h" /* QK_K, Q8_K_BLOCK_BYTES, LANES, ROWS_PER_PASS, VNNI_BW_TARGET */

#define QK45_SUB_BLOCKS 8 /* 32 weights each */

/* The sizes of a type's blocks and tiles, by value width (4: Q4_K, 5: Q5_K). */
template <int BITS> struct QK45 {
    static_assert(BITS == 4 || BITS == 5, "Q4_K or Q5_K");
    /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128] */
    static constexpr int BLOCK_BYTES = BITS == 5 ? 176 : 144;
    static constexpr int QS_OFFSET = BITS == 5 ? 48 : 16;
    static constexpr int CHUNK = BITS == 5 ? 320 : 256; /* bytes per sub-block and tile */
    static constexpr int TILE_VALUES = QK45_SUB_BLOCKS * CHUNK;
    static constexpr int TILE_BLOCK_BYTES = TILE_VALUES + 2 * QK45_SUB_BLOCKS * LANES + 2 * LANES * 2;
};

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes. */
static inline void qk45_scale_min(int j, const uint8_t *q, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *min = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* A block's 256 weights as their values (0..15 or 0..31), in column order, as ggml's
 * dequantize_row_q4_K / _q5_K read them: 4 rounds of 64 columns, each from 32 bytes of `qs`
 * (low nibbles, then high nibbles) and, for Q5_K, two bits of every `qh` byte. */
template <int BITS> static inline void qk45_values(const uint8_t *block, uint8_t *q) {
    const uint8_t *qh = block + 16, *ql = block + QK45<BITS>::QS_OFFSET;
    for (int round = 0; round < 4; round++) {
        const uint8_t u1 = (uint8_t)(1u << (2 * round)), u2 = (uint8_t)(2u << (2 * round));
        for (int l = 0; l < 32; l++) {
            const bool h1 = BITS == 5 && (qh[l] & u1), h2 = BITS == 5 && (qh[l] & u2);
            q[round * 64 + l] = (uint8_t)((ql[l] & 0xF) + (h1 ? 16 : 0));
            q[round * 64 + 32 + l] = (uint8_t)((ql[l] >> 4) + (h2 ? 16 : 0));
        }
        ql += 32;
    }
}

/* Packs `n_rows` rows of `nbk` blocks each into whole tiles of TILE_BLOCK_BYTES per tile
 * and block ([tile][block]); rows past n_rows (up to a whole tile) are zero. */
template <int BITS>
static inline void qk45_tiles_pack(const uint8_t *rows, int64_t n_rows, int64_t nbk, uint8_t *dst) {
    typedef QK45<BITS> T;
    const int64_t n_tiles = (n_rows + LANES - 1) / LANES;
    memset(dst, 0, (size_t)(n_tiles * nbk * T::TILE_BLOCK_BYTES));
    uint8_t q[QK_K];
    for (int64_t v = 0; v < n_rows; v++) {
        const int64_t t = v / LANES;
        const int lane = (int)(v % LANES);
        for (int64_t b = 0; b < nbk; b++) {
            const uint8_t *block = rows + (v * nbk + b) * T::BLOCK_BYTES;
            uint8_t *tile = dst + (t * nbk + b) * T::TILE_BLOCK_BYTES;
            uint8_t *scales = tile + T::TILE_VALUES, *mins = scales + QK45_SUB_BLOCKS * LANES;
            qk45_values<BITS>(block, q);
            for (int j = 0; j < QK45_SUB_BLOCKS; j++) {
                uint8_t *chunk = tile + j * T::CHUNK + lane * 4;
                const uint8_t *g = q + j * 32; /* 8 groups of 4 columns */
                for (int i = 0; i < 4; i++) {
                    for (int k = 0; k < 4; k++) {
                        chunk[k * 64 + i] = (uint8_t)((g[8 * k + i] & 0xF) |
                                                      (g[8 * k + 4 + i] & 0xF) << 4);
                    }
                    if (BITS == 5) {
                        uint8_t high = 0;
                        for (int group = 0; group < 8; group++) {
                            high |= (uint8_t)((g[4 * group + i] >> 4) << group);
                        }
                        chunk[256 + i] = high;
                    }
                }
                qk45_scale_min(j, block + 4, &scales[j * LANES + lane], &mins[j * LANES + lane]);
            }
            uint8_t *d = mins + QK45_SUB_BLOCKS * LANES;
            memcpy(d + lane * 2, block, 2);                /* d */
            memcpy(d + LANES * 2 + lane * 2, block + 2, 2); /* dmin */
        }
    }
}

#ifdef BUTTER_X86

/* Group g (0..7) of a chunk, unpacked: its low nibbles, and for Q5_K its high bit << 4. */
template <int BITS, int G>
VNNI_BW_TARGET static inline __attribute__((always_inline)) __m512i
qk45_group(__m512i low, __m512i high) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i value = G % 2 ? _mm512_and_si512(_mm512_srli_epi16(low, 4), nibble)
                                : _mm512_and_si512(low, nibble);
    if (BITS == 4) {
        return value;
    }
    const __m512i bit = G <= 4 ? _mm512_slli_epi16(high, 4 - G) : _mm512_srli_epi16(high, G - 4);
    return _mm512_ternarylogic_epi32(value, bit, _mm512_set1_epi8(0x10), 0xF8);
}

/* The activations' sums over each sub-block of block `xb` (ggml's bsums are per 16), as
 * four int32 words of two int16 sums each: word i holds sub-blocks 2i and 2i+1. */
__attribute__((target("ssse3"))) static inline __attribute__((always_inline)) __m128i
qk45_sub_block_sums(const uint8_t *xb) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)(xb + 4 + QK_K));
    const __m128i hi = _mm_loadu_si128((const __m128i *)(xb + 4 + QK_K + 16));
    return _mm_hadd_epi16(lo, hi); /* |sum| <= 32 x 127: no overflow */
}

/* Tile t's 16 outputs for R activation rows (ggml block_q8_K rows, `x_stride` bytes
 * apart), stored at out + r * out_stride; only the first `lanes` are stored. Each row's
 * sums stay in registers (the row loops are unrolled); the mins' side, which does not
 * depend on the values, is summed once per block, two sub-blocks per vpdpwssd. */
template <int BITS>
VNNI_BW_TARGET static inline __attribute__((always_inline)) void
qk45_tile_rows(const uint8_t *w, int64_t nbk, int64_t t, const int R, const uint8_t *x,
               int64_t x_stride, float *out, int64_t out_stride, int lanes) {
    typedef QK45<BITS> T;
    __m512 acc[ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *tile = w + (t * nbk + b) * T::TILE_BLOCK_BYTES;
        const uint8_t *scales = tile + T::TILE_VALUES, *mins = scales + QK45_SUB_BLOCKS * LANES;
        const uint8_t *xb = x + b * Q8_K_BLOCK_BYTES;
        __m512i isum[ROWS_PER_PASS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            isum[r] = _mm512_setzero_si512();
        }
        for (int j = 0; j < QK45_SUB_BLOCKS; j++) {
            const uint8_t *chunk = tile + j * T::CHUNK;
            for (int p = 0; p < T::CHUNK; p += 64) { /* the chunk a block ahead */
                _mm_prefetch((const char *)(chunk + T::TILE_BLOCK_BYTES + p), _MM_HINT_T0);
            }
            const __m512i l0 = _mm512_loadu_si512((const void *)chunk);
            const __m512i l1 = _mm512_loadu_si512((const void *)(chunk + 64));
            const __m512i l2 = _mm512_loadu_si512((const void *)(chunk + 128));
            const __m512i l3 = _mm512_loadu_si512((const void *)(chunk + 192));
            const __m512i h = BITS == 5 ? _mm512_loadu_si512((const void *)(chunk + 256))
                                        : _mm512_setzero_si512();
            const __m512i q[8] = {
                qk45_group<BITS, 0>(l0, h), qk45_group<BITS, 1>(l0, h),
                qk45_group<BITS, 2>(l1, h), qk45_group<BITS, 3>(l1, h),
                qk45_group<BITS, 4>(l2, h), qk45_group<BITS, 5>(l2, h),
                qk45_group<BITS, 6>(l3, h), qk45_group<BITS, 7>(l3, h)};
            const __m512i scale = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(scales + j * LANES)));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const uint8_t *qs = xb + r * x_stride + 4 + j * 32;
                __m512i dot = _mm512_setzero_si512();
                for (int g = 0; g < 8; g++) {
                    int32_t four;
                    memcpy(&four, qs + g * 4, 4);
                    dot = _mm512_dpbusd_epi32(dot, q[g], _mm512_set1_epi32(four));
                }
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, scale));
            }
        }
        /* The mins in pairs of sub-blocks (2i, 2i+1) as int16 in each lane's word. */
        __m512i min_pairs[QK45_SUB_BLOCKS / 2];
        for (int i = 0; i < QK45_SUB_BLOCKS / 2; i++) {
            const __m512i even = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(mins + 2 * i * LANES)));
            const __m512i odd = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(mins + (2 * i + 1) * LANES)));
            min_pairs[i] = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
        }
        const uint8_t *d = mins + QK45_SUB_BLOCKS * LANES;
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
        const __m512 wmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 32)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m128i sums = qk45_sub_block_sums(xb + r * x_stride);
            __m512i msum = _mm512_setzero_si512();
            msum = _mm512_dpwssd_epi32(msum, min_pairs[0],
                                       _mm512_set1_epi32(_mm_extract_epi32(sums, 0)));
            msum = _mm512_dpwssd_epi32(msum, min_pairs[1],
                                       _mm512_set1_epi32(_mm_extract_epi32(sums, 1)));
            msum = _mm512_dpwssd_epi32(msum, min_pairs[2],
                                       _mm512_set1_epi32(_mm_extract_epi32(sums, 2)));
            msum = _mm512_dpwssd_epi32(msum, min_pairs[3],
                                       _mm512_set1_epi32(_mm_extract_epi32(sums, 3)));
            float xd;
            memcpy(&xd, xb + r * x_stride, sizeof xd);
            const __m512 xs = _mm512_set1_ps(xd);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(xs, wd), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(xs, wmin), acc[r]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << lanes) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(out + r * out_stride, keep, acc[r]);
    }
}

/* qk45_tile_rows for any R from 1 to 8, each count compiled with its loops unrolled. */
template <int BITS>
VNNI_BW_TARGET static inline void qk45_tile_pass(const uint8_t *w, int64_t nbk, int64_t t, int R,
                                                 const uint8_t *x, int64_t x_stride, float *out,
                                                 int64_t out_stride, int lanes) {
    switch (R) {
    case 1: qk45_tile_rows<BITS>(w, nbk, t, 1, x, x_stride, out, out_stride, lanes); break;
    case 2: qk45_tile_rows<BITS>(w, nbk, t, 2, x, x_stride, out, out_stride, lanes); break;
    case 3: qk45_tile_rows<BITS>(w, nbk, t, 3, x, x_stride, out, out_stride, lanes); break;
    case 4: qk45_tile_rows<BITS>(w, nbk, t, 4, x, x_stride, out, out_stride, lanes); break;
    case 5: qk45_tile_rows<BITS>(w, nbk, t, 5, x, x_stride, out, out_stride, lanes); break;
    case 6: qk45_tile_rows<BITS>(w, nbk, t, 6, x, x_stride, out, out_stride, lanes); break;
    case 7: qk45_tile_rows<BITS>(w, nbk, t, 7, x, x_stride, out, out_stride, lanes); break;
    default: qk45_tile_rows<BITS>(w, nbk, t, 8, x, x_stride, out, out_stride, lanes); break;
    }
}

/* Group g (0..7) of a chunk's half, unpacked with AVX2 (as qk45_group). */
template <int BITS, int G>
AVX2_TARGET static inline __attribute__((always_inline)) __m256i
qk45_group_avx2(__m256i low, __m256i high) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i value = G % 2 ? _mm256_and_si256(_mm256_srli_epi16(low, 4), nibble)
                                : _mm256_and_si256(low, nibble);
    if (BITS == 4) {
        return value;
    }
    const __m256i bit = G <= 4 ? _mm256_slli_epi16(high, 4 - G) : _mm256_srli_epi16(high, G - 4);
    return _mm256_or_si256(value, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
}

/* Groups 4k..4k+3 of a sub-block's half (8 lanes x 16 columns) as bytes, from its chunk at
 * `half_chunk` (the chunk plus the half's 32-byte offset). */
template <int BITS>
AVX2_TARGET static inline __attribute__((always_inline)) void
qk45_groups_avx2(const uint8_t *half_chunk, int k, __m256i *q) {
    const __m256i h = BITS == 5 ? _mm256_loadu_si256((const __m256i *)(half_chunk + 256))
                                : _mm256_setzero_si256();
    const __m256i la = _mm256_loadu_si256((const __m256i *)(half_chunk + 128 * k));
    const __m256i lb = _mm256_loadu_si256((const __m256i *)(half_chunk + 128 * k + 64));
    q[0] = k ? qk45_group_avx2<BITS, 4>(la, h) : qk45_group_avx2<BITS, 0>(la, h);
    q[1] = k ? qk45_group_avx2<BITS, 5>(la, h) : qk45_group_avx2<BITS, 1>(la, h);
    q[2] = k ? qk45_group_avx2<BITS, 6>(lb, h) : qk45_group_avx2<BITS, 2>(lb, h);
    q[3] = k ? qk45_group_avx2<BITS, 7>(lb, h) : qk45_group_avx2<BITS, 3>(lb, h);
}

/* Tile t's values as bytes, as the AVX2 kernel reads them (UNPACK_BLOCK_BYTES a block:
 * [sub-block][k][half][group][8 lanes x 4 columns]), so that a prompt step's passes over
 * the tile load them instead of unpacking them again for every 4 rows. */
template <int BITS>
AVX2_TARGET static inline void qk45_unpack_tile_avx2(const uint8_t *w, int64_t nbk, int64_t t,
                                                     uint8_t *u) {
    typedef QK45<BITS> T;
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *tile = w + (t * nbk + b) * T::TILE_BLOCK_BYTES;
        for (int j = 0; j < QK45_SUB_BLOCKS; j++) {
            for (int k = 0; k < 2; k++) {
                for (int half = 0; half < 2; half++) {
                    __m256i q[4];
                    qk45_groups_avx2<BITS>(tile + j * T::CHUNK + half * 32, k, q);
                    uint8_t *values = u + (((b * QK45_SUB_BLOCKS + j) * 2 + k) * 2 + half) * 128;
                    for (int g = 0; g < 4; g++) {
                        _mm256_storeu_si256((__m256i *)(values + 32 * g), q[g]);
                    }
                }
            }
        }
    }
}

/* The AVX2 kernel over the same tiles: half `half` (8 lanes) of tile t for R (up to
 * AVX2_ROWS) rows. maddubs pairs of values (at most 31) and signed activations are at most
 * 2 x 31 x 128, so four groups' pairs add in 16 bits; madd multiplies each lane's pairs by
 * its scale. (Q4_K's eight groups would fit 16 bits too, but carrying those sums across
 * both halves of a sub-block spills registers: slower.) The mins' side is
 * summed once per block, two sub-blocks per madd (each lane's pair of mins times the
 * activations' pair of sub-block sums). The integers are the VNNI kernel's. */
template <int BITS, bool UNPACKED>
AVX2_TARGET static inline __attribute__((always_inline)) void
qk45_half_rows_avx2(const uint8_t *w, const uint8_t *u, int64_t nbk, int64_t t, int half,
                    const int R, const uint8_t *x, int64_t x_stride, float *out,
                    int64_t out_stride, int keep) {
    typedef QK45<BITS> T;
    const int h32 = half * 32; /* this half's bytes in each 64-byte part of a chunk */
    __m256 acc[AVX2_ROWS];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *tile = w + (t * nbk + b) * T::TILE_BLOCK_BYTES;
        const uint8_t *scales = tile + T::TILE_VALUES, *mins = scales + QK45_SUB_BLOCKS * LANES;
        const uint8_t *xb = x + b * Q8_K_BLOCK_BYTES;
        __m256i isum[AVX2_ROWS];
        for (int r = 0; r < R; r++) {
            isum[r] = _mm256_setzero_si256();
        }
        for (int j = 0; j < QK45_SUB_BLOCKS; j++) {
            const uint8_t *chunk = tile + j * T::CHUNK;
            if (!UNPACKED) {
                for (int p = 0; p < T::CHUNK; p += 64) { /* the chunk a block ahead */
                    _mm_prefetch((const char *)(chunk + T::TILE_BLOCK_BYTES + p + h32),
                                 _MM_HINT_T0);
                }
            }
            int64_t eight;
            memcpy(&eight, scales + j * LANES + half * (LANES / 2), sizeof eight);
            const __m256i scale = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
            const __m256i scale_pairs = _mm256_or_si256(scale, _mm256_slli_epi32(scale, 16));
            for (int k = 0; k < 2; k++) { /* groups 4k..4k+3 */
                __m256i q[4];
                if (UNPACKED) {
                    const uint8_t *values = u + (((b * QK45_SUB_BLOCKS + j) * 2 + k) * 2 + half) * 128;
                    for (int g = 0; g < 4; g++) {
                        q[g] = _mm256_loadu_si256((const __m256i *)(values + 32 * g));
                    }
                } else {
                    qk45_groups_avx2<BITS>(chunk + h32, k, q);
                }
                const __m256i q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3];
                for (int r = 0; r < R; r++) {
                    const uint8_t *qs = xb + r * x_stride + 4 + j * 32 + k * 16;
                    int32_t x0, x1, x2, x3;
                    memcpy(&x0, qs, 4);
                    memcpy(&x1, qs + 4, 4);
                    memcpy(&x2, qs + 8, 4);
                    memcpy(&x3, qs + 12, 4);
                    const __m256i p = _mm256_add_epi16(
                        _mm256_add_epi16(_mm256_maddubs_epi16(q0, _mm256_set1_epi32(x0)),
                                         _mm256_maddubs_epi16(q1, _mm256_set1_epi32(x1))),
                        _mm256_add_epi16(_mm256_maddubs_epi16(q2, _mm256_set1_epi32(x2)),
                                         _mm256_maddubs_epi16(q3, _mm256_set1_epi32(x3))));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scale_pairs));
                }
            }
        }
        __m256i min_pairs[QK45_SUB_BLOCKS / 2]; /* lanes' mins of sub-blocks 2i and 2i+1 */
        for (int i = 0; i < QK45_SUB_BLOCKS / 2; i++) {
            int64_t even, odd;
            memcpy(&even, mins + 2 * i * LANES + half * (LANES / 2), sizeof even);
            memcpy(&odd, mins + (2 * i + 1) * LANES + half * (LANES / 2), sizeof odd);
            min_pairs[i] = _mm256_or_si256(
                _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(even)),
                _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(odd)), 16));
        }
        const uint8_t *d = mins + QK45_SUB_BLOCKS * LANES;
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + half * LANES)));
        const __m256 wmin =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 32 + half * LANES)));
        for (int r = 0; r < R; r++) {
            const __m128i sums = qk45_sub_block_sums(xb + r * x_stride);
            const __m256i msum = _mm256_add_epi32(
                _mm256_add_epi32(
                    _mm256_madd_epi16(min_pairs[0], _mm256_set1_epi32(_mm_extract_epi32(sums, 0))),
                    _mm256_madd_epi16(min_pairs[1], _mm256_set1_epi32(_mm_extract_epi32(sums, 1)))),
                _mm256_add_epi32(
                    _mm256_madd_epi16(min_pairs[2], _mm256_set1_epi32(_mm_extract_epi32(sums, 2))),
                    _mm256_madd_epi16(min_pairs[3], _mm256_set1_epi32(_mm_extract_epi32(sums, 3)))));
            float xd;
            memcpy(&xd, xb + r * x_stride, sizeof xd);
            const __m256 xs = _mm256_set1_ps(xd);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(xs, wd), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(xs, wmin), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        store_lanes_avx2(out + r * out_stride + half * (LANES / 2), acc[r], keep);
    }
}

/* qk45_tile_pass with the AVX2 kernel, for any R from 1 to 8; with UNPACKED, the values
 * from `u` (qk45_unpack_tile_avx2's bytes of tile t). */
template <int BITS, bool UNPACKED>
AVX2_TARGET static inline void qk45_tile_pass_avx2_from(const uint8_t *w, const uint8_t *u,
                                                        int64_t nbk, int64_t t, int R,
                                                        const uint8_t *x, int64_t x_stride,
                                                        float *out, int64_t out_stride,
                                                        int lanes) {
    for (int r0 = 0; r0 < R; r0 += AVX2_ROWS) {
        const uint8_t *xr = x + r0 * x_stride;
        float *o = out + r0 * out_stride;
        for (int half = 0; half < 2; half++) {
            const int keep = lanes - half * (LANES / 2);
            switch (R - r0 < AVX2_ROWS ? R - r0 : AVX2_ROWS) {
            case 1: qk45_half_rows_avx2<BITS, UNPACKED>(w, u, nbk, t, half, 1, xr, x_stride, o, out_stride, keep); break;
            case 2: qk45_half_rows_avx2<BITS, UNPACKED>(w, u, nbk, t, half, 2, xr, x_stride, o, out_stride, keep); break;
            case 3: qk45_half_rows_avx2<BITS, UNPACKED>(w, u, nbk, t, half, 3, xr, x_stride, o, out_stride, keep); break;
            default: qk45_half_rows_avx2<BITS, UNPACKED>(w, u, nbk, t, half, 4, xr, x_stride, o, out_stride, keep); break;
            }
        }
    }
}

template <int BITS>
AVX2_TARGET static inline void qk45_tile_pass_avx2(const uint8_t *w, int64_t nbk, int64_t t, int R,
                                                   const uint8_t *x, int64_t x_stride, float *out,
                                                   int64_t out_stride, int lanes) {
    qk45_tile_pass_avx2_from<BITS, false>(w, nullptr, nbk, t, R, x, x_stride, out, out_stride,
                                          lanes);
}

template <int BITS>
AVX2_TARGET static inline void qk45_tile_pass_unpacked_avx2(const uint8_t *w, const uint8_t *u,
                                                            int64_t nbk, int64_t t, int R,
                                                            const uint8_t *x, int64_t x_stride,
                                                            float *out, int64_t out_stride,
                                                            int lanes) {
    qk45_tile_pass_avx2_from<BITS, true>(w, u, nbk, t, R, x, x_stride, out, out_stride, lanes);
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_Q4_K_Q5_K_TILES_H */
