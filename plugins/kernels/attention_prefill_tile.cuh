// Device pieces private to the multi-token attention kernel (attention_prefill.cu).
#pragma once

#include <cstdint>

#include "attention_tile.cuh"

namespace pagedkv {
namespace attn {

// softmaxStep (attention_tile.cuh) with the soft-cap and the per-element mask as compile-time switches. The
// shared version tests both runtime flags per element, and ptxas keeps those tests inside the unrolled element
// loop: two branches per score, 64 per 32-token tile and warp in the multi-token kernel -- more than its 16
// exponentials' worth of issue slots. The caller branches once per tile instead (see the kernel). The math is
// the shared version's, step for step: s[nt][e] holds the raw scores of KV tokens nt*8 + 2c + (e&1) for row g
// (e < 2) or g + 8 (e >= 2); masked entries become -inf before anything multiplies them; the running max m
// and the thread-partial sums l are updated, s becomes the unnormalized probabilities, and alpha is the factor
// each row's accumulated output must be rescaled by.
template <int kNT, bool kCapped, bool kMask>
__device__ __forceinline__ void softmaxStepFixed(AttentionKernelParams const& p, float (&s)[kNT][4],
                                                 int32_t const* sPos, int32_t qPos0, int32_t qPos1, int32_t lane,
                                                 float (&m)[2], float (&l)[2], float (&alpha)[2]) {
    int32_t const c = lane & 3;
    float const toLog2 = kCapped ? 1.f : p.scoreScaleLog2;  // s (after the loop below) * toLog2 = log2 logit
    float rowMax[2] = {negInf(), negInf()};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = kCapped ? cappedLogitLog2(p, s[nt][e]) : s[nt][e];
            if constexpr (kMask) {
                int32_t const kvPos = sPos[nt * 8 + 2 * c + (e & 1)];
                if (!kvVisible(e < 2 ? qPos0 : qPos1, kvPos, p.window, p.sinkTokens)) x = negInf();
            }
            s[nt][e] = x;
            rowMax[e >> 1] = fmaxf(rowMax[e >> 1], x);
        }
    }
    float mUse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // the 4 lanes of a quad hold the same row
        rowMax[h] = fmaxf(rowMax[h], __shfl_xor_sync(0xffffffffu, rowMax[h], 1));
        rowMax[h] = fmaxf(rowMax[h], __shfl_xor_sync(0xffffffffu, rowMax[h], 2));
        rowMax[h] *= toLog2;  // -inf stays -inf (toLog2 > 0: the launcher keeps the scale >= FLT_MIN)
        float const mNew = fmaxf(m[h], rowMax[h]);
        mUse[h] = mNew == negInf() ? 0.f : mNew;  // a row that saw nothing yet: keep exp2(-inf - 0) = 0
        alpha[h] = fastExp2(m[h] - mUse[h]);
        m[h] = mNew;
    }
    float rowSum[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float const pr = fastExp2(fmaf(s[nt][e], toLog2, -mUse[e >> 1]));
            s[nt][e] = pr;
            rowSum[e >> 1] += pr;
        }
    }
    l[0] = l[0] * alpha[0] + rowSum[0];
    l[1] = l[1] * alpha[1] + rowSum[1];
}

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
