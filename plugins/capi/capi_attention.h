/* pagedkv C API: paged attention (plugins/include/pagedkv/attention.h) for ctypes callers.
 * `src/pagedkv/kernels/attention.py` mirrors these structs field by field; struct_size (first) guards the ABI.
 *
 *   T tokens, B sequences, H query heads, KVH KV heads, D head_dim, MB block-table width
 */
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "pagedkv_capi.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct PagedKVAttentionArgs {
    int32_t struct_size;      /* sizeof(PagedKVAttentionArgs) */
    /* ---- shapes */
    int32_t num_q_heads;      /* H */
    int32_t num_kv_heads;     /* KVH */
    int32_t head_dim;         /* D in {64, 128, 256} */
    int32_t io_dtype;         /* 0 fp16, 1 bf16: out, and q unless q_fp8 */
    int32_t q_fp8;            /* 1: q holds fp8 e4m3 values, x = q * q_scale */
    float q_scale;
    /* ---- step metadata (device pointers; step_metadata.h) */
    int32_t num_tokens;       /* T */
    int32_t num_seqs;         /* B */
    int32_t max_blocks;       /* MB */
    int32_t pool_index;       /* row of pool_descs */
    int32_t max_q_len;        /* bound on any sequence's new tokens, in [1, T] */
    int32_t max_kv_len;       /* bound on any sequence's kv length (only sizes the split) */
    int32_t reserved0;
    const int64_t* pool_descs; /* [num_pools, 4] */
    const int32_t* block_table; /* [B, MB] */
    const int32_t* cu_q_lens;   /* [B + 1] */
    const int32_t* past_lens;   /* [B] */
    const void* q;              /* [T, H * D] */
    /* ---- pool geometry (makeKVLayout arguments) and quantization */
    int32_t num_layers;
    int32_t page_size;
    int32_t page_layout;      /* 0 HND, 1 NHD */
    int32_t ring_sink_tokens; /* sinks kept by a cyclic cache (KVLayout::sinkTokens) */
    int32_t cyclic_len;       /* 0: linear cache */
    int32_t layer;
    int32_t cache_dtype;      /* 0 fp16, 1 bf16, 2 fp8 e4m3, 3 int8 */
    float k_scale;
    float v_scale;
    /* ---- attention */
    int32_t window;           /* <= 0: full causal */
    int32_t attention_sinks;  /* always-visible first positions (with window > 0) */
    float softmax_scale;      /* 0: 1/sqrt(D) */
    float logit_softcap;      /* > 0: cap * tanh(logit / cap) */
    int32_t reserved1;
    /* ---- outputs */
    void* out;                /* [T, H * D] */
    void* workspace;          /* pagedkv_attention_workspace_bytes(...) bytes, or NULL when that is 0 */
    int64_t workspace_bytes;
} PagedKVAttentionArgs;

/* ABI check for bindings: writes the byte offset of each PagedKVAttentionArgs field, in declaration order, into
 * offsets[0..n) and returns the number of fields (or -1 when n is too small). */
PAGEDKV_EXPORT int32_t pagedkv_attention_args_layout(int64_t* offsets, int32_t n);

/* Validates (errors name the field and the value; no CUDA call before that), plans and launches on `stream`.
 * Never synchronizes. 0 or a cudaError_t value; pagedkv_last_error() gives the reason. */
PAGEDKV_EXPORT int32_t pagedkv_attention(const PagedKVAttentionArgs* args, cudaStream_t stream);

/* Workspace bytes for a launch with these bounds (any launch with smaller values fits), or -1 for invalid
 * bounds (pagedkv_last_error() says which). */
PAGEDKV_EXPORT int64_t pagedkv_attention_workspace_bytes(int32_t num_tokens, int32_t num_seqs, int32_t num_q_heads,
                                                         int32_t head_dim, int32_t max_kv_len, int32_t page_size);

/* The scheduling decision for `args` on a device with sm_count SMs and the given kernel occupancies, without
 * touching the GPU (pointers are not dereferenced). For tests and benchmark reports. */
typedef struct PagedKVAttentionPlanInfo {
    int32_t struct_size;
    int32_t run_decode;
    int32_t run_multi;
    int32_t run_merge;
    int32_t decode_grid[3];
    int32_t multi_grid[3];
    int32_t merge_grid;
    int32_t decode_chunk_len;
    int32_t multi_chunk_len;
    int32_t partial_chunks;
    int32_t max_span;
    int64_t workspace_bytes;  /* bytes this launch uses */
} PagedKVAttentionPlanInfo;

PAGEDKV_EXPORT int32_t pagedkv_attention_plan(const PagedKVAttentionArgs* args, int32_t sm_count,
                                              int32_t decode_ctas_per_sm, int32_t multi_ctas_per_sm,
                                              PagedKVAttentionPlanInfo* out);

/* Host replay of the kernels' work decomposition (the same decision functions the kernels run), for the CPU
 * tests: block_table, cu_q_lens and past_lens in `args` are HOST pointers here, num_blocks is the pool's NB.
 * Outputs (host, zeroed by the callee):
 *   coverage [T, H, max_pos]: how many times each (query row, kv position) entered a softmax
 *   direct_writes [T, H]: final-output writes by the attention kernels
 *   partial_writes [T, H]: split-K partial writes (each chunk once; a duplicate is an error)
 *   merged_chunks [T, H]: chunks the merge kernel combines (0: row not merged)
 *   poisoned [T, H]: rows filled with NaN because max_q_len was not a bound
 * Returns 0, or cudaErrorInvalidValue with the reason (also for a position >= max_pos). */
PAGEDKV_EXPORT int32_t pagedkv_attention_schedule_check(const PagedKVAttentionArgs* args, int64_t num_blocks,
                                                        int32_t sm_count, int32_t decode_ctas_per_sm,
                                                        int32_t multi_ctas_per_sm, int32_t max_pos,
                                                        int32_t* coverage, int32_t* direct_writes,
                                                        int32_t* partial_writes, int32_t* merged_chunks,
                                                        int32_t* poisoned);

#ifdef __cplusplus
}
#endif
