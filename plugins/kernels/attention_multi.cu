// Multi-token attention kernel: chunked-prefill chunks (a chunk attends to the cached prefix and causally to
// itself) and any sequence whose rows do not fit one 16-row tile. FlashAttention-2 style on mma.sync: a CTA
// owns a tile of kRows query rows (consecutive tokens x the G heads of one KV head), each warp 16 x kMTiles of
// them with Q fragments, S accumulators and O accumulators in registers; the 4 warps share K/V tiles of kTile
// tokens that stream through a cp.async pipeline (3 stages for D = 32, 64, else 2), pages resolved per
// row through the block table. Only the KV tiles the rows can see are visited (sinks + window, causal end),
// and the per-element mask runs only on tiles that need it.
//
// Grid (bodyTiles + B, KVH, Z): row-tile slots (attention_schedule.h: multiRowTile) in reverse order so that
// the tiles with the longest causal range start first, KV heads, split-K chunks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <string>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_tile.cuh"
#include "pdl.cuh"

namespace pagedkv {
namespace attn {
namespace {

template <typename CT, bool k8Bit, int kD>
struct MultiConfig {
    static_assert(kD % 16 == 0 && kD <= 256, "head dims are whole MMA k-steps and 16-byte chunks");
    static constexpr int kWarps = kMultiWarps;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kMTiles = multiWarpMTiles(kD);  // m16 tiles per warp
    static constexpr int kRows = multiTileRows(kD);      // kWarps * 16 * kMTiles
    // A pipeline stage holds kTile KV tokens (64 for D <= 128), computed as kTile / kSub sub-tiles of kSub = 32
    // tokens: the loader's per-call work (page lookups, barrier, vote) is paid once per 64 tokens, while S
    // stays 32 tokens wide per m-tile (64 would need 32 more registers per thread and spills at D = 128).
    static constexpr int kTile = multiTileTokens(kD);    // KV tokens per pipeline stage
    static constexpr int kSub = 32;                      // KV tokens per S / softmax / P V step
    static constexpr int kSubTiles = kTile / kSub;
    static constexpr int kNT = kSub / 8;                 // n8 tiles of S per m16 tile
    static constexpr int kTileRow = tileRowElems(kD);  // elements per row of the 16-bit tiles (Q, K, V)
    // 3 stages when they fit 2 CTAs/SM (64-element rows, D = 32 and 64: 64 KB): one barrier per KV tile instead
    // of two, and tiles are requested two tiles ahead. 128-element rows (D = 80, 96, 128; 64-token stages) and
    // D = 256 keep 2 stages (96 and 80 KB; 3 would exceed ~113 KB per CTA and drop it to 1 CTA/SM).
    static constexpr int kStages = kTileRow <= 64 ? 3 : kMultiStages;
    static constexpr int kAhead = kStages - 1;  // tiles in flight ahead of the one being computed
    static constexpr int kElemBytes = k8Bit ? 1 : 2;
    // A KV row as staged: 16-bit caches in the swizzled tile ldmatrix reads, 8-bit ones as stored (kD bytes).
    static constexpr int kRawRowBytes = k8Bit ? kD : kTileRow * 2;
    static constexpr int kRawTileBytes = kTile * kRawRowBytes;
    static constexpr int kConvTileBytes = k8Bit ? kTile * kTileRow * 2 : 0;
    static constexpr int kQBytes = kRows * kTileRow * 2;
    static constexpr int kSmemBytes = kQBytes + kStages * 2 * kRawTileBytes + 2 * kConvTileBytes + kStages * kTile * 4;
    // Q fragments in registers when they are few (D = 64); otherwise re-read from shared memory per k-step.
    static constexpr bool kQInRegs = kMTiles * kD <= 128;
    static_assert(kSub == 32 && kTile % kSub == 0, "the tile-is-clean vote reads one position per lane");
    static_assert(kQBytes % 32 == 0 && kRawTileBytes % 32 == 0,
                  "staging tiles start on 32-byte shared sectors (a cp.async pair across two is fetched twice)");
    // Warp w loads rows [w kTile / 4, (w + 1) kTile / 4) of a KV tile: a multiple of 8 rows, so the 16-bit
    // swizzle (row & 7) of a local row is the tile's.
    static_assert(kTile % (kWarps * 8) == 0, "each warp loads a multiple of 8 rows of a KV tile");
};

// What a lane holds across the KV loop for Q K^T: its ldmatrix lane offsets (FragLane) and, when they are few
// (kQInRegs), the Q fragments; otherwise they are re-read from the Q tile per k-step. (Its rows' query
// positions stay a kernel local: as a member here they cost the 8-bit D = 128 instance 76 bytes of spills.)
template <class Cfg, int kD>
struct MultiLane {
    static constexpr int kMT = Cfg::kMTiles;
    int32_t warpRow0;  // local row of the warp's first m-tile
    uint32_t sQAddr;
    uint32_t offA, offK, offV;
    uint32_t qFrag[Cfg::kQInRegs ? kMT : 1][Cfg::kQInRegs ? kD / 16 : 1][4];

    __device__ __forceinline__ MultiLane(unsigned char const* sQ, int32_t warp, int32_t lane) {
        using Lane = FragLane<kD>;
        warpRow0 = warp * 16 * kMT;
        sQAddr = smemAddr(sQ);
        offA = Lane::offsetA(lane), offK = Lane::offsetK(lane), offV = Lane::offsetV(lane);
    }
    // The Q fragments into registers (kQInRegs), once the Q tile is visible to the warp.
    __device__ __forceinline__ void loadQFragments() {
        if constexpr (Cfg::kQInRegs) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int kk = 0; kk < kD / 16; ++kk)
                    ldmatrixX4(qFrag[mt][kk], FragLane<kD>::at(sQAddr, offA, warpRow0 + mt * 16, kk));
        }
    }
    // The A fragment of m-tile mt's k-step kk.
    __device__ __forceinline__ void fragA(int mt, int kk, uint32_t (&a)[4]) const {
        if constexpr (Cfg::kQInRegs) {
            a[0] = qFrag[mt][kk][0], a[1] = qFrag[mt][kk][1];
            a[2] = qFrag[mt][kk][2], a[3] = qFrag[mt][kk][3];
        } else {
            ldmatrixX4(a, FragLane<kD>::at(sQAddr, offA, warpRow0 + mt * 16, kk));
        }
    }
};

// Compute stage 1 of a sub-tile: S = Q K^T for the warp's kMT m16 tiles x kSub tokens; each K fragment feeds
// kMT MMAs. Fully unrolled only when Q fragments live in registers (static indexing); otherwise a partial unroll
// keeps ptxas from hoisting every K fragment of the tile at once (4 k-steps: ldmatrix interleaved with the MMAs
// of the previous step, no spills; D = 128 sits at ~246 registers).
template <typename CT, class Cfg, int kD>
__device__ __forceinline__ void multiScores(MultiLane<Cfg, kD> const& q, uint32_t kSubAddr,
                                            float (&s)[Cfg::kMTiles][Cfg::kNT][4]) {
    constexpr int kMT = Cfg::kMTiles;
#pragma unroll(Cfg::kQInRegs ? kD / 16 : 4)
    for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) q.fragA(mt, kk, a[mt]);
#pragma unroll
        for (int np = 0; np < Cfg::kSub / 16; ++np) {
            uint32_t b[4];
            ldmatrixX4(b, FragLane<kD>::at(kSubAddr, q.offK, np * 16, kk));
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                Mma<CT>::run(s[mt][2 * np], a[mt], b[0], b[1]);
                Mma<CT>::run(s[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Compute stage 2 of a sub-tile: the online-softmax step of every m-tile (soft-cap and mask decided once per
// tile, withSoftmaxVariant), then O += P V, 16 tokens per k-step; each V fragment feeds kMT MMAs.
template <typename CT, class Cfg, int kD>
__device__ __forceinline__ void multiSoftmaxPV(AttentionKernelParams const& p, MultiLane<Cfg, kD> const& q,
                                               float (&s)[Cfg::kMTiles][Cfg::kNT][4], int32_t const* subPos,
                                               int32_t const (&qPos)[Cfg::kMTiles][2], bool needMask, uint32_t vSubAddr, int32_t lane,
                                               SoftmaxRows<kD / 8> (&st)[Cfg::kMTiles]) {
    constexpr int kMT = Cfg::kMTiles;
    constexpr int kNT = Cfg::kNT;
    withSoftmaxVariant(p.useSoftcap != 0, needMask, [&](auto capped, auto masked) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            float alpha[2];
            softmaxStepFixed<kNT, decltype(capped)::value, decltype(masked)::value>(
                p, s[mt], subPos, qPos[mt][0], qPos[mt][1], lane, st[mt].m, st[mt].l, alpha);
            rescaleRows(st[mt].o, alpha);
        }
    });
#pragma unroll
    for (int kt = 0; kt < Cfg::kSub / 16; ++kt) {
        uint32_t pa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) probFragment<CT, kNT>(s[mt], kt, pa[mt]);
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
            uint32_t b[4];
            ldmatrixX4Trans(b, FragLane<kD>::at(vSubAddr, q.offV, kt * 16, dp));
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                Mma<CT>::run(st[mt].o[2 * dp], pa[mt], b[0], b[1]);
                Mma<CT>::run(st[mt].o[2 * dp + 1], pa[mt], b[2], b[3]);
            }
        }
    }
}

// Epilogue: outputs straight from the accumulators, row g / g + 8 of each m-tile, dims dn * 8 + 2c, +1 -- the
// final output when the sequence is one chunk, else a normalized partial row and its log2-sum-exp.
template <typename CT, class Cfg, int kD>
__device__ __forceinline__ void writeMultiRows(AttentionKernelParams const& p, CtaWork const& w,
                                               MultiLane<Cfg, kD> const& q, SoftmaxRows<kD / 8> const (&st)[Cfg::kMTiles],
                                               int32_t kvHead, int32_t z, int32_t lane) {
    int32_t const g = lane >> 2;
    int32_t const c = lane & 3;
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float const sum = quadSum(st[mt].l[h]);
            int32_t const row = w.rowBegin + q.warpRow0 + mt * 16 + g + 8 * h;
            if (row >= w.rowEnd) continue;
            storeAccumulatorRow<CT, kD>(p, w, st[mt].o, h, sum, st[mt].m[h], row, kvHead, z, c);
        }
    }
}

// The CTA: prologue (work, KV source), the loader primed and Q loaded, the KV-tile loop (wait, barrier,
// [convert], per sub-tile: scores, loader, softmax + P V), the epilogue.
template <typename CT, bool k8Bit, int kD>
__global__ void __launch_bounds__(MultiConfig<CT, k8Bit, kD>::kThreads)
    attentionMultiKernel(__grid_constant__ AttentionKernelParams const p) {
    using Cfg = MultiConfig<CT, k8Bit, kD>;
    constexpr int kTile = Cfg::kTile;
    constexpr int kMT = Cfg::kMTiles;
    constexpr int kNT = Cfg::kNT;
    extern __shared__ __align__(16) unsigned char smem[];

    int32_t const slot = int32_t(gridDim.x) - 1 - int32_t(blockIdx.x);
    int32_t const kvHead = blockIdx.y;
    int32_t const z = blockIdx.z;
    int32_t const tid = threadIdx.x;
    int32_t const warp = tid >> 5;
    int32_t const lane = tid & 31;

    // ---- prologue
    gridDependencyWait();  // launched as a programmatic dependent (pdl.cuh): earlier kernels' writes visible from here
    CtaWork const w = multiCtaWork(p.split, p.stepView(), Cfg::kRows, kTile, slot, z);
    if (!w.active) return;
    KVSource const src = makeKVSource(p, w, kvHead, Cfg::kElemBytes);
    int32_t const qa = rowQueryPos(w.seq, w.rowBegin, p.groupSize);    // earliest query of the tile
    int32_t const qb = rowQueryPos(w.seq, w.rowEnd - 1, p.groupSize);  // latest
    // ---- shared memory: the Q tile, then the staged KV tiles
    unsigned char* const sQ = smem;
    KVStageTiles<Cfg::kStages, Cfg::kRawTileBytes, Cfg::kConvTileBytes, kTile> const sm(smem + Cfg::kQBytes);

    // ---- loader: each warp loads its own kWarpRows rows of every KV tile (copyKVRows: one page lookup per row,
    // by one lane, two tiles per lookup pass: PairedKVTileLoader, their block-table entries requested a tile or
    // two ahead).
    int32_t const numTiles = w.tiles.count();
    constexpr int kWarpRows = kTile / Cfg::kWarps;
    constexpr uint32_t kWarpRowBytes = uint32_t(kWarpRows * Cfg::kRawRowBytes);
    auto const tileAt = [&](int32_t n) {
        bool const valid = n < numTiles;
        return KVTileRef{valid, valid ? w.tiles.tile(n) * kTile + warp * kWarpRows : 0};
    };
    PairedKVTileLoader<kD, Cfg::kElemBytes, kWarpRows> loader;
    loader.start(p, src, tileAt, lane);
    // issue(i): tile i's copies into its stage (one commit group per call, empty past the last tile).
    auto issue = [&](int32_t i) {
        if (i < numTiles) {
            int32_t const stage = i % Cfg::kStages;
            loader.copy(p, src, tileAt, i, smemAddr(sm.rawK(stage)) + warp * kWarpRowBytes,
                        smemAddr(sm.rawV(stage)) + warp * kWarpRowBytes, sm.pos(stage) + warp * kWarpRows, lane);
        }
        cpAsyncCommit();
    };
#pragma unroll
    for (int32_t i = 0; i < Cfg::kAhead; ++i) issue(i);
    loadQRows<CT, kD, Cfg::kRows, Cfg::kThreads>(p, sQ, w.rowBegin, w.rowEnd, kvHead, tid);

    // ---- this thread's rows and state
    int32_t const warpRow0 = warp * 16 * kMT;  // local row of the warp's first m-tile
    bool const warpHasRows = w.rowBegin + warpRow0 < w.rowEnd;
    int32_t qPos[kMT][2];  // query positions of the lane's rows: m-tile mt, rows g and g + 8 (-1: none)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int32_t const row = w.rowBegin + warpRow0 + mt * 16 + (lane >> 2) + 8 * h;
            qPos[mt][h] = row < w.rowEnd ? rowQueryPos(w.seq, row, p.groupSize) : -1;
        }
    }
    MultiLane<Cfg, kD> q(sQ, warp, lane);
    SoftmaxRows<kD / 8> st[kMT];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) st[mt].init();

    // Commit groups before iteration i's wait: tiles [0, i + kAhead) (2 stages: issue(i + 1) comes first).
    // Waiting until at most kAhead - 1 = 1 group is pending therefore means tile i has landed.
    //  * 2 stages: issue(i + 1) fills the stage of tile i - 1, released by the barrier ending iteration i - 1.
    //  * 3 stages: issue(i + 2) fills the stage of tile i - 1 (and, 8-bit, convert(i) rewrites the converted
    //    tiles that compute(i - 1) read) only after this iteration's barrier, which every warp reaches after
    //    finishing iteration i - 1: one barrier per tile (two with the 8-bit conversion). It is placed after
    //    the S MMAs (any point after the barrier is safe), and every warp calls it exactly once per iteration.
    for (int32_t i = 0; i < numTiles; ++i) {
        if constexpr (Cfg::kStages == 2) issue(i + 1);
        cpAsyncWait<1>();        // tile i has landed for this thread ...
        __syncthreads();         // ... and for every thread; Q is visible too
        int32_t const stage = i % Cfg::kStages;
        uint32_t kTileAddr = smemAddr(sm.rawK(stage));
        uint32_t vTileAddr = smemAddr(sm.rawV(stage));
        if constexpr (k8Bit) {
            convertTile8<CT, kD, kTile, Cfg::kThreads>(sm.rawK(stage), sm.convK(), p.cacheIsFp8 != 0, tid);
            convertTile8<CT, kD, kTile, Cfg::kThreads>(sm.rawV(stage), sm.convV(), p.cacheIsFp8 != 0, tid);
            __syncthreads();
            kTileAddr = smemAddr(sm.convK());
            vTileAddr = smemAddr(sm.convV());
        }
        if (i == 0) q.loadQFragments();
        int32_t const* const tilePos = sm.pos(stage);
        if (warpHasRows) {
            // The stage's kTile tokens as kSubTiles steps of kSub tokens (not unrolled: registers and code size).
#pragma unroll 1
            for (int32_t h = 0; h < Cfg::kSubTiles; ++h) {
                int32_t const* const subPos = tilePos + h * Cfg::kSub;
                uint32_t const kSubAddr = kTileAddr + uint32_t(h * Cfg::kSub * Cfg::kTileRow * 2);
                uint32_t const vSubAddr = vTileAddr + uint32_t(h * Cfg::kSub * Cfg::kTileRow * 2);
                // A sub-tile holding no position at all (past the chunk's end) is skipped; else, is every row a
                // position all the CTA's queries see? Then skip the per-element mask.
                bool const anyRow = __any_sync(0xffffffffu, subPos[lane] >= 0);
                bool const holdsAll = __all_sync(0xffffffffu, subPos[lane] >= 0);
                bool const needMask =
                    tileNeedsMask(holdsAll, subPos[0], subPos[Cfg::kSub - 1], qa, qb, p.params.window);

                float s[kMT][kNT][4];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
                if (anyRow) multiScores<CT, Cfg, kD>(q, kSubAddr, s);
                // 3 stages: the loader's integer work issues while the tensor cores still run the S MMAs above
                // (their results are first needed by the softmax), instead of before any MMA of the tile.
                if constexpr (Cfg::kStages == 3) {
                    if (h == 0) issue(i + 2);
                }
                if (!anyRow) continue;
                multiSoftmaxPV<CT, Cfg, kD>(p, q, s, subPos, qPos, needMask, vSubAddr, lane, st);
            }
        } else {
            if constexpr (Cfg::kStages == 3) issue(i + 2);  // warps without rows still load their share
        }
        // 2 stages: every warp is done with this stage (and the converted tile) before they are refilled.
        if constexpr (Cfg::kStages == 2) __syncthreads();
    }
    cpAsyncWait<0>();

    // ---- epilogue
    writeMultiRows<CT, Cfg, kD>(p, w, q, st, kvHead, z, lane);
}

template <typename CT, bool k8Bit, int kD>
struct MultiFamily : MultiConfig<CT, k8Bit, kD> {
    static constexpr char const* kName = "multi-token attention kernel";
    static auto kernel() { return attentionMultiKernel<CT, k8Bit, kD>; }
};

}  // namespace

cudaError_t multiKernelShape(IODType io, CacheDType cache, int32_t headDim, KernelShape& shape) {
    return familyShape<MultiFamily>(io, cache, headDim, shape);
}

cudaError_t readMultiKernelChoice(MultiKernelChoice& choice) {
    char const* const value = std::getenv("PAGEDKV_MULTI_KERNEL");
    std::string const v = value != nullptr ? value : "";
    if (v.empty()) choice = MultiKernelChoice::kDefault;
    else if (v == "mma") choice = MultiKernelChoice::kMma;
    else if (v == "sm90-cooperative") choice = MultiKernelChoice::kSm90Cooperative;
    else if (v == "sm90-ws") choice = MultiKernelChoice::kSm90WarpSpecialized;
    else return invalidArgument("PAGEDKV_MULTI_KERNEL=" + v + ": expected mma, sm90-cooperative or sm90-ws");
    return cudaSuccess;
}

// On an sm_90 device the Hopper kernel serves what it covers (every head dim and cache dtype: multiKernelSm90Serves);
// the plan takes the serving kernel's row tile (its CTAs' query rows: sm90TileRows or multiTileRows) with its
// occupancy.
cudaError_t multiKernelOccupancy(IODType io, CacheDType cache, int32_t headDim, int32_t& ctasPerSm, int32_t& tileRows) {
    MultiKernelChoice choice{};
    if (cudaError_t const err = readMultiKernelChoice(choice); err != cudaSuccess) return err;
#if PAGEDKV_HAS_SM90A
    if (multiKernelSm90Serves(io, cache, headDim, choice))
        return multiKernelSm90Occupancy(io, cache, headDim, choice, ctasPerSm, tileRows);
#endif
    tileRows = multiTileRows(headDim);
    return prepareOrLaunch<MultiFamily>(io, cache, headDim, ctasPerSm, nullptr, dim3(), nullptr);
}

cudaError_t launchMultiKernel(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                              dim3 grid, cudaStream_t stream) {
    MultiKernelChoice choice{};
    if (cudaError_t const err = readMultiKernelChoice(choice); err != cudaSuccess) return err;
#if PAGEDKV_HAS_SM90A
    if (multiKernelSm90Serves(io, cache, headDim, choice))
        return launchMultiKernelSm90(kp, io, cache, headDim, choice, grid, stream);
#endif
    int32_t ctasPerSm = 0;
    return prepareOrLaunch<MultiFamily>(io, cache, headDim, ctasPerSm, &kp, grid, stream);
}

}  // namespace attn
}  // namespace pagedkv
