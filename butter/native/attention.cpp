/*
 * butter's attention inside llama.cpp's CPU backend: a flash attention op over an f16 or f32
 * cache, taken from llama.cpp by the buffer type (get_tensor_traits asks here for every op)
 * and computed by decode_attention.h (fewer than ATTENTION_MAX_ROWS query rows) or
 * prompt_attention.h (more), on llama.cpp's threads: each row over the cells its mask lets
 * it see, in fixed point, so that a row's bits do not depend on the rows beside it, the
 * thread count or where its cells lie.
 */
#include <cstring>

#include "decode_attention.h"
#include "layer_matmul.h"
#include "prompt_attention.h"
#include "prompt_attention_avx512.h"

namespace butter {

namespace {

bool is_f16_or_f32(const tensor *t) {
    return t->type == ggml_mirror::TYPE_F16 || t->type == ggml_mirror::TYPE_F32;
}

size_t element_bytes(const tensor *t) { return t->type == ggml_mirror::TYPE_F16 ? 2 : 4; }

/* Whether butter can compute this op (any row count): shapes and types decode_attention.h
 * and prompt_attention.h handle. */
bool takes_attention(const tensor *op) {
    if (op->op != ggml_mirror::OP_FLASH_ATTN_EXT || kernel_isa == BUTTER_ISA_NONE) {
        return false;
    }
    const tensor *q = op->src[0], *k = op->src[1], *v = op->src[2], *mask = op->src[3],
                 *sinks = op->src[4];
    if (q == nullptr || k == nullptr || v == nullptr || q->type != ggml_mirror::TYPE_F32 ||
        !is_f16_or_f32(k) || !is_f16_or_f32(v)) {
        return false;
    }
    const int64_t dk = k->ne[0], dv = v->ne[0];
    return dk % 8 == 0 && dv % 8 == 0 && q->ne[0] == dk &&
           k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0 && v->ne[2] == k->ne[2] &&
           v->ne[1] == k->ne[1] && q->ne[3] == k->ne[3] && v->ne[3] == k->ne[3] &&
           q->nb[0] == sizeof(float) && k->nb[0] == element_bytes(k) &&
           v->nb[0] == element_bytes(v) &&
           (mask == nullptr || (mask->type == ggml_mirror::TYPE_F16 &&
                                mask->nb[0] == sizeof(uint16_t) && mask->ne[0] >= k->ne[1] &&
                                mask->ne[1] >= q->ne[1] && mask->ne[2] == 1)) &&
           (sinks == nullptr || sinks->type == ggml_mirror::TYPE_F32) &&
           op->nb[0] == sizeof(float) && op->ne[0] == dv;
}

AttentionView attention_view(const tensor *op) {
    const tensor *q = op->src[0], *k = op->src[1], *v = op->src[2], *mask = op->src[3],
                 *sinks = op->src[4];
    AttentionView a{};
    a.dk = k->ne[0], a.dv = v->ne[0];
    a.rows = q->ne[1], a.heads = q->ne[2], a.kv_heads = k->ne[2], a.cells = k->ne[1];
    a.seqs = q->ne[3];
    a.q = (const char *)q->data, a.q_row = q->nb[1], a.q_head = q->nb[2], a.q_seq = q->nb[3];
    a.k = (const char *)k->data, a.k_cell = k->nb[1], a.k_head = k->nb[2], a.k_seq = k->nb[3];
    a.v = (const char *)v->data, a.v_cell = v->nb[1], a.v_head = v->nb[2], a.v_seq = v->nb[3];
    a.k_f16 = k->type == ggml_mirror::TYPE_F16, a.v_f16 = v->type == ggml_mirror::TYPE_F16;
    if (mask != nullptr) {
        a.mask = (const uint16_t *)mask->data;
        a.mask_row = mask->nb[1], a.mask_seq = mask->nb[3], a.mask_seqs = mask->ne[3];
    }
    a.sinks = sinks != nullptr ? (const float *)sinks->data : nullptr;
    a.dst = (char *)op->data, a.dst_row = op->nb[1];
    memcpy(&a.scale, (const float *)op->op_params + 0, sizeof(float));
    memcpy(&a.max_bias, (const float *)op->op_params + 1, sizeof(float));
    memcpy(&a.softcap, (const float *)op->op_params + 2, sizeof(float));
    if (a.softcap != 0.0f) {
        a.scale /= a.softcap; /* llama.cpp's order: tanh of the scaled score, times the cap */
    }
    return a;
}

/* The work buffer holds the cells each row sees and, for a wave of rows (as many as fit in
 * ATTENTION_WAVE_BYTES, at least one: more rows take more waves), decode_attention.h's
 * AttentionWave. */
constexpr size_t ATTENTION_WAVE_BYTES = (size_t)16 << 20;

struct AttentionWork {
    int64_t rows, heads, kv_heads, dv, cells, stride, chunks, wave_rows;
    size_t cells_bytes, scores_bytes, maxima_bytes, ranges_bytes, weight_bytes, value_bytes;

    explicit AttentionWork(const tensor *op) {
        const tensor *q = op->src[0], *k = op->src[1], *v = op->src[2];
        rows = q->ne[3] * q->ne[1];
        heads = q->ne[2], kv_heads = k->ne[2], dv = v->ne[0];
        cells = k->ne[1];
        chunks = attention_chunks(cells);
        stride = chunks * ATTENTION_CHUNK;
        cells_bytes = aligned((size_t)rows * (cells * sizeof(int32_t) + sizeof(int64_t)));
        const int64_t fit = (int64_t)(ATTENTION_WAVE_BYTES / wave_bytes_per_row());
        wave_rows = fit < 1 ? 1 : fit > rows ? rows : fit;
        scores_bytes = aligned((size_t)(wave_rows * heads * stride) * sizeof(float));
        maxima_bytes = aligned((size_t)(wave_rows * heads * chunks) * sizeof(float));
        ranges_bytes = aligned((size_t)(wave_rows * kv_heads * chunks) * sizeof(float));
        weight_bytes = aligned((size_t)(wave_rows * heads * chunks) * sizeof(int64_t));
        value_bytes = aligned((size_t)(wave_rows * heads * chunks * dv) * sizeof(int32_t));
    }

    /* One row's share of a wave: its scores, maxima, ranges and sums. */
    size_t wave_bytes_per_row() const {
        return (size_t)(heads * stride) * sizeof(float) +
               (size_t)(heads * chunks) * (sizeof(float) + sizeof(int64_t)) +
               (size_t)(kv_heads * chunks) * sizeof(float) +
               (size_t)(heads * chunks * dv) * sizeof(int32_t);
    }

    size_t bytes() const {
        return cells_bytes + scores_bytes + maxima_bytes + ranges_bytes + weight_bytes +
               value_bytes + ALIGN;
    }

    AttentionWave wave(char *base) const {
        char *at = base + cells_bytes;
        AttentionWave w{};
        w.scores = (float *)at, at += scores_bytes;
        w.maxima = (float *)at, at += maxima_bytes;
        w.ranges = (float *)at, at += ranges_bytes;
        w.weight_units = (int64_t *)at, at += weight_bytes;
        w.value_units = (int32_t *)at;
        w.stride = stride, w.chunks = chunks, w.heads = heads, w.kv_heads = kv_heads;
        w.dv = dv;
        return w;
    }
};

#ifdef BUTTER_X86

/* A run of a wave's tasks (row, chunk, KV head; KV heads of a chunk next to each other: a
 * cache stores a cell's heads side by side, so they share cache lines) in one phase. Only
 * the chunks a row sees are tasks, shared evenly: the view spans every stream's cells (and
 * cached prefixes'), so splitting all of its chunks would leave a thread whose share of the
 * view no row sees with nothing to do. */
template <typename Phase>
void attention_tasks(const compute_params *params, const AttentionView &a,
                     const AttentionWork &work, int64_t first_row, int64_t wave_rows,
                     const int64_t *seen, const int32_t *cells, Phase phase) {
    int64_t tasks = 0;
    for (int64_t row = 0; row < wave_rows; row++) {
        tasks += attention_chunks(seen[first_row + row]) * a.kv_heads;
    }
    const int64_t first_task = tasks * params->ith / params->nth,
                  end_task = tasks * (params->ith + 1) / params->nth;
    int64_t row = 0, row_first_task = 0; /* the row holding task t, and its first task */
    for (int64_t t = first_task; t < end_task; t++) {
        int64_t r = first_row + row;
        while (t >= row_first_task + attention_chunks(seen[r]) * a.kv_heads) {
            row_first_task += attention_chunks(seen[r]) * a.kv_heads;
            r = first_row + ++row;
        }
        const int64_t kv_head = (t - row_first_task) % a.kv_heads,
                      c = (t - row_first_task) / a.kv_heads;
        const int64_t first = c * ATTENTION_CHUNK;
        const int64_t n = seen[r] - first < ATTENTION_CHUNK ? seen[r] - first : ATTENTION_CHUNK;
        phase(r / a.rows, r % a.rows, row, kv_head, c, attention_chunks(seen[r]),
              cells + r * work.cells + first, n);
    }
}

/* Each row over the cells it sees, in three phases with a barrier after each: scores (and
 * each chunk's largest score and |value|), then each chunk's weights and fixed-point sums
 * (the row's largest score and |value| known by then), then each (row, head)'s result from
 * the sums of its chunks. Integers add up to the same in any order, so where in the cache
 * a row's cells lie, and in which order, changes no bit of its result. */
void attend(compute_params *params, tensor *op) {
    const AttentionView a = attention_view(op);
    const AttentionWork work(op);
    const int ith = params->ith, nth = params->nth;
    char *base = aligned_work(params);
    int64_t *seen = (int64_t *)base;           /* per row: how many cells */
    int32_t *cells = (int32_t *)(seen + work.rows); /* per row: which, in order */
    const AttentionWave wave = work.wave(base);
    for (int64_t r = ith; r < work.rows; r += nth) {
        seen[r] = attention_visible(a, r / a.rows, r % a.rows, cells + r * work.cells);
    }
    barrier(params);
    for (int64_t first_row = 0; first_row < work.rows; first_row += work.wave_rows) {
        const int64_t rows = work.rows - first_row < work.wave_rows ? work.rows - first_row
                                                                    : work.wave_rows;
        attention_tasks(params, a, work, first_row, rows, seen, cells,
                        [&](int64_t seq, int64_t query_row, int64_t row, int64_t kv_head,
                            int64_t chunk, int64_t, const int32_t *listed, int64_t n) {
                            attention_score_chunk(a, wave, seq, query_row, row, kv_head, chunk,
                                                  listed, n);
                        });
        barrier(params);
        attention_tasks(params, a, work, first_row, rows, seen, cells,
                        [&](int64_t seq, int64_t, int64_t row, int64_t kv_head, int64_t chunk,
                            int64_t chunks, const int32_t *listed, int64_t n) {
                            attention_weigh_chunk(a, wave, seq, row, kv_head, chunk, chunks,
                                                  listed, n);
                        });
        barrier(params);
        for (int64_t p = ith; p < rows * a.heads; p += nth) {
            const int64_t row = p / a.heads, r = first_row + row;
            attention_finish(a, wave, r / a.rows, r % a.rows, row, p % a.heads,
                             attention_chunks(seen[r]));
        }
        if (first_row + work.wave_rows < work.rows) {
            barrier(params); /* the next wave writes over this one's work */
        }
    }
    if (ith == 0) {
        if (probing.load()) {
            probe_attentions.fetch_add(1, std::memory_order_relaxed);
        } else {
            attentions.fetch_add(1, std::memory_order_relaxed);
            attention_rows.fetch_add(work.rows, std::memory_order_relaxed);
        }
    }
}

#endif /* BUTTER_X86 */

class DecodeAttention : public ggml_mirror::tensor_traits {
    bool work_size(int /*n_threads*/, const tensor *op, size_t &size) override {
        size = AttentionWork(op).bytes();
        return true;
    }

    bool compute_forward(compute_params *params, tensor *op) override {
#ifdef BUTTER_X86
        if (params->wsize < AttentionWork(op).bytes()) {
            return false; /* planned under the other setting: llama.cpp computes it */
        }
        attend(params, op);
        return true;
#else
        (void)params, (void)op;
        return false;
#endif
    }
};

DecodeAttention decode_attention_traits;

/* The bytes a prompt attention's threads work in: the next tile to take, the cells' largest
 * |value|s (shared), then each thread's own PromptScratch. */
size_t prompt_work_bytes(const tensor *op, int n_threads) {
    const AttentionView a = attention_view(op);
    return ALIGN + aligned(prompt_ranges_bytes(a)) +
           (size_t)n_threads * PromptScratch::bytes(a, PromptPlan(a), ALIGN) + ALIGN;
}

#ifdef BUTTER_X86

/* The threads take tiles (of every stream) one at a time, the last rows' first (a causal
 * prompt's later rows see more cells), until none is left: a tile is one thread's from
 * start to end, so which thread took it changes no bit. */
void attend_prompt(compute_params *params, tensor *op) {
    const AttentionView a = attention_view(op);
    const PromptPlan plan(a);
    char *base = aligned_work(params);
    int64_t *taken = (int64_t *)base;
    float *ranges = (float *)(base + ALIGN);
    const PromptScratch scratch(base + ALIGN + aligned(prompt_ranges_bytes(a)) +
                                    (size_t)params->ith * PromptScratch::bytes(a, plan, ALIGN),
                                a, plan, ALIGN);
    if (params->ith == 0) {
        __atomic_store_n(taken, 0, __ATOMIC_RELAXED);
    }
    prompt_cell_ranges(a, ranges, params->ith, params->nth);
    barrier(params);
    const bool wide = kernel_isa == BUTTER_ISA_AVX512_VNNI && wide_takes(a);
    const int64_t tasks = a.seqs * plan.tiles;
    for (int64_t t = __atomic_fetch_add(taken, 1, __ATOMIC_RELAXED); t < tasks;
         t = __atomic_fetch_add(taken, 1, __ATOMIC_RELAXED)) {
        const int64_t last_first = tasks - 1 - t, seq = last_first / plan.tiles;
        const float *ranges_of = ranges + seq * a.kv_heads * a.cells;
        if (wide) {
            wide_tile(a, plan, scratch, ranges_of, seq, last_first % plan.tiles);
        } else {
            prompt_tile(a, plan, scratch, ranges_of, seq, last_first % plan.tiles);
        }
    }
    if (params->ith == 0) {
        if (probing.load()) {
            probe_attentions.fetch_add(1, std::memory_order_relaxed);
        } else {
            attentions.fetch_add(1, std::memory_order_relaxed);
            attention_rows.fetch_add(a.seqs * a.rows, std::memory_order_relaxed);
        }
    }
}

#endif /* BUTTER_X86 */

class PromptAttention : public ggml_mirror::tensor_traits {
    bool work_size(int n_threads, const tensor *op, size_t &size) override {
        size = prompt_work_bytes(op, n_threads);
        return true;
    }

    bool compute_forward(compute_params *params, tensor *op) override {
#ifdef BUTTER_X86
        if (params->wsize < prompt_work_bytes(op, params->nth)) {
            return false; /* planned under the other setting: llama.cpp computes it */
        }
        attend_prompt(params, op);
        return true;
#else
        (void)params, (void)op;
        return false;
#endif
    }
};

PromptAttention prompt_attention_traits;

}  // namespace

ggml_mirror::tensor_traits *attention_path(const tensor *op) {
    if (!takes_attention(op)) {
        return nullptr;
    }
    const tensor *q = op->src[0], *k = op->src[1];
    if (q->ne[1] < ATTENTION_MAX_ROWS) {
        return decode_attention.load(std::memory_order_relaxed) ? &decode_attention_traits
                                                                : nullptr;
    }
    const bool fits = q->ne[2] / k->ne[2] <= PROMPT_TILE_PAIRS; /* a tile's pairs: on the stack */
    return fits && prompt_attention.load(std::memory_order_relaxed) ? &prompt_attention_traits
                                                                    : nullptr;
}

}  // namespace butter
