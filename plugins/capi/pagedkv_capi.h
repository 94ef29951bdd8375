// pagedkv C API: extern "C" entry points that Python calls through ctypes with device pointers
// (src/pagedkv/_capi.py mirrors every struct here). Each entry returns 0 on success or a cudaError_t
// value; pagedkv_last_error() gives the reason. Nothing here synchronizes unless its name says so.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PAGEDKV_CAPI_VERSION 1
#define PAGEDKV_EXPORT __attribute__((visibility("default")))

PAGEDKV_EXPORT int32_t pagedkv_capi_version(void);
PAGEDKV_EXPORT const char* pagedkv_build_info(void);  // "key=value;..." (TensorRT header source, archs)
PAGEDKV_EXPORT const char* pagedkv_last_error(void);

// Contract cross-check for tests/test_layout.py: locate `n` cache positions of one sequence through the C++
// KV-layout helpers (host side). out_block/out_offset/out_elem: [n]; out_elem is -1 for invalid blocks.
PAGEDKV_EXPORT int32_t pagedkv_layout_locate(int32_t num_layers, int32_t num_kv_heads, int32_t page_size,
                                             int32_t head_dim, int32_t page_layout, int32_t ring_sink_tokens,
                                             int32_t cyclic_len, const int32_t* block_row, int32_t max_blocks,
                                             int64_t num_blocks, int32_t layer, int32_t kv, int32_t head,
                                             const int32_t* positions, int32_t n, int64_t* out_block,
                                             int32_t* out_offset, int64_t* out_elem);

#ifdef __cplusplus
}
#endif
