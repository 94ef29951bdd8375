// The memcpy geometry of one block copy (BlockCopy of kv_manager.h): Python's
// `pagedkv.kvcache.copies.copy_plan`, ported. A block is contiguous (the outermost pool dimension), so a whole
// block is one row of block_bytes; "the first N tokens of every (layer, K/V, head)" is one strided 2-D copy,
// because inside a block the token dimension is contiguous in rows of page_size * stride_token elements:
//
//   rows  = stride_block / (page_size * stride_token)    HND: L*2*KVH rows   NHD: L*2 rows
//   pitch = page_size * stride_token * itemsize
//   width = N * stride_token * itemsize
//
// which is cudaMemcpy2DAsync(dst, pitch, src, pitch, width, rows) on the device (device_pools.cpp).
// tests/test_runtime_native.py holds it equal to Python's for many layouts.
#pragma once

#include <cstdint>

#include "pagedkv/kv_layout.h"

namespace pagedkv::runtime {

struct CopyPlan {
    int64_t rows;   // rows of `width` bytes, `pitch` bytes apart, from the block's first byte
    int64_t pitch;
    int64_t width;
    bool contiguous() const { return rows == 1 || width == pitch; }
};

// The geometry of copying the first `numTokens` tokens of a block (<= 0 or page_size: all of them).
// Throws KVArgumentError for numTokens > page_size.
CopyPlan copyPlan(KVLayout const& layout, int32_t itemsize, int32_t numTokens);

}  // namespace pagedkv::runtime
