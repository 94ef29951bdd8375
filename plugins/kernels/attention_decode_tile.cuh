// Decode-path helpers (owned by the decode kernel and the split-K merge; the shared tile helpers live in
// attention_tile.cuh): programmatic dependent launch between the attention kernel and the merge, and the
// KV source built from a pool descriptor loaded ahead of the CTA's metadata.
#pragma once

#include <cuda_runtime.h>

#include "attention_kernels.h"
#include "attention_tile.cuh"

namespace pagedkv {
namespace attn {

// ---- programmatic dependent launch (sm_90+; no-ops below, where the launcher never asks for it)
// The primary (the attention kernel) lets a dependent grid launched with programmatic stream serialization
// start once every one of its CTAs has passed this point; the dependent must call gridDependencyWait()
// before touching anything the primary writes. Harmless without a dependent: it only affects grids launched
// with the attribute, and those wait for the primary's completion before reading its results.
__device__ __forceinline__ void gridDependencyLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Blocks until every prerequisite grid has completed and its memory operations are visible (returns at once
// when the grid was launched without the attribute).
__device__ __forceinline__ void gridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launch `kernel` as a programmatic dependent of the work before it on `stream` (sm_90+), falling back to a
// plain launch where the device or the driver does not offer it. The kernel must call gridDependencyWait()
// before reading what earlier kernels wrote.
template <typename Kernel, typename... Args>
cudaError_t launchProgrammaticDependent(Kernel kernel, dim3 grid, dim3 block, cudaStream_t stream,
                                        Args const&... args) {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = 0;
        cfg.stream = stream;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
        (void)cudaGetLastError();  // a refused attribute is not sticky: clear it and launch plainly
    }
    kernel<<<grid, block, 0, stream>>>(args...);
    return cudaGetLastError();
}

// makeKVSource with the pool descriptor already loaded: the decode kernel issues the descriptor load before
// reading the step metadata, so the two global round trips of its prologue overlap.
__device__ __forceinline__ KVSource makeKVSourceFromPool(PoolView const& pool, AttentionKernelParams const& p,
                                                         CtaWork const& w, int32_t kvHead) {
    KVSource s;
    s.pool = pool.base;
    s.table = BlockTableRow{p.blockTable + int64_t(w.seqIndex) * p.maxBlocks, p.maxBlocks, pool.numBlocks};
    s.kvHead = kvHead;
    s.span = w.span;
    s.chunk = w.chunk;
    return s;
}

// ---- 8-bit decode loader: one 16-token tile (virtual indices [v0, v0 + 16) of the CTA's span) -> the
// chunk-swizzled staging tiles Frag8 reads, K and V, by one warp. Same contract as loadKVRowsWarp<kD, 1, 16,
// true> (rows holding nothing are zero-filled without touching global memory, sPos[r] = position or -1), but
// without shuffles: every lane resolves a row itself (two lanes per row, in parallel, so no extra
// instruction) and copies half of its chunks, chunk 2j + half for j < kChunks / 2, of K and of V, from a row
// base address plus immediate offsets. Lane l: row (l & 7) + 8 (l >> 4), half (l >> 3) & 1, so that
//  * the two 16-byte halves of every 32-byte sector are read by lanes l and l ^ 8 of the same instruction
//    (whole sectors from L2), and
//  * each quarter warp (8 lanes: one shared-memory phase of 16-byte stores) writes 8 rows r = 0..7 (or
//    8..15) at chunk position (2j + half) ^ (r & 7): 8 distinct 16-byte bank groups for D = 128 and 256
//    (conflict-free; D = 64 rows are 64 bytes, 2-way).
// Per tile and lane: one lookup, two elemOffsets and kChunks (LOP3 + cp.async) pairs, against 16 / (32 /
// kChunks) shuffle-and-copy steps of the generic loader (the 8-bit decode path is issue-bound).
template <int kD>
__device__ __forceinline__ void loadKVTile8Decode(AttentionKernelParams const& p, KVSource const& src, int32_t v0,
                                                  uint32_t sK, uint32_t sV, int32_t* sPos, int32_t lane) {
    constexpr int kRows = 16;
    constexpr int kChunks = kD / 16;  // 16-byte chunks per 8-bit row: 4, 8 or 16
    static_assert(kRows == kDecodeTileTokens && kChunks % 2 == 0, "two lanes per row of a 16-token tile");
    int32_t const row = (lane & 7) + 8 * (lane >> 4);
    int32_t const half = (lane >> 3) & 1;
    KVRow const r = kvRowAt(p.layout, src.table, src.span, src.chunk, v0 + row);
    bool const holds = r.pos >= 0;
    // A row holding nothing keeps the pool base: the copies below then read nothing (src-size 0) from
    // addresses inside the pool's first row (< kD bytes past the base).
    unsigned char const* kSrc = src.pool;
    unsigned char const* vSrc = src.pool;
    if (holds) {
        kSrc += p.layout.elemOffset(r.loc.block, p.layer, 0, src.kvHead, r.loc.offset) + half * 16;
        vSrc += p.layout.elemOffset(r.loc.block, p.layer, 1, src.kvHead, r.loc.offset) + half * 16;
    }
    if (half == 0) sPos[row] = r.pos;
    // Frag8<kD>::chunkOffset(row, 2j + half) = row * kD + (((2j + half) ^ (row & m)) << 4); row * kD is a
    // multiple of the 16 * kChunks bytes that the XOR stays inside, so it equals base ^ (j << 5) with
    // base = row * kD + ((half ^ (row & m)) << 4) (bit 0 of the chunk index comes from half and the swizzle).
    uint32_t const base = Frag8<kD>::chunkOffset(row, half);
#pragma unroll
    for (int j = 0; j < kChunks / 2; ++j) {
        uint32_t const dst = base ^ uint32_t(j << 5);
        cpAsync16(sK + dst, kSrc + 32 * j, holds);
        cpAsync16(sV + dst, vSrc + 32 * j, holds);
    }
}

}  // namespace attn
}  // namespace pagedkv
