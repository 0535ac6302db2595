/*
 * The mirror (ggml_mirror.h) against ggml's own headers, where the build has them
 * (BUTTER_GGML_SOURCE: setup.py passes -DBUTTER_HAVE_GGML_HEADERS and their folders): every
 * number, size and offset the library relies on is a static_assert, so a mirror that is not
 * that ggml's fails the build instead of crashing llama.cpp. What C++ cannot compare at
 * compile time, the vtable slot of each virtual function the CPU backend calls, is compared
 * here when Python asks (butter_layer_matmul_header_check).
 *
 * Without the headers this file only says so: the checks at load (mirror.cpp, and the
 * ggml commit and version in Python) still run.
 */
#include "layer_matmul.h"

#ifdef BUTTER_HAVE_GGML_HEADERS

#include <cstring>
#include <type_traits>

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h" /* the blocks the tile layouts read */
#include "ggml.h"
#include "ggml-backend-impl.h"
#include "ggml-cpu-impl.h"
#include "traits.h" /* ggml-cpu/traits.h */

#include "q4_1_q5_0_tiles.h"
#include "q4_k_q5_k_tiles.h"

namespace {

namespace m = ggml_mirror;

/* A field of ggml's struct and the mirror's: at the same offset, of the same size. */
#define SAME_FIELD(real, mirrored, field)                                                     \
    static_assert(offsetof(real, field) == offsetof(mirrored, field) &&                      \
                      sizeof(((real *)nullptr)->field) == sizeof(((mirrored *)nullptr)->field), \
                  #real "." #field " is not where the mirror has it")
#define SAME_SIZE(real, mirrored)                                                             \
    static_assert(sizeof(real) == sizeof(mirrored) && alignof(real) == alignof(mirrored),    \
                  #real " is not the mirror's size")

/* ggml.h: limits, type and op numbers */
static_assert(GGML_MAX_DIMS == m::MAX_DIMS && GGML_MAX_OP_PARAMS == m::MAX_OP_PARAMS &&
                  GGML_MAX_SRC == m::MAX_SRC && GGML_MAX_NAME == m::MAX_NAME,
              "ggml's tensor limits");
static_assert(GGML_TYPE_F32 == m::TYPE_F32 && GGML_TYPE_F16 == m::TYPE_F16 &&
                  GGML_TYPE_Q8_0 == m::TYPE_Q8_0 && GGML_TYPE_Q6_K == m::TYPE_Q6_K &&
                  GGML_TYPE_Q5_K == m::TYPE_Q5_K && GGML_TYPE_Q4_K == m::TYPE_Q4_K &&
                  GGML_TYPE_Q4_1 == m::TYPE_Q4_1 && GGML_TYPE_Q5_0 == m::TYPE_Q5_0,
              "ggml's type numbers");
static_assert(GGML_OP_MUL_MAT == m::OP_MUL_MAT && GGML_OP_FLASH_ATTN_EXT == m::OP_FLASH_ATTN_EXT &&
                  GGML_OP_GATED_DELTA_NET == m::OP_GATED_DELTA_NET &&
                  GGML_OP_SSM_CONV == m::OP_SSM_CONV && GGML_OP_CONCAT == m::OP_CONCAT,
              "ggml's op numbers");
static_assert(GGML_STATUS_SUCCESS == m::STATUS_SUCCESS, "ggml's success status");
static_assert(sizeof(enum ggml_type) == sizeof(int) && sizeof(enum ggml_op) == sizeof(int) &&
                  sizeof(enum ggml_status) == sizeof(int),
              "ggml's enums are ints in the mirror");

/* ggml.h: the tensor, every field */
SAME_SIZE(ggml_tensor, m::tensor);
SAME_FIELD(ggml_tensor, m::tensor, type);
SAME_FIELD(ggml_tensor, m::tensor, buffer);
SAME_FIELD(ggml_tensor, m::tensor, ne);
SAME_FIELD(ggml_tensor, m::tensor, nb);
SAME_FIELD(ggml_tensor, m::tensor, op);
SAME_FIELD(ggml_tensor, m::tensor, op_params);
SAME_FIELD(ggml_tensor, m::tensor, flags);
SAME_FIELD(ggml_tensor, m::tensor, src);
SAME_FIELD(ggml_tensor, m::tensor, view_src);
SAME_FIELD(ggml_tensor, m::tensor, view_offs);
SAME_FIELD(ggml_tensor, m::tensor, data);
SAME_FIELD(ggml_tensor, m::tensor, name);
SAME_FIELD(ggml_tensor, m::tensor, extra);

SAME_SIZE(ggml_init_params, m::init_params);
SAME_FIELD(ggml_init_params, m::init_params, mem_size);
SAME_FIELD(ggml_init_params, m::init_params, mem_buffer);
SAME_FIELD(ggml_init_params, m::init_params, no_alloc);

/* ggml-backend-impl.h: buffer types and buffers, every slot */
SAME_SIZE(ggml_backend_buffer_type_i, m::backend_buffer_type_i);
SAME_FIELD(ggml_backend_buffer_type_i, m::backend_buffer_type_i, get_name);
SAME_FIELD(ggml_backend_buffer_type_i, m::backend_buffer_type_i, alloc_buffer);
SAME_FIELD(ggml_backend_buffer_type_i, m::backend_buffer_type_i, get_alignment);
SAME_FIELD(ggml_backend_buffer_type_i, m::backend_buffer_type_i, get_max_size);
SAME_FIELD(ggml_backend_buffer_type_i, m::backend_buffer_type_i, get_alloc_size);
SAME_FIELD(ggml_backend_buffer_type_i, m::backend_buffer_type_i, is_host);
SAME_SIZE(ggml_backend_buffer_type, m::backend_buffer_type);
SAME_FIELD(ggml_backend_buffer_type, m::backend_buffer_type, iface);
SAME_FIELD(ggml_backend_buffer_type, m::backend_buffer_type, device);
SAME_FIELD(ggml_backend_buffer_type, m::backend_buffer_type, context);

SAME_SIZE(ggml_backend_buffer_i, m::backend_buffer_i);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, free_buffer);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, get_base);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, init_tensor);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, memset_tensor);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, set_tensor);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, get_tensor);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, set_tensor_2d);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, get_tensor_2d);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, cpy_tensor);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, clear);
SAME_FIELD(ggml_backend_buffer_i, m::backend_buffer_i, reset);
SAME_SIZE(ggml_backend_buffer, m::backend_buffer);
SAME_FIELD(ggml_backend_buffer, m::backend_buffer, iface);
SAME_FIELD(ggml_backend_buffer, m::backend_buffer, buft);
SAME_FIELD(ggml_backend_buffer, m::backend_buffer, context);
SAME_FIELD(ggml_backend_buffer, m::backend_buffer, size);
SAME_FIELD(ggml_backend_buffer, m::backend_buffer, usage);

/* ggml-cpu-impl.h: what a CPU op's threads are handed */
SAME_SIZE(ggml_compute_params, m::compute_params);
SAME_FIELD(ggml_compute_params, m::compute_params, ith);
SAME_FIELD(ggml_compute_params, m::compute_params, nth);
SAME_FIELD(ggml_compute_params, m::compute_params, wsize);
SAME_FIELD(ggml_compute_params, m::compute_params, wdata);
SAME_FIELD(ggml_compute_params, m::compute_params, threadpool);
SAME_FIELD(ggml_compute_params, m::compute_params, use_ref);

/* ggml-cpu/traits.h: two classes of virtual functions only (a vtable pointer each) */
SAME_SIZE(ggml::cpu::tensor_traits, m::tensor_traits);
SAME_SIZE(ggml::cpu::extra_buffer_type, m::extra_buffer_type);
static_assert(std::has_virtual_destructor<ggml::cpu::tensor_traits>::value &&
                  std::has_virtual_destructor<ggml::cpu::extra_buffer_type>::value,
              "ggml's interfaces start with a virtual destructor, as the mirror's");

/* ggml-common.h: the blocks the tile layouts read from a GGUF, and the Q8_K rows ggml's
 * quantize_row_q8_K writes for the K-quant kernels */
static_assert(QK8_0 == QK && sizeof(block_q8_0) == Q8_0_BLOCK_BYTES, "block_q8_0");
static_assert(QK4_1 == QK && sizeof(block_q4_1) == Q4_1_BLOCK_BYTES, "block_q4_1");
static_assert(QK5_0 == QK && sizeof(block_q5_0) == Q5_0_BLOCK_BYTES, "block_q5_0");
static_assert(sizeof(block_q6_K) == Q6_K_BLOCK_BYTES, "block_q6_K");
static_assert(sizeof(block_q5_K) == QK45<5>::BLOCK_BYTES, "block_q5_K");
static_assert(sizeof(block_q4_K) == QK45<4>::BLOCK_BYTES, "block_q4_K");
static_assert(sizeof(block_q8_K) == Q8_K_BLOCK_BYTES, "block_q8_K");

/* A virtual function's vtable slot, from its pointer to member: the Itanium C++ ABI (GCC,
 * Clang) stores 1 + the slot's byte offset in its first word. Taking it links nothing. */
template <class Member> uintptr_t vtable_slot(Member member) {
    static_assert(sizeof(Member) == 2 * sizeof(uintptr_t), "an Itanium pointer to member");
    uintptr_t words[2];
    memcpy(words, &member, sizeof words);
    return words[0];
}

bool vtables_agree() {
    return vtable_slot(&ggml::cpu::tensor_traits::work_size) ==
               vtable_slot(&m::tensor_traits::work_size) &&
           vtable_slot(&ggml::cpu::tensor_traits::compute_forward) ==
               vtable_slot(&m::tensor_traits::compute_forward) &&
           vtable_slot(&ggml::cpu::extra_buffer_type::supports_op) ==
               vtable_slot(&m::extra_buffer_type::supports_op) &&
           vtable_slot(&ggml::cpu::extra_buffer_type::get_tensor_traits) ==
               vtable_slot(&m::extra_buffer_type::get_tensor_traits);
}

}  // namespace

int butter::header_check() { return vtables_agree() ? BUTTER_HEADERS_AGREE : BUTTER_HEADERS_DISAGREE; }

#else

int butter::header_check() { return BUTTER_HEADERS_ABSENT; }

#endif /* BUTTER_HAVE_GGML_HEADERS */
