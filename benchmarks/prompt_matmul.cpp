/*
 * butter's prompt matmul kernels on one thread, without a server around them: one layer
 * matmul of `rows` activation rows (ggml's Q8_K rows) against an `n` x `k` Q4_K, Q5_K or
 * Q6_K matrix in butter's tiles (q4_k_q5_k_tiles.h, q6_k_tiles.h), walked as butter's
 * multiply_tiles walks it (each tile of 16 matrix rows for every activation row, 8 rows a
 * pass). Prints each kernel's best time of `reps`, its multiply-adds per second, and
 * whether the kernels give the same bytes (they must: the same integers, the same float
 * order): the AVX2 kernel on the tiles as they are, for Q5_K and Q6_K also as a prompt step
 * runs it (each tile's values unpacked once before its passes), and the AVX512-VNNI kernel
 * where the CPU has it. Random weights and activations: the kernels' work does not depend
 * on the values.
 *
 *     g++ -O3 -std=c++17 -mf16c -Ibutter/native benchmarks/prompt_matmul.cpp -o /tmp/prompt_matmul
 *     /tmp/prompt_matmul                      # Qwen3-0.6B's gate: 512 rows, 3072 x 1024, Q4_K
 *     /tmp/prompt_matmul 512 1024 3072 5 6    # rows, n, k, reps, bits (4, 5, 6: Q4_K .. Q6_K)
 */
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "q4_k_q5_k_tiles.h"
#include "q6_k_tiles.h"

namespace {

/* `count` K-quant blocks of random bytes with small positive fp16 scales at `d_offset` (and
 * the next two bytes: Q4_K's and Q5_K's d and dmin, after Q6_K's d nothing). */
std::vector<uint8_t> random_blocks(int64_t count, int block_bytes, int d_offset,
                                   std::mt19937 &rng) {
    std::vector<uint8_t> blocks((size_t)(count * block_bytes));
    for (uint8_t &byte : blocks) {
        byte = (uint8_t)rng();
    }
    std::uniform_real_distribution<float> scale(1e-4f, 1e-2f);
    for (int64_t b = 0; b < count; b++) {
        for (int at = d_offset; at < block_bytes && at < d_offset + 4; at += 2) {
            const uint16_t d = _cvtss_sh(scale(rng), 0);
            memcpy(&blocks[(size_t)(b * block_bytes + at)], &d, 2);
        }
    }
    return blocks;
}

/* `rows` activation rows of `k` columns as ggml's block_q8_K: float d, int8 qs[256] in
 * -127..127, and the sums of each 16 of them (which the kernels read). */
std::vector<uint8_t> random_q8_k_rows(int64_t rows, int64_t k, std::mt19937 &rng) {
    const int64_t blocks = rows * (k / QK_K);
    std::vector<uint8_t> x((size_t)(blocks * Q8_K_BLOCK_BYTES));
    std::uniform_int_distribution<int> value(-127, 127);
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *block = &x[(size_t)(b * Q8_K_BLOCK_BYTES)];
        const float d = 0.01f;
        memcpy(block, &d, 4);
        int8_t *qs = (int8_t *)(block + 4);
        for (int i = 0; i < QK_K; i++) {
            qs[i] = (int8_t)value(rng);
        }
        for (int s = 0; s < QK_K / 16; s++) {
            int16_t sum = 0;
            for (int i = 0; i < 16; i++) {
                sum = (int16_t)(sum + qs[16 * s + i]);
            }
            memcpy(block + 4 + QK_K + 2 * s, &sum, 2);
        }
    }
    return x;
}

typedef void (*TilePass)(const uint8_t *w, int64_t nbk, int64_t t, int R, const uint8_t *x,
                         int64_t x_stride, float *out, int64_t out_stride, int lanes);
typedef void (*UnpackedPass)(const uint8_t *w, const uint8_t *u, int64_t nbk, int64_t t, int R,
                             const uint8_t *x, int64_t x_stride, float *out, int64_t out_stride,
                             int lanes);
typedef void (*Unpack)(const uint8_t *w, int64_t nbk, int64_t t, uint8_t *u);

/* A kernel: `pass` on the tiles as they are, or (`unpack` set) `unpacked` on each tile's
 * values unpacked once before its passes, as matmul.cpp runs the AVX2 Q5_K and Q6_K kernels
 * on a prompt step. */
struct Kernel {
    const char *name;
    TilePass pass;
    Unpack unpack;
    UnpackedPass unpacked;
};

/* Seconds for the whole matmul on one thread, into `out` (rows x n). */
double run(const Kernel &kernel, const std::vector<uint8_t> &tiles, const std::vector<uint8_t> &x,
           int64_t rows, int64_t n, int64_t k, std::vector<float> &out) {
    const int64_t nbk = k / QK_K, n_tiles = (n + LANES - 1) / LANES;
    const int64_t row_bytes = nbk * Q8_K_BLOCK_BYTES;
    std::vector<uint8_t> unpacked((size_t)(nbk * UNPACK_BLOCK_BYTES));
    out.assign((size_t)(rows * n), 0.0f);
    const auto began = std::chrono::steady_clock::now();
    for (int64_t t = 0; t < n_tiles; t++) {
        const int lanes = (int)(n - t * LANES < LANES ? n - t * LANES : LANES);
        if (kernel.unpack != nullptr) {
            kernel.unpack(tiles.data(), nbk, t, unpacked.data());
        }
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
            const int R = (int)(rows - r0 < ROWS_PER_PASS ? rows - r0 : ROWS_PER_PASS);
            const uint8_t *xr = x.data() + r0 * row_bytes;
            float *o = out.data() + r0 * n + t * LANES;
            if (kernel.unpack != nullptr) {
                kernel.unpacked(tiles.data(), unpacked.data(), nbk, t, R, xr, row_bytes, o, n,
                                lanes);
            } else {
                kernel.pass(tiles.data(), nbk, t, R, xr, row_bytes, o, n, lanes);
            }
        }
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}

/* A weight type's blocks, tiles and kernels (the AVX2 one unpacked too where matmul.cpp
 * unpacks it; the VNNI one last). */
struct Type {
    const char *name;
    int block_bytes, d_offset, tile_block_bytes;
    void (*pack)(const uint8_t *rows, int64_t n_rows, int64_t nbk, uint8_t *dst);
    Kernel kernels[3];
    int count;
};

const Type TYPES[3] = {
    {"Q4_K", QK45<4>::BLOCK_BYTES, 0, QK45<4>::TILE_BLOCK_BYTES, qk45_tiles_pack<4>,
     {{"AVX2", qk45_tile_pass_avx2<4>, nullptr, nullptr},
      {"AVX512-VNNI", qk45_tile_pass<4>, nullptr, nullptr}},
     2},
    {"Q5_K", QK45<5>::BLOCK_BYTES, 0, QK45<5>::TILE_BLOCK_BYTES, qk45_tiles_pack<5>,
     {{"AVX2", qk45_tile_pass_avx2<5>, nullptr, nullptr},
      {"AVX2, values unpacked per tile", nullptr, qk45_unpack_tile_avx2<5>,
       qk45_tile_pass_unpacked_avx2<5>},
      {"AVX512-VNNI", qk45_tile_pass<5>, nullptr, nullptr}},
     3},
    {"Q6_K", Q6_K_BLOCK_BYTES, 208, Q6_TILE_BLOCK_BYTES, q6_tiles_pack,
     {{"AVX2", q6_tile_pass_avx2, nullptr, nullptr},
      {"AVX2, values unpacked per tile", nullptr, q6_unpack_tile_avx2,
       q6_tile_pass_unpacked_avx2},
      {"AVX512-VNNI", q6_tile_pass, nullptr, nullptr}},
     3},
};

int bench(const Type &type, int64_t rows, int64_t n, int64_t k, int reps) {
    std::mt19937 rng(42);
    const std::vector<uint8_t> blocks =
        random_blocks(n * (k / QK_K), type.block_bytes, type.d_offset, rng);
    std::vector<uint8_t> tiles((size_t)((n + LANES - 1) / LANES * (k / QK_K) *
                                        type.tile_block_bytes));
    type.pack(blocks.data(), n, k / QK_K, tiles.data());
    const std::vector<uint8_t> x = random_q8_k_rows(rows, k, rng);
    const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vnni");
    const int kinds = vnni ? type.count : type.count - 1; /* (the VNNI kernel is last) */
    std::vector<float> outputs[3];
    for (int kind = 0; kind < kinds; kind++) {
        double best = 1e30;
        for (int rep = 0; rep < reps; rep++) {
            const double seconds = run(type.kernels[kind], tiles, x, rows, n, k, outputs[kind]);
            best = seconds < best ? seconds : best;
        }
        printf("%s %s: %.4f s, %.1f G multiply-adds/s (%lld rows x %lld x %lld, one "
               "thread)\n",
               type.name, type.kernels[kind].name, best, (double)rows * n * k / best / 1e9,
               (long long)rows, (long long)n, (long long)k);
    }
    if (!vnni) {
        printf("(no AVX512-VNNI here: the AVX2 kernels alone)\n");
    }
    bool same = true;
    for (int kind = 1; kind < kinds; kind++) {
        same = same && memcmp(outputs[0].data(), outputs[kind].data(),
                              outputs[0].size() * sizeof(float)) == 0;
    }
    printf("outputs: %s\n", same ? "the same bytes" : "DIFFERENT");
    return same ? 0 : 2;
}

}  // namespace

int main(int argc, char **argv) {
    const auto arg = [&](int i, int64_t fallback) { return argc > i ? atoll(argv[i]) : fallback; };
    const int64_t rows = arg(1, 512), n = arg(2, 3072), k = arg(3, 1024);
    const int reps = (int)arg(4, 5), bits = (int)arg(5, 4);
    if (k % QK_K != 0 || rows < 1 || n < 1 || bits < 4 || bits > 6) {
        fprintf(stderr, "k must be a multiple of 256, rows and n positive, bits 4, 5 or 6\n");
        return 1;
    }
    return bench(TYPES[bits - 4], rows, n, k, reps);
}
