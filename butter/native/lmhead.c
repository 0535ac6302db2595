/*
 * butter's output projection ("LM head") for llama.cpp models on x86 CPUs.
 *
 * Why: on a small model the output projection is most of a decode step. Gemma 3 270M ties
 * a 262k x 640 Q8_0 embedding to its output; llama.cpp's x86 kernels run it at ~48 G int8
 * MAC/s on two AVX512-VNNI cores, 70% of an 8-row step. Laid out for VNNI (16 vocabulary
 * rows per 512-bit register, every weight load reused by up to 8 rows), the same
 * arithmetic takes a fifth of the time (benchmarks/RESULTS.md). CPUs with AVX2 but no
 * AVX512-VNNI get a 256-bit kernel over the same layout, with bit-identical results.
 *
 * How: llama.cpp calls `butter_lmhead_eval` for every graph node (its `cb_eval` hook). When
 * armed, it asks for the final normed hidden state ("result_norm"), computes the logits of
 * those rows here, and stops the graph before llama.cpp's own projection runs.
 *
 * Same numbers as llama.cpp: the activations are quantized to Q8_0 exactly as ggml's x86
 * quantize_row_q8_0 does (scale 127/amax, round half to even, fp16 block scale), each
 * 32-element block is an exact integer dot product scaled by the two fp16 scales, and only
 * the float summation order over blocks differs (last bits). A row's logits never depend
 * on which other rows share the step.
 *
 * This file needs no ggml headers: the few ggml accessors it uses are passed in by the
 * Python side (butter/backends/lmhead.py).
 *
 * The boundary with Python (ctypes, which checks nothing itself):
 * - Python never mirrors `butter_lmhead`: it allocates butter_lmhead_state_size() bytes,
 *   and reads and writes the state only through the functions here. What Python must
 *   agree on is the functions' signatures, and those are versioned: change any exported
 *   signature, status code or ISA number and bump BUTTER_LMHEAD_ABI_VERSION (Python
 *   refuses any other version at load).
 * - Every caller buffer comes with its size in bytes. A call whose buffer is too short
 *   writes nothing and returns BUTTER_E_SHORT. The buffers the state keeps (weights,
 *   scratch) are checked once, when they are handed over, against dimensions that
 *   butter_lmhead_init fixed.
 * - A kernel runs only where the CPU has its instructions; anywhere else the entry points
 *   return BUTTER_DECLINED (the eval hook leaves the rows to llama.cpp) instead of
 *   computing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "q6_k_tiles.h" /* Q6_K output matrices, kept in their own bytes */
#include "q8_0_tiles.h" /* the tile layout, the activation quantizer, the VNNI kernel */

/* Bump with any change to an exported signature, status code, ISA number or the order of
 * butter_lmhead_counters. */
#define BUTTER_LMHEAD_ABI_VERSION 5

/* Status codes of the exported functions. */
#define BUTTER_OK 0
#define BUTTER_DECLINED 1       /* no kernel for this CPU: llama.cpp's projection applies */
#define BUTTER_E_SHORT (-1)     /* a buffer is shorter than the call needs; nothing written */
#define BUTTER_E_ARGUMENT (-2)  /* a count, dimension or pointer out of range */
#define BUTTER_E_STATE (-3)     /* the state is not initialized, or lacks what the call needs */

/* Instruction sets, best last; butter_lmhead_supported() returns the best one here. */
#define ISA_NONE 0
#define ISA_AVX2 1
#define ISA_AVX512_VNNI 2

#define COUNTERS 4          /* butter_lmhead_counters: armed, rows_done, calls, declined */

/* Bounds on the dimensions, so that every buffer size below fits in 64 bits with room. */
#define MAX_EMBD (1 << 20)
#define MAX_VOCAB (1 << 28)
#define MAX_ROWS (1 << 16)

/* Marks a state that butter_lmhead_init has set up ("butterLM"). */
#define STATE_MAGIC UINT64_C(0x6275747465724c4d)

typedef struct {
    uint64_t magic;       /* STATE_MAGIC once initialized */
    /* ggml accessors, from libggml-base (butter_lmhead_set_ggml) */
    const char *(*get_name)(const void *tensor);
    void *(*get_data)(const void *tensor);
    int64_t (*nelements)(const void *tensor);
    size_t (*nbytes)(const void *tensor);
    bool (*is_contiguous)(const void *tensor);
    /* packed weights (butter_lmhead_pack) */
    const int8_t *wq;     /* [tile][block][group][lane][4] */
    const uint16_t *wd;   /* [tile][block][lane] fp16 block scales */
    const int16_t *wsum;  /* [tile][block][lane] sum of the block's 32 weights */
    /* or a Q6_K matrix (butter_lmhead_pack_q6_k), in q6_k_tiles.h's layout */
    const uint8_t *w6;
    uint8_t *xk;          /* [max_rows][n_embd / 256] activations as ggml's Q8_K blocks */
    void (*quantize_q8_k)(const float *x, void *y, int64_t k); /* ggml's quantize_row_q8_K */
    int64_t n_tiles;
    int64_t n_embd;
    int64_t n_vocab;
    int32_t n_threads;
    /* one step */
    int32_t armed;        /* set by the caller before llama_decode */
    int64_t max_rows;
    int64_t rows_done;    /* rows projected here during this decode (graph stopped each time) */
    float *out;           /* [max_rows][n_tiles * LANES] */
    uint8_t *xq;          /* [max_rows][n_embd] activations as Q8_0 + 128 */
    float *xd;            /* [max_rows][n_embd / QK] their block scales */
    int32_t isa;          /* which kernel was asked for (ISA_*) */
    int32_t runs;         /* whether that kernel runs on this CPU (else every call declines) */
    int32_t calls;        /* micro-batches seen during this decode */
    int32_t declined;     /* of those, left to llama.cpp (too many rows, unexpected tensor) */
} butter_lmhead;

int32_t butter_lmhead_abi_version(void) { return BUTTER_LMHEAD_ABI_VERSION; }

/* How many bytes the caller allocates for a state (aligned for 64-bit fields). */
size_t butter_lmhead_state_size(void) { return sizeof(butter_lmhead); }

int32_t butter_lmhead_supported(void) {
#ifdef BUTTER_X86
    __builtin_cpu_init();
    /* Both kernels quantize the activations with AVX2/FMA/F16C code. */
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni")) {
        return ISA_AVX512_VNNI;
    }
    if (avx2) {
        return ISA_AVX2;
    }
#endif
    return ISA_NONE;
}

static bool kernel_runs(int32_t isa) {
    return (isa == ISA_AVX2 || isa == ISA_AVX512_VNNI) && isa <= butter_lmhead_supported();
}

/* Whether `bytes` hold `count` elements of `size` bytes (count is never negative here). */
static bool holds(size_t bytes, int64_t count, size_t size) {
    return bytes / size >= (uint64_t)count;
}

static bool initialized(const butter_lmhead *s) {
    return s != NULL && s->magic == STATE_MAGIC;
}

static int64_t blocks_per_row(const butter_lmhead *s) { return s->n_embd / QK; }

/* Logits per row of `out`: the vocabulary padded to whole tiles. */
static int64_t out_stride(const butter_lmhead *s) { return s->n_tiles * LANES; }

/* Sets up a state in the caller's `state_bytes` bytes at `state` (8-byte aligned). Its
 * dimensions bound every buffer handed over later. Returns BUTTER_DECLINED, with the state
 * set up all the same, where `isa` has no kernel on this CPU: every later projection then
 * declines too. */
int32_t butter_lmhead_init(void *state, size_t state_bytes, int64_t n_vocab, int64_t n_embd,
                           int64_t max_rows, int32_t n_threads, int32_t isa) {
    if (state == NULL || (uintptr_t)state % _Alignof(butter_lmhead) != 0) {
        return BUTTER_E_ARGUMENT;
    }
    if (state_bytes < sizeof(butter_lmhead)) {
        return BUTTER_E_SHORT;
    }
    if (n_embd < QK || n_embd > MAX_EMBD || n_embd % QK != 0 || n_vocab < 1 ||
        n_vocab > MAX_VOCAB || max_rows < 1 || max_rows > MAX_ROWS) {
        return BUTTER_E_ARGUMENT;
    }
    butter_lmhead *s = (butter_lmhead *)state;
    memset(s, 0, sizeof *s);
    s->n_embd = n_embd;
    s->n_vocab = n_vocab;
    s->n_tiles = (n_vocab + LANES - 1) / LANES;
    s->max_rows = max_rows;
    s->n_threads = n_threads < 1 ? 1 : n_threads;
    s->isa = isa;
    s->runs = kernel_runs(isa);
    s->magic = STATE_MAGIC;
    return s->runs ? BUTTER_OK : BUTTER_DECLINED;
}

/* The ggml accessors the eval hook reads llama.cpp's tensors with. */
int32_t butter_lmhead_set_ggml(butter_lmhead *s, const char *(*get_name)(const void *),
                               void *(*get_data)(const void *),
                               int64_t (*nelements)(const void *),
                               size_t (*nbytes)(const void *),
                               bool (*is_contiguous)(const void *)) {
    if (!initialized(s)) {
        return BUTTER_E_STATE;
    }
    if (!get_name || !get_data || !nelements || !nbytes || !is_contiguous) {
        return BUTTER_E_ARGUMENT;
    }
    s->get_name = get_name;
    s->get_data = get_data;
    s->nelements = nelements;
    s->nbytes = nbytes;
    s->is_contiguous = is_contiguous;
    return BUTTER_OK;
}

/* The step's buffers: `out` [max_rows][n_tiles * 16] logits, `xq` [max_rows][n_embd]
 * quantized activations, `xd` [max_rows][n_embd / 32] their scales. */
int32_t butter_lmhead_set_scratch(butter_lmhead *s, float *out, size_t out_bytes, uint8_t *xq,
                                  size_t xq_bytes, float *xd, size_t xd_bytes) {
    if (!initialized(s)) {
        return BUTTER_E_STATE;
    }
    if (!out || !xq || !xd) {
        return BUTTER_E_ARGUMENT;
    }
    if (!holds(out_bytes, s->max_rows * out_stride(s), sizeof(float)) ||
        !holds(xq_bytes, s->max_rows * s->n_embd, sizeof(uint8_t)) ||
        !holds(xd_bytes, s->max_rows * blocks_per_row(s), sizeof(float))) {
        return BUTTER_E_SHORT;
    }
    s->out = out;
    s->xq = xq;
    s->xd = xd;
    return BUTTER_OK;
}

/* The threads the next projections run on (the backend's team shrinks on a busy machine:
 * butter/backends/team.py). */
int32_t butter_lmhead_set_threads(butter_lmhead *s, int32_t n_threads) {
    if (!initialized(s)) {
        return BUTTER_E_STATE;
    }
    if (n_threads < 1) {
        return BUTTER_E_ARGUMENT;
    }
    s->n_threads = n_threads;
    return BUTTER_OK;
}

/* Arms the hook for the next llama_decode (or disarms it), and zeroes the counters. */
int32_t butter_lmhead_arm(butter_lmhead *s, int32_t armed) {
    if (!initialized(s)) {
        return BUTTER_E_STATE;
    }
    s->armed = armed != 0;
    s->rows_done = 0;
    s->calls = 0;
    s->declined = 0;
    return BUTTER_OK;
}

/* What the last decode did: armed, rows_done, calls, declined (COUNTERS int64s). */
int32_t butter_lmhead_counters(const butter_lmhead *s, int64_t *out, size_t out_bytes) {
    if (!initialized(s)) {
        return BUTTER_E_STATE;
    }
    if (!out) {
        return BUTTER_E_ARGUMENT;
    }
    if (!holds(out_bytes, COUNTERS, sizeof(int64_t))) {
        return BUTTER_E_SHORT;
    }
    out[0] = s->armed;
    out[1] = s->rows_done;
    out[2] = s->calls;
    out[3] = s->declined;
    return BUTTER_OK;
}

/* Q8_0 rows as stored in a GGUF ([n_vocab][n_embd / 32] blocks of 34 bytes) into tiles of
 * 16 rows, which the state then projects with; rows past n_vocab (up to a whole tile) are
 * zero and give logits of 0. `wq` takes n_tiles * 16 * n_embd bytes, `wd` and `wsum` one
 * 16-bit value per block of those rows. */
int32_t butter_lmhead_pack(butter_lmhead *s, const uint8_t *rows, size_t rows_bytes,
                           int8_t *wq, size_t wq_bytes, uint16_t *wd, size_t wd_bytes,
                           int16_t *wsum, size_t wsum_bytes) {
    if (!initialized(s)) {
        return BUTTER_E_STATE;
    }
    if (!rows || !wq || !wd || !wsum) {
        return BUTTER_E_ARGUMENT;
    }
    const int64_t n_vocab = s->n_vocab;
    const int64_t nb = blocks_per_row(s);
    const int64_t padded_blocks = s->n_tiles * LANES * nb;
    if (!holds(rows_bytes, n_vocab * nb, Q8_0_BLOCK_BYTES) ||
        !holds(wq_bytes, padded_blocks * QK, sizeof(int8_t)) ||
        !holds(wd_bytes, padded_blocks, sizeof(uint16_t)) ||
        !holds(wsum_bytes, padded_blocks, sizeof(int16_t))) {
        return BUTTER_E_SHORT;
    }
    q8_tiles_pack(rows, n_vocab, nb, wq, wd, wsum);
    s->wq = wq;
    s->wd = wd;
    s->wsum = wsum;
    return BUTTER_OK;
}

/* A Q6_K output matrix as stored in a GGUF ([n_vocab][n_embd / 256] blocks of 210 bytes),
 * into `w6` (q6_k_tiles.h's layout: n_tiles * (n_embd / 256) * Q6_TILE_BLOCK_BYTES bytes),
 * which the state then projects with instead of Q8_0 tiles: the file's own bytes, so the
 * logits are llama.cpp's arithmetic. The activations become ggml's Q8_K, by ggml's own
 * `quantize_q8_k` (quantize_row_q8_K), in `xk` (max_rows * (n_embd / 256) * 292 bytes).
 * Both kernels (AVX512-VNNI, AVX2) read this layout. */
int32_t butter_lmhead_pack_q6_k(butter_lmhead *s, const uint8_t *rows, size_t rows_bytes,
                                uint8_t *w6, size_t w6_bytes,
                                void (*quantize_q8_k)(const float *, void *, int64_t),
                                uint8_t *xk, size_t xk_bytes) {
    if (!initialized(s)) {
        return BUTTER_E_STATE;
    }
    if (!rows || !w6 || !quantize_q8_k || !xk || s->n_embd % QK_K != 0) {
        return BUTTER_E_ARGUMENT;
    }
    const int64_t nbk = s->n_embd / QK_K;
    if (!holds(rows_bytes, s->n_vocab * nbk, Q6_K_BLOCK_BYTES) ||
        !holds(w6_bytes, s->n_tiles * nbk, Q6_TILE_BLOCK_BYTES) ||
        !holds(xk_bytes, s->max_rows * nbk, Q8_K_BLOCK_BYTES)) {
        return BUTTER_E_SHORT;
    }
    q6_tiles_pack(rows, s->n_vocab, nbk, w6);
    s->w6 = w6;
    s->xk = xk;
    s->quantize_q8_k = quantize_q8_k;
    return BUTTER_OK;
}

/* llama.cpp's sampler input: {id, logit, p} for every token. */
typedef struct {
    int32_t id;
    float logit;
    float p;
} token_data;

static void fill_candidates(const float *logits, int32_t n_vocab, token_data *out) {
    for (int32_t i = 0; i < n_vocab; i++) {
        out[i].id = i;
        out[i].logit = logits[i];
        out[i].p = 0.0f;
    }
}

/* {i, logits[i], 0} for the first n_vocab logits. */
int32_t butter_fill_candidates(const float *logits, size_t logits_bytes, int32_t n_vocab,
                               token_data *out, size_t out_bytes) {
    if (!logits || !out || n_vocab < 0) {
        return BUTTER_E_ARGUMENT;
    }
    if (!holds(logits_bytes, n_vocab, sizeof(float)) ||
        !holds(out_bytes, n_vocab, sizeof(token_data))) {
        return BUTTER_E_SHORT;
    }
    fill_candidates(logits, n_vocab, out);
    return BUTTER_OK;
}

/* llama.h's llama_token_data_array and llama_sampler_apply. */
typedef struct {
    token_data *data; /* samplers may point it elsewhere */
    size_t size;
    int64_t selected;
    bool sorted;
} token_data_array;
typedef void (*sampler_apply)(void *sampler, token_data_array *candidates);

/* What llama_sampler_sample does before accepting, for `n` rows at once, side by side on
 * `n_threads` threads: each row's chain picks a token from that row's logits. Chains are
 * independent objects (their own RNG and state), so they can run on different threads.
 * `scratch` holds n_vocab candidates per thread; `chosen[i]` gets row i's token, -1 if its
 * chain selected nothing. `chains`, `logits` and `chosen` hold n entries each; each of the
 * n logits rows must hold n_vocab floats (they are llama.cpp's or the state's rows, whose
 * length the caller knows and this cannot check). */
int32_t butter_sample_rows(int32_t n, void *const *chains, size_t chains_bytes,
                           const float *const *logits, size_t logits_bytes, int32_t n_vocab,
                           sampler_apply apply, token_data *scratch, size_t scratch_bytes,
                           int32_t n_threads, int32_t *chosen, size_t chosen_bytes) {
    if (n < 0 || n_vocab < 0 || !chains || !logits || !apply || !scratch || !chosen) {
        return BUTTER_E_ARGUMENT;
    }
    if (n_threads < 1) {
        n_threads = 1; /* (0 would mean OpenMP's default team, beyond the scratch) */
    }
    if (!holds(chains_bytes, n, sizeof(void *)) || !holds(logits_bytes, n, sizeof(float *)) ||
        !holds(chosen_bytes, n, sizeof(int32_t)) ||
        !holds(scratch_bytes, (int64_t)n_threads * n_vocab, sizeof(token_data))) {
        return BUTTER_E_SHORT;
    }
    #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int32_t i = 0; i < n; i++) {
#ifdef _OPENMP
        token_data *candidates = scratch + (size_t)omp_get_thread_num() * (size_t)n_vocab;
#else
        token_data *candidates = scratch;
#endif
        fill_candidates(logits[i], n_vocab, candidates);
        token_data_array array = {candidates, (size_t)n_vocab, -1, false};
        apply(chains[i], &array);
        chosen[i] = array.selected >= 0 ? array.data[array.selected].id : -1;
    }
    return BUTTER_OK;
}

#ifdef BUTTER_X86

/* ggml's x86 quantize_row_q8_0 for `rows` rows (offset: see q8_quantize_row). */
AVX2_TARGET static void quantize_rows(const float *x, int64_t rows, int64_t n_embd, int offset,
                                      uint8_t *xq, float *xd) {
    for (int64_t r = 0; r < rows; r++) {
        q8_quantize_row(x + r * n_embd, n_embd, offset, xq + r * n_embd, xd + r * (n_embd / QK));
    }
}

/* Rows of one sweep over the matrix: each tile (16 vocabulary rows, in L1) serves all of
 * them, in passes of ROWS_PER_PASS, before the next tile is read. A sweep per 8 rows would
 * read the whole matrix from memory again for every 8 rows of a drafted step. */
#define SWEEP_ROWS 64

/* The logits of `rows` (at most SWEEP_ROWS) activation rows, Q8_0 tiles, VNNI. */
VNNI_TARGET static void sweep(const butter_lmhead *s, int64_t rows, const uint8_t *xq,
                              const float *xd, float *out) {
    const int64_t nb = s->n_embd / QK;
    const int64_t stride = s->n_tiles * LANES;
    #pragma omp parallel for schedule(static) num_threads(s->n_threads)
    for (int64_t t = 0; t < s->n_tiles; t++) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
            const int R = (int)(rows - r0 < ROWS_PER_PASS ? rows - r0 : ROWS_PER_PASS);
            q8_tile_pass(s->wq, s->wd, s->wsum, nb, t, R, xq + r0 * s->n_embd, xd + r0 * nb,
                         out + r0 * stride + t * LANES, stride, LANES);
        }
    }
}

/* The same with the AVX2 kernel (q8_tile_pass_avx2 takes any number of rows). */
AVX2_TARGET static void sweep_avx2(const butter_lmhead *s, int64_t rows, const uint8_t *xq,
                                   const float *xd, float *out) {
    const int64_t stride = s->n_tiles * LANES;
    #pragma omp parallel for schedule(static) num_threads(s->n_threads)
    for (int64_t t = 0; t < s->n_tiles; t++) {
        q8_tile_pass_avx2(s->wq, s->wd, s->n_embd / QK, t, (int)rows, xq, xd, out + t * LANES,
                          stride, LANES);
    }
}

/* The same over Q6_K tiles (activations as Q8_K rows of `row_bytes`), VNNI. */
VNNI_BW_TARGET static void sweep_q6(const butter_lmhead *s, int64_t rows, const uint8_t *xk,
                                    float *out) {
    const int64_t nbk = s->n_embd / QK_K;
    const int64_t row_bytes = nbk * Q8_K_BLOCK_BYTES;
    const int64_t stride = s->n_tiles * LANES;
    #pragma omp parallel for schedule(static) num_threads(s->n_threads)
    for (int64_t t = 0; t < s->n_tiles; t++) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
            const int R = (int)(rows - r0 < ROWS_PER_PASS ? rows - r0 : ROWS_PER_PASS);
            q6_tile_pass(s->w6, nbk, t, R, xk + r0 * row_bytes, row_bytes,
                         out + r0 * stride + t * LANES, stride, LANES);
        }
    }
}

/* The same with the AVX2 kernel. */
AVX2_TARGET static void sweep_q6_avx2(const butter_lmhead *s, int64_t rows, const uint8_t *xk,
                                      float *out) {
    const int64_t nbk = s->n_embd / QK_K;
    const int64_t stride = s->n_tiles * LANES;
    #pragma omp parallel for schedule(static) num_threads(s->n_threads)
    for (int64_t t = 0; t < s->n_tiles; t++) {
        q6_tile_pass_avx2(s->w6, nbk, t, (int)rows, xk, nbk * Q8_K_BLOCK_BYTES, out + t * LANES,
                          stride, LANES);
    }
}

#endif /* BUTTER_X86 */

/* Logits of `rows` hidden states (f32, n_embd each) into rows first.. of s->out. The
 * callers have checked the bounds and that s->isa's kernel runs on this CPU. */
static void project_rows(butter_lmhead *s, const float *x, int64_t rows, int64_t first) {
#ifdef BUTTER_X86
    const int64_t nb = blocks_per_row(s);
    const int64_t stride = out_stride(s);
    const bool vnni = s->isa == ISA_AVX512_VNNI;
    if (s->w6 != NULL) {
        const int64_t row_bytes = s->n_embd / QK_K * Q8_K_BLOCK_BYTES;
        uint8_t *xk = s->xk + first * row_bytes;
        for (int64_t r = 0; r < rows; r++) {
            s->quantize_q8_k(x + r * s->n_embd, xk + r * row_bytes, s->n_embd);
        }
        for (int64_t r0 = 0; r0 < rows; r0 += SWEEP_ROWS) {
            const int64_t n = rows - r0 < SWEEP_ROWS ? rows - r0 : SWEEP_ROWS;
            float *out = s->out + (first + r0) * stride;
            if (vnni) {
                sweep_q6(s, n, xk + r0 * row_bytes, out);
            } else {
                sweep_q6_avx2(s, n, xk + r0 * row_bytes, out);
            }
        }
        return;
    }
    uint8_t *xq = s->xq + first * s->n_embd;
    float *xd = s->xd + first * nb;
    quantize_rows(x, rows, s->n_embd, vnni ? 128 : 0, xq, xd);
    for (int64_t r0 = 0; r0 < rows; r0 += SWEEP_ROWS) {
        const int64_t n = rows - r0 < SWEEP_ROWS ? rows - r0 : SWEEP_ROWS;
        float *out = s->out + (first + r0) * stride;
        if (vnni) {
            sweep(s, n, xq + r0 * s->n_embd, xd + r0 * nb, out);
        } else {
            sweep_avx2(s, n, xq + r0 * s->n_embd, xd + r0 * nb, out);
        }
    }
#else
    (void)s; (void)x; (void)rows; (void)first; /* (unreachable: no kernel runs here) */
#endif
}

/* Whether the state has its weights and scratch buffers (checked when handed over). */
static bool can_project(const butter_lmhead *s) {
    return (s->wq != NULL || s->w6 != NULL) && s->out != NULL;
}

/* Logits of `rows` hidden states (`x`, f32, n_embd each, `x_bytes` in all) into rows
 * first.. of the state's `out`, outside any decode. */
int32_t butter_lmhead_project(butter_lmhead *s, const float *x, size_t x_bytes, int64_t rows,
                              int64_t first) {
    if (!initialized(s) || !can_project(s)) {
        return BUTTER_E_STATE;
    }
    if (!x || rows < 0 || first < 0 || rows > s->max_rows - first) {
        return BUTTER_E_ARGUMENT;
    }
    if (!holds(x_bytes, rows * s->n_embd, sizeof(float))) {
        return BUTTER_E_SHORT;
    }
    if (!s->runs) {
        return BUTTER_DECLINED;
    }
    project_rows(s, x, rows, first);
    return BUTTER_OK;
}

/* ggml's answers for a node: carry on with the graph, having taken nothing from it. Asked,
 * the hook does not want the node; shown one (never, having said so), the graph goes on. */
static bool pass(bool ask) { return !ask; }

/* llama.cpp's eval callback (ggml_backend_sched_eval_callback). With `ask`, it says which
 * nodes it wants to see once computed; without, it gets one, and returning false stops
 * the graph. Unarmed, it wants nothing, and the graph runs as if there were no hook. Where
 * it cannot project (no kernel for this CPU, a tensor it did not expect, too many rows),
 * it declines: counts the call in `declined` and lets llama.cpp project those rows. */
bool butter_lmhead_eval(void *tensor, bool ask, void *user_data) {
    butter_lmhead *s = (butter_lmhead *)user_data;
    if (!initialized(s) || !s->armed || s->get_name == NULL ||
        strcmp(s->get_name(tensor), "result_norm") != 0) {
        return pass(ask);
    }
    if (ask) {
        return true;
    }
    /* A decode that llama.cpp splits into micro-batches comes here once per micro-batch,
     * possibly in another order than the batch's rows: the caller sees `calls` and then
     * evaluates the step again without the hook (llama_cpp.py). */
    s->calls++;
    if (!s->runs || !can_project(s)) {
        s->declined++;
        return true; /* llama.cpp projects these rows itself */
    }
    const int64_t elements = s->nelements(tensor);
    const int64_t rows = elements / s->n_embd;
    const bool plain_f32 = elements % s->n_embd == 0 && s->is_contiguous(tensor) &&
                           s->nbytes(tensor) == (size_t)elements * sizeof(float);
    const int64_t done = s->rows_done;
    if (!plain_f32 || rows > s->max_rows - done) {
        s->declined++;
        return true;
    }
    project_rows(s, (const float *)s->get_data(tensor), rows, done);
    s->rows_done = done + rows;
    return false; /* the logits are here: skip llama.cpp's projection */
}

/* An importable module, so that the build and the import system can find this library;
 * Python calls it through ctypes. */
static struct PyModuleDef lmhead_module = {
    PyModuleDef_HEAD_INIT, "_lmhead",
    "butter's output-projection kernel (loaded with ctypes, see butter/backends/lmhead.py)",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lmhead(void) { return PyModule_Create(&lmhead_module); }
