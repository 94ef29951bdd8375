// Device building blocks shared by the decode and multi-token attention kernels: the pool view, loading
// query rows and KV rows into shared memory, the 8-bit -> 16-bit tile conversion, the logit transform and the
// online-softmax step on MMA accumulator fragments. Page addressing goes through kv_layout.h only
// (kvRowAt -> locateToken, KVLayout::elemOffset).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention_dequant.cuh"
#include "attention_kernels.h"
#include "attention_mma.cuh"
#include "attention_schedule.h"
#include "pagedkv/kv_layout.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv {
namespace attn {

// ---- the pool of this layer's group, read from the device-side descriptor (never a host sync)
struct PoolView {
    unsigned char const* base;
    int64_t numBlocks;
};

__device__ __forceinline__ PoolView loadPool(AttentionKernelParams const& p) {
    int64_t const* desc = p.poolDescs + int64_t(p.poolIndex) * kPoolDescFields;
    PoolView v;
    v.base = reinterpret_cast<unsigned char const*>(__ldg(desc + kPoolDescAddress));
    v.numBlocks = __ldg(desc + kPoolDescNumBlocks);
    return v;
}

// Where a CTA's KV rows come from: one sequence's block-table row, one KV head, one chunk of its span.
struct KVSource {
    unsigned char const* pool;
    BlockTableRow table;
    int32_t kvHead;
    KVSpan span;
    ChunkRange chunk;
};

__device__ __forceinline__ KVSource makeKVSource(AttentionKernelParams const& p, CtaWork const& w, int32_t kvHead) {
    PoolView pool = loadPool(p);
    KVSource s;
    s.pool = pool.base;
    s.table = BlockTableRow{p.blockTable + int64_t(w.seqIndex) * p.maxBlocks, p.maxBlocks, pool.numBlocks};
    s.kvHead = kvHead;
    s.span = w.span;
    s.chunk = w.chunk;
    return s;
}

// ---- KV rows: virtual indices [v0, v0 + kRows) of the CTA's span -> shared memory, K and V.
// 16-bit caches land in swizzled tiles that ldmatrix reads directly; 8-bit caches land row-major in a staging
// tile that convertTile8 turns into a swizzled 16-bit tile. A row holding nothing (kvRowAt: pos = -1) is
// zero-filled without touching global memory, and sPos[r] records each row's cache position (or -1) for the
// masks. Threads [0, kThreads) of the caller (a warp or the CTA) share the work.
template <int kD, int kElemBytes, int kRows, int kThreads>
__device__ __forceinline__ void loadKVRows(AttentionKernelParams const& p, KVSource const& src, int32_t v0,
                                           uint32_t sK, uint32_t sV, int32_t* sPos, int32_t tid) {
    constexpr int kRowBytes = kD * kElemBytes;
    constexpr int kChunks = kRowBytes / 16;
    static_assert((kRows * kChunks) % kThreads == 0, "KV tile chunks must split evenly over the threads");
#pragma unroll
    for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
        int const q = tid + i * kThreads;
        int const r = q / kChunks;
        int const ch = q % kChunks;
        KVRow const row = kvRowAt(p.layout, src.table, src.span, src.chunk, v0 + r);
        bool const holds = row.pos >= 0;
        unsigned char const* kSrc = src.pool;  // any valid address: nothing is read when !holds
        unsigned char const* vSrc = src.pool;
        if (holds) {
            kSrc = src.pool + p.layout.elemOffset(row.loc.block, p.layer, 0, src.kvHead, row.loc.offset) * kElemBytes +
                   ch * 16;
            vSrc = src.pool + p.layout.elemOffset(row.loc.block, p.layer, 1, src.kvHead, row.loc.offset) * kElemBytes +
                   ch * 16;
        }
        uint32_t const dst = kElemBytes == 2 ? swizzledChunk(r, ch, kRowBytes) : uint32_t(r * kRowBytes + ch * 16);
        cpAsync16(sK + dst, kSrc, holds);
        cpAsync16(sV + dst, vSrc, holds);
        if (ch == 0) sPos[r] = row.pos;
    }
}

// Warp-level variant for the decode kernel, where the loader runs once per 16-token tile of each warp and its
// instruction count matters: lane r < kRows resolves row r once (kvRowAt + elemOffset: the page lookup), and
// the lanes that copy the row's 16-byte chunks receive its K and V byte offsets by shuffle.
template <int kD, int kElemBytes, int kRows>
__device__ __forceinline__ void loadKVRowsWarp(AttentionKernelParams const& p, KVSource const& src, int32_t v0,
                                               uint32_t sK, uint32_t sV, int32_t* sPos, int32_t lane) {
    constexpr int kRowBytes = kD * kElemBytes;
    constexpr int kChunks = kRowBytes / 16;  // 4 .. 32
    constexpr int kRowsPerStep = 32 / kChunks;
    static_assert(kChunks >= 4 && kChunks <= 32 && kRows <= 32 && kRows % kRowsPerStep == 0, "warp KV tile shape");
    int64_t kOff = -1, vOff = -1;  // byte offsets from the pool base; -1: the row holds nothing
    if (lane < kRows) {
        KVRow const row = kvRowAt(p.layout, src.table, src.span, src.chunk, v0 + lane);
        if (row.pos >= 0) {
            kOff = p.layout.elemOffset(row.loc.block, p.layer, 0, src.kvHead, row.loc.offset) * kElemBytes;
            vOff = p.layout.elemOffset(row.loc.block, p.layer, 1, src.kvHead, row.loc.offset) * kElemBytes;
        }
        sPos[lane] = row.pos;
    }
#pragma unroll
    for (int i = 0; i < kRows / kRowsPerStep; ++i) {
        int const r = i * kRowsPerStep + lane / kChunks;
        int const ch = lane % kChunks;
        int64_t const k = __shfl_sync(0xffffffffu, kOff, r);
        int64_t const v = __shfl_sync(0xffffffffu, vOff, r);
        bool const holds = k >= 0;
        uint32_t const dst = kElemBytes == 2 ? swizzledChunk(r, ch, kRowBytes) : uint32_t(r * kRowBytes + ch * 16);
        cpAsync16(sK + dst, holds ? src.pool + k + ch * 16 : src.pool, holds);
        cpAsync16(sV + dst, holds ? src.pool + v + ch * 16 : src.pool, holds);
    }
}

// ---- 8-bit staging tile [kRows][kD] bytes -> swizzled 16-bit tile of the compute type (exact, no scale).
template <typename CT, int kD, int kRows, int kThreads>
__device__ __forceinline__ void convertTile8(unsigned char const* staging, unsigned char* tile16, bool isFp8,
                                             int32_t tid) {
    constexpr int kChunks8 = kD / 8;  // 8-element groups per row
    static_assert((kRows * kChunks8) % kThreads == 0, "conversion must split evenly over the threads");
#pragma unroll
    for (int i = 0; i < kRows * kChunks8 / kThreads; ++i) {
        int const q = tid + i * kThreads;
        int const r = q / kChunks8;
        int const j = q % kChunks8;
        uint2 raw = *reinterpret_cast<uint2 const*>(staging + r * kD + j * 8);
        *reinterpret_cast<uint4*>(tile16 + swizzledChunk(r, j, kD * 2)) = dequant8x8<CT>(raw, isFp8);
    }
}

// ---- query rows -> swizzled 16-bit tile [kRows][kD]. Local row r is global row rowBegin + r (token R / G,
// head kvHead * G + R % G); rows at or past rowEnd are zero.
template <typename CT, int kD, int kRows, int kThreads>
__device__ __forceinline__ void loadQRows(AttentionKernelParams const& p, unsigned char* sQ, int32_t rowBegin,
                                          int32_t rowEnd, int32_t kvHead, int32_t tid) {
    constexpr int kChunks = kD / 8;  // 16-byte chunks of the compute type per row
    for (int q = tid; q < kRows * kChunks; q += kThreads) {
        int const r = q / kChunks;
        int const ch = q % kChunks;
        int32_t const row = rowBegin + r;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (row < rowEnd) {
            int32_t const token = row / p.groupSize;
            int32_t const head = kvHead * p.groupSize + row % p.groupSize;
            int64_t const elem = (int64_t(token) * p.numQHeads + head) * kD + ch * 8;
            if (p.qFP8) {
                uint2 raw = __ldg(reinterpret_cast<uint2 const*>(static_cast<unsigned char const*>(p.q) + elem));
                val = dequant8x8<CT>(raw, true);
            } else {
                val = __ldg(reinterpret_cast<uint4 const*>(static_cast<CT const*>(p.q) + elem));
            }
        }
        *reinterpret_cast<uint4*>(sQ + swizzledChunk(r, ch, kD * 2)) = val;
    }
}

// ---- ldmatrix lane addresses (fragment layouts: attention_mma.cuh). In a swizzled tile the chunk of 16-dim
// step k read by a lane is (2k + half) ^ (row & 7) = 2k ^ (half ^ (row & 7)), so its byte offset within the
// row is ((half ^ (row & 7)) << 4) ^ (k << 5): a per-lane constant XOR a compile-time immediate (rows are
// 2^n bytes, so the XOR never leaves the row). Tile rows of the lane: (lane & 7) plus 8 for some matrices.
template <int kD>
struct FragLane {
    static constexpr int kRowBytes = kD * 2;
    // A operand (16 rows x 16 dims): matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) in the order of a[0..3].
    static __device__ __forceinline__ uint32_t offsetA(int32_t lane) {
        int32_t const row = (lane & 7) + ((lane >> 3) & 1) * 8;
        int32_t const half = lane >> 4;
        return uint32_t(row * kRowBytes + ((half ^ (lane & 7)) << 4));
    }
    // K as the B operand of Q K^T (16 tokens x 16 dims): r[0..1] tokens 0-7, r[2..3] tokens 8-15.
    static __device__ __forceinline__ uint32_t offsetK(int32_t lane) {
        int32_t const m = lane >> 3;
        int32_t const tok = (lane & 7) + (m >> 1) * 8;
        int32_t const half = m & 1;
        return uint32_t(tok * kRowBytes + ((half ^ (lane & 7)) << 4));
    }
    // V as the B operand of P V (ldmatrix .trans; 16 tokens x 16 dims): r[0..1] dims 0-7, r[2..3] dims 8-15.
    static __device__ __forceinline__ uint32_t offsetV(int32_t lane) {
        int32_t const m = lane >> 3;
        int32_t const tok = (lane & 7) + (m & 1) * 8;
        int32_t const half = m >> 1;
        return uint32_t(tok * kRowBytes + ((half ^ (lane & 7)) << 4));
    }
    // Address of 16-dim step k for rows/tokens starting at row0 (a multiple of 16) of the tile.
    static __device__ __forceinline__ uint32_t at(uint32_t tile, uint32_t laneOffset, int32_t row0, int32_t k) {
        return tile + uint32_t(row0 * kRowBytes) + (laneOffset ^ uint32_t(k << 5));
    }
};

// ---- logits (log2 domain) from raw dot products
// tanh(x) = 1 - 2 / (e^2x + 1) with ex2.approx and rcp.approx: absolute error below 1e-6 over the whole range
// (e^2x = inf gives 1, e^2x = 0 gives -1), so cap * tanh errs by ~cap * 1e-6 -- unlike tanh.approx.f32,
// whose ~2^-11 relative error times a cap of 30-50 would shift logits by ~0.02.
__device__ __forceinline__ float accurateTanh(float x) {
    float const e = fastExp2(x * (2.f * kLog2e));
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(e + 1.f));
    return 1.f - 2.f * r;
}

__device__ __forceinline__ float logitLog2(AttentionKernelParams const& p, float raw) {
    return p.useSoftcap ? accurateTanh(raw * p.capInScale) * p.capOutScaleLog2 : raw * p.scoreScaleLog2;
}

// Online-softmax step for one m16 tile of a warp: s[nt][e] holds the raw scores of KV tokens nt*8 + 2c + (e&1)
// for row g (e < 2) or g + 8 (e >= 2). Masked entries become -inf BEFORE anything multiplies them, the
// running max m and the thread-partial sums l are updated, s becomes the probabilities (unnormalized), and
// alpha is the factor the accumulated output of each row must be rescaled by. kvPos of column j is
// sPos[j]; qPos0/qPos1 are the query positions of rows g and g + 8 (-1: padding row, sees nothing).
template <int kNT>
__device__ __forceinline__ void softmaxStep(AttentionKernelParams const& p, float (&s)[kNT][4], int32_t const* sPos,
                                            bool needMask, int32_t qPos0, int32_t qPos1, int32_t lane,
                                            float (&m)[2], float (&l)[2], float (&alpha)[2]) {
    int32_t const c = lane & 3;
    float rowMax[2] = {negInf(), negInf()};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = logitLog2(p, s[nt][e]);
            if (needMask) {
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
            float const pr = fastExp2(s[nt][e] - mUse[e >> 1]);
            s[nt][e] = pr;
            rowSum[e >> 1] += pr;
        }
    }
    l[0] = l[0] * alpha[0] + rowSum[0];
    l[1] = l[1] * alpha[1] + rowSum[1];
}

// O *= alpha per row, skipped by the whole warp when no row's running max moved (alpha == 1 exactly): after
// the first tiles of a long sequence that is the common case, and it saves D / 2 multiplies per lane.
template <int kDimTiles>
__device__ __forceinline__ void rescaleRows(float (&o)[kDimTiles][4], float const (&alpha)[2]) {
    if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
    for (int dn = 0; dn < kDimTiles; ++dn) {
        o[dn][0] *= alpha[0], o[dn][1] *= alpha[0];
        o[dn][2] *= alpha[1], o[dn][3] *= alpha[1];
    }
}

// Probabilities of KV tokens [16 kt, 16 kt + 16) as the A operand of P V.
template <typename CT, int kNT>
__device__ __forceinline__ void probFragment(float const (&s)[kNT][4], int kt, uint32_t (&a)[4]) {
    a[0] = Mma<CT>::pack(s[2 * kt][0], s[2 * kt][1]);
    a[1] = Mma<CT>::pack(s[2 * kt][2], s[2 * kt][3]);
    a[2] = Mma<CT>::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]);
    a[3] = Mma<CT>::pack(s[2 * kt + 1][2], s[2 * kt + 1][3]);
}

// Sum a per-thread partial over the 4 lanes of a quad (one accumulator row).
__device__ __forceinline__ float quadSum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

// Quiet NaN of the compute type, for rows a launch could not serve (see CtaWork::poison).
template <typename CT>
__device__ __forceinline__ uint16_t quietNaNBits();
template <>
__device__ __forceinline__ uint16_t quietNaNBits<__half>() {
    return 0x7E00u;
}
template <>
__device__ __forceinline__ uint16_t quietNaNBits<__nv_bfloat16>() {
    return 0x7FC0u;
}

// Index of (chunk z, token t, head h) in the partial arrays.
__device__ __forceinline__ int64_t partialRow(AttentionKernelParams const& p, int32_t z, int32_t token,
                                              int32_t head) {
    return (int64_t(z) * p.numTokens + token) * p.numQHeads + head;
}

}  // namespace attn
}  // namespace pagedkv
