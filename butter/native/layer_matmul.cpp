/*
 * butter's Q8_0, Q6_K, Q5_K, Q4_K, Q4_1 and Q5_0 layer matmuls, and its decode and prompt
 * attention, plugged into llama.cpp's CPU backend on x86 CPUs with AVX512-VNNI or AVX2 (one
 * tile layout per type, one kernel per instruction set). This file is the C API Python
 * calls (butter/backends/llama_cpp/layer_matmul.py, through ctypes) and the library's
 * state; layer_matmul.h lists the other parts.
 *
 * Why: with several sequences decoding at once, a step multiplies every layer matrix by 2-8
 * activation rows. For these types llama.cpp's x86 CPU code has no interleaved ("repacked")
 * kernel, and its generic paths (tinyBLAS, or one dot product per row and column) run those
 * small products far below what the cores can do: on Qwen3-0.6B's shape in Q8_0 the layer
 * matmuls were ~2/3 of an 8-row step. The tile layout that made butter's output projection
 * 4x faster at 8 rows (q8_0_tiles.h) serves any Q8_0 matrix, and the other types get the
 * same layout with their values kept packed (q6_k_tiles.h, q4_k_q5_k_tiles.h,
 * q4_1_q5_0_tiles.h). Q4_K is the one type here that llama.cpp's x86 code does repack: its
 * interleaved kernel is fast for one row, but multiplies rows four at a time from four rows
 * on, rounding otherwise than one by one, and its cost grows with every row. Here every row
 * is computed as it would be alone at any row count, and a few rows cost little more than
 * one (which is what verifying draft tokens and batching streams need).
 *
 * How: a buffer type in llama.cpp's CPU backend (buffer_type.cpp), registered before the
 * first model is loaded.
 *
 * The boundary (ctypes and the C++ ABI, which check nothing themselves): ggml_abi.h holds
 * what Python and this library agree on, and names the ggml the mirror of ggml's
 * structures (ggml_mirror.h) was copied from. Python registers nothing, and touches
 * nothing inside llama.cpp, until that ggml's commit and version, the mirror's figures, and
 * every mirrored field read back from objects the running ggml made all agree; and the
 * library itself refuses to change llama.cpp's list of buffer types before the field check
 * passed. Once registered, every kernel and the attention compute probes through real ggml
 * graphs against llama.cpp's own (self_check.cpp); what disagrees stays with llama.cpp.
 * ggml's functions come in as pointers from Python (resolved by the names
 * butter_layer_matmul_function_names lists, in llama_cpp's own copies of the libraries),
 * checked non-null.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>

#include "layer_matmul.h"
#include "q6_k_tiles.h" /* QK_K */

/* Exported to Python; everything else in the library is hidden (-fvisibility=hidden). */
#define BUTTER_API extern "C" __attribute__((visibility("default")))

namespace butter {

ggml_mirror::Functions ggml;
bool bound = false;
bool registered = false;
int kernel_isa = BUTTER_ISA_NONE;
std::atomic<int> enabled_types{0};
std::atomic<bool> probing{false};
std::atomic<bool> accepting{false};
std::atomic<int64_t> q8_0_matrices{0}, q6_k_matrices{0}, q5_k_matrices{0}, q4_1_matrices{0},
    q5_0_matrices{0}, q4_k_matrices{0}, packed_bytes{0}, matmuls{0}, matmul_rows{0},
    probe_matmuls{0};
std::atomic<int64_t> attentions{0}, attention_rows{0}, probe_attentions{0};
std::atomic<bool> decode_attention{false}, prompt_attention{false};

namespace {

/* Whether every mirrored field read back right (butter_layer_matmul_check_mirror): until
 * then nothing inside llama.cpp is changed. */
bool mirror_checked = false;

}  // namespace

}  // namespace butter

using namespace butter;

BUTTER_API int32_t butter_layer_matmul_abi_version(void) { return BUTTER_LAYER_MATMUL_ABI_VERSION; }

/* The ggml commit the mirror was copied from (ggml_abi.h), as this library was built. */
BUTTER_API const char *butter_layer_matmul_ggml_commit(void) { return BUTTER_GGML_COMMIT; }

/* BUTTER_HEADERS_AGREE where the library was compiled against ggml's headers and the
 * virtual functions sit in their slots, BUTTER_HEADERS_DISAGREE where they do not,
 * BUTTER_HEADERS_ABSENT without the headers (ggml_mirror_check.cpp). */
BUTTER_API int32_t butter_layer_matmul_header_check(void) { return header_check(); }

/* The mirror's figures (ggml_abi.h's BUTTER_MIRROR_* places), for Python to check against
 * the running ggml. */
BUTTER_API int32_t butter_layer_matmul_mirror(int64_t *out, size_t out_bytes) {
    if (out == nullptr || out_bytes < BUTTER_MIRRORED * sizeof(int64_t)) {
        return BUTTER_E_ARGUMENT;
    }
    mirror_figures(out);
    return BUTTER_OK;
}

/* The name of a buffer type, read through the mirrored struct (Python checks that the CPU
 * buffer type reads as "CPU"). */
BUTTER_API const char *butter_layer_matmul_buffer_type_name(void *buft) {
    backend_buffer_type *b = (backend_buffer_type *)buft;
    return b == nullptr ? nullptr : b->iface.get_name(b);
}

/* The best kernel this CPU runs: BUTTER_ISA_AVX512_VNNI, _AVX2 or _NONE. */
BUTTER_API int32_t butter_layer_matmul_best_isa(void) { return best_isa(); }

/* The ggml functions butter_layer_matmul_bind takes, comma-separated, in its order. */
BUTTER_API const char *butter_layer_matmul_function_names(void) { return FUNCTION_NAMES; }

/* ggml's functions, one pointer per name of butter_layer_matmul_function_names. */
BUTTER_API int32_t butter_layer_matmul_bind(void *const *functions, size_t count) {
    if (functions == nullptr || count != ggml_mirror::FUNCTION_COUNT) {
        return BUTTER_E_ARGUMENT;
    }
    for (size_t i = 0; i < count; i++) {
        if (functions[i] == nullptr) {
            return BUTTER_E_ARGUMENT;
        }
    }
    if (registered) {
        return BUTTER_E_STATE;
    }
    memcpy((void *)&ggml, functions, sizeof ggml);
    bound = true;
    return BUTTER_OK;
}

/* Reads tensors and a buffer the running ggml made through the mirror: *wrong gets the
 * bits (1 << BUTTER_FIELD_*) of every field that disagrees (0: the mirror is this ggml's). */
BUTTER_API int32_t butter_layer_matmul_check_mirror(int32_t *wrong) {
    if (wrong == nullptr) {
        return BUTTER_E_ARGUMENT;
    }
    if (!bound) {
        return BUTTER_E_STATE;
    }
    *wrong = mirror_disagreements();
    mirror_checked = *wrong == 0;
    return BUTTER_OK;
}

/* Adds butter's buffer type to the CPU backend's extra buffer types (once per process, and
 * before llama.cpp first lists them, which it does at its first model load), with the
 * kernels of `isa` (at most this CPU's best) for the `types` (BUTTER_TYPE_BIT_*). Refused
 * until the mirror check passed. */
BUTTER_API int32_t butter_layer_matmul_register(void *cpu_device, int32_t isa, int32_t types) {
    if (!cpu_device) {
        return BUTTER_E_ARGUMENT;
    }
    if (!mirror_checked || registered) {
        return BUTTER_E_STATE;
    }
    if (isa == BUTTER_ISA_NONE || isa > best_isa()) {
        return BUTTER_DECLINED;
    }
    kernel_isa = isa;
    enabled_types.store(types);
    register_buffer_type(cpu_device);
    registered = true;
    return BUTTER_OK;
}

/* Takes the buffer type called `name` out of the CPU backend's extra buffer types, so that
 * llama.cpp never offers weights to it (before llama.cpp first lists them, like register).
 * Refused until the mirror check passed: the list is a std::vector inside llama.cpp.
 * BUTTER_DECLINED: none has that name. */
BUTTER_API int32_t butter_layer_matmul_drop_buffer_type(const char *name) {
    if (name == nullptr) {
        return BUTTER_E_ARGUMENT;
    }
    if (!mirror_checked) {
        return BUTTER_E_STATE;
    }
    return drop_buffer_type(ggml.extra_buffer_types(), name) ? BUTTER_OK : BUTTER_DECLINED;
}

/* Whether butter computes the decode steps' attention (decode_attention.h), from the next
 * graph on. */
BUTTER_API int32_t butter_layer_matmul_decode_attention(int32_t on) {
    decode_attention.store(on != 0);
    return BUTTER_OK;
}

/* Whether butter computes the prompt steps' attention (prompt_attention.h), from the next
 * graph on. */
BUTTER_API int32_t butter_layer_matmul_prompt_attention(int32_t on) {
    prompt_attention.store(on != 0);
    return BUTTER_OK;
}

/* The types whose new weights may be stored here from now on (BUTTER_TYPE_BIT_*). */
BUTTER_API int32_t butter_layer_matmul_enable_types(int32_t types) {
    enabled_types.store(types);
    return BUTTER_OK;
}

/* One probe product through a real ggml graph on `threads` threads: a random `type`
 * matrix of n rows of k (k a multiple of 256) times `rows` random activation rows, once with
 * the weight stored here (butter's kernel) and once as llama.cpp computes it. out[0]: the
 * largest difference, out[1]: the largest of llama.cpp's values, out[2]: 1 if butter's
 * kernel computed the product. `perturb` adds perturb x out[1] to butter's first value
 * before comparing (a wrong kernel, for the tests of the fallback; 0 otherwise). */
BUTTER_API int32_t butter_layer_matmul_self_check(int32_t type, int64_t k, int64_t n,
                                                  int64_t rows, int32_t threads, double perturb,
                                                  double *out, size_t out_bytes) {
    if (out == nullptr || out_bytes < 3 * sizeof(double) || type_bit(type) == 0 || k <= 0 ||
        k % QK_K != 0 || n <= 0 || rows <= 0 || threads <= 0) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    return self_check(type, k, n, rows, threads, perturb, out);
}

/* One flash attention through a real ggml graph on `threads` threads, with butter's decode
 * attention on (`butter` 1) or llama.cpp's own: `rows` query rows of `heads` heads over
 * `cells` f16 cells of `kv_heads` heads, `dim` wide, scaled by 1/sqrt(dim). The keys and
 * values come from `seed`, query row r from `seed` + 1 + r, and row r sees every cell but
 * those c with c % 5 == r % 5, so the first rows of a bigger probe are those of a smaller one.
 * The cells lie in a view of `view` slots (>= cells) as `placement` puts them (0: in order
 * at the start; else scattered in an order of its own); the other slots hold other values,
 * hidden from every row. `max_bias` (ALiBi: the mask then holds each seen cell's distance
 * term, minus c % 7) and `softcap` are the op's own parameters (0: none). out: the rows x
 * heads x dim results; *ran: 1 if butter computed them. */
BUTTER_API int32_t butter_layer_matmul_attention_probe(int32_t butter, int64_t rows,
                                                       int64_t cells, int64_t view,
                                                       int64_t placement, int64_t heads,
                                                       int64_t kv_heads, int64_t dim,
                                                       int32_t threads, int64_t seed,
                                                       float max_bias, float softcap,
                                                       float *out, size_t out_bytes,
                                                       int32_t *ran) {
    if (out == nullptr || ran == nullptr || rows <= 0 || cells <= 0 || view < cells ||
        !(max_bias >= 0.0f) || !(softcap >= 0.0f) ||
        kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || threads <= 0 ||
        out_bytes < (size_t)(rows * heads * dim) * sizeof(float)) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    return attention_probe(butter != 0, rows, cells, view, placement, heads, kv_heads, dim,
                           threads, seed, max_bias, softcap, out, ran);
}

/* The vector widths (floats) at which this CPU can compute ggml's Gated DeltaNet op as
 * ggml_vec_dot_f32 sums, as a mask of lane counts (8: AVX2 with FMA, 16: AVX-512). */
BUTTER_API int32_t butter_layer_matmul_delta_net_widths(void) { return delta_net_widths(); }

/* The width (one of those) at which butter computes Gated DeltaNet ops from the next graph
 * on; 0: llama.cpp computes them. */
BUTTER_API int32_t butter_layer_matmul_delta_net(int32_t width) {
    if (width != 0 && (width & delta_net_widths()) != width) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    delta_net_width.store(width);
    return BUTTER_OK;
}

/* One Gated DeltaNet through a real ggml graph on `threads` threads, at `width` (0:
 * llama.cpp's own op): `tokens` tokens of `seqs` sequences, `heads` heads of `dim`, a gate
 * per head (or per column with `per_column`), `snapshots` (K) states kept; inputs drawn
 * from `seed`. out: the op's result, (tokens + snapshots x dim) x seqs x heads x dim floats;
 * *ran: 1 if butter computed it. */
BUTTER_API int32_t butter_layer_matmul_delta_net_probe(int32_t width, int64_t tokens,
                                                       int64_t heads, int64_t dim, int64_t seqs,
                                                       int64_t snapshots, int32_t per_column,
                                                       int32_t threads, int64_t seed, float *out,
                                                       size_t out_bytes, int32_t *ran) {
    if (out == nullptr || ran == nullptr || tokens <= 0 || heads <= 0 || dim <= 0 ||
        seqs <= 0 || snapshots <= 0 || threads <= 0 ||
        (width != 0 && (width & delta_net_widths()) != width) ||
        out_bytes < (size_t)((tokens + snapshots * dim) * seqs * heads * dim) * sizeof(float)) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    return delta_net_probe(width, tokens, heads, dim, seqs, snapshots, per_column != 0, threads,
                           seed, out, ran);
}

/* The floats a vector (8 or 16, one of delta_net_widths') at which butter computes the
 * short convolutions (SSM_CONV ops) and the CONCATs feeding them from the next graph on (0:
 * llama.cpp computes them), their products rounded before they are added in blocks of
 * `rounding` (0 or 4; delta_net.cpp's rounded_products). */
BUTTER_API int32_t butter_layer_matmul_short_conv(int32_t lanes, int32_t rounding) {
    if ((lanes != 0 && (lanes & delta_net_widths()) != lanes) ||
        (rounding != 0 && rounding != 4)) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    short_conv_width.store(lanes);
    short_conv_rounding.store(rounding);
    return BUTTER_OK;
}

/* One short convolution through a real ggml graph on `threads` threads, by butter at
 * `lanes` floats a vector (8 or 16) and `rounding` (as for butter_layer_matmul_short_conv)
 * or by llama.cpp (lanes 0): `tokens` outputs of each of `channels`
 * channels (a multiple of 16) of `seqs` sequences, `width` weights a channel; inputs drawn
 * from `seed`, joined by a CONCAT as llama.cpp joins them. out: channels x tokens x seqs
 * floats; *ran: 1 if butter computed both the CONCAT and the convolution. */
BUTTER_API int32_t butter_layer_matmul_conv_probe(int32_t lanes, int32_t rounding,
                                                  int64_t tokens, int64_t channels, int64_t width,
                                                  int64_t seqs, int32_t threads, int64_t seed,
                                                  float *out, size_t out_bytes, int32_t *ran) {
    if (out == nullptr || ran == nullptr || tokens <= 0 || channels <= 0 || channels % 16 != 0 ||
        width <= 0 || width > 8 || seqs <= 0 || threads <= 0 ||
        (lanes != 0 && (lanes & delta_net_widths()) != lanes) || (rounding != 0 && rounding != 4) ||
        out_bytes < (size_t)(tokens * channels * seqs) * sizeof(float)) {
        return BUTTER_E_ARGUMENT;
    }
    if (!registered) {
        return BUTTER_E_STATE;
    }
    return conv_probe(lanes, rounding, tokens, channels, width, seqs, threads, seed, out, ran);
}

/* One row of k activations (a multiple of 256) quantized to ggml's Q8_K as butter's K-quant
 * matmuls quantize them (q6_k_tiles.h's q8_k_quantize_row), into out (k / 256 blocks). */
BUTTER_API int32_t butter_layer_matmul_quantize_q8_k(const float *x, int64_t k, void *out,
                                                     size_t out_bytes) {
    if (x == nullptr || out == nullptr || k <= 0 || k % QK_K != 0 ||
        out_bytes < (size_t)(k / QK_K) * Q8_K_BLOCK_BYTES) {
        return BUTTER_E_ARGUMENT;
    }
#ifdef BUTTER_X86
    if (best_isa() == BUTTER_ISA_NONE) {
        return BUTTER_DECLINED;
    }
    q8_k_quantize_row(x, (uint8_t *)out, k);
    return BUTTER_OK;
#else
    return BUTTER_DECLINED;
#endif
}

/* The registered buffer type (to find it in llama.cpp's list), or null. */
BUTTER_API void *butter_layer_matmul_buffer_type(void) {
    return registered ? buffer_type() : nullptr;
}

/* Whether the next model loads may place their layers' weights here (of the enabled types). */
BUTTER_API int32_t butter_layer_matmul_accept(int32_t accept) {
    accepting.store(accept != 0);
    return BUTTER_OK;
}

/* Matrices stored here (by type) and their bytes, since the process started; matmuls
 * computed here and their activation rows; attentions and their query rows (ggml_abi.h's
 * BUTTER_COUNTER_* places). */
BUTTER_API int32_t butter_layer_matmul_counters(int64_t *out, size_t out_bytes) {
    if (out == nullptr || out_bytes < BUTTER_COUNTERS * sizeof(int64_t)) {
        return BUTTER_E_ARGUMENT;
    }
    out[BUTTER_COUNTER_Q8_0_MATRICES] = q8_0_matrices.load();
    out[BUTTER_COUNTER_Q6_K_MATRICES] = q6_k_matrices.load();
    out[BUTTER_COUNTER_Q5_K_MATRICES] = q5_k_matrices.load();
    out[BUTTER_COUNTER_Q4_1_MATRICES] = q4_1_matrices.load();
    out[BUTTER_COUNTER_Q5_0_MATRICES] = q5_0_matrices.load();
    out[BUTTER_COUNTER_Q4_K_MATRICES] = q4_k_matrices.load();
    out[BUTTER_COUNTER_PACKED_BYTES] = packed_bytes.load();
    out[BUTTER_COUNTER_MATMULS] = matmuls.load();
    out[BUTTER_COUNTER_ROWS] = matmul_rows.load();
    out[BUTTER_COUNTER_ATTENTIONS] = attentions.load();
    out[BUTTER_COUNTER_ATTENTION_ROWS] = attention_rows.load();
    out[BUTTER_COUNTER_DELTA_NETS] = delta_nets.load();
    out[BUTTER_COUNTER_SHORT_CONVS] = short_convs.load();
    return BUTTER_OK;
}

static struct PyModuleDef layer_matmul_module = {
    PyModuleDef_HEAD_INIT, "_layer_matmul",
    "butter's Q8_0, Q6_K, Q5_K, Q4_K, Q4_1 and Q5_0 layer matmuls and attention for llama.cpp "
    "(loaded with ctypes, see butter/backends/llama_cpp/layer_matmul.py)",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__layer_matmul(void) { return PyModule_Create(&layer_matmul_module); }
