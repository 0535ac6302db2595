/*
 * Probes through real ggml graphs: a product whose weight is stored in butter's buffer
 * type against the same product computed by llama.cpp (butter_layer_matmul_self_check: a
 * type whose kernel disagrees is not accepted), and a flash attention computed by butter or
 * by llama.cpp (butter_layer_matmul_attention_probe: the tests' and registration's check of
 * butter's attention).
 */
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "layer_matmul.h"

namespace butter {

namespace {

/* y = x * w^T for a `type` matrix of n rows of k, by ggml on `threads` threads: with the
 * weight stored in `buft` (butter's buffer type), or in plain memory (null: llama.cpp's
 * own kernels). The result goes to `out` (rows x n floats). */
bool graph_product(backend_buffer_type *buft, int type, const std::vector<uint8_t> &weight,
                   int64_t k, int64_t n, const std::vector<float> &x, int64_t rows,
                   int threads, std::vector<float> &out) {
    Context weights(1 << 16, true);
    Context compute(weight.size() + x.size() * sizeof(float) + rows * n * sizeof(float) +
                        ((size_t)64 << 20),
                    false);
    if (weights.ctx == nullptr || compute.ctx == nullptr) {
        return false;
    }
    tensor *w = ggml.new_tensor_2d(buft != nullptr ? weights.ctx : compute.ctx, type, k, n);
    if (w == nullptr) {
        return false;
    }
    ggml.set_name(w, "blk.0.self_check");
    Buffer buffer(buft != nullptr ? ggml.alloc_ctx_tensors_from_buft(weights.ctx, buft) : nullptr);
    if (buft != nullptr) {
        if (buffer.buffer == nullptr) {
            return false;
        }
        ggml.tensor_set(w, weight.data(), 0, weight.size());
    } else {
        memcpy(ggml.get_data(w), weight.data(), weight.size());
    }
    tensor *xt = ggml.new_tensor_2d(compute.ctx, ggml_mirror::TYPE_F32, k, rows);
    tensor *y = xt == nullptr ? nullptr : ggml.mul_mat(compute.ctx, w, xt);
    void *graph = y == nullptr ? nullptr : ggml.new_graph(compute.ctx);
    if (graph == nullptr) {
        return false;
    }
    memcpy(ggml.get_data(xt), x.data(), x.size() * sizeof(float));
    ggml.build_forward_expand(graph, y);
    if (ggml.graph_compute_with_ctx(compute.ctx, graph, threads) != ggml_mirror::STATUS_SUCCESS) {
        return false;
    }
    out.assign((const float *)ggml.get_data(y), (const float *)ggml.get_data(y) + rows * n);
    return true;
}

/* out[0]: the largest difference between butter's product and llama.cpp's (a NaN counts
 * as the worst), out[1]: the largest of llama.cpp's values; `perturb` x out[1] added to
 * butter's first value first. */
void compare(std::vector<float> &ours, const std::vector<float> &theirs, double perturb,
             double *out) {
    double largest = 0.0, worst = 0.0;
    for (float v : theirs) {
        largest = fabs(v) > largest ? fabs(v) : largest;
    }
    ours[0] += (float)(perturb * largest);
    for (size_t i = 0; i < ours.size(); i++) {
        const double d = fabs((double)ours[i] - (double)theirs[i]);
        worst = d > worst || d != d ? d : worst;
    }
    out[0] = worst;
    out[1] = largest;
}

}  // namespace

/* Floats in [-1, 1), the same for the same seed. */
void probe_values(uint64_t seed, float *out, int64_t n) {
    uint64_t state = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        out[i] = (float)((double)(state >> 40) / (double)(1ull << 23) - 1.0);
    }
}

/* One probe product (butter_layer_matmul_self_check, which checked the arguments). */
int32_t self_check(int type, int64_t k, int64_t n, int64_t rows, int threads, double perturb,
                   double *out) {
    std::vector<float> w(k * n), x(k * rows), ours, theirs;
    probe_values(1000 + (uint64_t)type, w.data(), (int64_t)w.size());
    probe_values(2000 + (uint64_t)rows, x.data(), (int64_t)x.size());
    std::vector<uint8_t> weight(ggml.row_size(type, k) * n);
    ggml.quantize_chunk(type, w.data(), weight.data(), 0, n, k, nullptr);
    probing.store(true);
    const int64_t ran_before = probe_matmuls.load();
    const bool done = graph_product(buffer_type(), type, weight, k, n, x, rows, threads, ours);
    const bool ran = probe_matmuls.load() > ran_before;
    probing.store(false);
    if (!done || !graph_product(nullptr, type, weight, k, n, x, rows, threads, theirs)) {
        return BUTTER_E_STATE;
    }
    compare(ours, theirs, perturb, out);
    out[2] = ran ? 1.0 : 0.0;
    return BUTTER_OK;
}

namespace {

/* Where the probe's cells lie in a view of `view` slots: cell c at slot[c]. Placement 0
 * keeps them in order at the start; any other value scatters them over the view in an order
 * of its own (a Fisher-Yates shuffle drawn from probe_values). */
std::vector<int64_t> probe_slots(int64_t cells, int64_t view, int64_t placement) {
    std::vector<int64_t> slots(view);
    for (int64_t i = 0; i < view; i++) {
        slots[i] = i;
    }
    if (placement != 0) {
        std::vector<float> draws(view);
        probe_values((uint64_t)placement * 7919, draws.data(), view);
        for (int64_t i = view - 1; i > 0; i--) {
            const int64_t j = (int64_t)((draws[i] + 1.0f) * 0.5f * (float)(i + 1)) % (i + 1);
            std::swap(slots[i], slots[j]);
        }
    }
    slots.resize(cells);
    return slots;
}

/* The probe's keys and values: f16, `kv_heads` x `view` slots of `dim`, the cells' over
 * their slots (from `seed`) and other values in the other slots. */
void fill_cache(tensor *k, tensor *v, int64_t cells, int64_t view, int64_t kv_heads,
                int64_t dim, int64_t seed, const std::vector<int64_t> &slots) {
    const size_t kv_floats = (size_t)(dim * view * kv_heads);
    std::vector<float> values((size_t)(dim * cells * kv_heads)), placed(kv_floats);
    for (int which = 0; which < 2; which++) {
        /* the other slots' values first, then the cells' over their slots */
        probe_values((uint64_t)seed + 77 + (uint64_t)which, placed.data(), (int64_t)kv_floats);
        probe_values((uint64_t)seed + (which ? 1000003 : 0), values.data(),
                     (int64_t)values.size());
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t c = 0; c < cells; c++) {
                memcpy(placed.data() + (h * view + slots[c]) * dim,
                       values.data() + (h * cells + c) * dim, (size_t)dim * sizeof(float));
            }
        }
        ggml.fp32_to_fp16_row(placed.data(), (uint16_t *)ggml.get_data(which ? v : k),
                              (int64_t)kv_floats);
    }
}

/* The probe's query rows (row r from `seed` + 1 + r) and mask (row r sees every cell but
 * those c with c % 5 == r % 5, and no other slot; with `alibi`, a seen cell's value is
 * -(c % 7), as ALiBi's masks hold a distance term, else 0). */
void fill_queries(tensor *q, tensor *mask, int64_t rows, int64_t cells, int64_t view,
                  int64_t heads, int64_t dim, int64_t seed, const std::vector<int64_t> &slots,
                  bool alibi) {
    std::vector<float> row(dim), hidden(view);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            probe_values((uint64_t)(seed + 1 + r) * 131 + (uint64_t)h, row.data(), dim);
            for (int64_t d = 0; d < dim; d++) {
                row[d] *= 4.0f; /* scores spread enough that the softmax is not flat */
            }
            memcpy((char *)ggml.get_data(q) + r * q->nb[1] + h * q->nb[2], row.data(),
                   (size_t)dim * sizeof(float));
        }
        std::fill(hidden.begin(), hidden.end(), -INFINITY);
        for (int64_t c = 0; c < cells; c++) {
            hidden[slots[c]] = c % 5 == r % 5 ? -INFINITY : alibi ? -(float)(c % 7) : 0.0f;
        }
        ggml.fp32_to_fp16_row(hidden.data(),
                              (uint16_t *)((char *)ggml.get_data(mask) + r * mask->nb[1]), view);
    }
}

/* Computes the graph with butter's attention on or off (and back as it was after); *ran: 1
 * if butter computed an attention. */
int compute_attention(void *ctx, void *graph, bool butter, int threads, int32_t *ran) {
    const bool was_on = decode_attention.load(), prompts_were_on = prompt_attention.load();
    decode_attention.store(butter);
    prompt_attention.store(butter);
    probing.store(true);
    const int64_t ran_before = probe_attentions.load();
    const int status = ggml.graph_compute_with_ctx(ctx, graph, threads);
    *ran = probe_attentions.load() > ran_before ? 1 : 0;
    probing.store(false);
    decode_attention.store(was_on);
    prompt_attention.store(prompts_were_on);
    return status;
}

}  // namespace

/* One attention probe (butter_layer_matmul_attention_probe, which checked the arguments). */
int32_t attention_probe(bool butter, int64_t rows, int64_t cells, int64_t view,
                        int64_t placement, int64_t heads, int64_t kv_heads, int64_t dim,
                        int threads, int64_t seed, float max_bias, float softcap, float *out,
                        int32_t *ran) {
    const size_t kv_floats = (size_t)(dim * view * kv_heads);
    Context compute(2 * kv_floats * sizeof(float) + (size_t)(rows * (heads * dim * 2 + view)) *
                        sizeof(float) + ((size_t)16 << 20), false);
    if (compute.ctx == nullptr) {
        return BUTTER_E_STATE;
    }
    tensor *q = ggml.new_tensor_3d(compute.ctx, ggml_mirror::TYPE_F32, dim, rows, heads);
    tensor *k = ggml.new_tensor_3d(compute.ctx, ggml_mirror::TYPE_F16, dim, view, kv_heads);
    tensor *v = ggml.new_tensor_3d(compute.ctx, ggml_mirror::TYPE_F16, dim, view, kv_heads);
    tensor *mask = ggml.new_tensor_2d(compute.ctx, ggml_mirror::TYPE_F16, view, rows);
    if (q == nullptr || k == nullptr || v == nullptr || mask == nullptr) {
        return BUTTER_E_STATE;
    }
    const std::vector<int64_t> slots = probe_slots(cells, view, placement);
    fill_cache(k, v, cells, view, kv_heads, dim, seed, slots);
    fill_queries(q, mask, rows, cells, view, heads, dim, seed, slots, max_bias > 0.0f);
    tensor *y = ggml.flash_attn_ext(compute.ctx, q, k, v, mask, 1.0f / sqrtf((float)dim),
                                    max_bias, softcap);
    void *graph = y == nullptr ? nullptr : ggml.new_graph(compute.ctx);
    if (graph == nullptr) {
        return BUTTER_E_STATE;
    }
    ggml.build_forward_expand(graph, y);
    if (compute_attention(compute.ctx, graph, butter, threads, ran) !=
        ggml_mirror::STATUS_SUCCESS) {
        return BUTTER_E_STATE;
    }
    memcpy(out, ggml.get_data(y), (size_t)(rows * heads * dim) * sizeof(float));
    return BUTTER_OK;
}

}  // namespace butter
