/*
 * butter's prompt attention tiles on one thread: prompt_attention.h's (AVX2) against
 * prompt_attention_avx512.h's, on one causal step of `rows` query rows after `context`
 * cached cells (Qwen3-0.6B's shape by default: 16 query heads over 8 KV heads of 128, an
 * f16 cache whose cells hold their KV heads side by side, as llama.cpp's does). Prints
 * each one's best time of `reps` and its multiply-adds per second, and whether their
 * outputs are the same bytes (they must be: the same per-cell operations). Without
 * AVX-512, or with BUTTER_KERNEL_ISA=avx2 (as the server takes it: the AVX2 class's
 * stand-in), the AVX2 tiles alone.
 *
 *     g++ -O3 -std=c++17 -mf16c -Ibutter/native benchmarks/prompt_tiles.cpp -o /tmp/prompt_tiles
 *     /tmp/prompt_tiles 8192 256 3            # context, rows, reps
 *     /tmp/prompt_tiles 8192 256 3 32 8 64    # ... heads, KV heads, dimension
 *     BUTTER_KERNEL_ISA=avx2 /tmp/prompt_tiles 8192 256 3
 */
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <random>
#include <vector>

#include "prompt_attention_avx512.h"

namespace {

struct Step {
    int64_t context, rows, heads, kv_heads, dim;
    std::vector<float> q;
    std::vector<uint16_t> k, v, mask;
    AttentionView view{};

    Step(int64_t context_, int64_t rows_, int64_t heads_, int64_t kv_heads_, int64_t dim_)
        : context(context_), rows(rows_), heads(heads_), kv_heads(kv_heads_), dim(dim_) {
        const int64_t cells = context + rows, padded = (cells + 63) / 64 * 64;
        std::mt19937 rng(42);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        q.resize(rows * heads * dim);
        for (float &x : q) {
            x = 2.0f * normal(rng);
        }
        k.resize(cells * kv_heads * dim), v.resize(cells * kv_heads * dim);
        for (uint16_t &x : k) {
            x = _cvtss_sh(normal(rng), 0);
        }
        for (uint16_t &x : v) {
            x = _cvtss_sh(normal(rng), 0);
        }
        mask.resize(padded * rows);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t c = 0; c < padded; c++) {
                mask[r * padded + c] = c <= context + r ? 0 : 0xFC00; /* f16 0 or -inf */
            }
        }
        AttentionView &a = view;
        a.dk = a.dv = dim, a.rows = rows, a.heads = heads, a.kv_heads = kv_heads;
        a.cells = cells, a.seqs = 1;
        a.q = (const char *)q.data(), a.q_row = heads * dim * 4, a.q_head = dim * 4;
        a.k = (const char *)k.data(), a.k_cell = kv_heads * dim * 2, a.k_head = dim * 2;
        a.v = (const char *)v.data(), a.v_cell = kv_heads * dim * 2, a.v_head = dim * 2;
        a.k_f16 = a.v_f16 = true;
        a.mask = mask.data(), a.mask_row = padded * 2, a.mask_seqs = 1;
        a.dst_row = dim * 4;
        a.scale = 1.0f / sqrtf((float)dim);
    }

    /* Seconds for the whole step with one thread's tiles, into `out`. */
    double run(bool wide, std::vector<float> &out) {
        AttentionView a = view;
        out.assign(rows * heads * dim, 0.0f);
        a.dst = (char *)out.data();
        const PromptPlan plan(a);
        std::vector<char> room(PromptScratch::bytes(a, plan, 64) + 64);
        const PromptScratch scratch((char *)(((uintptr_t)room.data() + 63) / 64 * 64), a, plan,
                                    64);
        std::vector<float> ranges(prompt_ranges_bytes(a) / sizeof(float));
        const auto began = std::chrono::steady_clock::now();
        prompt_cell_ranges(a, ranges.data(), 0, 1);
        for (int64_t tile = plan.tiles - 1; tile >= 0; tile--) {
            if (wide) {
                wide_tile(a, plan, scratch, ranges.data(), 0, tile);
            } else {
                prompt_tile(a, plan, scratch, ranges.data(), 0, tile);
            }
        }
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    }
};

}  // namespace

int main(int argc, char **argv) {
    const auto arg = [&](int i, int64_t fallback) { return argc > i ? atoll(argv[i]) : fallback; };
    Step step(arg(1, 8192), arg(2, 256), arg(4, 16), arg(5, 8), arg(6, 128));
    const int reps = (int)arg(3, 3);
    /* queries x (keys + values) x cells each row sees */
    const double macs = (double)step.heads * step.dim * 2 * step.rows *
                        ((double)step.context + (double)(step.rows + 1) / 2);
    /* Without AVX-512 (or on a width not a multiple of 16, or when asked) the AVX2 tiles
     * alone. */
    const char *isa = getenv("BUTTER_KERNEL_ISA");
    const bool avx2_asked = isa != nullptr && strcasecmp(isa, "avx2") == 0;
    const int kinds =
        wide_takes(step.view) && __builtin_cpu_supports("avx512f") && !avx2_asked ? 2 : 1;
    std::vector<float> outputs[2];
    for (int wide = 0; wide < kinds; wide++) {
        double best = 1e30;
        for (int rep = 0; rep < reps; rep++) {
            const double seconds = step.run(wide != 0, outputs[wide]);
            best = seconds < best ? seconds : best;
        }
        printf("%s tiles: %.3f s, %.1f G multiply-adds/s (context %lld, %lld rows, one thread)\n",
               wide ? "AVX-512" : "AVX2", best, macs / best / 1e9, (long long)step.context,
               (long long)step.rows);
    }
    if (kinds == 1) {
        printf("(the AVX-512 tiles do not run here: no AVX-512F, a width not a multiple "
               "of 16, or BUTTER_KERNEL_ISA=avx2)\n");
        return 0;
    }
    const bool same = memcmp(outputs[0].data(), outputs[1].data(),
                             outputs[0].size() * sizeof(float)) == 0;
    printf("outputs: %s\n", same ? "the same bytes" : "DIFFERENT");
    return same ? 0 : 2;
}
