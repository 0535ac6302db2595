/*
 * delta_net.cpp's kernel at one vector width: included once per width inside a namespace of
 * its own, with DELTA_LANES naming the width's vectors (Wide or Narrow) and DELTA_TARGET its
 * instruction set, so that every function is compiled for exactly that set (GCC inlines
 * intrinsics only into functions of their target).
 */

using W = DELTA_LANES;
using V = W::V;

/* ggml_vec_dot_f32 of a row held in registers (DIM floats) with y: whole steps of 4
 * vectors into 4 accumulators, reduced as ggml reduces them, then the floats past the last
 * whole step one at a time, in order, each product rounded before it is added (as the
 * native build computes ggml's leftovers of 8 or more: `volatile` keeps this one from
 * being contracted into an FMA). */
template <int DIM>
DELTA_TARGET inline float delta_dot(const V *row, const float *y) {
    constexpr int N = DIM / W::FLOATS, STEPPED = DIM / (4 * W::FLOATS) * 4;
    V sum[4] = {W::zero(), W::zero(), W::zero(), W::zero()};
    for (int i = 0; i < STEPPED; i += 4) {
        for (int j = 0; j < 4; j++) {
            sum[j] = W::fma(row[i + j], W::load(y + (i + j) * W::FLOATS), sum[j]);
        }
    }
    float total = W::reduce(sum);
    if constexpr (STEPPED < N) {
        float rest[(N - STEPPED) * W::FLOATS];
        for (int i = STEPPED; i < N; i++) {
            W::store(rest + (i - STEPPED) * W::FLOATS, row[i]);
        }
        for (int e = 0; e < (N - STEPPED) * W::FLOATS; e++) {
            const volatile float product = rest[e] * y[STEPPED * W::FLOATS + e];
            total += product;
        }
    }
    return total;
}

/* Rows [j0, j0 + DELTA_ROWS) of a state into `to`. */
template <int N>
DELTA_TARGET inline void delta_store(float *to, const V (&row)[DELTA_ROWS][N], int64_t j0) {
    for (int r = 0; r < DELTA_ROWS; r++) {
        for (int i = 0; i < N; i++) {
            W::store(to + (j0 + r) * N * W::FLOATS + i * W::FLOATS, row[r][i]);
        }
    }
}

/* Rows [j0, j0 + DELTA_ROWS) of a head's state through tokens [t0, t1): per token, as
 * llama.cpp's op does to each row, decay by e^g, delta = (v[j] - row . k) x beta,
 * row += delta x k, out[j] = (row . q) / sqrt(dim). The rows start from the step's state
 * (t0 = 0) or where the tokens before left them (snapshot slot 0, which ends as the final
 * state), and go to every snapshot slot whose token this is. */
template <int DIM>
DELTA_TARGET inline void delta_rows(const DeltaHead &h, const float *gates, int64_t j0,
                                    int64_t t0, int64_t t1) {
    constexpr int N = DIM / W::FLOATS;
    const DeltaView &d = h.d;
    const float scale = 1.0f / sqrtf((float)DIM);
    V row[DELTA_ROWS][N];
    const float *in = t0 == 0 ? h.state_in() : h.state_out(0);
    for (int r = 0; r < DELTA_ROWS; r++) {
        for (int i = 0; i < N; i++) {
            row[r][i] = W::load(in + (j0 + r) * DIM + i * W::FLOATS);
        }
    }
    for (int64_t t = t0; t < t1; t++) {
        const float *k = h.k(t), *q = h.q(t), *v = h.v(t);
        const float beta = h.beta(t);
        if (d.per_column) {
            const float *gate = gates + t * DIM;
            for (int r = 0; r < DELTA_ROWS; r++) {
                for (int i = 0; i < N; i++) {
                    row[r][i] = W::mul(row[r][i], W::load(gate + i * W::FLOATS));
                }
            }
        } else {
            const V gate = W::set1(gates[t]);
            for (int r = 0; r < DELTA_ROWS; r++) {
                for (int i = 0; i < N; i++) {
                    row[r][i] = W::mul(row[r][i], gate);
                }
            }
        }
        float *out = h.attention_out(t);
        for (int r = 0; r < DELTA_ROWS; r++) {
            const float delta = (v[j0 + r] - delta_dot<DIM>(row[r], k)) * beta;
            const V by = W::set1(delta);
            for (int i = 0; i < N; i++) {
                row[r][i] = W::fma(W::load(k + i * W::FLOATS), by, row[r][i]);
            }
            out[j0 + r] = delta_dot<DIM>(row[r], q) * scale;
        }
        const int64_t slot = d.tokens - 1 - t;
        if (slot < d.snapshots && slot > 0) {
            delta_store(h.state_out(slot), row, j0);
        }
    }
    delta_store(h.state_out(0), row, j0);
}

/* This thread's share of the op: tasks of DELTA_ROWS rows of one head of one sequence, cut
 * evenly (which thread computes a row changes no bit: rows never meet), taken
 * DELTA_TOKENS tokens at a time so that the tokens' k and q stay in the cache while every
 * row of the share passes over them. */
template <int DIM>
DELTA_TARGET void delta_share(const DeltaView &d, float *gates, int ith, int nth) {
    const int64_t per_head = DIM / DELTA_ROWS, tasks = d.seqs * d.heads * per_head;
    const int64_t first = tasks * ith / nth, end = tasks * (ith + 1) / nth;
    for (int64_t task = first; task < end;) {
        const int64_t unit = task / per_head, seq = unit / d.heads, head = unit % d.heads;
        const int64_t unit_end = (unit + 1) * per_head < end ? (unit + 1) * per_head : end;
        const DeltaHead h(d, head, seq);
        delta_gates(h, gates);
        for (int64_t t0 = 0; t0 < d.tokens; t0 += DELTA_TOKENS) {
            const int64_t t1 = t0 + DELTA_TOKENS < d.tokens ? t0 + DELTA_TOKENS : d.tokens;
            for (int64_t pair = task; pair < unit_end; pair++) {
                delta_rows<DIM>(h, gates, pair % per_head * DELTA_ROWS, t0, t1);
            }
        }
        task = unit_end;
    }
}
