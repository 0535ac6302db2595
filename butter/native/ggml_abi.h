/*
 * What butter's layer library (layer_matmul.cpp and its parts) and its Python side
 * (butter/backends/llama_cpp/layer_matmul.py) agree on, and which ggml the library was
 * written against: one list for both languages.
 *
 * Python reads it as butter/backends/llama_cpp/ggml_abi.py, generated from this file by
 * `.ci/ggml-abi` (tests/test_ggml_abi.py fails where that module is stale, and checks that
 * the built library reports these numbers). Only lines `#define BUTTER_<NAME> <value>` are
 * read, and a value is a decimal integer, a negative one in parentheses, or a string; say
 * what a value means in a comment on the lines above it.
 *
 * Change an exported signature, a status code, the counters or the mirror's figures and
 * bump BUTTER_LAYER_MATMUL_ABI_VERSION (Python refuses a library of another version).
 */
#ifndef BUTTER_GGML_ABI_H
#define BUTTER_GGML_ABI_H

#define BUTTER_LAYER_MATMUL_ABI_VERSION 14

/* The ggml the mirror (ggml_mirror.h) was copied from: the llama.cpp commit that
 * llama-cpp-python 0.3.36 vendors (its submodule vendor/llama.cpp), ggml's version there,
 * and that llama-cpp-python release (pyproject.toml pins it). Python compares the running
 * ggml's ggml_commit() and ggml_version() with these before it touches anything inside
 * llama.cpp; on another ggml butter's layer kernels and attention stay off. */
#define BUTTER_GGML_COMMIT "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
#define BUTTER_GGML_VERSION "0.25.3"
#define BUTTER_LLAMA_CPP_PYTHON_VERSION "0.3.36"

/* Status codes of the exported functions. */
#define BUTTER_OK 0
/* no kernel for this CPU (nothing registered), or no buffer type of that name */
#define BUTTER_DECLINED 1
/* a pointer is null, or a count or size out of range */
#define BUTTER_E_ARGUMENT (-2)
/* registered already, or not bound or registered yet; or ggml failed the probe */
#define BUTTER_E_STATE (-3)

/* Instruction sets of the kernels (butter_layer_matmul_best_isa, _register). */
#define BUTTER_ISA_NONE 0
#define BUTTER_ISA_AVX2 1
#define BUTTER_ISA_AVX512_VNNI 2

/* Weight types, as bits of the masks of _register and _enable_types. */
#define BUTTER_TYPE_BIT_Q8_0 1
#define BUTTER_TYPE_BIT_Q6_K 2
#define BUTTER_TYPE_BIT_Q5_K 4
#define BUTTER_TYPE_BIT_Q4_1 8
#define BUTTER_TYPE_BIT_Q5_0 16
#define BUTTER_TYPE_BIT_Q4_K 32

/* butter_layer_matmul_counters: how many, and each one's place. */
#define BUTTER_COUNTERS 13
#define BUTTER_COUNTER_Q8_0_MATRICES 0
#define BUTTER_COUNTER_Q6_K_MATRICES 1
#define BUTTER_COUNTER_Q5_K_MATRICES 2
#define BUTTER_COUNTER_PACKED_BYTES 3
#define BUTTER_COUNTER_MATMULS 4
#define BUTTER_COUNTER_ROWS 5
#define BUTTER_COUNTER_Q4_1_MATRICES 6
#define BUTTER_COUNTER_Q5_0_MATRICES 7
#define BUTTER_COUNTER_Q4_K_MATRICES 8
#define BUTTER_COUNTER_ATTENTIONS 9
#define BUTTER_COUNTER_ATTENTION_ROWS 10
/* Gated DeltaNet ops (delta_net.cpp) */
#define BUTTER_COUNTER_DELTA_NETS 11
/* short convolutions (SSM_CONV ops, delta_net.cpp) */
#define BUTTER_COUNTER_SHORT_CONVS 12

/* butter_layer_matmul_mirror: the mirror's figures that Python checks against the running
 * ggml (its tensor size, its names of the type and op numbers), and each one's place. */
#define BUTTER_MIRRORED 14
#define BUTTER_MIRROR_TENSOR_BYTES 0
#define BUTTER_MIRROR_TYPE_F32 1
#define BUTTER_MIRROR_TYPE_Q8_0 2
#define BUTTER_MIRROR_TYPE_Q6_K 3
#define BUTTER_MIRROR_TYPE_Q5_K 4
#define BUTTER_MIRROR_OP_MUL_MAT 5
#define BUTTER_MIRROR_TYPE_Q4_1 6
#define BUTTER_MIRROR_TYPE_Q5_0 7
#define BUTTER_MIRROR_TYPE_Q4_K 8
#define BUTTER_MIRROR_OP_FLASH_ATTN_EXT 9
#define BUTTER_MIRROR_TYPE_F16 10
#define BUTTER_MIRROR_OP_GATED_DELTA_NET 11
#define BUTTER_MIRROR_OP_SSM_CONV 12
#define BUTTER_MIRROR_OP_CONCAT 13

/* butter_layer_matmul_check_mirror: the bit (1 << n) of each field of tensors and buffers
 * the running ggml made that reads otherwise through the mirror. */
#define BUTTER_FIELD_TYPE 0
#define BUTTER_FIELD_NE 1
#define BUTTER_FIELD_NB 2
#define BUTTER_FIELD_DATA 3
#define BUTTER_FIELD_NAME 4
/* view_src, view_offs */
#define BUTTER_FIELD_VIEW 5
/* op, op_params, src */
#define BUTTER_FIELD_OP 6
/* tensor.buffer, and the buffer's buft, size and get_base */
#define BUTTER_FIELD_BUFFER 7
/* the buffer type's get_name and device */
#define BUTTER_FIELD_BUFT 8
#define BUTTER_FIELD_EXTRA 9
/* ggml could not make the probe tensors */
#define BUTTER_FIELD_SETUP 10

/* butter_layer_matmul_header_check: whether the library was compiled against ggml's own
 * headers (BUTTER_GGML_SOURCE at build: then the mirror's sizes and offsets were checked
 * by static_assert), and whether the virtual functions the CPU backend calls sit in the
 * vtable slots ggml's classes give them. */
#define BUTTER_HEADERS_ABSENT 0
#define BUTTER_HEADERS_AGREE 1
#define BUTTER_HEADERS_DISAGREE 2

#endif /* BUTTER_GGML_ABI_H */
