/*
 * What the parts of butter's layer library share (one extension module, several
 * translation units, each one concern):
 *   layer_matmul.cpp      the C API Python calls (ctypes), and the module
 *   mirror.cpp            the mirror read back from tensors the running ggml made
 *   ggml_mirror_check.cpp the mirror against ggml's own headers, at build
 *   matmul.cpp            the tile layouts and the matmul dispatch to the kernels
 *   attention.cpp         decode and prompt attention, glued to ggml's flash attention op
 *   delta_net.cpp         recurrent layers: ggml's GATED_DELTA_NET, SSM_CONV and CONCAT
 *   buffer_type.cpp       the buffer type llama.cpp's CPU backend stores weights in
 *   self_check.cpp        probe products and attentions through real ggml graphs
 * Everything here is hidden from other libraries (-fvisibility=hidden): only the C API is
 * exported.
 */
#ifndef BUTTER_LAYER_MATMUL_H
#define BUTTER_LAYER_MATMUL_H

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ggml_abi.h"
#include "ggml_mirror.h"

namespace butter {

using ggml_mirror::backend_buffer;
using ggml_mirror::backend_buffer_type;
using ggml_mirror::compute_params;
using ggml_mirror::tensor;

/* ggml's functions (butter_layer_matmul_bind) and the library's state. */
extern ggml_mirror::Functions ggml;
extern bool bound;
extern bool registered;
extern int kernel_isa; /* the kernels that run (chosen at registration) */
/* The types whose new weights may be placed here (the self-checks narrow it). */
extern std::atomic<int> enabled_types;
/* While a probe runs, what it stores and computes is not counted. */
extern std::atomic<bool> probing;
/* Whether new weights may be placed here (butter_layer_matmul_accept). Matmuls on weights
 * already here always run here: nothing else can read the layout. */
extern std::atomic<bool> accepting;

extern std::atomic<int64_t> q8_0_matrices, q6_k_matrices, q5_k_matrices, q4_1_matrices,
    q5_0_matrices, q4_k_matrices, packed_bytes, matmuls, matmul_rows, probe_matmuls;
extern std::atomic<int64_t> attentions, attention_rows, probe_attentions;

/* Decode attention (decode_attention.h): with it on, a flash attention of fewer than
 * ATTENTION_MAX_ROWS query rows over an f16 or f32 cache is computed here, every row the
 * same way whatever the step holds; anything else stays with llama.cpp. Prompt attention
 * (prompt_attention.h): one of ATTENTION_MAX_ROWS query rows or more, each row's bits those
 * decode_attention.h gives it alone. Turned on and off between graph computations (a graph
 * is planned and computed under one setting). */
extern std::atomic<bool> decode_attention, prompt_attention;

/* The vector width (floats) at which butter computes ggml's GATED_DELTA_NET ops, the one
 * whose probe gave llama.cpp's bits (0: llama.cpp computes them); the ops it computed. */
extern std::atomic<int> delta_net_width;
extern std::atomic<int64_t> delta_nets, probe_delta_nets;
/* The vector width (floats) at which butter computes ggml's SSM_CONV ops and the CONCATs
 * along dim 0 that feed them (0: llama.cpp computes them), and how it rounds their sums
 * (delta_net.cpp's rounded_products), the pair whose probe gave llama.cpp's bits; the
 * SSM_CONV ops it computed. */
extern std::atomic<int> short_conv_width, short_conv_rounding;
extern std::atomic<int64_t> short_convs, probe_short_convs;

constexpr size_t ALIGN = 64;

inline size_t aligned(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/* The work buffer ggml hands an op's threads, aligned. */
inline char *aligned_work(const compute_params *params) {
    return (char *)(((uintptr_t)params->wdata + ALIGN - 1) / ALIGN * ALIGN);
}

/* Waits for the other threads of this op (none when the op runs on one). */
inline void barrier(const compute_params *params) {
    if (params->nth > 1) {
        ggml.barrier(params->threadpool);
    }
}

/* A ggml context of `bytes` (freed with it). */
struct Context {
    void *ctx;
    Context(size_t bytes, bool no_alloc)
        : ctx(ggml.init(ggml_mirror::init_params{bytes, nullptr, no_alloc})) {}
    ~Context() {
        if (ctx != nullptr) {
            ggml.free(ctx);
        }
    }
    Context(const Context &) = delete;
    Context &operator=(const Context &) = delete;
};

/* A ggml buffer (freed with it). */
struct Buffer {
    backend_buffer *buffer;
    explicit Buffer(backend_buffer *b) : buffer(b) {}
    ~Buffer() {
        if (buffer != nullptr) {
            ggml.buffer_free(buffer);
        }
    }
    Buffer(const Buffer &) = delete;
    Buffer &operator=(const Buffer &) = delete;
};

/* matmul.cpp */
int best_isa();
int type_bit(int type);
bool is_supported_weight(const tensor *w);
size_t tiled_bytes(const tensor *w);
/* Packs a weight's GGUF bytes into its tile layout at t->data; the counter of its type. */
std::atomic<int64_t> *pack_weight(tensor *t, const void *data);
ggml_mirror::tensor_traits *matmul_traits();

/* attention.cpp */
ggml_mirror::tensor_traits *attention_path(const tensor *op);

/* delta_net.cpp */
int delta_net_widths(); /* the widths this CPU runs, as a mask of their lane counts */
ggml_mirror::tensor_traits *delta_net_path(const tensor *op);
ggml_mirror::tensor_traits *short_conv_path(const tensor *op);
ggml_mirror::tensor_traits *concat_path(const tensor *op);
int32_t conv_probe(int lanes, int rounding, int64_t tokens, int64_t channels, int64_t width,
                   int64_t seqs, int threads, int64_t seed, float *out, int32_t *ran);
int32_t delta_net_probe(int width, int64_t tokens, int64_t heads, int64_t dim, int64_t seqs,
                        int64_t snapshots, bool per_column, int threads, int64_t seed,
                        float *out, int32_t *ran);

/* buffer_type.cpp */
backend_buffer_type *buffer_type();
void register_buffer_type(void *cpu_device);
bool drop_buffer_type(std::vector<backend_buffer_type *> &types, const char *name);

/* mirror.cpp */
int mirror_disagreements();
void mirror_figures(int64_t *out);

/* ggml_mirror_check.cpp */
int header_check();

/* self_check.cpp */
void probe_values(uint64_t seed, float *out, int64_t n);
int32_t self_check(int type, int64_t k, int64_t n, int64_t rows, int threads, double perturb,
                   double *out);
int32_t attention_probe(bool butter, int64_t rows, int64_t cells, int64_t view,
                        int64_t placement, int64_t heads, int64_t kv_heads, int64_t dim,
                        int threads, int64_t seed, float max_bias, float softcap, float *out,
                        int32_t *ran);

}  // namespace butter

#endif /* BUTTER_LAYER_MATMUL_H */
