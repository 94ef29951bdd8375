// pagedkv C API: paged attention (pagedkv/attention.h) for ctypes callers. The caller fills the launcher's own
// AttentionParams (its layout from pagedkv_kv_layout); src/pagedkv/kernels/attention.py does.
//
//   T tokens, B sequences, H query heads, KVH KV heads, D head_dim, MB block-table width
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "pagedkv/attention.h"
#include "pagedkv_capi.h"

extern "C" {

// pagedkv::launchAttention on `stream`: validates (errors name the field and the value; no CUDA call before
// that), plans and launches. Never synchronizes.
PAGEDKV_EXPORT int32_t pagedkv_attention(const pagedkv::AttentionParams* params, cudaStream_t stream);

// Workspace bytes for a launch with these bounds (any launch with smaller values fits), or -1 for invalid
// bounds (pagedkv_last_error() says which).
PAGEDKV_EXPORT int64_t pagedkv_attention_workspace_bytes(int32_t num_tokens, int32_t num_seqs, int32_t num_q_heads,
                                                         int32_t head_dim, int32_t max_kv_len, int32_t page_size);

// The scheduling decision for `params` on a device with sm_count SMs and the given kernel occupancies, without
// touching the GPU (pointers are not dereferenced). For tests and benchmark reports.
struct PagedKVAttentionPlanInfo {
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
    int64_t workspace_bytes;  // bytes this launch uses
    int32_t decode_warps;     // the decode CTA width (2, 4, 8; 0 when no decode kernel runs)
};

// decode_ctas_per_sm: PAGEDKV_DECODE_WIDTHS entries, the decode kernel's resident CTAs per SM at 2, 4 and 8 warps per
// CTA; 0 for a width the device does not host (pagedkv_attention_kernel_shapes says which widths are compiled).
// decode_chunks: 0, or the decode split forced as PAGEDKV_DECODE_CHUNKS forces it at a launch (capped by what the plan
// can split into).
#define PAGEDKV_DECODE_WIDTHS 3
PAGEDKV_EXPORT int32_t pagedkv_attention_plan(const pagedkv::AttentionParams* params, int32_t sm_count,
                                              const int32_t* decode_ctas_per_sm, int32_t multi_ctas_per_sm,
                                              int32_t decode_chunks, PagedKVAttentionPlanInfo* out);

// The plan a launch of `params` makes on the current device (its SM count and the kernels' occupancy, as the
// launcher gathers them: PAGEDKV_DECODE_WARPS and PAGEDKV_DECODE_CHUNKS included). Queries the device, launches nothing. For benchmark reports.
PAGEDKV_EXPORT int32_t pagedkv_attention_device_plan(const pagedkv::AttentionParams* params,
                                                     PagedKVAttentionPlanInfo* out);

// Threads and dynamic shared memory per CTA of the decode and multi-token kernels that serve (io_dtype,
// cache_dtype, head_dim), as compiled (host constants, no GPU needed): what the device's per-block shared-memory
// limit is checked against at the first launch (docs/plugin_io.md tabulates them per head dim and architecture).
struct PagedKVAttentionKernelShapes {
    int32_t decode_threads;     // the decode kernel at its default width (4 warps; 2 for 8-bit caches at D = 64, 128)
    int32_t decode_smem_bytes;
    int32_t multi_threads;
    int32_t multi_smem_bytes;
    int32_t decode_width_smem_bytes[PAGEDKV_DECODE_WIDTHS];  // at 2, 4, 8 warps per CTA; 0: width not compiled
    int32_t decode_width_threads[PAGEDKV_DECODE_WIDTHS];     // 64, 128, 256; 0: width not compiled
};

PAGEDKV_EXPORT int32_t pagedkv_attention_kernel_shapes(int32_t io_dtype, int32_t cache_dtype, int32_t head_dim,
                                                       PagedKVAttentionKernelShapes* out);

// Host replay of the kernels' work decomposition (the same decision functions the kernels run), for the CPU
// tests: params->meta's blockTable, cuQLens and pastLens are HOST pointers here, num_blocks is the pool's NB.
// Outputs (host, zeroed by the callee):
//   coverage [T, H, max_pos]: how many times each (query row, kv position) entered a softmax
//   direct_writes [T, H]: final-output writes by the attention kernels
//   partial_writes [T, H]: split-K partial writes (each chunk once; a duplicate is an error)
//   merged_chunks [T, H]: chunks the merge kernel combines (0: row not merged)
//   poisoned [T, H]: rows filled with NaN because max_q_len was not a bound
// Returns 0, or cudaErrorInvalidValue with the reason (also for a position >= max_pos).
PAGEDKV_EXPORT int32_t pagedkv_attention_schedule_check(const pagedkv::AttentionParams* params, int64_t num_blocks,
                                                        int32_t sm_count, const int32_t* decode_ctas_per_sm,
                                                        int32_t multi_ctas_per_sm, int32_t decode_chunks,
                                                        int32_t max_pos,
                                                        int32_t* coverage, int32_t* direct_writes,
                                                        int32_t* partial_writes, int32_t* merged_chunks,
                                                        int32_t* poisoned);

}  // extern "C"
