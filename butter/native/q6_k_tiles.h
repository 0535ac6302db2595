/*
 * Q6_K matrices laid out for AVX512-VNNI (the layer matmuls of layer_matmul.cpp).
 *
 * Q6_K stores 256 weights per block as 6-bit values q (0..63) in two arrays (the low 4 bits
 * in `ql`, the high 2 bits in `qh`), one int8 scale per 16 weights and an fp16 block scale
 * d: weight = d * scale * (q - 32). Laid out like the Q8_0 tiles (q8_0_tiles.h), 16 matrix
 * rows side by side, so one 512-bit register holds 4 consecutive columns of 16 rows and one
 * `vpdpbusd` multiplies them by 4 bytes of an activation row. The values stay 6-bit in
 * memory, the same 210 bytes per block and row as the file: for each tile and block, 16
 * chunks of 192 bytes, one per scale group j (16 columns), read in order,
 *
 *   64 bytes: groups 4j (low nibbles) and 4j+1 (high nibbles),
 *   64 bytes: groups 4j+2 and 4j+3, the same way,
 *   64 bytes: the 2 high bits of groups 4j..4j+3 (bits 0-1, 2-3, 4-5, 6-7),
 *
 * then the scales (16 x 16 int8, [scale group][row]) and d (16 fp16, [row]). A group is 4
 * consecutive columns of the 16 rows ([row][4 bytes], 64 bytes once unpacked); unpacking
 * takes a few bitwise operations per group, shared by every activation row of the pass.
 *
 * Same arithmetic as llama.cpp's Q6_K dot product: the activations are ggml's own Q8_K
 * (int8 per 256 with a float scale and sums per 16, from ggml's quantize_row_q8_K); each
 * block's sum of scale * sum((q - 32) * x) is the exact integer llama.cpp forms, times the
 * same two scales; only the float sums over blocks may differ in order.
 */
#ifndef BUTTER_Q6_K_TILES_H
#define BUTTER_Q6_K_TILES_H

#include "q8_0_tiles.h" /* LANES, ROWS_PER_PASS */

#ifdef BUTTER_X86
/* Unpacking the 6-bit values takes 16-bit shifts (AVX512BW). */
#define VNNI_BW_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
#endif

#define QK_K 256                /* weights per K-quant block */
#define Q6_K_BLOCK_BYTES 210    /* ql[128], qh[64], scales[16], fp16 d */
#define Q8_K_BLOCK_BYTES 292    /* ggml's block_q8_K: float d, int8 qs[256], int16 bsums[16] */
#define Q6_SCALE_GROUPS 16      /* 16 weights per scale */
#define Q6_CHUNK 192            /* bytes per scale group and tile */
#define Q6_TILE_VALUES (Q6_SCALE_GROUPS * Q6_CHUNK)
#define Q6_TILE_SCALES 256
#define Q6_TILE_BLOCK_BYTES (Q6_TILE_VALUES + Q6_TILE_SCALES + LANES * 2)
#define UNPACK_BLOCK_BYTES (LANES * QK_K) /* a tile's block of K-quant values as bytes */

#ifdef BUTTER_X86
/* One row of activations as ggml's quantize_row_q8_K (quantize_row_q8_K_ref on x86) makes
 * it, byte for byte, 8 floats at a time: per block of 256 the value of largest magnitude
 * (the first, where several tie), iscale = -127 / it, each q = min(127, round-to-even(
 * iscale x)) (ggml's nearest_int is that rounding; an inf or NaN product gives what its
 * bit trick gives) stored as int8 (the low byte), sums of 16, d = 1 / iscale; a block of
 * zeros (or of NaNs, which ggml's scan passes over) has d = 0, qs = 0. */
AVX2_TARGET static inline void q8_k_quantize_row(const float *x, uint8_t *y, int64_t k) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K, y += Q8_K_BLOCK_BYTES) {
        __m256 top = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8) { /* (a NaN, second here, never becomes the top) */
            top = _mm256_max_ps(_mm256_and_ps(magnitude, _mm256_loadu_ps(x + j)), top);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        float amax = 0.0f;
        for (int i = 0; i < 8; i++) {
            amax = lanes[i] > amax ? lanes[i] : amax;
        }
        int8_t *qs = (int8_t *)(y + 4);
        int16_t *bsums = (int16_t *)(y + 4 + QK_K);
        if (amax == 0.0f) {
            memset(y, 0, Q8_K_BLOCK_BYTES);
            continue;
        }
        float max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            if (fabsf(x[j]) == amax) {
                max = x[j];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m256 scale = _mm256_set1_ps(iscale);
        const __m256i most = _mm256_set1_epi32(127);
        const __m256i exponent = _mm256_set1_epi32(0x7f800000);
        const __m256i mantissa = _mm256_set1_epi32(0x007fffff), half = _mm256_set1_epi32(0x400000);
        for (int j = 0; j < QK_K; j += 32) {
            __m256i q[4];
            for (int i = 0; i < 4; i++) {
                const __m256 v = _mm256_mul_ps(scale, _mm256_loadu_ps(x + j + 8 * i));
                const __m256i bits = _mm256_castps_si256(v);
                const __m256i finite = _mm256_cmpgt_epi32(
                    exponent, _mm256_and_si256(bits, exponent)); /* (exponent not all ones) */
                /* ggml's nearest_int of an inf or NaN: its mantissa bits less 2^22 */
                const __m256i odd = _mm256_sub_epi32(_mm256_and_si256(bits, mantissa), half);
                const __m256i value = _mm256_min_epi32(
                    most, _mm256_blendv_epi8(odd, _mm256_cvtps_epi32(v), finite));
                /* stored to an int8 as ggml stores it: its low byte */
                q[i] = _mm256_srai_epi32(_mm256_slli_epi32(value, 24), 24);
            }
            for (int half = 0; half < 2; half++) {
                const __m256i sum = _mm256_add_epi32(q[2 * half], q[2 * half + 1]);
                int32_t parts[8];
                _mm256_storeu_si256((__m256i *)parts, sum);
                bsums[j / 16 + half] = (int16_t)(parts[0] + parts[1] + parts[2] + parts[3] +
                                                 parts[4] + parts[5] + parts[6] + parts[7]);
            }
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                     _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(qs + j), _mm256_permutevar8x32_epi32(bytes, order));
        }
        const float d = 1 / iscale;
        memcpy(y, &d, sizeof d);
    }
}
#endif

/* A Q6_K block's 256 weights as their 6-bit values q (0..63), in column order, as ggml's
 * dequantize_row_q6_K reads them: halves of 128, each from 64 bytes of `ql` (low nibbles,
 * then high nibbles) and 32 of `qh` (2 bits for each quarter of 32). */
static inline void q6_k_values(const uint8_t *block, uint8_t *q) {
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = block + half * 64, *qh = block + 128 + half * 32;
        uint8_t *out = q + half * 128;
        for (int l = 0; l < 32; l++) {
            out[l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
            out[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
            out[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            out[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
}

/* Packs `n_rows` Q6_K rows of `nbk` blocks each, as stored in a GGUF, into whole tiles of
 * Q6_TILE_BLOCK_BYTES per tile and block ([tile][block]). Rows past n_rows (up to a whole
 * tile) are zero and compute to 0. */
static inline void q6_tiles_pack(const uint8_t *rows, int64_t n_rows, int64_t nbk, uint8_t *dst) {
    const int64_t n_tiles = (n_rows + LANES - 1) / LANES;
    memset(dst, 0, (size_t)(n_tiles * nbk * Q6_TILE_BLOCK_BYTES));
    uint8_t q[QK_K];
    for (int64_t v = 0; v < n_rows; v++) {
        const int64_t t = v / LANES;
        const int lane = (int)(v % LANES);
        for (int64_t b = 0; b < nbk; b++) {
            const uint8_t *block = rows + (v * nbk + b) * Q6_K_BLOCK_BYTES;
            uint8_t *tile = dst + (t * nbk + b) * Q6_TILE_BLOCK_BYTES;
            q6_k_values(block, q);
            for (int j = 0; j < Q6_SCALE_GROUPS; j++) { /* 4 groups of 4 columns */
                uint8_t *chunk = tile + j * Q6_CHUNK + lane * 4;
                const uint8_t *g = q + j * 16;
                for (int i = 0; i < 4; i++) {
                    chunk[i] = (uint8_t)((g[i] & 0xF) | (g[4 + i] & 0xF) << 4);
                    chunk[64 + i] = (uint8_t)((g[8 + i] & 0xF) | (g[12 + i] & 0xF) << 4);
                    chunk[128 + i] = (uint8_t)(g[i] >> 4 | (g[4 + i] >> 4) << 2 |
                                               (g[8 + i] >> 4) << 4 | (g[12 + i] >> 4) << 6);
                }
                tile[Q6_TILE_VALUES + j * LANES + lane] = block[192 + j];
            }
            memcpy(tile + Q6_TILE_VALUES + Q6_TILE_SCALES + lane * 2, block + 208, 2);
        }
    }
}

#ifdef BUTTER_X86

/* Tile t's 16 outputs for R activation rows (ggml block_q8_K rows, `x_stride` bytes
 * apart), stored at out + r * out_stride; only the first `lanes` are stored. */
VNNI_BW_TARGET static inline __attribute__((always_inline)) void
q6_tile_rows(const uint8_t *w, int64_t nbk, int64_t t, const int R, const uint8_t *x,
             int64_t x_stride, float *out, int64_t out_stride, int lanes) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), high_bits = _mm512_set1_epi8(0x30);
    __m512 acc[ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *tile = w + (t * nbk + b) * Q6_TILE_BLOCK_BYTES;
        const uint8_t *scales = tile + Q6_TILE_VALUES;
        __m512i isum[ROWS_PER_PASS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            isum[r] = _mm512_setzero_si512();
        }
        for (int j = 0; j < Q6_SCALE_GROUPS; j++) {
            const uint8_t *chunk = tile + j * Q6_CHUNK;
            /* the chunk a block ahead, so memory keeps streaming while this one computes */
            _mm_prefetch((const char *)(chunk + Q6_TILE_BLOCK_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char *)(chunk + Q6_TILE_BLOCK_BYTES + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(chunk + Q6_TILE_BLOCK_BYTES + 128), _MM_HINT_T0);
            const __m512i l01 = _mm512_loadu_si512((const void *)chunk);
            const __m512i l23 = _mm512_loadu_si512((const void *)(chunk + 64));
            const __m512i h = _mm512_loadu_si512((const void *)(chunk + 128));
            /* q = low nibble | (2 high bits << 4): A | (B & C) is ternary-logic 0xF8 */
            const __m512i q0 = _mm512_ternarylogic_epi32(_mm512_and_si512(l01, nibble),
                                                         _mm512_slli_epi16(h, 4), high_bits, 0xF8);
            const __m512i q1 = _mm512_ternarylogic_epi32(
                _mm512_and_si512(_mm512_srli_epi16(l01, 4), nibble), _mm512_slli_epi16(h, 2),
                high_bits, 0xF8);
            const __m512i q2 = _mm512_ternarylogic_epi32(_mm512_and_si512(l23, nibble), h,
                                                         high_bits, 0xF8);
            const __m512i q3 = _mm512_ternarylogic_epi32(
                _mm512_and_si512(_mm512_srli_epi16(l23, 4), nibble), _mm512_srli_epi16(h, 2),
                high_bits, 0xF8);
            const __m512i scale = _mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(scales + j * LANES)));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const uint8_t *xb = x + r * x_stride + b * Q8_K_BLOCK_BYTES;
                const uint8_t *qs = xb + 4 + j * 16;
                int32_t x0, x1, x2, x3;
                int16_t bsum;
                memcpy(&x0, qs, 4);
                memcpy(&x1, qs + 4, 4);
                memcpy(&x2, qs + 8, 4);
                memcpy(&x3, qs + 12, 4);
                memcpy(&bsum, xb + 4 + QK_K + j * 2, 2);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_set1_epi32(-32 * (int32_t)bsum), q0,
                                                  _mm512_set1_epi32(x0));
                dot = _mm512_dpbusd_epi32(dot, q1, _mm512_set1_epi32(x1));
                dot = _mm512_dpbusd_epi32(dot, q2, _mm512_set1_epi32(x2));
                dot = _mm512_dpbusd_epi32(dot, q3, _mm512_set1_epi32(x3));
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, scale));
            }
        }
        const __m512 wscale = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(scales + Q6_TILE_SCALES)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            float xd;
            memcpy(&xd, x + r * x_stride + b * Q8_K_BLOCK_BYTES, sizeof xd);
            const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(xd), wscale);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << lanes) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(out + r * out_stride, keep, acc[r]);
    }
}

/* q6_tile_rows for any R from 1 to 8, each count compiled with its loops unrolled. */
VNNI_BW_TARGET static inline void q6_tile_pass(const uint8_t *w, int64_t nbk, int64_t t, int R,
                                            const uint8_t *x, int64_t x_stride, float *out,
                                            int64_t out_stride, int lanes) {
    switch (R) {
    case 1: q6_tile_rows(w, nbk, t, 1, x, x_stride, out, out_stride, lanes); break;
    case 2: q6_tile_rows(w, nbk, t, 2, x, x_stride, out, out_stride, lanes); break;
    case 3: q6_tile_rows(w, nbk, t, 3, x, x_stride, out, out_stride, lanes); break;
    case 4: q6_tile_rows(w, nbk, t, 4, x, x_stride, out, out_stride, lanes); break;
    case 5: q6_tile_rows(w, nbk, t, 5, x, x_stride, out, out_stride, lanes); break;
    case 6: q6_tile_rows(w, nbk, t, 6, x, x_stride, out, out_stride, lanes); break;
    case 7: q6_tile_rows(w, nbk, t, 7, x, x_stride, out, out_stride, lanes); break;
    default: q6_tile_rows(w, nbk, t, 8, x, x_stride, out, out_stride, lanes); break;
    }
}

/* The four groups of a scale group's half (8 lanes x 16 columns) as bytes 0..63, from its
 * chunk at `half_chunk` (the chunk plus the half's 32-byte offset). */
AVX2_TARGET static inline __attribute__((always_inline)) void
q6_groups_avx2(const uint8_t *half_chunk, __m256i *q) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), high_bits = _mm256_set1_epi8(0x30);
    const __m256i l01 = _mm256_loadu_si256((const __m256i *)half_chunk);
    const __m256i l23 = _mm256_loadu_si256((const __m256i *)(half_chunk + 64));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(half_chunk + 128));
    q[0] = _mm256_or_si256(_mm256_and_si256(l01, nibble),
                           _mm256_and_si256(_mm256_slli_epi16(h, 4), high_bits));
    q[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l01, 4), nibble),
                           _mm256_and_si256(_mm256_slli_epi16(h, 2), high_bits));
    q[2] = _mm256_or_si256(_mm256_and_si256(l23, nibble), _mm256_and_si256(h, high_bits));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l23, 4), nibble),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), high_bits));
}

/* Tile t's values as bytes, as the AVX2 kernel reads them (`UNPACK_BLOCK_BYTES` a block:
 * [scale group][half][group][8 lanes x 4 columns]), so that a prompt step's passes over
 * the tile load them instead of unpacking them again for every 4 rows. */
AVX2_TARGET static inline void q6_unpack_tile_avx2(const uint8_t *w, int64_t nbk, int64_t t,
                                                   uint8_t *u) {
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *tile = w + (t * nbk + b) * Q6_TILE_BLOCK_BYTES;
        for (int j = 0; j < Q6_SCALE_GROUPS; j++) {
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
                q6_groups_avx2(tile + j * Q6_CHUNK + half * 32, q);
                uint8_t *values = u + ((b * Q6_SCALE_GROUPS + j) * 2 + half) * 128;
                for (int g = 0; g < 4; g++) {
                    _mm256_storeu_si256((__m256i *)(values + 32 * g), q[g]);
                }
            }
        }
    }
}

/* The AVX2 kernel over the same tiles: half `half` (8 lanes) of tile t for R (up to
 * AVX2_ROWS) rows. maddubs multiplies the unsigned 6-bit values by the signed activations
 * into 16-bit pairs of at most 2 x 63 x 128, so two groups' pairs add without overflow;
 * madd then multiplies each lane's pairs by its scale (both halves of an int32 hold it).
 * The -32 offset comes in once per block as -32 x the sum of scale x the activations' sum
 * per 16, two groups per madd (scales and sums fit 16 bits). The integers are the VNNI
 * kernel's. */
AVX2_TARGET static inline __attribute__((always_inline)) void
q6_half_rows_avx2(const uint8_t *w, const uint8_t *u, int64_t nbk, int64_t t, int half,
                  const int R, const uint8_t *x, int64_t x_stride, float *out,
                  int64_t out_stride, int keep) {
    const __m256i low_half = _mm256_set1_epi32(0xFFFF);
    const int h32 = half * 32; /* this half's bytes in each 64-byte part of a chunk */
    __m256 acc[AVX2_ROWS];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *tile = w + (t * nbk + b) * Q6_TILE_BLOCK_BYTES;
        const uint8_t *scales = tile + Q6_TILE_VALUES;
        __m256i isum[AVX2_ROWS];
        for (int r = 0; r < R; r++) {
            isum[r] = _mm256_setzero_si256();
        }
        for (int j = 0; j < Q6_SCALE_GROUPS; j++) {
            __m256i q[4];
            if (u != NULL) { /* (a constant where this is inlined) */
                const uint8_t *values = u + ((b * Q6_SCALE_GROUPS + j) * 2 + half) * 128;
                for (int g = 0; g < 4; g++) {
                    q[g] = _mm256_loadu_si256((const __m256i *)(values + 32 * g));
                }
            } else {
                const uint8_t *chunk = tile + j * Q6_CHUNK;
                for (int p = 0; p < 3; p++) {
                    _mm_prefetch((const char *)(chunk + Q6_TILE_BLOCK_BYTES + 64 * p + h32),
                                 _MM_HINT_T0);
                }
                q6_groups_avx2(chunk + h32, q);
            }
            const __m256i q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3];
            int64_t eight;
            memcpy(&eight, scales + j * LANES + half * (LANES / 2), sizeof eight);
            const __m256i scale = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(eight));
            const __m256i scale_pairs = _mm256_or_si256(_mm256_and_si256(scale, low_half),
                                                        _mm256_slli_epi32(scale, 16));
            for (int r = 0; r < R; r++) {
                const uint8_t *qs = x + r * x_stride + b * Q8_K_BLOCK_BYTES + 4 + j * 16;
                int32_t x0, x1, x2, x3;
                memcpy(&x0, qs, 4);
                memcpy(&x1, qs + 4, 4);
                memcpy(&x2, qs + 8, 4);
                memcpy(&x3, qs + 12, 4);
                const __m256i p01 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(q0, _mm256_set1_epi32(x0)),
                    _mm256_maddubs_epi16(q1, _mm256_set1_epi32(x1)));
                const __m256i p23 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(q2, _mm256_set1_epi32(x2)),
                    _mm256_maddubs_epi16(q3, _mm256_set1_epi32(x3)));
                isum[r] = _mm256_add_epi32(
                    isum[r], _mm256_add_epi32(_mm256_madd_epi16(p01, scale_pairs),
                                              _mm256_madd_epi16(p23, scale_pairs)));
            }
        }
        /* The -32 offset once per block: each lane's scales of groups 2i and 2i+1 (int16
         * pairs) times the activations' sums of those groups, then x -32. */
        __m256i group_scales[Q6_SCALE_GROUPS / 2];
        for (int i = 0; i < Q6_SCALE_GROUPS / 2; i++) {
            int64_t even, odd;
            memcpy(&even, scales + 2 * i * LANES + half * (LANES / 2), sizeof even);
            memcpy(&odd, scales + (2 * i + 1) * LANES + half * (LANES / 2), sizeof odd);
            group_scales[i] = _mm256_or_si256(
                _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(even)), low_half),
                _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(odd)), 16));
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *bsums = x + r * x_stride + b * Q8_K_BLOCK_BYTES + 4 + QK_K;
            __m256i offset = _mm256_setzero_si256();
            for (int i = 0; i < Q6_SCALE_GROUPS / 2; i++) {
                int32_t two; /* the sums of groups 2i and 2i+1 */
                memcpy(&two, bsums + 4 * i, 4);
                offset = _mm256_add_epi32(offset,
                                          _mm256_madd_epi16(group_scales[i], _mm256_set1_epi32(two)));
            }
            isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5));
        }
        const __m256 wscale = _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(scales + Q6_TILE_SCALES + half * LANES)));
        for (int r = 0; r < R; r++) {
            float xd;
            memcpy(&xd, x + r * x_stride + b * Q8_K_BLOCK_BYTES, sizeof xd);
            const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(xd), wscale);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        store_lanes_avx2(out + r * out_stride + half * (LANES / 2), acc[r], keep);
    }
}

/* q6_tile_pass with the AVX2 kernel, for any R >= 1 (in runs of AVX2_ROWS rows); the values
 * from `u` (q6_unpack_tile_avx2's bytes of tile t) unless it is NULL. */
AVX2_TARGET static inline __attribute__((always_inline)) void
q6_tile_pass_avx2_from(const uint8_t *w, const uint8_t *u, int64_t nbk, int64_t t, int R,
                       const uint8_t *x, int64_t x_stride, float *out, int64_t out_stride,
                       int lanes) {
    for (int r0 = 0; r0 < R; r0 += AVX2_ROWS) {
        const uint8_t *xr = x + r0 * x_stride;
        float *o = out + r0 * out_stride;
        for (int half = 0; half < 2; half++) {
            const int keep = lanes - half * (LANES / 2);
            switch (R - r0 < AVX2_ROWS ? R - r0 : AVX2_ROWS) {
            case 1: q6_half_rows_avx2(w, u, nbk, t, half, 1, xr, x_stride, o, out_stride, keep); break;
            case 2: q6_half_rows_avx2(w, u, nbk, t, half, 2, xr, x_stride, o, out_stride, keep); break;
            case 3: q6_half_rows_avx2(w, u, nbk, t, half, 3, xr, x_stride, o, out_stride, keep); break;
            default: q6_half_rows_avx2(w, u, nbk, t, half, 4, xr, x_stride, o, out_stride, keep); break;
            }
        }
    }
}

AVX2_TARGET static inline void q6_tile_pass_avx2(const uint8_t *w, int64_t nbk, int64_t t, int R,
                                                 const uint8_t *x, int64_t x_stride, float *out,
                                                 int64_t out_stride, int lanes) {
    q6_tile_pass_avx2_from(w, NULL, nbk, t, R, x, x_stride, out, out_stride, lanes);
}

AVX2_TARGET static inline void q6_tile_pass_unpacked_avx2(const uint8_t *w, const uint8_t *u,
                                                          int64_t nbk, int64_t t, int R,
                                                          const uint8_t *x, int64_t x_stride,
                                                          float *out, int64_t out_stride,
                                                          int lanes) {
    q6_tile_pass_avx2_from(w, u, nbk, t, R, x, x_stride, out, out_stride, lanes);
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_Q6_K_TILES_H */
