/*
 * The physical limits #54 compares prefill against: multiply-adds per second on one core,
 * for each instruction set this CPU has. Each loop keeps 12 independent accumulators (more
 * than the latency x throughput of any unit here), so it runs at the units' throughput:
 *
 *   fp32 FMA        vfmadd231ps: 8 (AVX2) or 16 (AVX-512) multiply-adds an instruction
 *   int8 maddubs    vpmaddubsw alone: 32 u8 x s8 products a 256-bit instruction, summed in
 *                   pairs to int16 (the AVX2 kernels' first step, not yet a dot product)
 *   int8 dot        vpmaddubsw + vpmaddwd + vpaddd: an int8 dot product into int32 as the
 *                   AVX2 kernels form it (32 multiply-adds for three instructions)
 *   int8 VNNI       vpdpbusd: 64 multiply-adds a 512-bit instruction, into int32
 *
 *     g++ -O2 -std=c++17 benchmarks/peak_rates.cpp -o /tmp/peak_rates && /tmp/peak_rates
 *
 * (AMX-INT8 is not measured: no such CPU has been at hand.)
 */
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr int ACC = 12;
constexpr long STEPS = 20000000;

template <class Loop>
void report(const char *name, double macs_per_step, Loop loop) {
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        const auto began = std::chrono::steady_clock::now();
        loop();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
        best = s < best ? s : best;
    }
    printf("%-28s %7.1f G multiply-adds/s (one core)\n", name, macs_per_step * STEPS / best / 1e9);
}

__attribute__((target("avx2,fma"))) float fma_avx2() {
    __m256 acc[ACC];
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-7f);
    for (auto &x : acc) x = _mm256_set1_ps(1.0f);
    for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 12
        for (auto &x : acc) x = _mm256_fmadd_ps(x, a, b);
    }
    float sum = 0.0f;
    for (auto &x : acc) sum += _mm256_cvtss_f32(x);
    return sum;
}

__attribute__((target("avx2"))) int maddubs_avx2(bool dot) {
    __m256i acc[ACC];
    const __m256i s = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
    for (auto &x : acc) x = _mm256_set1_epi8(3);
    for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 12
        for (auto &x : acc) { /* (each product depends on its accumulator: nothing hoisted) */
            const __m256i p = _mm256_maddubs_epi16(x, s);
            x = dot ? _mm256_add_epi32(x, _mm256_madd_epi16(p, ones)) : p;
        }
    }
    int sum = 0;
    for (auto &x : acc) sum += _mm256_cvtsi256_si32(x);
    return sum;
}

__attribute__((target("avx512f"))) float fma_avx512() {
    __m512 acc[ACC];
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    for (auto &x : acc) x = _mm512_set1_ps(1.0f);
    for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 12
        for (auto &x : acc) x = _mm512_fmadd_ps(x, a, b);
    }
    float sum = 0.0f;
    alignas(64) float lanes[16];
    for (auto &x : acc) {
        _mm512_store_ps(lanes, x);
        sum += lanes[0];
    }
    return sum;
}

__attribute__((target("avx512f,avx512vnni"))) int vnni_avx512() {
    __m512i acc[ACC];
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
    for (auto &x : acc) x = _mm512_setzero_si512();
    for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 12
        for (auto &x : acc) x = _mm512_dpbusd_epi32(x, u, s);
    }
    int sum = 0;
    alignas(64) int lanes[16];
    for (auto &x : acc) {
        _mm512_store_si512(lanes, x);
        sum += lanes[0];
    }
    return sum;
}

volatile double sink;

}  // namespace

int main() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        report("fp32 FMA (AVX2)", 8.0 * ACC, [] { sink = fma_avx2(); });
        report("int8 maddubs (AVX2)", 32.0 * ACC, [] { sink = maddubs_avx2(false); });
        report("int8 dot (AVX2)", 32.0 * ACC, [] { sink = maddubs_avx2(true); });
    }
    if (__builtin_cpu_supports("avx512f")) {
        report("fp32 FMA (AVX-512)", 16.0 * ACC, [] { sink = fma_avx512(); });
    }
    if (__builtin_cpu_supports("avx512vnni")) {
        report("int8 VNNI (AVX-512)", 64.0 * ACC, [] { sink = vnni_avx512(); });
    }
    return 0;
}
