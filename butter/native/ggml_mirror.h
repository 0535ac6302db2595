/*
 * The few ggml structures, numbers and functions butter's layer library touches, mirrored
 * from the ggml that llama-cpp-python 0.3.36 vendors (ggml_abi.h names the commit), so
 * that the library builds without ggml's headers.
 *
 * A mirror can silently be wrong, so it is checked three times:
 * - at build, where ggml's own headers are given (BUTTER_GGML_SOURCE: setup.py), every
 *   size, offset and number below by static_assert (ggml_mirror_check.cpp);
 * - at load, before anything inside llama.cpp is touched, the running ggml's commit and
 *   version (Python: layer_matmul.py), then its names of the type and op numbers and its
 *   tensor size (butter_layer_matmul_mirror);
 * - then every field the library reads or writes, read through the mirror from tensors and
 *   a buffer the running ggml made (mirror.cpp).
 * Any mismatch and nothing is registered; llama.cpp computes as before.
 */
#ifndef BUTTER_GGML_MIRROR_H
#define BUTTER_GGML_MIRROR_H

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ggml_mirror {

/* ggml.h */
constexpr int MAX_DIMS = 4;
constexpr int MAX_OP_PARAMS = 64;
constexpr int MAX_SRC = 10;
constexpr int MAX_NAME = 64;
constexpr int TYPE_F32 = 0;
constexpr int TYPE_F16 = 1;
constexpr int TYPE_Q8_0 = 8;
constexpr int TYPE_Q5_K = 13;
constexpr int TYPE_Q4_K = 12;
constexpr int TYPE_Q4_1 = 3;
constexpr int TYPE_Q5_0 = 6;
constexpr int TYPE_Q6_K = 14;
constexpr int OP_MUL_MAT = 29;
constexpr int OP_FLASH_ATTN_EXT = 74;
constexpr int OP_GATED_DELTA_NET = 86;
constexpr int OP_SSM_CONV = 76;
constexpr int OP_CONCAT = 22;
constexpr int STATUS_SUCCESS = 0;

struct backend_buffer;
struct backend_buffer_type;

struct tensor {
    int type;
    backend_buffer *buffer;
    int64_t ne[MAX_DIMS];
    size_t nb[MAX_DIMS];
    int op;
    int32_t op_params[MAX_OP_PARAMS / sizeof(int32_t)];
    int32_t flags;
    tensor *src[MAX_SRC];
    tensor *view_src;
    size_t view_offs;
    void *data;
    char name[MAX_NAME];
    void *extra;
    char padding[8];
};

struct init_params {
    size_t mem_size;
    void *mem_buffer;
    bool no_alloc;
};

/* ggml-backend-impl.h */
struct backend_buffer_type_i {
    const char *(*get_name)(backend_buffer_type *buft);
    backend_buffer *(*alloc_buffer)(backend_buffer_type *buft, size_t size);
    size_t (*get_alignment)(backend_buffer_type *buft);
    size_t (*get_max_size)(backend_buffer_type *buft);
    size_t (*get_alloc_size)(backend_buffer_type *buft, const tensor *t);
    bool (*is_host)(backend_buffer_type *buft);
};

struct backend_buffer_type {
    backend_buffer_type_i iface;
    void *device;
    void *context;
};

struct backend_buffer_i {
    void (*free_buffer)(backend_buffer *buffer);
    void *(*get_base)(backend_buffer *buffer);
    int (*init_tensor)(backend_buffer *buffer, tensor *t);
    void (*memset_tensor)(backend_buffer *buffer, tensor *t, uint8_t value, size_t offset,
                          size_t size);
    void (*set_tensor)(backend_buffer *buffer, tensor *t, const void *data, size_t offset,
                       size_t size);
    void (*get_tensor)(backend_buffer *buffer, const tensor *t, void *data, size_t offset,
                       size_t size);
    void (*set_tensor_2d)(backend_buffer *buffer, tensor *t, const void *data, size_t offset,
                          size_t size, size_t n_copies, size_t stride_tensor,
                          size_t stride_data);
    void (*get_tensor_2d)(backend_buffer *buffer, const tensor *t, void *data, size_t offset,
                          size_t size, size_t n_copies, size_t stride_tensor,
                          size_t stride_data);
    bool (*cpy_tensor)(backend_buffer *buffer, const tensor *src, tensor *dst);
    void (*clear)(backend_buffer *buffer, uint8_t value);
    void (*reset)(backend_buffer *buffer);
};

struct backend_buffer {
    backend_buffer_i iface;
    backend_buffer_type *buft;
    void *context;
    size_t size;
    int usage;
};

/* ggml-cpu-impl.h */
struct compute_params {
    int ith, nth;
    size_t wsize;
    void *wdata;
    void *threadpool;
    bool use_ref;
};

/* ggml-cpu/traits.h: the two interfaces the CPU backend calls through (same virtual
 * functions in the same order, so the same vtable layout). */
class tensor_traits {
  public:
    virtual ~tensor_traits() {}
    virtual bool work_size(int n_threads, const tensor *op, size_t &size) = 0;
    virtual bool compute_forward(compute_params *params, tensor *op) = 0;
};

class extra_buffer_type {
  public:
    virtual ~extra_buffer_type() {}
    virtual bool supports_op(void *dev, const tensor *op) = 0;
    virtual tensor_traits *get_tensor_traits(const tensor *op) = 0;
};

/* ggml's functions, from llama_cpp's libraries (butter_layer_matmul_bind), in the order of
 * FUNCTION_NAMES. */
#define FUNCTION_NAMES                                                                      \
    "_Z39ggml_backend_cpu_get_extra_buffer_typesv,ggml_backend_cpu_buffer_type,"            \
    "ggml_backend_buft_alloc_buffer,ggml_backend_buft_is_host,ggml_barrier,ggml_nbytes,"    \
    "quantize_row_q8_K,ggml_init,ggml_free,ggml_new_tensor_2d,ggml_set_name,ggml_view_2d,"  \
    "ggml_mul_mat,ggml_new_graph,ggml_build_forward_expand,ggml_graph_compute_with_ctx,"    \
    "ggml_get_data,ggml_row_size,ggml_quantize_chunk,"                                      \
    "ggml_backend_alloc_ctx_tensors_from_buft,ggml_backend_tensor_set,"                     \
    "ggml_backend_buffer_free,ggml_backend_buffer_get_base,ggml_backend_buffer_get_size,"   \
    "ggml_backend_buft_get_device,ggml_new_tensor_3d,ggml_flash_attn_ext,"                  \
    "ggml_fp32_to_fp16_row,ggml_new_tensor_4d,ggml_gated_delta_net,ggml_ssm_conv,"         \
    "ggml_concat,ggml_transpose"
constexpr size_t FUNCTION_COUNT = 33;

struct Functions {
    std::vector<backend_buffer_type *> &(*extra_buffer_types)();
    backend_buffer_type *(*cpu_buffer_type)();
    backend_buffer *(*buft_alloc_buffer)(backend_buffer_type *buft, size_t size);
    bool (*buft_is_host)(backend_buffer_type *buft);
    void (*barrier)(void *threadpool);
    size_t (*nbytes)(const tensor *t);
    void (*quantize_row_q8_k)(const float *x, void *y, int64_t k);
    /* for the mirror check and the self-check */
    void *(*init)(init_params params);
    void (*free)(void *ctx);
    tensor *(*new_tensor_2d)(void *ctx, int type, int64_t ne0, int64_t ne1);
    tensor *(*set_name)(tensor *t, const char *name);
    tensor *(*view_2d)(void *ctx, tensor *a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset);
    tensor *(*mul_mat)(void *ctx, tensor *a, tensor *b);
    void *(*new_graph)(void *ctx);
    void (*build_forward_expand)(void *graph, tensor *t);
    int (*graph_compute_with_ctx)(void *ctx, void *graph, int n_threads);
    void *(*get_data)(const tensor *t);
    size_t (*row_size)(int type, int64_t ne);
    size_t (*quantize_chunk)(int type, const float *src, void *dst, int64_t start, int64_t nrows,
                             int64_t n_per_row, const float *imatrix);
    backend_buffer *(*alloc_ctx_tensors_from_buft)(void *ctx, backend_buffer_type *buft);
    void (*tensor_set)(tensor *t, const void *data, size_t offset, size_t size);
    void (*buffer_free)(backend_buffer *buffer);
    void *(*buffer_get_base)(backend_buffer *buffer);
    size_t (*buffer_get_size)(backend_buffer *buffer);
    void *(*buft_get_device)(backend_buffer_type *buft);
    /* for the attention probe */
    tensor *(*new_tensor_3d)(void *ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2);
    tensor *(*flash_attn_ext)(void *ctx, tensor *q, tensor *k, tensor *v, tensor *mask,
                              float scale, float max_bias, float logit_softcap);
    void (*fp32_to_fp16_row)(const float *x, uint16_t *y, int64_t n);
    /* for the Gated DeltaNet probe */
    tensor *(*new_tensor_4d)(void *ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2,
                             int64_t ne3);
    tensor *(*gated_delta_net)(void *ctx, tensor *q, tensor *k, tensor *v, tensor *g,
                               tensor *beta, tensor *state, int64_t snapshots);
    /* for the short convolution probe */
    tensor *(*ssm_conv)(void *ctx, tensor *x, tensor *w);
    tensor *(*concat)(void *ctx, tensor *a, tensor *b, int dim);
    tensor *(*transpose)(void *ctx, tensor *a);
};
static_assert(sizeof(Functions) == FUNCTION_COUNT * sizeof(void *), "one pointer per name");

}  // namespace ggml_mirror

#endif /* BUTTER_GGML_MIRROR_H */
