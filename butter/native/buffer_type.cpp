/*
 * The buffer type butter adds to llama.cpp's CPU backend, the way llama.cpp's own repacked
 * kernels plug in. The CPU backend keeps a list of "extra" buffer types; when it loads a
 * model, it offers each weight to them in order, and the first whose `supports_op` accepts
 * the weight's op gets to store it, in its own layout (`set_tensor`). When the graph runs,
 * the CPU backend asks the extra buffer types first for every node (`get_tensor_traits`),
 * and a matmul whose weight lives here runs here (matmul.cpp), as does a flash attention
 * butter takes (attention.cpp).
 *
 * This buffer type accepts exactly one thing: a layer's plain 2-D weight of one of
 * butter's types multiplied by f32 activations. Everything else (other types, other ops,
 * anything llama.cpp's repacking takes first) stays with llama.cpp. It goes first in the
 * list: Q4_K, which llama.cpp's x86 code does repack, is taken here first (llama.cpp's
 * interleaved kernel multiplies rows four at a time from four rows on, rounding otherwise
 * than one by one, and its cost grows with every row).
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "layer_matmul.h"

namespace butter {

namespace {

/* A layer's weight ("blk.N..."). The output matrix is left in llama.cpp's buffer, which maps
 * the file: butter's output projection (lmhead.c) computes the logits from its own copy,
 * and a second packed copy here would cost its size in memory for a path rarely taken. */
bool is_layer_weight(const tensor *w) { return strncmp(w->name, "blk.", 4) == 0; }

class TileBufferType : public ggml_mirror::extra_buffer_type {
    /* Asked at load (the weight has no data yet: may it live here?) and when the graph is
     * scheduled (it lives here: can this op run on it?). */
    bool supports_op(void *dev, const tensor *op) override {
        (void)dev;
        const tensor *w = op->src[0];
        const tensor *x = op->src[1];
        if (op->op != ggml_mirror::OP_MUL_MAT || !is_supported_weight(w) || x == nullptr ||
            x->type != ggml_mirror::TYPE_F32) {
            return false;
        }
        if (x->buffer != nullptr && !ggml.buft_is_host(x->buffer->buft)) {
            return false;
        }
        if (w->data != nullptr) {
            return true; /* stored here already: nothing else can compute with it */
        }
        return accepting.load() && is_layer_weight(w) && (enabled_types.load() & type_bit(w->type));
    }

    /* Asked for every op the CPU backend plans or computes, whatever holds its tensors. */
    ggml_mirror::tensor_traits *get_tensor_traits(const tensor *op) override {
        const tensor *w = op->src[0];
        if (op->op == ggml_mirror::OP_MUL_MAT && w != nullptr && w->buffer != nullptr &&
            w->buffer->buft == buffer_type()) {
            return (ggml_mirror::tensor_traits *)w->extra;
        }
        if (op->op == ggml_mirror::OP_GATED_DELTA_NET) {
            return delta_net_path(op);
        }
        if (op->op == ggml_mirror::OP_SSM_CONV) {
            return short_conv_path(op);
        }
        if (op->op == ggml_mirror::OP_CONCAT) {
            return concat_path(op);
        }
        return attention_path(op);
    }
};

void fail(const char *what) {
    /* ggml's own answer to a broken invariant (GGML_ABORT): a weight that cannot be stored
     * would compute garbage. */
    fprintf(stderr, "butter layer matmul: %s\n", what);
    abort();
}

int init_tensor(backend_buffer *buffer, tensor *t) {
    (void)buffer;
    t->extra = matmul_traits();
    return ggml_mirror::STATUS_SUCCESS;
}

void set_tensor(backend_buffer *buffer, tensor *t, const void *data, size_t offset,
                size_t size) {
    (void)buffer;
    if (!is_supported_weight(t)) {
        fail("a tensor that is not a plain 2-D matrix of a type butter multiplies was stored");
    }
    if (offset != 0 || size != ggml.nbytes(t)) {
        fail("a weight was stored in parts");
    }
    std::atomic<int64_t> *stored = pack_weight(t, data);
    if (!probing.load()) {
        stored->fetch_add(1, std::memory_order_relaxed);
        packed_bytes.fetch_add((int64_t)tiled_bytes(t), std::memory_order_relaxed);
    }
}

const char *get_name(backend_buffer_type *buft) {
    (void)buft;
    return "BUTTER_TILES";
}

backend_buffer *alloc_buffer(backend_buffer_type *buft, size_t size) {
    backend_buffer *buffer = ggml.buft_alloc_buffer(ggml.cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
    /* A CPU buffer whose tensors are stored in the tile layout: nothing may read or copy
     * them as ggml tensors. */
    buffer->buft = buft;
    buffer->iface.init_tensor = init_tensor;
    buffer->iface.set_tensor = set_tensor;
    buffer->iface.memset_tensor = nullptr;
    buffer->iface.get_tensor = nullptr;
    buffer->iface.set_tensor_2d = nullptr;
    buffer->iface.get_tensor_2d = nullptr;
    buffer->iface.cpy_tensor = nullptr;
    return buffer;
}

size_t get_alignment(backend_buffer_type *buft) {
    (void)buft;
    return ALIGN;
}

size_t get_alloc_size(backend_buffer_type *buft, const tensor *t) {
    (void)buft;
    return is_supported_weight(t) ? tiled_bytes(t) : ggml.nbytes(t);
}

TileBufferType tile_buffer_type_context;

backend_buffer_type tile_buffer_type = {
    {get_name, alloc_buffer, get_alignment, nullptr, get_alloc_size, nullptr},
    nullptr, /* the CPU device, set at registration */
    &tile_buffer_type_context,
};

}  // namespace

backend_buffer_type *buffer_type() { return &tile_buffer_type; }

/* First in the CPU backend's list: the types enabled here are the ones butter's table gives
 * butter (Q4_K before llama.cpp's repacking takes it); anything else falls through. */
void register_buffer_type(void *cpu_device) {
    tile_buffer_type.device = cpu_device;
    auto &listed = ggml.extra_buffer_types();
    listed.insert(listed.begin(), &tile_buffer_type);
}

/* Takes the buffer type called `name` out of `types`; whether there was one. */
bool drop_buffer_type(std::vector<backend_buffer_type *> &types, const char *name) {
    for (auto it = types.begin(); it != types.end(); ++it) {
        backend_buffer_type *type = *it;
        if (type != nullptr && strcmp(type->iface.get_name(type), name) == 0) {
            types.erase(it);
            return true;
        }
    }
    return false;
}

}  // namespace butter
