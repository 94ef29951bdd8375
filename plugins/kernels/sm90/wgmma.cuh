// sm_90a warpgroup-MMA plumbing for the Hopper multi-token attention kernel: shared-memory matrix descriptors,
// the wgmma fence / commit / wait, and the generic -> async proxy fence that makes shared-memory stores visible to
// wgmma. The MMA instructions themselves are in wgmma_ops.cuh (generated).
//
// Tiles the MMAs read (PTX ISA 9.7.15.5.1.2, 128-byte swizzle): a 16-bit tile of R rows x kD elements is stored as
// kD / 64 column blocks of R rows x 128 bytes (blockedTileChunk, attention_tile.cuh); inside a block, 16-byte chunk
// ch of row r sits at chunk position ch ^ (r & 7). The hardware applies that XOR on address bits [4, 7) from bits
// [7, 10), so every block starts on a 1024-byte boundary. In the descriptors' units (16 bytes):
//  * K-major operand (Q as A, K as B of S = Q K^T; rows = M or N, 16 k-elements = 32 bytes of a row): 8-row core
//    matrices 1024 bytes apart (stride byte offset); the k-step's 32-byte column inside the 128-byte row is the
//    start address; the leading byte offset is unused for swizzled K-major layouts (1 by convention).
//  * MN-major operand (V as B of O = P V: k = KV token, n = head dim, n contiguous in a row): 8 k-rows of 128 bytes
//    form one core-matrix row, the next 8 tokens 1024 bytes on (stride byte offset), the next 64 head dims one column
//    block on (leading byte offset = R x 128).
#pragma once

#include <cstdint>

namespace pagedkv {
namespace attn {
namespace wgmma {

constexpr uint64_t kSwizzle128B = uint64_t(1) << 62;  // descriptor bits 62-63: 1 = 128-byte swizzle

__device__ __forceinline__ uint64_t descriptor(uint32_t smemAddress, uint32_t leadingBytes, uint32_t strideBytes) {
    return uint64_t((smemAddress & 0x3FFFFu) >> 4) | (uint64_t((leadingBytes >> 4) & 0x3FFFu) << 16) |
           (uint64_t((strideBytes >> 4) & 0x3FFFu) << 32) | kSwizzle128B;
}

// A or B of S = Q K^T: rows [row0, row0 + 64 or N) of a blocked tile of kTileRows rows, k-step kk (16 elements).
template <int kTileRows>
__device__ __forceinline__ uint64_t kMajor(uint32_t tile, int32_t row0, int32_t kk) {
    return descriptor(tile + uint32_t((kk >> 2) * kTileRows * 128 + row0 * 128 + (kk & 3) * 32), 16, 1024);
}

// B of O = P V: tokens [16 kt, 16 kt + 16) of a blocked V tile of kTileRows tokens, every head dim.
template <int kTileRows>
__device__ __forceinline__ uint64_t mnMajor(uint32_t tile, int32_t kt) {
    return descriptor(tile + uint32_t(kt * 16 * 128), kTileRows * 128, 1024);
}

// Orders this thread's register writes (accumulators, A fragments) before the next wgmma reads them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// This thread's shared-memory writes (st.shared, completed cp.async) become visible to the async proxy that wgmma
// reads through; a barrier after it publishes them to the other warps' MMAs.
__device__ __forceinline__ void fenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving accesses of an accumulator across an MMA issue or wait.
template <int kTiles>
__device__ __forceinline__ void pin(float (&d)[kTiles][4]) {
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

}  // namespace wgmma
}  // namespace attn
}  // namespace pagedkv
