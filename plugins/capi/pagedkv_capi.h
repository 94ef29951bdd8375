// pagedkv C API: entry points with C linkage that Python calls through ctypes, with device pointers. They take
// and fill the launchers' own parameter structs (pagedkv/qkv_write.h, pagedkv/attention.h, pagedkv/kv_layout.h:
// standard-layout PODs), never a flat copy of them; so this header is C++. Bindings do not mirror the structs
// by hand: pagedkv_struct_layouts() describes each one (field names, types, byte offsets) and
// src/pagedkv/kernels/_structs.py builds its ctypes mirrors from that description, checking every offset.
//
// Each entry returns 0 on success or a cudaError_t value; pagedkv_last_error() gives the reason ("field=value:
// expected ...", fields named as the plugin attributes are). Nothing here synchronizes.
#pragma once

#include <stdint.h>

#include "pagedkv/kv_layout.h"

#define PAGEDKV_CAPI_VERSION 2  // 2: the launchers' parameter structs replace the flat *Args structs
#define PAGEDKV_EXPORT __attribute__((visibility("default")))

extern "C" {

PAGEDKV_EXPORT int32_t pagedkv_capi_version(void);
PAGEDKV_EXPORT const char* pagedkv_build_info(void);  // "key=value;..." (TensorRT header source, archs)
PAGEDKV_EXPORT const char* pagedkv_last_error(void);

// The capability table (pagedkv/capabilities.h) as a JSON object: head dims, page-size range, cache / I/O dtypes,
// limits. Python's pagedkv.capabilities reads it; nothing on the Python side spells these sets out.
PAGEDKV_EXPORT const char* pagedkv_capabilities(void);

// {"StructName": {"size": N, "align": A, "fields": [{"name", "type", "offset", "size", "count"?}, ...]}, ...}
// for every struct the C API takes or fills. "type" is i32, i64, u64, f32, bool, ptr or another struct's name;
// "count" marks a fixed-size array ("size" is the whole member's).
PAGEDKV_EXPORT const char* pagedkv_struct_layouts(void);

// makeKVLayout with named errors (kv_layout_check.h): fills *out, or returns cudaErrorInvalidValue naming the
// first bad geometry field.
PAGEDKV_EXPORT int32_t pagedkv_kv_layout(int32_t num_layers, int32_t num_kv_heads, int32_t page_size,
                                         int32_t head_dim, int32_t page_layout, int32_t ring_sink_tokens,
                                         int32_t cyclic_len, pagedkv::KVLayout* out);

// Contract cross-check for tests/test_layout.py: locate `n` cache positions of one sequence through the C++
// KV-layout helpers (host side). out_block/out_offset/out_elem: [n]; out_elem is -1 for invalid blocks.
PAGEDKV_EXPORT int32_t pagedkv_layout_locate(const pagedkv::KVLayout* layout, const int32_t* block_row,
                                             int32_t max_blocks, int64_t num_blocks, int32_t layer, int32_t kv,
                                             int32_t head, const int32_t* positions, int32_t n, int64_t* out_block,
                                             int32_t* out_offset, int64_t* out_elem);

}  // extern "C"
