// sm_90a plumbing for the Hopper multi-token attention kernels: shared-memory matrix descriptors, the wgmma fence /
// commit / wait, the generic -> async proxy fence that makes shared-memory stores visible to wgmma, mbarriers and
// named barriers. The MMA instructions themselves are in wgmma_ops.cuh (generated).
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

// The descriptor of an operand `bytes` further on: its start-address field plus bytes / 16. Exact because every
// operand starts 16-byte aligned and every shared-memory address is below 2^18 (228 KB per SM), so the 14-bit field
// never carries into the leading byte offset. The MMAs of one tile then cost one add each for their descriptors,
// the mask / shift / or of `descriptor` once per tile.
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) {
    uint32_t const lo = uint32_t(desc) + (bytes >> 4);
    return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// A or B of S = Q K^T: rows [row0, row0 + 64 or N) of a blocked tile of kTileRows rows, k-step kk (16 elements).
template <int kTileRows>
__device__ __forceinline__ uint64_t kMajor(uint32_t tile, int32_t row0, int32_t kk) {
    return advance(descriptor(tile, 16, 1024), uint32_t((kk >> 2) * kTileRows * 128 + row0 * 128 + (kk & 3) * 32));
}

// B of O = P V: tokens [16 kt, 16 kt + 16) of a blocked V tile of kTileRows tokens, every head dim.
template <int kTileRows>
__device__ __forceinline__ uint64_t mnMajor(uint32_t tile, int32_t kt) {
    return advance(descriptor(tile, kTileRows * 128, 1024), uint32_t(kt * 16 * 128));
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

// ---- mbarriers (the warp-specialized kernel's stage handshakes) and named barriers (its warpgroup turns)
__device__ __forceinline__ void mbarrierInit(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Publishes the initialized barriers before any thread uses them (with a CTA barrier after it).
__device__ __forceinline__ void fenceBarrierInit() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival, release semantics: this thread's earlier shared-memory writes are visible to a thread that waits.
__device__ __forceinline__ void mbarrierArrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Tracks this thread's earlier cp.async copies: the barrier's pending count goes up by one now and back down once
// they have all landed, so with an mbarrierArrive after it a phase completes only when every arriving thread's
// copies are in shared memory -- without the thread waiting for them.
__device__ __forceinline__ void cpAsyncMbarrierArrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits (acquire) until the phase with the given parity has completed; a fresh barrier's "previous" phase (parity
// 1) counts as completed.
__device__ __forceinline__ void mbarrierWait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (done == 0);
}
__device__ __forceinline__ void namedBarrierSync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void namedBarrierArrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Changes this warpgroup's per-thread register allocation (every warp of the warpgroup executes it).
template <uint32_t kRegisters, bool kGrow>
__device__ __forceinline__ void setMaxRegisters() {
    static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg range");
    if constexpr (kGrow) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
    else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

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
