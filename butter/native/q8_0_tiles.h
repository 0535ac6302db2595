/*
 * Q8_0 matrices laid out for AVX512-VNNI (and read by the AVX2 kernels too), shared by
 * butter's two kernels: the output projection (lmhead.c) and the layer matmuls it plugs
 * into llama.cpp (layer_matmul.cpp).
 *
 * A matrix of N rows (each n_embd wide, stored as Q8_0 blocks of 32) becomes tiles of 16
 * rows. In a tile, each block's 32 int8 weights are stored as 8 groups of 4 bytes per row,
 * groups outermost ([tile][block][group][lane][4]), so one 512-bit load holds the same 4
 * columns of 16 rows: one `vpdpbusd` multiplies them by 4 bytes of an activation row and
 * adds into 16 int32 lanes. Each weight load serves up to 8 activation rows (one register
 * of accumulators per row). Block scales (fp16) and each block's weight sum sit in their
 * own [tile][block][lane] arrays.
 *
 * The activations are quantized to Q8_0 exactly as ggml's x86 quantize_row_q8_0 does
 * (scale amax/127, round half to even, fp16 scale), then offset by +128: VNNI multiplies
 * unsigned by signed bytes, and the weights' block sums take the 128 back out. So each
 * block's dot product is the exact integer llama.cpp computes, times the same two fp16
 * scales; only the float summation over blocks may differ in order (last bits). A row's
 * result never depends on the other rows computed with it.
 *
 * Everything here is static: C (lmhead.c) and C++ (layer_matmul.cpp) both include it.
 */
#ifndef BUTTER_Q8_0_TILES_H
#define BUTTER_Q8_0_TILES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BUTTER_X86 1
/* GCC 12 warns of its own placeholder in every AVX-512 conversion it inlines
 * (`__m512 __Y = __Y` in _mm512_undefined_ps, GCC bug 105593): not of butter's code. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#define VNNI_TARGET __attribute__((target("avx512f,avx512vnni,f16c")))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#endif

#define QK 32               /* elements per Q8_0 block */
#define LANES 16            /* matrix rows per tile: one 512-bit register of int32 */
#define GROUPS 8            /* groups of 4 bytes per block (one VNNI step each) */
#define ROWS_PER_PASS 8     /* activation rows sharing one pass over a tile */
#define Q8_0_BLOCK_BYTES 34 /* fp16 scale + 32 int8 */

/* Packs `n_rows` Q8_0 rows of `nb` blocks each, as stored in a GGUF, into whole tiles:
 * `wq` takes n_tiles * 16 * nb * 32 bytes, `wd` and `wsum` n_tiles * 16 * nb values.
 * Rows past n_rows (up to a whole tile) are zero and compute to 0. */
static inline void q8_tiles_pack(const uint8_t *rows, int64_t n_rows, int64_t nb, int8_t *wq,
                                 uint16_t *wd, int16_t *wsum) {
    const int64_t n_tiles = (n_rows + LANES - 1) / LANES;
    const int64_t padded_blocks = n_tiles * LANES * nb;
    memset(wq, 0, (size_t)(padded_blocks * QK));
    memset(wd, 0, (size_t)padded_blocks * sizeof(uint16_t));
    memset(wsum, 0, (size_t)padded_blocks * sizeof(int16_t));
    for (int64_t v = 0; v < n_rows; v++) {
        const int64_t t = v / LANES, lane = v % LANES;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = rows + (v * nb + b) * Q8_0_BLOCK_BYTES;
            const int8_t *q = (const int8_t *)(block + 2);
            const int64_t tb = t * nb + b;
            int sum = 0;
            for (int g = 0; g < GROUPS; g++) {
                int8_t *dst = wq + ((tb * GROUPS + g) * LANES + lane) * 4;
                for (int j = 0; j < 4; j++) {
                    dst[j] = q[g * 4 + j];
                    sum += q[g * 4 + j];
                }
            }
            memcpy(&wd[tb * LANES + lane], block, sizeof(uint16_t));
            wsum[tb * LANES + lane] = (int16_t)sum;
        }
    }
}

#ifdef BUTTER_X86

/* ggml's x86 quantize_row_q8_0 for one row of `n` floats (n a multiple of 32). For VNNI
 * `offset` is 128, so the bytes are unsigned; for AVX2 it is 0 and they are the signed
 * values. */
AVX2_TARGET static inline void q8_quantize_row(const float *x, int64_t n, int offset, uint8_t *xq,
                                               float *xd) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        xd[b] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
        uint8_t *q = xq + b * QK;
        for (int j = 0; j < QK; j++) {
            q[j] = (uint8_t)((int)nearbyintf(v[j] * id) + offset);
        }
    }
}

/* Tile t's 16 outputs for R activation rows (quantized with offset 128; row r at
 * xq + r * n, its scales at xd + r * nb), stored at out + r * out_stride. Only the first
 * `lanes` outputs are stored (a matrix's last tile may be partial). */
VNNI_TARGET static inline __attribute__((always_inline)) void
q8_tile_rows(const int8_t *wq, const uint16_t *wd, const int16_t *wsum, int64_t nb, int64_t t,
             const int R, const uint8_t *xq, const float *xd, float *out, int64_t out_stride,
             int lanes) {
    const int64_t n = nb * QK;
    __m512 acc[ROWS_PER_PASS];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const int64_t tb = t * nb + b;
        const int8_t *w = wq + tb * QK * LANES;
        __m512i dot[ROWS_PER_PASS];
        for (int r = 0; r < R; r++) {
            dot[r] = _mm512_setzero_si512();
        }
        for (int g = 0; g < GROUPS; g++) {
            const __m512i weights = _mm512_loadu_si512((const void *)(w + g * LANES * 4));
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * n + b * QK + g * 4, sizeof four);
                dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(four), weights);
            }
        }
        const __m512i offset = _mm512_slli_epi32(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(wsum + tb * LANES))), 7);
        const __m512 wscale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + tb * LANES)));
        for (int r = 0; r < R; r++) {
            const __m512 scale = _mm512_mul_ps(wscale, _mm512_set1_ps(xd[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r], offset)), scale, acc[r]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << lanes) - 1u);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(out + r * out_stride, keep, acc[r]);
    }
}

/* q8_tile_rows for any R from 1 to 8, each count compiled with its loops unrolled. */
VNNI_TARGET static inline void q8_tile_pass(const int8_t *wq, const uint16_t *wd,
                                            const int16_t *wsum, int64_t nb, int64_t t, int R,
                                            const uint8_t *xq, const float *xd, float *out,
                                            int64_t out_stride, int lanes) {
    switch (R) {
    case 1: q8_tile_rows(wq, wd, wsum, nb, t, 1, xq, xd, out, out_stride, lanes); break;
    case 2: q8_tile_rows(wq, wd, wsum, nb, t, 2, xq, xd, out, out_stride, lanes); break;
    case 3: q8_tile_rows(wq, wd, wsum, nb, t, 3, xq, xd, out, out_stride, lanes); break;
    case 4: q8_tile_rows(wq, wd, wsum, nb, t, 4, xq, xd, out, out_stride, lanes); break;
    case 5: q8_tile_rows(wq, wd, wsum, nb, t, 5, xq, xd, out, out_stride, lanes); break;
    case 6: q8_tile_rows(wq, wd, wsum, nb, t, 6, xq, xd, out, out_stride, lanes); break;
    case 7: q8_tile_rows(wq, wd, wsum, nb, t, 7, xq, xd, out, out_stride, lanes); break;
    default: q8_tile_rows(wq, wd, wsum, nb, t, 8, xq, xd, out, out_stride, lanes); break;
    }
}

/* The AVX2 kernels (no VNNI): 8 matrix rows per 256-bit half of a tile, up to AVX2_ROWS
 * activation rows per pass, so accumulators and weights fit the 16 registers. */
#define AVX2_ROWS 4

/* Stores the first `keep` (0..8) of 8 floats. */
AVX2_TARGET static inline __attribute__((always_inline)) void store_lanes_avx2(float *out,
                                                                               __m256 v,
                                                                               int keep) {
    if (keep >= 8) {
        _mm256_storeu_ps(out, v);
    } else if (keep > 0) {
        const __m256i order = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(keep), order), v);
    }
}

/* Half `half` (8 lanes) of tile t for R activation rows quantized with offset 0 (signed).
 * Without VNNI, products go through maddubs (unsigned x signed bytes into saturating 16-bit
 * pairs), so it uses ggml's sign trick instead of the +128 offset: |w| times x with w's
 * sign. In this order a weight of -128 works too (|x| <= 127, so a pair is at most
 * 2 x 128 x 127 and never saturates). The block sums (wsum) are not needed. */
AVX2_TARGET static inline __attribute__((always_inline)) void
q8_half_rows_avx2(const int8_t *wq, const uint16_t *wd, int64_t nb, int64_t t, int half,
                  const int R, const uint8_t *xq, const float *xd, float *out,
                  int64_t out_stride, int keep) {
    const int64_t n = nb * QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[AVX2_ROWS];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const int64_t tb = t * nb + b;
        const int8_t *w = wq + tb * QK * LANES + half * (LANES / 2) * 4;
        __m256i dot[AVX2_ROWS];
        for (int r = 0; r < R; r++) {
            dot[r] = _mm256_setzero_si256();
        }
        for (int g = 0; g < GROUPS; g++) {
            const __m256i weights = _mm256_loadu_si256((const __m256i *)(w + g * LANES * 4));
            const __m256i magnitudes = _mm256_abs_epi8(weights); /* -128 -> 128 as unsigned */
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * n + b * QK + g * 4, sizeof four);
                const __m256i x = _mm256_set1_epi32(four);
                const __m256i pairs = _mm256_maddubs_epi16(magnitudes,
                                                           _mm256_sign_epi8(x, weights));
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
            }
        }
        const __m256 wscale = _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(wd + tb * LANES + half * (LANES / 2))));
        for (int r = 0; r < R; r++) {
            const __m256 scale = _mm256_mul_ps(wscale, _mm256_set1_ps(xd[r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        store_lanes_avx2(out + r * out_stride + half * (LANES / 2), acc[r], keep);
    }
}

/* Tile t's outputs for R (any number) activation rows, like q8_tile_pass, with the AVX2
 * kernel: the rows quantized with offset 0, in passes of AVX2_ROWS. A tile's weights
 * (16 x n bytes) stay in L1 across the passes. */
AVX2_TARGET static inline void q8_tile_pass_avx2(const int8_t *wq, const uint16_t *wd, int64_t nb,
                                                 int64_t t, int R, const uint8_t *xq,
                                                 const float *xd, float *out, int64_t out_stride,
                                                 int lanes) {
    const int64_t n = nb * QK;
    for (int r0 = 0; r0 < R; r0 += AVX2_ROWS) {
        const uint8_t *x = xq + r0 * n;
        const float *d = xd + r0 * nb;
        float *o = out + r0 * out_stride;
        for (int half = 0; half < 2; half++) {
            const int keep = lanes - half * (LANES / 2);
            switch (R - r0 < AVX2_ROWS ? R - r0 : AVX2_ROWS) {
            case 1: q8_half_rows_avx2(wq, wd, nb, t, half, 1, x, d, o, out_stride, keep); break;
            case 2: q8_half_rows_avx2(wq, wd, nb, t, half, 2, x, d, o, out_stride, keep); break;
            case 3: q8_half_rows_avx2(wq, wd, nb, t, half, 3, x, d, o, out_stride, keep); break;
            default: q8_half_rows_avx2(wq, wd, nb, t, half, 4, x, d, o, out_stride, keep); break;
            }
        }
    }
}

#endif /* BUTTER_X86 */

#endif /* BUTTER_Q8_0_TILES_H */
