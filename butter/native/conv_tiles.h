/*
 * delta_net.cpp's short convolution and CONCAT tiles at one vector width: included once per
 * width inside the namespace of that width's Gated DeltaNet rows (delta_net_rows.h, whose
 * W and V it uses), so that each is compiled for exactly that instruction set. A tile is
 * W::FLOATS x W::FLOATS floats, transposed in registers (W::transpose).
 */

/* Channels [c0, c0 + FLOATS) of a short convolution over tokens [t0, t0 + FLOATS) of
 * sequence `seq`: each channel's tokens one vector per weight, summed from 0 in llama.cpp's
 * order (the first `rounded` products rounded and then added, the rest fused), then
 * transposed to go out token by token. */
DELTA_TARGET void short_conv_tile(const tensor *op, int64_t seq, int64_t c0, int64_t t0,
                                  int64_t rounded) {
    const tensor *x = op->src[0], *w = op->src[1];
    const int64_t width = w->ne[0];
    V sums[W::FLOATS]; /* a channel's tokens each, then a token's channels */
    for (int64_t c = 0; c < W::FLOATS; c++) {
        const float *row = (const float *)((const char *)x->data + (c0 + c) * x->nb[1] +
                                           seq * x->nb[2]) + t0;
        const float *weights = (const float *)((const char *)w->data + (c0 + c) * w->nb[1]);
        V sum = W::zero();
        for (int64_t i = 0; i < rounded; i++) {
            V product = W::mul(W::load(row + i), W::set1(weights[i]));
            __asm__("" : "+v"(product)); /* (kept from being fused into the add) */
            sum = W::add(sum, product);
        }
        for (int64_t i = rounded; i < width; i++) {
            sum = W::fma(W::load(row + i), W::set1(weights[i]), sum);
        }
        sums[c] = sum;
    }
    W::transpose(sums);
    for (int64_t t = 0; t < W::FLOATS; t++) {
        W::store((float *)((char *)op->data + (t0 + t) * op->nb[1] + seq * op->nb[2]) + c0,
                 sums[t]);
    }
}

/* Columns [c0, c0 + FLOATS) of rows [r0, r0 + FLOATS) of `from` (whose columns lie 4 bytes
 * apart: from's i1 is the row, i0 the column) to rows r0.. of `to`, from column `at` + c0. */
DELTA_TARGET void concat_tile(const tensor *from, tensor *to, int64_t at, int64_t r0,
                              int64_t c0, int64_t i2, int64_t i3) {
    V block[W::FLOATS]; /* a column's rows each, then a row's columns */
    for (int64_t c = 0; c < W::FLOATS; c++) {
        block[c] = W::load(element(from, c0 + c, r0, i2, i3));
    }
    W::transpose(block);
    for (int64_t r = 0; r < W::FLOATS; r++) {
        W::store((float *)element(to, at + c0, r0 + r, i2, i3), block[r]);
    }
}
