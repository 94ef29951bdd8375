/* pagedkv C API: the fused QKV-preprocess + paged KV write (pagedkv::launchQKVWrite) for ctypes callers.
 * src/pagedkv/kernels/write.py mirrors PagedKVQKVWriteArgs field by field and checks the layout against
 * pagedkv_qkv_write_args_offsets(). Every entry returns 0 or a cudaError_t value; pagedkv_last_error() gives
 * the reason (field and value) of an invalid argument. Nothing here synchronizes.
 *
 *   T tokens, B sequences, MB block-table width, H query heads, KVH KV heads, D head_dim
 */
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "pagedkv_capi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Field names follow the plugin attributes (src/pagedkv/config.py: WriteConfig / PoolConfig / RopeConfig). */
typedef struct PagedKVQKVWriteArgs {
    int32_t struct_size; /* sizeof(PagedKVQKVWriteArgs), set by the caller: ABI check */
    /* shapes */
    int32_t num_q_heads;  /* H, a multiple of num_kv_heads */
    int32_t num_kv_heads; /* KVH */
    int32_t head_dim;     /* D: 64, 128 or 256 */
    int32_t io_dtype;     /* 0 fp16, 1 bf16: qkv, bias and q_out (unless q_out_fp8) */
    int32_t num_tokens;   /* T == cu_q_lens[B] */
    int32_t num_seqs;     /* B */
    int32_t max_blocks;   /* MB */
    /* pool group (KVLayout) */
    int32_t pool_index;  /* row of pool_descs */
    int32_t num_layers;
    int32_t layer_index;
    int32_t page_size;
    int32_t page_layout; /* 0 HND, 1 NHD */
    int32_t ring_sink_tokens; /* cyclic cache only */
    int32_t cyclic_len;  /* 0: linear cache */
    int32_t cache_dtype; /* 0 fp16, 1 bf16, 2 fp8_e4m3, 3 int8 */
    float k_scale;       /* quantized caches: x ~= stored * k_scale */
    float v_scale;
    /* RoPE (RopeConfig) */
    int32_t rope_style;      /* 0 none, 1 neox, 2 gptj */
    int32_t rope_rotary_dim; /* 0 -> head_dim */
    float rope_theta;
    int32_t rope_scaling; /* 0 none, 1 linear, 2 llama3 */
    float rope_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int32_t rope_original_max_positions;
    /* outputs */
    int32_t q_out_fp8; /* store q as fp8 e4m3 (q / q_scale) */
    float q_scale;
    int32_t zero_v_tail; /* zero V rows past a prefill chunk's end in its last page */
    int32_t reserved0;   /* 0; keeps the pointers below 8-byte aligned without implicit padding */
    /* device pointers */
    const void* qkv;              /* [T, (H + 2*KVH) * D] */
    const void* bias;             /* [(H + 2*KVH) * D] or NULL */
    const int32_t* position_ids;  /* [T] explicit RoPE positions or NULL (past_lens[b] + i) */
    const int64_t* pool_descs;    /* [num_pools, 4] (step_metadata.h PoolDescField) */
    const int32_t* block_table;   /* [B, MB] */
    const int32_t* cu_q_lens;     /* [B + 1] */
    const int32_t* past_lens;     /* [B] */
    void* q_out;                  /* [T, H * D] */
    int32_t* status;              /* [4], zeroed by the caller before the launch */
} PagedKVQKVWriteArgs;

/* Validates, builds the launcher's parameters (RoPE table, KV layout) and launches on `stream`. */
PAGEDKV_EXPORT int32_t pagedkv_qkv_write(const PagedKVQKVWriteArgs* args, cudaStream_t stream);

/* sizeof(PagedKVQKVWriteArgs), and the byte offset of each field in declaration order into out[0..n)
 * (returns the number of fields; writes min(n, fields) entries). */
PAGEDKV_EXPORT int32_t pagedkv_qkv_write_args_size(void);
PAGEDKV_EXPORT int32_t pagedkv_qkv_write_args_offsets(int64_t* out, int32_t n);

/* computeRopeParams for tests: inverse frequencies [128] (first rotary_dim_out / 2 valid), rotary dim, mscale. */
PAGEDKV_EXPORT int32_t pagedkv_rope_params(int32_t head_dim, int32_t rope_style, int32_t rope_rotary_dim,
                                           float rope_theta, int32_t rope_scaling, float rope_factor,
                                           float rope_low_freq_factor, float rope_high_freq_factor,
                                           int32_t rope_original_max_positions, float* inv_freq_out,
                                           int32_t* rotary_dim_out, float* mscale_out);

/* The kernel's RoPE angle reduction evaluated on the host (same code): angle of positions[i] for inverse
 * frequency inv_freq[j], in [-pi, pi), into out[i * num_freqs + j]. */
PAGEDKV_EXPORT int32_t pagedkv_rope_angles(const float* inv_freq, int32_t num_freqs, const int32_t* positions,
                                           int32_t n, float* out);

#ifdef __cplusplus
}
#endif
