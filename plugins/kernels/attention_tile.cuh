// Device building blocks shared by the decode and multi-token attention kernels: the pool view, loading
// query rows and KV rows into shared memory, the 8-bit -> 16-bit tile conversion, the logit transform and the
// online-softmax step on MMA accumulator fragments. Page addressing goes through kv_layout.h only
// (kvRowEntryAt / resolveKVRow -> locateToken's two halves, KVLayout::elemOffset).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

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
    int64_t const* desc = p.params.meta.poolDescs + int64_t(p.params.meta.poolIndex) * kPoolDescFields;
    PoolView v;
    v.base = reinterpret_cast<unsigned char const*>(__ldg(desc + kPoolDescAddress));
    v.numBlocks = __ldg(desc + kPoolDescNumBlocks);
    return v;
}

// Where a CTA's KV rows come from: one sequence's block-table row, one KV head (through kBase), one chunk of
// its span. kBase is the byte offset of (layer, K, kvHead) inside a block and vDelta the bytes from a K row to the V
// row of the same (block, offset): elemOffset is linear, so a row's K offset is kBase + elemOffset(block, 0,
// 0, 0, offset) * element bytes, and the per-row work is two products instead of five.
struct KVSource {
    unsigned char const* pool;
    BlockTableRow table;
    KVSpan span;
    ChunkRange chunk;
    int64_t kBase;
    int64_t vDelta;
    int64_t rowStride;  // bytes from a token row to the next token's row of the same page (strideToken)
};

// With the pool descriptor already loaded: the decode kernel issues that load before reading the step
// metadata, so the two global round trips of its prologue overlap.
__device__ __forceinline__ KVSource makeKVSourceFromPool(PoolView const& pool, AttentionKernelParams const& p,
                                                         CtaWork const& w, int32_t kvHead, int32_t elemBytes) {
    KVSource s;
    s.pool = pool.base;
    StepMetadata const& meta = p.params.meta;
    s.table = BlockTableRow{meta.blockTable + int64_t(w.seqIndex) * meta.maxBlocks, meta.maxBlocks, pool.numBlocks};
    s.span = w.span;
    s.chunk = w.chunk;
    s.kBase = p.params.layout.elemOffset(0, p.params.layer, 0, kvHead, 0) * elemBytes;
    s.vDelta = p.params.layout.elemOffset(0, p.params.layer, 1, kvHead, 0) * elemBytes - s.kBase;
    s.rowStride = p.params.layout.strideToken * elemBytes;
    return s;
}

__device__ __forceinline__ KVSource makeKVSource(AttentionKernelParams const& p, CtaWork const& w, int32_t kvHead,
                                                 int32_t elemBytes) {
    return makeKVSourceFromPool(loadPool(p), p, w, kvHead, elemBytes);
}

// Byte offset of (row, 16-byte chunk) in a swizzled 16-bit tile of head dim kD (rows of tileRowElems(kD)
// elements: attention_schedule.h).
template <int kD>
__device__ __forceinline__ uint32_t tileChunk(int32_t row, int32_t chunk) {
    return swizzledChunk(row, chunk, tileRowElems(kD) * 2);
}

// Byte offset of (row, 16-byte chunk) in a blocked 16-bit tile of kTileRows rows, the layout the Hopper kernel's
// wgmma reads (sm90/wgmma.cuh): column block ch / 8 holds kTileRows rows of 128 bytes, chunk ch % 8 of row r at
// position (ch % 8) ^ (r & 7). For head dims <= 64 it is tileChunk's layout.
template <int kTileRows>
__device__ __forceinline__ uint32_t blockedTileChunk(int32_t row, int32_t chunk) {
    return uint32_t((chunk >> 3) * (kTileRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// ---- 8-bit K/V tiles read straight into MMA fragments (decode kernel): no conversion pass through shared
// memory. The staging tile is [tokens][kD] bytes with 16-byte chunk ch of row r at ch ^ (r & (chunks - 1,
// at most 7)). Two index permutations make every fragment a few wide, bank-conflict-free shared loads:
//  * Q K^T: a dot product does not care in which order the head dims are summed, so the MMA's k index
//    (logical dim) runs over the physical dims in the order that lets lane (g, c) read whole 16-byte chunks:
//    k-step i = 4h + wi takes word wi of chunk laneChunkK(c, h) of token g (g + 8), bytes (0, 1) as the
//    fragment's k pair (2c, 2c + 1) and bytes (2, 3) as (2c + 8, 2c + 9). Q is stored in shared memory in
//    the same logical order (loadQRowsK8), so its ldmatrix fragments match.
//  * P V: the MMA's n index of output tile dn at n = g is the physical dim vDim(dn, g), chosen so that lane
//    g reads its dims of all output tiles as one contiguous run of a token row (tokens 2c, 2c + 1, 2c + 8,
//    2c + 9 of the tile: the k pairs of the B fragment). The output accumulators are mapped back through
//    vDim when they leave the registers.
// Bank conflicts: K reads (8 lanes per 16-byte phase: tokens 2q, 2q + 1 x c) and V reads (tokens 2c.. x
// g = 2q, 2q + 1) hit 8 distinct chunk positions for D = 128 and 256; D = 64 V reads are 2-way.
template <int kD>
struct Frag8 {
    static constexpr int kChunks = kD / 16;                 // 16-byte chunks per token row
    static constexpr int kSwizzleMask = (kChunks < 8 ? kChunks : 8) - 1;
    static constexpr int kKChunksPerLane = kD / 64;         // chunks of one token a lane reads for Q K^T
    static constexpr int kVBytesPerLane = kD / 8;           // bytes of one token a lane reads for P V
    static constexpr int kVRun = kD / 8 < 16 ? kD / 8 : 16; // contiguous dims per lane and 128-dim block

    static __device__ __forceinline__ uint32_t chunkOffset(int32_t row, int32_t chunk) {
        return uint32_t(row * kD + ((chunk ^ (row & kSwizzleMask)) << 4));
    }
    // Chunk h (< kKChunksPerLane) of lane quad position c, for Q K^T.
    static __host__ __device__ constexpr int laneChunkK(int c, int h) {
        return kD == 64 ? c : 8 * (h >> 1) + 2 * c + (h & 1);
    }
    // Physical dim of logical dim kl (the MMA's k index of Q K^T).
    static __host__ __device__ constexpr int physDimK(int kl) {
        return 16 * laneChunkK(((kl & 15) & 7) >> 1, (kl >> 4) >> 2) + 4 * ((kl >> 4) & 3) + 2 * ((kl & 15) >> 3) +
               (kl & 1);
    }
    // Physical dim of output tile dn (< kD / 8), column n (< 8), for P V.
    static __host__ __device__ constexpr int vDim(int dn, int n) { return 128 * (dn >> 4) + kVRun * n + (dn & 15); }
};

// ---- KV rows of a warp's tiles -> shared memory, K and V, in three steps, two tiles at a time:
//  * locateKVRowPair: lane l < 2 kRows locates row l % kRows of tile l / kRows of a pair of the warp's tiles
//    (kvRowEntryAt: position, page slot, offset) and requests its block-table entry. One lookup pass serves
//    two tiles, and the caller keeps the result in registers until the pair's first copy, a tile or two of
//    compute later, so the entry's global round trip overlaps compute instead of stalling the warp
//    (profiled: the lookups were ~1/3 of the decode loop's instructions, the entry load its largest
//    long-scoreboard stall).
//  * resolveKVRowOffset: the entry checked (resolveKVRow) and the row's K byte offset computed, per pair.
//  * copyKVRows, per tile: a tile that is one run -- every row holds a position and row r lies r token
//    strides after row 0, i.e. any tile that does not straddle a page boundary, a window/sink seam, a cyclic
//    wrap or the end of the span -- is copied from row 0's offset (one shuffle per tile); any other tile row
//    by row, the lanes copying a row's 16-byte chunks receiving its offset by shuffle from the lane holding
//    it (two shuffles and 64-bit address work per row; measured: the run path took the chunked prefill
//    from 4475 to 4324 us). The V row is src.vDelta after the K row; sPos[r] records the position or -1,
//    and a row holding nothing is zero-filled without touching global memory.
// Destinations: 16-bit caches land in swizzled tiles (tileChunk: rows of tileRowElems(kD) elements) that
// ldmatrix reads directly, or, with kBlockRows > 0, in the blocked tile of kBlockRows rows that wgmma reads
// (blockedTileChunk; sK / sV then point at the warp's first row inside column block 0); 8-bit caches in a staging
// tile of kD-byte rows, row-major for convertTile8 or chunk-swizzled for Frag8 (kSwizzle8: the decode kernel at
// D = 64, 128, 256).
template <int kRows>
__device__ __forceinline__ KVRow locateKVRowPair(AttentionKernelParams const& p, KVSource const& src, bool valid0,
                                                 int32_t v0, bool valid1, int32_t v1, int32_t lane) {
    static_assert(2 * kRows <= 32, "a warp locates two tiles at once");
    bool const second = lane >= kRows;
    bool const valid = lane < 2 * kRows && (second ? valid1 : valid0);
    // v = -1 lies outside every chunk: pos -1, nothing loaded
    return kvRowEntryAt(p.params.layout, src.table, src.span, src.chunk,
                        valid ? (second ? v1 + lane - kRows : v0 + lane) : -1);
}

// A located row's K byte offset from the pool base, or kNothing (offset 0 with the sign bit set) for a row
// holding nothing: its copies zero-fill (src-size 0, no read) with block 0's address -- inside the pool, so
// sanitizers see no stray pointer -- and need no per-copy select of the address.
struct KVRowOffset {
    int64_t kOff;
    int32_t pos;
};
constexpr int64_t kNothing = INT64_MIN;

__device__ __forceinline__ KVRowOffset resolveKVRowOffset(AttentionKernelParams const& p, KVSource const& src,
                                                          KVRow row, int32_t elemBytes) {
    resolveKVRow(src.table, row);
    KVRowOffset r;
    r.pos = row.pos;
    r.kOff = row.pos >= 0 ? src.kBase + p.params.layout.elemOffset(row.loc.block, 0, 0, 0, row.loc.offset) * elemBytes
                          : kNothing;
    return r;
}

// The positions of a tile's rows (held by lanes [firstLane, firstLane + kRows) of the pair) into sPos[0, kRows).
template <int kRows>
__device__ __forceinline__ void storeKVPositions(KVRowOffset const& rows, int32_t firstLane, int32_t* sPos,
                                                 int32_t lane) {
    int32_t const pos = __shfl_sync(0xffffffffu, rows.pos, firstLane + lane % kRows);
    if (lane < kRows) sPos[lane] = pos;
}

// Whether a tile's rows are one run -- every row holds a position and row r lies r token strides after row 0, whose
// offset comes back in row0. Warp-uniform. kNothing is negative, so a row holding nothing is never part of one.
template <int kRows>
__device__ __forceinline__ bool kvRowsAreRun(KVSource const& src, KVRowOffset const& rows, int32_t firstLane,
                                             int32_t lane, int64_t& row0) {
    row0 = __shfl_sync(0xffffffffu, rows.kOff, firstLane);
    uint32_t const runBits =
        __ballot_sync(0xffffffffu, rows.kOff >= 0 && rows.kOff == row0 + (lane - firstLane) * src.rowStride);
    uint32_t const tileMask = (kRows == 32 ? 0xffffffffu : (1u << kRows) - 1u) << firstLane;
    return (runBits & tileMask) == tileMask;
}

// One tile: rows [0, kRows) held by lanes [firstLane, firstLane + kRows) of the pair. A row is kChunks 16-byte
// chunks; when kChunks divides 32 each copy step covers 32 / kChunks whole rows (lane l: chunk l % kChunks),
// otherwise (D = 80, 96 as 16-bit: 10, 12 chunks; D = 80 as 8-bit: 5) the tile's kRows x kChunks chunks are
// taken in row-major order, 32 per step (lane l of step i: chunk 32 i + l; the last step's lanes past the tile
// copy nothing), so that every lane is busy and a lane pair still copies one 32-byte sector of a run.
template <int kD, int kElemBytes, int kRows, bool kSwizzle8 = false, int kBlockRows = 0>
__device__ __forceinline__ void copyKVRows(KVSource const& src, KVRowOffset const& rows, int32_t firstLane,
                                           uint32_t sK, uint32_t sV, int32_t* sPos, int32_t lane) {
    constexpr int kRowBytes = kD * kElemBytes;
    constexpr int kChunks = kRowBytes / 16;  // 2 .. 32
    static_assert(kRowBytes % 16 == 0 && kChunks >= 2 && kChunks <= 32 && kRows <= 32, "warp KV tile shape");
    storeKVPositions<kRows>(rows, firstLane, sPos, lane);
    int const laneChunk = lane % kChunks;  // the lane's chunk of every row it copies (when kChunks divides 32)
    static_assert(kBlockRows == 0 || kElemBytes == 2,
                  "blocked tiles hold 16-bit elements (a row's chunks past D: none)");
    auto dstOf = [&](int r, int ch) {
        return kBlockRows > 0  ? blockedTileChunk<kBlockRows>(r, ch)
               : kElemBytes == 2 ? tileChunk<kD>(r, ch)
               : kSwizzle8     ? Frag8<kD>::chunkOffset(r, ch)
                               : uint32_t(r * kRowBytes + ch * 16);
    };
    // Checked here, not when the pair is resolved: a mask kept from there costs the multi-token kernel spills.
    int64_t row0;
    bool const run = kvRowsAreRun<kRows>(src, rows, firstLane, lane, row0);
    if constexpr (32 % kChunks == 0) {
        constexpr int kRowsPerStep = 32 / kChunks;
        static_assert(kRows % kRowsPerStep == 0, "whole rows per copy step");
        int const ch = laneChunk;
        if (run) {
            unsigned char const* const laneK = src.pool + row0 + (lane / kChunks) * src.rowStride + ch * 16;
#pragma unroll
            for (int i = 0; i < kRows / kRowsPerStep; ++i) {
                int const r = i * kRowsPerStep + lane / kChunks;
                int64_t const off = int64_t(i * kRowsPerStep) * src.rowStride;
                cpAsync16(sK + dstOf(r, ch), laneK + off, true);
                cpAsync16(sV + dstOf(r, ch), laneK + src.vDelta + off, true);
            }
            return;
        }
        unsigned char const* const laneK = src.pool + ch * 16;
        unsigned char const* const laneV = laneK + src.vDelta;
#pragma unroll
        for (int i = 0; i < kRows / kRowsPerStep; ++i) {
            int const r = i * kRowsPerStep + lane / kChunks;
            int64_t const k = __shfl_sync(0xffffffffu, rows.kOff, firstLane + r);
            bool const holds = k >= 0;
            int64_t const off = k & INT64_MAX;  // kNothing -> 0: block 0, a valid address that is not read
            cpAsync16(sK + dstOf(r, ch), laneK + off, holds);
            cpAsync16(sV + dstOf(r, ch), laneV + off, holds);
        }
    } else {
        constexpr int kSlots = kRows * kChunks;  // the tile's chunks
        constexpr int kSteps = (kSlots + 31) / 32;
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
            int const q = 32 * i + lane;
            bool const inTile = kSlots % 32 == 0 || q < kSlots;
            int const r = inTile ? q / kChunks : kRows - 1;  // past the tile: any row, for the shuffle below
            int const ch = q - r * kChunks;
            if (run) {
                if (inTile) {
                    unsigned char const* const k = src.pool + row0 + int64_t(r) * src.rowStride + ch * 16;
                    cpAsync16(sK + dstOf(r, ch), k, true);
                    cpAsync16(sV + dstOf(r, ch), k + src.vDelta, true);
                }
            } else {
                int64_t const k = __shfl_sync(0xffffffffu, rows.kOff, firstLane + r);  // every lane takes part
                if (inTile) {
                    int64_t const off = (k & INT64_MAX) + ch * 16;  // kNothing -> block 0, not read
                    cpAsync16(sK + dstOf(r, ch), src.pool + off, k >= 0);
                    cpAsync16(sV + dstOf(r, ch), src.pool + off + src.vDelta, k >= 0);
                }
            }
        }
    }
}

// ---- the staged KV tiles of a pipeline in shared memory, from `base`: kStages x (K, V) raw tiles of kRawTileBytes
// each, then (8-bit caches converted in shared memory: kConvTileBytes > 0) one converted K and one converted V
// tile, then the tiles' positions, kPosPerStage per stage. The decode kernel has one such block per warp, the
// multi-token kernel one per CTA.
template <int kStages, int kRawTileBytes, int kConvTileBytes, int kPosPerStage>
struct KVStageTiles {
    unsigned char* base;

    __device__ __forceinline__ explicit KVStageTiles(unsigned char* base_) : base(base_) {}
    __device__ __forceinline__ unsigned char* rawK(int stage) const { return base + stage * 2 * kRawTileBytes; }
    __device__ __forceinline__ unsigned char* rawV(int stage) const { return rawK(stage) + kRawTileBytes; }
    __device__ __forceinline__ unsigned char* convK() const { return base + kStages * 2 * kRawTileBytes; }
    __device__ __forceinline__ unsigned char* convV() const { return convK() + kConvTileBytes; }
    __device__ __forceinline__ int32_t* pos(int stage) const {
        return reinterpret_cast<int32_t*>(convV() + kConvTileBytes) + stage * kPosPerStage;
    }
};

// ---- a warp's stream of KV tile copies through the three steps above, two tiles per lookup pass: the warp's
// tiles 2q and 2q + 1 are located when tile 2q - 2 is copied and resolved when tile 2q is, so every block-table
// entry has a tile or two of compute to arrive in. The tile numbering is the caller's (tileAt(n): the warp's
// n-th tile -- a decode step or half of one, a multi-token KV tile -- as its first virtual index, 0 when
// invalid); the decode and multi-token kernels run their loaders through this one.
struct KVTileRef {
    bool valid;
    int32_t start;  // first virtual index of the tile's rows (0 when !valid)
};

template <int kD, int kElemBytes, int kRows, bool kSwizzle8 = false>
struct PairedKVTileLoader {
    KVRow located;     // the next pair's rows: block-table entries requested
    KVRowOffset rows;  // the current pair's rows: K byte offsets

    template <typename TileAt>
    static __device__ __forceinline__ KVRow locatePair(AttentionKernelParams const& p, KVSource const& src,
                                                       TileAt const& tileAt, int32_t n, int32_t lane) {
        KVTileRef const a = tileAt(n);
        KVTileRef const b = tileAt(n + 1);
        return locateKVRowPair<kRows>(p, src, a.valid, a.start, b.valid, b.start, lane);
    }
    // Locates the first pair (tiles 0 and 1).
    template <typename TileAt>
    __device__ __forceinline__ void start(AttentionKernelParams const& p, KVSource const& src, TileAt const& tileAt,
                                          int32_t lane) {
        located = locatePair(p, src, tileAt, 0, lane);
    }
    // Tile n's copies into (sK, sV) and its positions into sPos; an even n first resolves its pair and locates
    // the next one. The caller commits the copy group.
    template <typename TileAt>
    __device__ __forceinline__ void copy(AttentionKernelParams const& p, KVSource const& src, TileAt const& tileAt,
                                         int32_t n, uint32_t sK, uint32_t sV, int32_t* sPos, int32_t lane) {
        if ((n & 1) == 0) {
            rows = resolveKVRowOffset(p, src, located, kElemBytes);
            located = locatePair(p, src, tileAt, n + 2, lane);
        }
        copyKVRows<kD, kElemBytes, kRows, kSwizzle8>(src, rows, (n & 1) * kRows, sK, sV, sPos, lane);
    }
};

// ---- 8-bit staging tile [kRows][kD] bytes -> swizzled 16-bit tile of the compute type (exact, no scale); with
// kBlockRows > 0 the blocked tile wgmma reads (blockedTileChunk).
// `tid` runs over [0, kThreads): the CTA's threads (multi-token kernel) or one warp's lanes (decode kernel).
template <typename CT, int kD, int kRows, int kThreads, int kBlockRows = 0>
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
        uint32_t const dst = kBlockRows > 0 ? blockedTileChunk<kBlockRows>(r, j) : tileChunk<kD>(r, j);
        *reinterpret_cast<uint4*>(tile16 + dst) = dequant8x8<CT>(raw, isFp8);
    }
}

// The same conversion for kRows rows of a K and a V staging tile at once, by one warp, into blocked tiles (the
// warp-specialized Hopper producer): every load of both tiles is issued before any conversion, and fp8 vs int8 is
// decided once. Written as convertTile8 twice, ptxas kept each chunk a dependent load -> branch -> convert -> store
// step (it cannot move a shared-memory load above a store to shared memory that may alias it), one load latency
// per 16-byte chunk on the producer's critical path. K becomes KT values, V VT values (dequant8x8As).
template <typename KT, typename VT, int kD, int kRows, int kBlockRows>
__device__ __forceinline__ void convertKVRows8(unsigned char const* stagingK, unsigned char const* stagingV,
                                               unsigned char* tileK, unsigned char* tileV, bool isFp8,
                                               int32_t lane) {
    constexpr int kChunks8 = kD / 8;  // 8-element groups per row
    constexpr int kPerLane = kRows * kChunks8 / 32;
    static_assert((kRows * kChunks8) % 32 == 0, "conversion must split evenly over the lanes");
    uint2 rawK[kPerLane], rawV[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        int const q = lane + i * 32;
        rawK[i] = *reinterpret_cast<uint2 const*>(stagingK + (q / kChunks8) * kD + (q % kChunks8) * 8);
        rawV[i] = *reinterpret_cast<uint2 const*>(stagingV + (q / kChunks8) * kD + (q % kChunks8) * 8);
    }
    auto store = [&](auto fp8) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            int const q = lane + i * 32;
            uint32_t const dst = blockedTileChunk<kBlockRows>(q / kChunks8, q % kChunks8);
            *reinterpret_cast<uint4*>(tileK + dst) = dequant8x8As<KT, decltype(fp8)::value>(rawK[i]);
            *reinterpret_cast<uint4*>(tileV + dst) = dequant8x8As<VT, decltype(fp8)::value>(rawV[i]);
        }
    };
    if (isFp8) store(std::true_type{});
    else store(std::false_type{});
}

// Element offset in q of chunk ch (8 elements) of global row R (token R / G, head kvHead * G + R % G).
template <int kD>
__device__ __forceinline__ int64_t qRowElem(AttentionKernelParams const& p, int32_t row, int32_t kvHead, int32_t ch) {
    int32_t const token = row / p.groupSize;
    int32_t const head = kvHead * p.groupSize + row % p.groupSize;
    return (int64_t(token) * p.params.numQHeads + head) * kD + ch * 8;
}

// ---- query rows -> swizzled 16-bit tile [kRows][tileRowElems(kD)] (kBlocked: the blocked tile of kRows rows that
// wgmma reads). Local row r is global row rowBegin + r (token R / G, head kvHead * G + R % G); rows at or past
// rowEnd are zero. The kThreads threads load local rows [firstRow, firstRow + numRows) (default: all of them).
template <typename CT, int kD, int kRows, int kThreads, bool kBlocked = false>
__device__ __forceinline__ void loadQRows(AttentionKernelParams const& p, unsigned char* sQ, int32_t rowBegin,
                                          int32_t rowEnd, int32_t kvHead, int32_t tid, int32_t firstRow = 0,
                                          int32_t numRows = kRows) {
    constexpr int kChunks = kD / 8;  // 16-byte chunks of the compute type per row
    for (int q = tid; q < numRows * kChunks; q += kThreads) {
        int const r = firstRow + q / kChunks;
        int const ch = q % kChunks;
        int32_t const row = rowBegin + r;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (row < rowEnd) {
            int64_t const elem = qRowElem<kD>(p, row, kvHead, ch);
            if (p.params.qFP8) {
                uint2 raw = __ldg(reinterpret_cast<uint2 const*>(static_cast<unsigned char const*>(p.params.q) + elem));
                val = dequant8x8<CT>(raw, true);
            } else {
                val = __ldg(reinterpret_cast<uint4 const*>(static_cast<CT const*>(p.params.q) + elem));
            }
        }
        *reinterpret_cast<uint4*>(sQ + (kBlocked ? blockedTileChunk<kRows>(r, ch) : tileChunk<kD>(r, ch))) = val;
    }
}

// loadQRows's rows as cp.async copies into the blocked tile of kRows rows (16-bit queries: an 8-bit one is converted
// on the way, through registers): nothing waits for them here; the caller commits, waits and fences before its MMAs
// read them. A row at or past rowEnd is zero-filled (its copy reads nothing from the valid address it is given).
template <typename CT, int kD, int kRows, int kThreads>
__device__ __forceinline__ void copyQRowsAsync(AttentionKernelParams const& p, uint32_t sQ, int32_t rowBegin,
                                               int32_t rowEnd, int32_t kvHead, int32_t tid, int32_t firstRow,
                                               int32_t numRows) {
    constexpr int kChunks = kD / 8;  // 16-byte chunks per row
    CT const* const q = static_cast<CT const*>(p.params.q);
    for (int i = tid; i < numRows * kChunks; i += kThreads) {
        int const r = firstRow + i / kChunks;
        int const ch = i % kChunks;
        int32_t const row = rowBegin + r;
        bool const holds = row < rowEnd;
        int64_t const elem = qRowElem<kD>(p, holds ? row : 0, kvHead, ch);  // row 0: a valid address, not read
        cpAsync16(sQ + blockedTileChunk<kRows>(r, ch), q + elem, holds);
    }
}

// The power of two 2^shift that puts maxAbs (a max |q| over bf16 queries) in [2^14, 2^15) for an f16 tile: no
// overflow, and every value above maxAbs * 2^-28 keeps all 8 of its bf16 significant bits in f16 (11 bits).
// floor(log2(maxAbs)) comes from the exponent field (0 and subnormals read as -127; inf/NaN as 128 and stay inf/NaN
// whatever the scale); the shift is clamped so that both powers of two are normal. `scale` multiplies the queries,
// `unscale` (2^-shift) the logits.
struct F16QueryScale {
    float scale, unscale;
};
__device__ __forceinline__ F16QueryScale f16QueryScale(float maxAbs) {
    int32_t const ex = int32_t((__float_as_uint(maxAbs) >> 23) & 0xFFu) - 127;
    int32_t const shift = max(-100, min(100, 14 - ex));
    return {__uint_as_float(uint32_t(127 + shift) << 23), __uint_as_float(uint32_t(127 - shift) << 23)};
}

// 16 bf16 query rows into the f16 blocked tile of kRows rows that the warp-specialized Hopper kernel's S = Q K^T
// reads over an 8-bit cache (K in f16: the hardware converts fp8 to f16, not to bf16). One warp loads local rows
// [firstRow, firstRow + 16) -- the rows of one consumer warp's S accumulators, so the power of two they are scaled by
// is that warp's alone and needs no exchange beyond its lanes (f16QueryScale of their max |q|, as loadQRowsK8's of
// its CTA's). Rows at or past rowEnd are zero. Returns 2^-shift, the factor this warp's logits must be multiplied by.
template <int kD, int kRows>
__device__ __forceinline__ float loadQRowsScaledF16(AttentionKernelParams const& p, unsigned char* sQ,
                                                    int32_t rowBegin, int32_t rowEnd, int32_t kvHead, int32_t lane,
                                                    int32_t firstRow) {
    constexpr int kChunks = kD / 8;  // 16-byte chunks per row
    constexpr int kPerLane = 16 * kChunks / 32;
    static_assert((16 * kChunks) % 32 == 0, "16 rows' chunks split evenly over a warp");
    // The chunks stay in registers between the two passes up to D = 128 (32 registers); at D = 256 O's 128
    // accumulators a thread are live here and 64 more spilled, so the second pass loads them again (L1 hits).
    constexpr bool kKeep = kPerLane <= 8;
    auto load = [&](int i) {
        int const q = lane + 32 * i;
        int32_t const row = rowBegin + firstRow + q / kChunks;
        if (row >= rowEnd) return make_uint4(0u, 0u, 0u, 0u);
        return __ldg(reinterpret_cast<uint4 const*>(static_cast<__nv_bfloat16 const*>(p.params.q) +
                                                    qRowElem<kD>(p, row, kvHead, q % kChunks)));
    };
    auto toFloat2 = [](uint32_t pair) { return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&pair)); };
    uint4 kept[kKeep ? kPerLane : 1];
    float maxAbs = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        uint4 const v = load(i);
        if constexpr (kKeep) kept[i] = v;
        uint32_t const w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            float2 const f = toFloat2(w[t]);
            maxAbs = fmaxf(maxAbs, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) maxAbs = fmaxf(maxAbs, __shfl_xor_sync(0xffffffffu, maxAbs, off));
    F16QueryScale const qs = f16QueryScale(maxAbs);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        uint4 v;
        if constexpr (kKeep) v = kept[i];
        else v = load(i);
        uint32_t const w[4] = {v.x, v.y, v.z, v.w};
        uint32_t h[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            float2 const f = toFloat2(w[t]);
            h[t] = Mma<__half>::pack(f.x * qs.scale, f.y * qs.scale);  // exact power-of-two scaling, then RN
        }
        int const q = lane + 32 * i;
        *reinterpret_cast<uint4*>(sQ + blockedTileChunk<kRows>(firstRow + q / kChunks, q % kChunks)) =
            make_uint4(h[0], h[1], h[2], h[3]);
    }
    return qs.unscale;
}

// ---- query rows for the 8-bit decode path, which runs Q K^T as an f16 MMA (8-bit K values are exact in f16
// and convert with one cvt per pair). Like loadQRows, but (1) logical dim kl of the tile holds physical dim
// Frag8<kD>::physDimK(kl) (pairs kl, kl + 1 of even kl are physical neighbours), and (2) the tile is f16:
// bf16 queries are multiplied by 2^shift, one power of two for the whole CTA (f16QueryScale: the largest |q| in
// [2^14, 2^15), no overflow, exact conversion above max|q| * 2^-28). Returns 2^-shift, the factor the logits must
// be multiplied by (1 for f16 and fp8 queries, which convert exactly as they are). Every thread of the CTA must
// call it: it synchronizes the CTA once (sWarpMax: kThreads / 32 floats of scratch); the caller synchronizes again
// before reading sQ.
template <typename CT, int kD, int kRows, int kThreads>
__device__ __forceinline__ float loadQRowsK8(AttentionKernelParams const& p, unsigned char* sQ, float* sWarpMax,
                                             int32_t rowBegin, int32_t rowEnd, int32_t kvHead, int32_t tid) {
    constexpr int kChunks = kD / 8;
    constexpr int kPerThread = kRows * kChunks / kThreads;
    static_assert(kRows * kChunks % kThreads == 0 && kThreads % 32 == 0, "Q tile chunks must split evenly");
    constexpr bool kBf16 = std::is_same<CT, __nv_bfloat16>::value;
    uint32_t pairs[kPerThread][4];  // fp8 q: f16 pairs already; else pairs of CT
    float maxAbs = 0.f;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        int const q = tid + i * kThreads;
        int const r = q / kChunks;
        int const ch = q % kChunks;
        int32_t const row = rowBegin + r;
        pairs[i][0] = pairs[i][1] = pairs[i][2] = pairs[i][3] = 0u;
        if (row < rowEnd) {
            int32_t const token = row / p.groupSize;
            int32_t const head = kvHead * p.groupSize + row % p.groupSize;
            int64_t const rowElem = (int64_t(token) * p.params.numQHeads + head) * kD;
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                int64_t const elem = rowElem + Frag8<kD>::physDimK(ch * 8 + 2 * t);  // even: pair-aligned
                if (p.params.qFP8) {
                    uint32_t const raw =
                        __ldg(reinterpret_cast<unsigned short const*>(static_cast<unsigned char const*>(p.params.q) +
                                                                      elem));
                    uint32_t hi;
                    e4m3x4ToHalfPairs(raw, pairs[i][t], hi);
                } else {
                    pairs[i][t] = __ldg(reinterpret_cast<uint32_t const*>(static_cast<CT const*>(p.params.q) + elem));
                    if constexpr (kBf16) {
                        float2 const f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&pairs[i][t]));
                        maxAbs = fmaxf(maxAbs, fmaxf(fabsf(f.x), fabsf(f.y)));
                    }
                }
            }
        }
    }
    float qScale = 1.f, qUnscale = 1.f;
    if constexpr (kBf16) {
        if (!p.params.qFP8) {  // uniform
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) maxAbs = fmaxf(maxAbs, __shfl_xor_sync(0xffffffffu, maxAbs, off));
            if ((tid & 31) == 0) sWarpMax[tid >> 5] = maxAbs;
            __syncthreads();
#pragma unroll
            for (int w = 0; w < kThreads / 32; ++w) maxAbs = fmaxf(maxAbs, sWarpMax[w]);
            F16QueryScale const qs = f16QueryScale(maxAbs);
            qScale = qs.scale;
            qUnscale = qs.unscale;
        }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        int const q = tid + i * kThreads;
        int const r = q / kChunks;
        int const ch = q % kChunks;
        uint32_t h[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            if (kBf16 && !p.params.qFP8) {
                float2 const f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&pairs[i][t]));
                h[t] = Mma<__half>::pack(f.x * qScale, f.y * qScale);  // exact power-of-two scaling, then RN
            } else {
                h[t] = pairs[i][t];  // f16 q as stored, or fp8 q already converted
            }
        }
        *reinterpret_cast<uint4*>(sQ + tileChunk<kD>(r, ch)) = make_uint4(h[0], h[1], h[2], h[3]);
    }
    return qUnscale;
}

// ---- ldmatrix lane addresses (fragment layouts: attention_mma.cuh). In a swizzled tile the chunk of 16-dim
// step k read by a lane is (2k + half) ^ (row & 7) = 2k ^ (half ^ (row & 7)), so its byte offset within the
// row is ((half ^ (row & 7)) << 4) ^ (k << 5): a per-lane constant XOR a compile-time immediate (rows are
// 2^n bytes, tileRowElems, so the XOR never leaves the row). Tile rows of the lane: (lane & 7) plus 8 for some
// matrices. The kernels take k < kD / 16 only.
template <int kD>
struct FragLane {
    static constexpr int kRowBytes = tileRowElems(kD) * 2;
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

// capIn: the soft-cap's input scale (p.capInScale, times the raw scores' factor when there is one).
__device__ __forceinline__ float cappedLogitLog2(AttentionKernelParams const& p, float raw, float capIn) {
    return accurateTanh(raw * capIn) * p.capOutScaleLog2;
}

// Online-softmax step for one m16 tile of a warp: s[nt][e] holds the raw scores of KV tokens nt*8 + 2c + (e&1)
// for row g (e < 2) or g + 8 (e >= 2). Masked entries become -inf BEFORE anything multiplies them, the
// running max m and the thread-partial sums l are updated, s becomes the probabilities (unnormalized), and
// alpha is the factor the accumulated output of each row must be rescaled by. kvPos of column j is
// sPos[j]; qPos0/qPos1 are the query positions of rows g and g + 8 (-1: padding row, sees nothing).
// Without soft-cap the scores stay raw until the exponent: the logit scale is > 0 (validated), so the row max
// of raw scores times the scale is the max of the scaled logits (rounding is monotonic), and each
// probability costs one FFMA + ex2 instead of FMUL, FADD, ex2.
//
// Soft-cap and mask are each kOn / kOff (compile time) or kRuntime (tested per score: ptxas keeps those tests
// inside the unrolled element loop, two branches per score, but the kernel stays one instantiation with fewer
// registers — the decode kernel's choice; the multi-token kernel, issue-bound, picks per tile instead).
enum class Switch { kOff, kOn, kRuntime };

// kMaxSlack > 0 (log2 units): the running max m stays while a tile's row max exceeds it by at most kMaxSlack, so
// alpha is exactly 1 and the caller's vote skips rescaling O (FlashAttention-4's conditional rescaling); the
// probabilities then reach 2^kMaxSlack instead of 1, which fp16's range (65504) and the fp32 sums hold for a slack
// of 8, and m and l stay consistent, so the outputs and a split's LSE are the same function of the scores.
template <int kNT, Switch kCap, Switch kMask, int kMaxSlack = 0>
__device__ __forceinline__ void softmaxStepImpl(AttentionKernelParams const& p, float (&s)[kNT][4],
                                                int32_t const* sPos, bool needMask, int32_t qPos0, int32_t qPos1,
                                                int32_t lane, float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                float rawScale) {
    int32_t const c = lane & 3;
    bool const capped = kCap == Switch::kRuntime ? p.useSoftcap != 0 : kCap == Switch::kOn;  // uniform
    bool const masked = kMask == Switch::kRuntime ? needMask : kMask == Switch::kOn;
    // rawScale > 0 multiplies every raw score (the 8-bit decode path's power-of-two Q unscaling), folded into
    // the per-tile constants instead of one multiply per score.
    // s (after the loop below) * toLog2 = log2 logit; kept >= FLT_MIN like the launcher's scale (-inf * 0 = NaN)
    float const toLog2 = capped ? 1.f : fmaxf(p.scoreScaleLog2 * rawScale, FLT_MIN);
    float const capIn = p.capInScale * rawScale;
    // Wide tiles (kNT >= 8: the Hopper kernel's 128 tokens) reduce in kParts independent chains, so that the max
    // and the sum are not one dependent chain of 2 kNT operations per row; narrower tiles keep one chain (and their
    // exact summation order).
    constexpr int kParts = kNT >= 8 ? 4 : 1;
    float rowMaxPart[kParts][2];
#pragma unroll
    for (int q = 0; q < kParts; ++q) rowMaxPart[q][0] = rowMaxPart[q][1] = negInf();
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = capped ? cappedLogitLog2(p, s[nt][e], capIn) : s[nt][e];
            if (masked) {
                int32_t const kvPos = sPos[nt * 8 + 2 * c + (e & 1)];
                if (!kvVisible(e < 2 ? qPos0 : qPos1, kvPos, p.params.window, p.params.attentionSinks)) x = negInf();
            }
            s[nt][e] = x;
            rowMaxPart[nt % kParts][e >> 1] = fmaxf(rowMaxPart[nt % kParts][e >> 1], x);
        }
    }
    float rowMax[2] = {rowMaxPart[0][0], rowMaxPart[0][1]};
#pragma unroll
    for (int q = 1; q < kParts; ++q) rowMax[0] = fmaxf(rowMax[0], rowMaxPart[q][0]), rowMax[1] = fmaxf(rowMax[1], rowMaxPart[q][1]);
    float mUse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // the 4 lanes of a quad hold the same row
        rowMax[h] = fmaxf(rowMax[h], __shfl_xor_sync(0xffffffffu, rowMax[h], 1));
        rowMax[h] = fmaxf(rowMax[h], __shfl_xor_sync(0xffffffffu, rowMax[h], 2));
        rowMax[h] *= toLog2;  // -inf stays -inf (toLog2 > 0: the launcher keeps the scale >= FLT_MIN)
        float const mNew = kMaxSlack > 0 && rowMax[h] <= m[h] + float(kMaxSlack) ? m[h] : fmaxf(m[h], rowMax[h]);
        mUse[h] = mNew == negInf() ? 0.f : mNew;  // a row that saw nothing yet: keep exp2(-inf - 0) = 0
        alpha[h] = fastExp2(m[h] - mUse[h]);
        m[h] = mNew;
    }
    float rowSumPart[kParts][2];
#pragma unroll
    for (int q = 0; q < kParts; ++q) rowSumPart[q][0] = rowSumPart[q][1] = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float const pr = fastExp2(fmaf(s[nt][e], toLog2, -mUse[e >> 1]));
            s[nt][e] = pr;
            rowSumPart[nt % kParts][e >> 1] += pr;
        }
    }
    float rowSum[2] = {rowSumPart[0][0], rowSumPart[0][1]};
#pragma unroll
    for (int q = 1; q < kParts; ++q) rowSum[0] += rowSumPart[q][0], rowSum[1] += rowSumPart[q][1];
    l[0] = l[0] * alpha[0] + rowSum[0];
    l[1] = l[1] * alpha[1] + rowSum[1];
}

// Both switches at run time (one inlined variant): the decode kernel's 16-bit D = 256 path (registers).
template <int kNT>
__device__ __forceinline__ void softmaxStep(AttentionKernelParams const& p, float (&s)[kNT][4], int32_t const* sPos,
                                            bool needMask, int32_t qPos0, int32_t qPos1, int32_t lane,
                                            float (&m)[2], float (&l)[2], float (&alpha)[2], float rawScale = 1.f) {
    softmaxStepImpl<kNT, Switch::kRuntime, Switch::kRuntime>(p, s, sPos, needMask, qPos0, qPos1, lane, m, l, alpha,
                                                             rawScale);
}

// Both switches at compile time: the multi-token kernel and the other decode paths branch once per tile and
// call this.
template <int kNT, bool kCapped, bool kMask, int kMaxSlack = 0>
__device__ __forceinline__ void softmaxStepFixed(AttentionKernelParams const& p, float (&s)[kNT][4],
                                                 int32_t const* sPos, int32_t qPos0, int32_t qPos1, int32_t lane,
                                                 float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                 float rawScale = 1.f) {
    softmaxStepImpl<kNT, kCapped ? Switch::kOn : Switch::kOff, kMask ? Switch::kOn : Switch::kOff, kMaxSlack>(
        p, s, sPos, kMask, qPos0, qPos1, lane, m, l, alpha, rawScale);
}

// Soft-cap and mask decided once per tile (uniform branches), not per score: step(capped, masked) is called
// with std::true_type / std::false_type for each, so it compiles four times with both switches as constants
// (softmaxStepFixed). The decode, multi-token and Hopper kernels all branch this way.
template <typename Step>
__device__ __forceinline__ void withSoftmaxVariant(bool capped, bool masked, Step&& step) {
    using Yes = std::true_type;
    using No = std::false_type;
    if (capped) {
        if (masked) step(Yes{}, Yes{});
        else step(Yes{}, No{});
    } else {
        if (masked) step(No{}, Yes{});
        else step(No{}, No{});
    }
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

// The online-softmax state of one m16 tile of a warp: the output accumulators (rows g and g + 8 of each n8
// output tile, attention_mma.cuh), the running max (log2 domain) and the thread-partial sums of the two rows.
template <int kDimTiles>
struct SoftmaxRows {
    float o[kDimTiles][4];
    float m[2];
    float l[2];
    __device__ __forceinline__ void init() {
#pragma unroll
        for (int dn = 0; dn < kDimTiles; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
        m[0] = m[1] = negInf();
        l[0] = l[1] = 0.f;
    }
    // The row sums over the quad's 4 lanes (each thread holds a partial of its rows' columns).
    __device__ __forceinline__ void reduceSums() {
        l[0] = quadSum(l[0]);
        l[1] = quadSum(l[1]);
    }
};

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
    return (int64_t(z) * p.params.meta.numTokens + token) * p.params.numQHeads + head;
}

// Row g + 8 h of an m16 accumulator tile (global row `row`; this lane's dims 8 dn + 2c, + 1) -> the output, or a
// split chunk's normalized partial row and log2-sum-exp for the merge. The caller skips rows at or past
// w.rowEnd; sum is the row's quad-reduced sum (0: nothing seen -> 0, never 0/0) and m its running max. The
// multi-token kernels (mma.sync and Hopper) write their rows straight from the accumulators through this.
template <typename CT, int kD>
__device__ __forceinline__ void storeAccumulatorRow(AttentionKernelParams const& p, CtaWork const& w,
                                                    float const (&o)[kD / 8][4], int h, float sum, float m,
                                                    int32_t row, int32_t kvHead, int32_t z, int32_t c) {
    int32_t const token = row / p.groupSize;
    int32_t const head = kvHead * p.groupSize + row % p.groupSize;
    float const scale = sum > 0.f ? p.outScale / sum : 0.f;
    if (w.nChunks == 1) {
        CT* const dst = static_cast<CT*>(p.params.out) + (int64_t(token) * p.params.numQHeads + head) * kD + 2 * c;
#pragma unroll
        for (int dn = 0; dn < kD / 8; ++dn)
            *reinterpret_cast<uint32_t*>(dst + dn * 8) = Mma<CT>::pack(o[dn][2 * h] * scale, o[dn][2 * h + 1] * scale);
    } else {
        int64_t const prow = partialRow(p, z, token, head);
        float* const dst = p.partialOut + prow * kD + 2 * c;
#pragma unroll
        for (int dn = 0; dn < kD / 8; ++dn)
            *reinterpret_cast<float2*>(dst + dn * 8) = make_float2(o[dn][2 * h] * scale, o[dn][2 * h + 1] * scale);
        if (c == 0) p.partialLse[prow] = sum > 0.f ? m + __log2f(sum) : negInf();
    }
}

}  // namespace attn
}  // namespace pagedkv
