// Device pieces private to the multi-token attention kernel (attention_prefill.cu).
#pragma once

#include <cstdint>

#include "attention_tile.cuh"

namespace pagedkv {
namespace attn {

// loadKVRowsWarp (attention_tile.cuh) for the multi-token kernel's staging layouts (16-bit: swizzled tile;
// 8-bit: row-major for convertTile8), with less address work per tile: lane r < kRows resolves row v0 + r once
// (kvRowAt + KVLayout::elemOffset, as there) but only its K byte offset travels by shuffle -- the V row of the
// same (block, layer, head, offset) lies a fixed vDeltaBytes further (elemOffset is linear in kv; the caller
// computes the delta once from elemOffset itself) -- and each copying lane adds its chunk to a per-CTA base.
// A row holding nothing (pos -1) copies with src-size 0 from the pool base (zero fill, no global read).
template <int kD, int kElemBytes, int kRows>
__device__ __forceinline__ void loadKVRowsWarpLean(AttentionKernelParams const& p, KVSource const& src,
                                                   int64_t vDeltaBytes, int32_t v0, uint32_t sK, uint32_t sV,
                                                   int32_t* sPos, int32_t lane) {
    constexpr int kRowBytes = kD * kElemBytes;
    constexpr int kChunks = kRowBytes / 16;  // 4 .. 32
    constexpr int kRowsPerStep = 32 / kChunks;
    static_assert(kChunks >= 4 && kChunks <= 32 && kRows <= 32 && kRows % kRowsPerStep == 0, "warp KV tile shape");
    int64_t kOff = -1;  // K byte offset from the pool base; -1: the row holds nothing
    if (lane < kRows) {
        KVRow const row = kvRowAt(p.layout, src.table, src.span, src.chunk, v0 + lane);
        if (row.pos >= 0)
            kOff = p.layout.elemOffset(row.loc.block, p.layer, 0, src.kvHead, row.loc.offset) * kElemBytes;
        sPos[lane] = row.pos;
    }
    int const ch = lane % kChunks;
    unsigned char const* const laneBase = src.pool + ch * 16;
#pragma unroll
    for (int i = 0; i < kRows / kRowsPerStep; ++i) {
        int const r = i * kRowsPerStep + lane / kChunks;
        int64_t const k = __shfl_sync(0xffffffffu, kOff, r);
        bool const holds = k >= 0;
        unsigned char const* const kSrc = holds ? laneBase + k : src.pool;
        unsigned char const* const vSrc = holds ? laneBase + k + vDeltaBytes : src.pool;
        uint32_t const dst = kElemBytes == 2 ? swizzledChunk(r, ch, kRowBytes) : uint32_t(r * kRowBytes + ch * 16);
        cpAsync16(sK + dst, kSrc, holds);
        cpAsync16(sV + dst, vSrc, holds);
    }
}

}  // namespace attn
}  // namespace pagedkv
