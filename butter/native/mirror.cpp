/*
 * The mirror (ggml_mirror.h) read back from the running ggml, before anything is
 * registered: the figures Python compares with ggml's own answers (its tensor size, its
 * names of the type and op numbers), and every field the library reads or writes, read
 * through the mirror from tensors and a buffer the running ggml made.
 */
#include <cstring>

#include "layer_matmul.h"
#include "q8_0_tiles.h" /* QK, Q8_0_BLOCK_BYTES */

namespace butter {

namespace {

/* The bit of a field (ggml_abi.h's BUTTER_FIELD_*). */
constexpr int field(int number) { return 1 << number; }

constexpr int FIELD_TYPE = field(BUTTER_FIELD_TYPE), FIELD_NE = field(BUTTER_FIELD_NE),
              FIELD_NB = field(BUTTER_FIELD_NB), FIELD_DATA = field(BUTTER_FIELD_DATA),
              FIELD_NAME = field(BUTTER_FIELD_NAME), FIELD_VIEW = field(BUTTER_FIELD_VIEW),
              FIELD_OP = field(BUTTER_FIELD_OP), FIELD_BUFFER = field(BUTTER_FIELD_BUFFER),
              FIELD_BUFT = field(BUTTER_FIELD_BUFT), FIELD_EXTRA = field(BUTTER_FIELD_EXTRA),
              FIELD_SETUP = field(BUTTER_FIELD_SETUP);

}  // namespace

/* The mirror's figures, for Python to check against the running ggml (ggml_abi.h's
 * BUTTER_MIRROR_* places). */
void mirror_figures(int64_t *out) {
    out[BUTTER_MIRROR_TENSOR_BYTES] = (int64_t)sizeof(tensor);
    out[BUTTER_MIRROR_TYPE_F32] = ggml_mirror::TYPE_F32;
    out[BUTTER_MIRROR_TYPE_F16] = ggml_mirror::TYPE_F16;
    out[BUTTER_MIRROR_TYPE_Q8_0] = ggml_mirror::TYPE_Q8_0;
    out[BUTTER_MIRROR_TYPE_Q6_K] = ggml_mirror::TYPE_Q6_K;
    out[BUTTER_MIRROR_TYPE_Q5_K] = ggml_mirror::TYPE_Q5_K;
    out[BUTTER_MIRROR_TYPE_Q4_K] = ggml_mirror::TYPE_Q4_K;
    out[BUTTER_MIRROR_TYPE_Q4_1] = ggml_mirror::TYPE_Q4_1;
    out[BUTTER_MIRROR_TYPE_Q5_0] = ggml_mirror::TYPE_Q5_0;
    out[BUTTER_MIRROR_OP_MUL_MAT] = ggml_mirror::OP_MUL_MAT;
    out[BUTTER_MIRROR_OP_FLASH_ATTN_EXT] = ggml_mirror::OP_FLASH_ATTN_EXT;
    out[BUTTER_MIRROR_OP_GATED_DELTA_NET] = ggml_mirror::OP_GATED_DELTA_NET;
    out[BUTTER_MIRROR_OP_SSM_CONV] = ggml_mirror::OP_SSM_CONV;
    out[BUTTER_MIRROR_OP_CONCAT] = ggml_mirror::OP_CONCAT;
}

/* Tensors and a buffer made by the running ggml, read through the mirror. */
int mirror_disagreements() {
    int wrong = 0;
    Context host(1 << 20, false);
    if (host.ctx == nullptr) {
        return FIELD_SETUP;
    }
    tensor *w = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_Q8_0, 4 * QK, 3);
    tensor *x = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_F32, 4 * QK, 2);
    if (w == nullptr || x == nullptr) {
        return FIELD_SETUP;
    }
    ggml.set_name(w, "blk.0.mirror_check");
    const size_t row = ggml.row_size(ggml_mirror::TYPE_Q8_0, 4 * QK);
    if (w->type != ggml_mirror::TYPE_Q8_0 || x->type != ggml_mirror::TYPE_F32) {
        wrong |= FIELD_TYPE;
    }
    if (w->ne[0] != 4 * QK || w->ne[1] != 3 || w->ne[2] != 1 || w->ne[3] != 1) {
        wrong |= FIELD_NE;
    }
    if (w->nb[0] != Q8_0_BLOCK_BYTES || w->nb[1] != row || w->nb[2] != 3 * row ||
        x->nb[0] != sizeof(float)) {
        wrong |= FIELD_NB;
    }
    if (w->data == nullptr || w->data != ggml.get_data(w)) {
        wrong |= FIELD_DATA;
    }
    if (strcmp(w->name, "blk.0.mirror_check") != 0) {
        wrong |= FIELD_NAME;
    }
    tensor *view = ggml.view_2d(host.ctx, w, 4 * QK, 2, row, row);
    if (view == nullptr || w->view_src != nullptr || view->view_src != w ||
        view->view_offs != row) {
        wrong |= FIELD_VIEW;
    }
    tensor *y = ggml.mul_mat(host.ctx, w, x);
    if (y == nullptr || y->op != ggml_mirror::OP_MUL_MAT || y->src[0] != w || y->src[1] != x ||
        y->src[2] != nullptr || y->ne[0] != 3 || y->ne[1] != 2) {
        wrong |= FIELD_OP;
    }
    /* a flash attention: its sources and parameters where decode_attention.h reads them */
    tensor *q = ggml.new_tensor_3d(host.ctx, ggml_mirror::TYPE_F32, 64, 3, 4);
    tensor *k = ggml.new_tensor_3d(host.ctx, ggml_mirror::TYPE_F16, 64, 256, 2);
    tensor *mask = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_F16, 256, 3);
    tensor *a = q == nullptr || k == nullptr || mask == nullptr
                    ? nullptr
                    : ggml.flash_attn_ext(host.ctx, q, k, k, mask, 0.125f, 0.5f, 30.0f);
    if (a == nullptr) {
        return wrong | FIELD_SETUP;
    }
    const float *params = (const float *)a->op_params;
    if (a->op != ggml_mirror::OP_FLASH_ATTN_EXT || a->src[0] != q || a->src[1] != k ||
        a->src[2] != k || a->src[3] != mask || a->src[4] != nullptr || params[0] != 0.125f ||
        params[1] != 0.5f || params[2] != 30.0f || a->ne[0] != 64 || a->ne[1] != 4 ||
        a->ne[2] != 3 || a->ne[3] != 1) {
        wrong |= FIELD_OP;
    }
    /* a Gated DeltaNet: its sources and K where delta_net.cpp reads them */
    tensor *dq = ggml.new_tensor_4d(host.ctx, ggml_mirror::TYPE_F32, 64, 2, 3, 1);
    tensor *dg = ggml.new_tensor_4d(host.ctx, ggml_mirror::TYPE_F32, 1, 2, 3, 1);
    tensor *ds = ggml.new_tensor_4d(host.ctx, ggml_mirror::TYPE_F32, 64, 64, 2, 1);
    tensor *dn = dq == nullptr || dg == nullptr || ds == nullptr
                     ? nullptr
                     : ggml.gated_delta_net(host.ctx, dq, dq, dq, dg, dg, ds, 2);
    if (dn == nullptr) {
        return wrong | FIELD_SETUP;
    }
    if (dn->op != ggml_mirror::OP_GATED_DELTA_NET || dn->src[0] != dq || dn->src[1] != dq ||
        dn->src[2] != dq || dn->src[3] != dg || dn->src[4] != dg || dn->src[5] != ds ||
        dn->op_params[0] != 2 || dn->ne[0] != 128 || dn->ne[1] != 3 + 2 * 64 || ds->ne[3] != 1 ||
        ds->nb[3] != (size_t)(64 * 64 * 2) * sizeof(float)) {
        wrong |= FIELD_OP;
    }
    /* a short convolution: its sources where delta_net.cpp reads them */
    tensor *cx = ggml.new_tensor_3d(host.ctx, ggml_mirror::TYPE_F32, 3 + 5, 32, 2);
    tensor *cw = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_F32, 4, 32);
    tensor *conv = cx == nullptr || cw == nullptr ? nullptr : ggml.ssm_conv(host.ctx, cx, cw);
    if (conv == nullptr) {
        return wrong | FIELD_SETUP;
    }
    if (conv->op != ggml_mirror::OP_SSM_CONV || conv->src[0] != cx || conv->src[1] != cw ||
        conv->ne[0] != 32 || conv->ne[1] != 5 || conv->ne[2] != 2 || cx->nb[1] != 8 * sizeof(float) ||
        conv->nb[1] != 32 * sizeof(float)) {
        wrong |= FIELD_OP;
    }
    /* a concatenation of a transposed view, as before a short convolution */
    tensor *steps = ggml.new_tensor_2d(host.ctx, ggml_mirror::TYPE_F32, 32, 5);
    tensor *flipped = steps == nullptr ? nullptr : ggml.transpose(host.ctx, steps);
    tensor *joined = flipped == nullptr ? nullptr
                                        : ggml.concat(host.ctx, ggml.new_tensor_2d(host.ctx,
                                                          ggml_mirror::TYPE_F32, 3, 32),
                                                      flipped, 0);
    if (joined == nullptr) {
        return wrong | FIELD_SETUP;
    }
    if (joined->op != ggml_mirror::OP_CONCAT || joined->src[1] != flipped ||
        joined->op_params[0] != 0 || joined->ne[0] != 8 || joined->ne[1] != 32 ||
        flipped->ne[0] != 5 || flipped->nb[0] != 32 * sizeof(float) ||
        flipped->nb[1] != sizeof(float) || flipped->data != steps->data) {
        wrong |= FIELD_OP | FIELD_VIEW;
    }
    if (k->type != ggml_mirror::TYPE_F16 || k->nb[0] != 2 || k->nb[1] != 128) {
        wrong |= FIELD_TYPE | FIELD_NB;
    }
    if (w->buffer != nullptr || w->extra != nullptr) {
        wrong |= FIELD_BUFFER | FIELD_EXTRA;
    }
    Context placed(1 << 16, true);
    if (placed.ctx == nullptr) {
        return wrong | FIELD_SETUP;
    }
    tensor *t = ggml.new_tensor_2d(placed.ctx, ggml_mirror::TYPE_F32, 64, 4);
    backend_buffer_type *cpu = ggml.cpu_buffer_type();
    Buffer buffer(t == nullptr ? nullptr : ggml.alloc_ctx_tensors_from_buft(placed.ctx, cpu));
    if (buffer.buffer == nullptr) {
        return wrong | FIELD_SETUP;
    }
    backend_buffer *b = buffer.buffer;
    if (t->buffer != b || b->buft != cpu || b->size != ggml.buffer_get_size(b) ||
        b->iface.get_base == nullptr || b->iface.get_base(b) != ggml.buffer_get_base(b) ||
        t->data != ggml.buffer_get_base(b)) {
        wrong |= FIELD_BUFFER;
    }
    if (strcmp(cpu->iface.get_name(cpu), "CPU") != 0 || cpu->device != ggml.buft_get_device(cpu)) {
        wrong |= FIELD_BUFT;
    }
    if (t->extra != nullptr) {
        wrong |= FIELD_EXTRA;
    }
    return wrong;
}

}  // namespace butter
