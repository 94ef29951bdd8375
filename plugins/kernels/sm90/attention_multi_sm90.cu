// Multi-token attention kernel for sm_90a (H100 / H200): the chunked-prefill / long-prompt / draft rows of
// attention_multi.cu on warpgroup MMAs. Same work split, same loader, same softmax; what changes is the math:
//  * a CTA's 2 consumer warpgroups (256 threads) serve kRows = 128 query rows (consecutive tokens x the G heads of
//    one KV head, the planner's row tile), each warpgroup 64 of them;
//  * KV tiles of kTile = 128 tokens stream through a cp.async pipeline into blocked, 128-byte-swizzled tiles
//    (blockedTileChunk), page by page through the block table (copyKVRows: one lookup per row, runs copied whole);
//  * per tile and warpgroup, S = Q K^T is kD / 16 wgmma m64n128k16 reading Q and K straight from shared memory,
//    the online softmax runs on the S registers (softmaxStepFixed: mask, soft-cap, running max and sum), and
//    O += P V is kTile / 16 wgmma m64nDk16 with P from registers and V read MN-major from shared memory;
//  * each warpgroup overlaps its softmax of tile i + 1 with its own P V of tile i (the pipeline below); in the
//    cooperative variant the two warpgroups also load and run in lockstep (one CTA barrier per tile); in the
//    warp-specialized one (the default) a producer warpgroup loads and the consumer warpgroups take turns on the
//    tensor cores.
// Head dims 64 / 128, every cache dtype (8-bit tiles are converted into 16-bit ones in shared memory, as the mma.sync
// kernel does); the other head dims (32, 80, 96, 256) and other GPUs stay on attention_multi.cu's mma.sync kernel
// (multiKernelSm90Serves). Design, byte and FLOP counts, measurements:
// benchmarks/NOTES-attention.md, "the Hopper multi-token kernel".
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_tile.cuh"
#include "pdl.cuh"
#include "wgmma.cuh"
#include "wgmma_ops.cuh"

namespace pagedkv {
namespace attn {
namespace {

// ---- shapes. Both kernels: a CTA serves kRows = 128 query rows (the planner's row tile) as 2 consumer warpgroups
// of 64 rows; KV tiles of kTile = 128 tokens in 3 stages (the pipeline holds tiles i, i + 1 and i + 2; the
// warp-specialized 8-bit variant 2 + 2, below).
//  * cooperative (PAGEDKV_MULTI_KERNEL=sm90-cooperative): 256 threads; every thread loads its share of each tile
//    and the CTA synchronizes once per tile (8-bit caches: a second time, after converting the tile into 16-bit
//    ones: one K, two V buffers).
//  * warp-specialized (the default): 384 threads; a producer warpgroup loads every tile (8-bit caches: and
//    converts it) into the stage the MMAs read and hands it over through mbarriers, so the consumer warpgroups
//    never wait on a CTA barrier, and take turns issuing their MMAs (named barriers), one's softmax under the
//    other's MMAs.
template <typename CT, bool k8Bit, int kD, bool kWarpSpecialized_ = false>
struct Sm90MultiConfig {
    static_assert(kD == 64 || kD == 128, "whole 128-byte column blocks, one wgmma N for O");
    static constexpr bool kWarpSpecialized = kWarpSpecialized_;
    static constexpr int kConsumerThreads = 256;
    static constexpr int kThreads = kConsumerThreads + (kWarpSpecialized ? 128 : 0);  // + the producer warpgroup
    static constexpr int kRows = 128;
    static_assert(kRows == multiTileRows(kD), "the planner's row tiles (attention_plan.cpp) are this kernel's");
    static constexpr int kTile = 128;  // KV tokens per stage = N of S = Q K^T
    static constexpr int kNT = kTile / 8;
    static constexpr int kQBytes = kRows * kD * 2;
    static constexpr int kKVTileBytes = kTile * kD * 2;  // a 16-bit K or V tile as the MMAs read it
    // Stages of the tiles as loaded (8-bit caches: [token][kD] bytes). The warp-specialized 8-bit variant keeps 2
    // of them and 2 converted (K, V) stages the MMAs read: 3 of each do not fit at D = 128.
    static constexpr bool kWS8 = k8Bit && kWarpSpecialized;
    static constexpr int kStages = kWS8 ? 2 : 3;
    static constexpr int kRawTileBytes = k8Bit ? kTile * kD : kKVTileBytes;
    // converted tiles: cooperative one K, two V (tile j's V at 1 + (j & 1)); warp-specialized 2 x (K, V)
    static constexpr int kConvBytes = !k8Bit ? 0 : kWS8 ? 4 * kKVTileBytes : 3 * kKVTileBytes;
    // the stages the MMAs read, handed over by the full / empty mbarriers (warp-specialized)
    static constexpr int kMmaStages = kWS8 ? 2 : kStages;
    // Position slots, tile j's at j % kPosSlots: the 8-bit producer writes tile j + 1's while tiles j - 1 and j
    // may still be read.
    static constexpr int kPosSlots = kWS8 ? 3 : kStages;
    static constexpr int kAlign = 1024;  // the swizzle repeats every 1024 bytes: blocks start on that boundary
    static constexpr int kPosBytes = kPosSlots * kTile * 4;
    static constexpr int kBarrierBytes = kWarpSpecialized ? 2 * kMmaStages * 8 : 0;  // full[], empty[] mbarriers
    static constexpr int kSmemBytes =
        kAlign + kQBytes + kStages * 2 * kRawTileBytes + kConvBytes + kPosBytes + kBarrierBytes;
    static_assert(kQBytes % kAlign == 0 && kRawTileBytes % kAlign == 0 && kKVTileBytes % kAlign == 0,
                  "tiles start on swizzle boundaries");
    static_assert(kSmemBytes <= 232448, "sm_90 opt-in shared memory per CTA");
};

// Broadcast from lane 0: ptxas then sees the value as warp-uniform. A wgmma under a branch it cannot prove uniform
// is serialized (each MMA waited for before the next issues), so every condition around the MMAs goes through this.
__device__ __forceinline__ int32_t warpUniform(int32_t v) { return __shfl_sync(0xffffffffu, v, 0); }

// ---- shared memory, 1024-byte aligned: Q, stages x (K, V), [8-bit: converted K, V, V], stages x positions,
// [warp-specialized: full[stages], empty[stages] mbarriers]
template <typename Cfg>
struct Sm90Smem {
    unsigned char* base;
    __device__ __forceinline__ explicit Sm90Smem(unsigned char* raw)
        : base(raw + ((Cfg::kAlign - (smemAddr(raw) & (Cfg::kAlign - 1))) & (Cfg::kAlign - 1))) {}
    __device__ __forceinline__ unsigned char* q() const { return base; }
    __device__ __forceinline__ unsigned char* rawK(int stage) const {
        return base + Cfg::kQBytes + stage * 2 * Cfg::kRawTileBytes;
    }
    __device__ __forceinline__ unsigned char* rawV(int stage) const { return rawK(stage) + Cfg::kRawTileBytes; }
    __device__ __forceinline__ unsigned char* conv() const {
        return base + Cfg::kQBytes + Cfg::kStages * 2 * Cfg::kRawTileBytes;
    }
    __device__ __forceinline__ int32_t* pos(int32_t j) const {  // tile j's positions
        return reinterpret_cast<int32_t*>(conv() + Cfg::kConvBytes) + (j % Cfg::kPosSlots) * Cfg::kTile;
    }
    __device__ __forceinline__ uint32_t full(int stage) const {
        return smemAddr(conv() + Cfg::kConvBytes + Cfg::kPosBytes) + 8u * uint32_t(stage);
    }
    __device__ __forceinline__ uint32_t empty(int stage) const { return full(Cfg::kMmaStages) + 8u * uint32_t(stage); }
    // the tiles the MMAs of tile j read: its stage (16-bit caches) or the converted tiles (8-bit)
    __device__ __forceinline__ uint32_t mmaK(int32_t j) const {
        if constexpr (Cfg::kWS8) return smemAddr(conv()) + uint32_t((j & 1) * 2 * Cfg::kKVTileBytes);
        else return Cfg::kConvBytes ? smemAddr(conv()) : smemAddr(rawK(j % Cfg::kStages));
    }
    __device__ __forceinline__ uint32_t mmaV(int32_t j) const {
        if constexpr (Cfg::kWS8) return mmaK(j) + uint32_t(Cfg::kKVTileBytes);
        else return Cfg::kConvBytes ? smemAddr(conv()) + uint32_t((1 + (j & 1)) * Cfg::kKVTileBytes)
                                    : smemAddr(rawV(j % Cfg::kStages));
    }
};

// ---- a consumer warpgroup's math on its 64 rows: S(j) = Q K_j^T into s; softmax(j) turns s into probabilities
// (mask, soft-cap, running max / sum; alpha: the factor O must be rescaled by); packP packs them into pa (only
// once no MMA reads pa any more: register operands stay live until the MMA completes); PV(j) is O += P_j V_j.
// This thread holds rows g and g + 8 of its warp's 16.
template <typename CT, int kD, typename Cfg>
struct Sm90Consumer {
    // Conditional rescaling (softmaxStepImpl): O is rescaled only when a row's max grows by more than 8 (log2 units).
    // On random scores some row of a warp sets a new max on many tiles, each costing 64 multiplies per thread on the
    // issue path the softmax is bound by (NOTES-attention.md, seventeenth session: -1 to -2 % at 1 x 8192).
    static constexpr int kMaxSlack = 8;
    static constexpr int kTile = Cfg::kTile;
    static constexpr int kNT = Cfg::kNT;
    float o[kD / 8][4];
    float s[kNT][4];
    uint32_t pa[kTile / 16][4];
    float m[2], l[2], alpha[2];
    int32_t qPos[2];
    int32_t groupRow0, warpRow0, lane;

    __device__ __forceinline__ Sm90Consumer(AttentionKernelParams const& p, CtaWork const& w, int32_t group,
                                            int32_t warp, int32_t lane_)
        : groupRow0(group * 64), warpRow0(group * 64 + (warp & 3) * 16), lane(lane_) {
#pragma unroll
        for (int dn = 0; dn < kD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        m[0] = m[1] = negInf();
        l[0] = l[1] = 0.f;
        alpha[0] = alpha[1] = 1.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int32_t const row = w.rowBegin + warpRow0 + (lane >> 2) + 8 * h;
            qPos[h] = row < w.rowEnd ? rowQueryPos(w.seq, row, p.groupSize) : -1;
        }
    }

    __device__ __forceinline__ void issueS(uint32_t sQ, uint32_t kTileAddr) {  // async; the caller commits
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk)
            wgmma::Mma<CT, kTile>::ss(s, wgmma::kMajor<Cfg::kRows>(sQ, groupRow0, kk),
                                      wgmma::kMajor<kTile>(kTileAddr, 0, kk), kk > 0);
    }
    __device__ __forceinline__ void issuePV(uint32_t vTileAddr) {
#pragma unroll
        for (int kt = 0; kt < kTile / 16; ++kt) wgmma::Mma<CT, kD>::rs(o, pa[kt], wgmma::mnMajor<kTile>(vTileAddr, kt), true);
    }
    __device__ __forceinline__ void softmax(AttentionKernelParams const& p, int32_t const* tilePos, bool needMask) {
        withSoftmaxVariant(p.useSoftcap != 0, needMask, [&](auto capped, auto masked) {
            softmaxStepFixed<kNT, decltype(capped)::value, decltype(masked)::value, kMaxSlack>(
                p, s, tilePos, qPos[0], qPos[1], lane, m, l, alpha);
        });
    }
    // S alone, or P V alone: issued, committed and waited for; `whileRunning` runs between the commit and the wait
    // (the ping-pong turn handed to the other warpgroup while the tensor cores work).
    template <typename WhileRunning>
    __device__ __forceinline__ void runS(uint32_t sQ, uint32_t kTileAddr, WhileRunning&& whileRunning) {
        wgmma::fence();
        issueS(sQ, kTileAddr);
        wgmma::commit();
        whileRunning();
        wgmma::wait<0>();
        wgmma::pin(s);
    }
    template <typename WhileRunning>
    __device__ __forceinline__ void runPV(uint32_t vTileAddr, WhileRunning&& whileRunning) {
        wgmma::fence();
        issuePV(vTileAddr);
        wgmma::commit();
        whileRunning();
        wgmma::wait<0>();
        wgmma::pin(o);
    }
    // The intra-warpgroup overlap: S(j + 1) and PV(j) issued back to back (after the rescaled O and the packed P(j)
    // are fenced), then softmax(j + 1) once S(j + 1) is done, while PV(j) may still run, and PV(j) waited for.
    __device__ __forceinline__ void issueSAndPV(uint32_t sQ, uint32_t kNext, uint32_t vThis) {
        wgmma::fence();
        issueS(sQ, kNext);
        wgmma::commit();
        issuePV(vThis);
        wgmma::commit();
    }
    __device__ __forceinline__ void softmaxUnderPV(AttentionKernelParams const& p, int32_t const* tilePos,
                                                   bool needMask) {
        wgmma::wait<1>();
        wgmma::pin(s);
        softmax(p, tilePos, needMask);
        wgmma::wait<0>();
        wgmma::pin(o);
    }
    __device__ __forceinline__ void packP() {
#pragma unroll
        for (int kt = 0; kt < kTile / 16; ++kt) probFragment<CT, kNT>(s, kt, pa[kt]);
    }
    __device__ __forceinline__ void rescale() { rescaleRows(o, alpha); }

    // Outputs straight from the accumulators (row g / g + 8; dims 8 dn + 2c, + 1): final rows, or a split chunk's
    // normalized partial and log2-sum-exp for the merge.
    __device__ __forceinline__ void store(AttentionKernelParams const& p, CtaWork const& w, int32_t kvHead,
                                          int32_t z) const {
        int32_t const c = lane & 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float const sum = quadSum(l[h]);
            int32_t const row = w.rowBegin + warpRow0 + (lane >> 2) + 8 * h;
            if (row >= w.rowEnd) continue;
            storeAccumulatorRow<CT, kD>(p, w, o, h, sum, m[h], row, kvHead, z, c);
        }
    }
};

// Does a tile need the per-element mask (some row holds no position, or some position is not visible to every
// query of the CTA)? Each lane reads kTile / 32 positions; every warp reads the same ones. Every load is issued
// before any test: written as `a && b` (or as `&=` of comparisons), ptxas made each load a load -> compare ->
// branch step of one serial chain (~5 % of the consumers' stall samples at 1 x 8192); their minimum needs them all.
template <int kTile>
__device__ __forceinline__ bool tileNeedsMaskAt(AttentionKernelParams const& p, int32_t const* tilePos, int32_t qa,
                                                int32_t qb, int32_t lane) {
    int32_t pos[kTile / 32];
#pragma unroll
    for (int e = 0; e < kTile / 32; ++e) pos[e] = tilePos[e * 32 + lane];  // conflict-free
    int32_t const pMin = tilePos[0], pMax = tilePos[kTile - 1];           // broadcasts
    int32_t lowest = pos[0];  // the smallest is >= 0 iff every row holds a position; min, not &&: no branches
#pragma unroll
    for (int e = 1; e < kTile / 32; ++e) lowest = min(lowest, pos[e]);
    return warpUniform(tileNeedsMask(__all_sync(0xffffffffu, lowest >= 0), pMin, pMax, qa, qb, p.params.window)) != 0;
}

// ---- cooperative kernel (PAGEDKV_MULTI_KERNEL=sm90-cooperative). Pipeline (FlashAttention-3's intra-warpgroup overlap): iteration i issues
// S(i + 1) and PV(i) back to back, runs softmax(i + 1) while PV(i) is in flight, then rescales O. Commit groups at
// iteration i's wait: tiles [0, i + 2), so waiting for all of them lands tile i + 1; the barrier after it also
// means every warpgroup finished PV(i - 1), which frees tile i - 1's stage for tile i + 2. The MMAs sit in
// straight-line code under uniform conditions: every warpgroup runs every tile (a tile holding no position, or a
// warpgroup past the rows, is masked / never stored).
template <typename CT, bool k8Bit, int kD>
__global__ void __launch_bounds__(Sm90MultiConfig<CT, k8Bit, kD>::kThreads, 1)
    attentionMultiKernelSm90(__grid_constant__ AttentionKernelParams const p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cfg = Sm90MultiConfig<CT, k8Bit, kD>;
    constexpr int kElemBytes = k8Bit ? 1 : 2;
    constexpr int kTile = Cfg::kTile;
    extern __shared__ __align__(16) unsigned char smemRaw[];

    // ---- prologue: this CTA's rows, chunk and KV tiles (the same decisions as the mma.sync kernel's)
    gridDependencyWait();  // launched as a programmatic dependent (pdl.cuh): earlier kernels' writes visible from here
    int32_t const slot = int32_t(gridDim.x) - 1 - int32_t(blockIdx.x);
    int32_t const kvHead = blockIdx.y;
    int32_t const z = blockIdx.z;
    int32_t const tid = threadIdx.x;
    int32_t const warp = tid >> 5;
    int32_t const lane = tid & 31;
    int32_t const group = warpUniform(tid >> 7);
    CtaWork const w = multiCtaWork(p.split, p.stepView(), Cfg::kRows, kTile, slot, z);
    if (!w.active) return;
    KVSource const src = makeKVSource(p, w, kvHead, kElemBytes);
    int32_t const qa = rowQueryPos(w.seq, w.rowBegin, p.groupSize);
    int32_t const qb = rowQueryPos(w.seq, w.rowEnd - 1, p.groupSize);
    Sm90Smem<Cfg> const sm(smemRaw);
    uint32_t const sQ = smemAddr(sm.q());

    // ---- loader: warp w copies rows [w kWarpRows, (w + 1) kWarpRows) of every KV tile; tiles 2j and 2j + 1 are
    // located together a tile or two ahead (locateKVRowPair), resolved at 2j's copy.
    int32_t const numTiles = warpUniform(w.tiles.count());
    constexpr int kWarpRows = kTile / (Cfg::kConsumerThreads / 32);
    static_assert(kWarpRows % 8 == 0 && 2 * kWarpRows <= 32, "a warp locates two tiles' rows at once");
    uint32_t const warpRowOffset = uint32_t(warp * kWarpRows * (k8Bit ? kD : 128));
    auto warpRows = [&](int32_t i) { return i < numTiles ? w.tiles.tile(i) * kTile + warp * kWarpRows : 0; };
    KVRow ahead = locateKVRowPair<kWarpRows>(p, src, 0 < numTiles, warpRows(0), 1 < numTiles, warpRows(1), lane);
    KVRowOffset rows;
    auto issue = [&](int32_t i) {  // tile i into its stage: one commit group per call, empty past the last tile
        if (i < numTiles) {
            int32_t const stage = i % Cfg::kStages;
            if ((i & 1) == 0) {
                rows = resolveKVRowOffset(p, src, ahead, kElemBytes);
                ahead = locateKVRowPair<kWarpRows>(p, src, i + 2 < numTiles, warpRows(i + 2), i + 3 < numTiles,
                                                   warpRows(i + 3), lane);
            }
            copyKVRows<kD, kElemBytes, kWarpRows, false, k8Bit ? 0 : kTile>(
                src, rows, (i & 1) * kWarpRows, smemAddr(sm.rawK(stage)) + warpRowOffset,
                smemAddr(sm.rawV(stage)) + warpRowOffset, sm.pos(i) + warp * kWarpRows, lane);
        }
        cpAsyncCommit();
    };
    issue(0);
    issue(1);
    loadQRows<CT, kD, Cfg::kRows, Cfg::kConsumerThreads, true>(p, sm.q(), w.rowBegin, w.rowEnd, kvHead, tid);

    // Tile j becomes visible: this thread's copies completed (`pending` groups may stay in flight), [8-bit: the
    // whole CTA converts it into the tiles the MMAs read -- free: S(j - 1) and PV(j - 2), their last readers,
    // completed before the first barrier], handed to the async proxy, published by the barrier.
    auto landed = [&](auto pending, int32_t j) {
        cpAsyncWait<decltype(pending)::value>();
        if constexpr (k8Bit) {
            __syncthreads();
            bool const isFp8 = p.cacheIsFp8 != 0;
            unsigned char* const conv = sm.conv();
            convertTile8<CT, kD, kTile, Cfg::kConsumerThreads, kTile>(sm.rawK(j % Cfg::kStages), conv, isFp8, tid);
            convertTile8<CT, kD, kTile, Cfg::kConsumerThreads, kTile>(
                sm.rawV(j % Cfg::kStages), conv + (1 + (j & 1)) * Cfg::kKVTileBytes, isFp8, tid);
        }
        wgmma::fenceProxyAsync();
        __syncthreads();
    };

    Sm90Consumer<CT, kD, Cfg> cons(p, w, group, warp, lane);
    if (numTiles > 0) {
        landed(IntTag<1>{}, 0);  // tile 0 and Q
        bool const needMask = tileNeedsMaskAt<kTile>(p, sm.pos(0), qa, qb, lane);
        cons.runS(sQ, sm.mmaK(0), [] {});
        cons.softmax(p, sm.pos(0), needMask);  // O is still 0: nothing to rescale
        cons.packP();
        for (int32_t i = 0; i + 1 < numTiles; ++i) {
            landed(IntTag<0>{}, i + 1);
            // The MMAs first: the loader's integer work for tile i + 2 and the mask decision issue under them.
            cons.issueSAndPV(sQ, sm.mmaK(i + 1), sm.mmaV(i));
            issue(i + 2);
            bool const nextMask = tileNeedsMaskAt<kTile>(p, sm.pos(i + 1), qa, qb, lane);
            cons.softmaxUnderPV(p, sm.pos(i + 1), nextMask);
            cons.rescale();
            cons.packP();
        }
        cons.runPV(sm.mmaV(numTiles - 1), [] {});
    }
    cpAsyncWait<0>();
    cons.store(p, w, kvHead, z);
#endif
}

// ---- warp-specialized kernel (the default): warps 0-7 are the consumer warpgroups, warps 8-11 the producer.
//  * 16-bit producer: warp 8 + q copies rows [32 q, 32 q + 32) of every tile straight into the stage the MMAs
//    read. For tile j it resolves the rows it located during tile j - 1 (their block-table entries have been in
//    flight since), locates tile j + 1's, waits until the stage is empty (both warpgroups released tile j - 3),
//    issues the copies and arrives on full[j] twice: once through cp.async (counts once this lane's copies have
//    landed) and once now (release: the positions are ordinary stores). It never waits for its own copies, so tile
//    j + 1's lookups and copies issue while tile j's are still in flight.
//  * 8-bit producer: the same rows into one of 2 staging stages, one tile ahead; for tile j it waits until the
//    converted stage j % 2 is empty (tile j - 2 released), issues tile j + 1's copies, waits for tile j's (its own
//    lanes'), converts its rows into the 16-bit blocked tiles (the exact dequantization of the other kernels),
//    hands them to the async proxy and arrives on full[j % 2].
//  * consumers: the cooperative kernel's pipeline with mbarrier waits instead of CTA barriers; after PV(i) each
//    thread releases tile i's stage. Turns (FlashAttention-3's ping-pong): a warpgroup issues its MMAs only after the
//    other issued its previous ones (named barriers 1 + group), so the tensor cores alternate between them and one
//    warpgroup's softmax runs under the other's MMAs. 16-bit: S(i + 1) and PV(i) issued together (the
//    intra-warpgroup overlap: 3 stages); 8-bit: S(i), softmax, PV(i) in turn, so that 2 converted stages leave
//    the producer half a tile to convert the next one.
constexpr uint32_t kQReadyBarrier = 3;  // named barrier: the consumers' Q stores done (0 is __syncthreads)

// Registers: sm_90 allocates them per warpgroup, so the 384 threads start with 65536 / 384 = 168 each; the
// producer warpgroup then gives back down to kProducerRegisters and the consumers grow to kConsumerRegisters
// (setmaxnreg; 128 x 56 + 256 x 224 = 64512).
constexpr uint32_t kProducerRegisters = 56;
constexpr uint32_t kConsumerRegisters = 224;

template <typename CT, bool k8Bit, int kD>
__global__ void __launch_bounds__(Sm90MultiConfig<CT, k8Bit, kD, true>::kThreads, 1)
    attentionMultiKernelSm90WS(__grid_constant__ AttentionKernelParams const p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cfg = Sm90MultiConfig<CT, k8Bit, kD, true>;
    constexpr int kElemBytes = k8Bit ? 1 : 2;
    constexpr int kTile = Cfg::kTile;
    constexpr int kStages = Cfg::kStages;
    constexpr int kMmaStages = Cfg::kMmaStages;
    constexpr int kProducerWarps = (Cfg::kThreads - Cfg::kConsumerThreads) / 32;
    constexpr int kWarpRows = kTile / kProducerWarps;  // a producer warp's rows of every tile
    static_assert(kWarpRows == 32, "one lookup per lane: the two 16-row halves of a locateKVRowPair");
    extern __shared__ __align__(16) unsigned char smemRaw[];

    // ---- prologue (every warp)
    gridDependencyWait();  // launched as a programmatic dependent (pdl.cuh): earlier kernels' writes visible from here
    int32_t const slot = int32_t(gridDim.x) - 1 - int32_t(blockIdx.x);
    int32_t const kvHead = blockIdx.y;
    int32_t const z = blockIdx.z;
    int32_t const tid = threadIdx.x;
    int32_t const warp = warpUniform(tid >> 5);
    int32_t const lane = tid & 31;
    CtaWork const w = multiCtaWork(p.split, p.stepView(), Cfg::kRows, kTile, slot, z);
    if (!w.active) return;
    int32_t const numTiles = warpUniform(w.tiles.count());
    Sm90Smem<Cfg> const sm(smemRaw);
    if (tid == 0) {
        for (int st = 0; st < kMmaStages; ++st) {
            wgmma::mbarrierInit(sm.full(st), kProducerWarps * 32);          // every producer lane, each tile
            wgmma::mbarrierInit(sm.empty(st), Cfg::kConsumerThreads);       // every consumer thread
        }
        wgmma::fenceBarrierInit();
    }
    __syncthreads();

    if (warp >= Cfg::kConsumerThreads / 32) {
        // ---- producer warpgroup
        wgmma::setMaxRegisters<kProducerRegisters, false>();
        int32_t const row0 = (warp - Cfg::kConsumerThreads / 32) * kWarpRows;  // of each tile
        KVSource const src = makeKVSource(p, w, kvHead, kElemBytes);
        auto locate = [&](int32_t j) {
            bool const valid = j < numTiles;
            int32_t const r = valid ? w.tiles.tile(j) * kTile + row0 : 0;
            return locateKVRowPair<16>(p, src, valid, r, valid, r + 16, lane);
        };
        // tile j's rows (located one tile earlier) into stage j % kStages, positions into tile j's slot
        constexpr int kRowBytes = k8Bit ? kD : 128;  // a row's bytes in a staging tile / in column block 0
        KVRow ahead = locate(0);
        auto copyTile = [&](int32_t j) {
            KVRowOffset const rows = resolveKVRowOffset(p, src, ahead, kElemBytes);
            ahead = locate(j + 1);
            uint32_t const kAddr = smemAddr(sm.rawK(j % kStages)) + uint32_t(row0 * kRowBytes);
            uint32_t const vAddr = smemAddr(sm.rawV(j % kStages)) + uint32_t(row0 * kRowBytes);
#pragma unroll
            for (int half = 0; half < 2; ++half)
                copyKVRows<kD, kElemBytes, 16, false, k8Bit ? 0 : kTile>(
                    src, rows, 16 * half, kAddr + uint32_t(16 * half * kRowBytes),
                    vAddr + uint32_t(16 * half * kRowBytes), sm.pos(j) + row0 + 16 * half, lane);
        };
        if constexpr (!k8Bit) {
            for (int32_t j = 0; j < numTiles; ++j) {
                int32_t const stage = j % kStages;
                if (j >= kStages) wgmma::mbarrierWait(sm.empty(stage), uint32_t((j / kStages - 1) & 1));
                copyTile(j);
                wgmma::cpAsyncMbarrierArrive(sm.full(stage));
                wgmma::mbarrierArrive(sm.full(stage));
            }
        } else {
            bool const isFp8 = p.cacheIsFp8 != 0;
            if (numTiles > 0) copyTile(0);
            cpAsyncCommit();
            for (int32_t j = 0; j < numTiles; ++j) {
                int32_t const stage = j % kMmaStages;
                // tile j - 2 released: its converted stage and its position slot ((j + 1) % 3) are free
                if (j >= kMmaStages) wgmma::mbarrierWait(sm.empty(stage), uint32_t((j / kMmaStages - 1) & 1));
                if (j + 1 < numTiles) copyTile(j + 1);  // into the staging stage tile j - 1 was converted from
                cpAsyncCommit();
                cpAsyncWait<1>();  // tile j's copies (this lane's) landed
                __syncwarp();      // ... and every lane's of this warp: its rows
                // 8 rows at a time (the swizzle repeats every 8 rows): 56 registers hold one group's loads
#pragma unroll 1
                for (int r = row0; r < row0 + kWarpRows; r += 8) {
                    unsigned char* const convK = sm.conv() + stage * 2 * Cfg::kKVTileBytes + r * 128;
                    convertTile8<CT, kD, 8, 32, kTile>(sm.rawK(j % kStages) + r * kD, convK, isFp8, lane);
                    convertTile8<CT, kD, 8, 32, kTile>(sm.rawV(j % kStages) + r * kD, convK + Cfg::kKVTileBytes,
                                                       isFp8, lane);
                }
                wgmma::fenceProxyAsync();
                wgmma::mbarrierArrive(sm.full(stage));
                __syncwarp();  // the staging reads done before the next copies into this stage
            }
        }
        cpAsyncWait<0>();  // no copy outlives its thread
        return;
    }

    // ---- consumer warpgroups
    wgmma::setMaxRegisters<kConsumerRegisters, true>();
    int32_t const group = warpUniform(tid >> 7);
    int32_t const qa = rowQueryPos(w.seq, w.rowBegin, p.groupSize);
    int32_t const qb = rowQueryPos(w.seq, w.rowEnd - 1, p.groupSize);
    uint32_t const sQ = smemAddr(sm.q());
    loadQRows<CT, kD, Cfg::kRows, Cfg::kConsumerThreads, true>(p, sm.q(), w.rowBegin, w.rowEnd, kvHead, tid);
    wgmma::fenceProxyAsync();
    wgmma::namedBarrierSync(kQReadyBarrier, Cfg::kConsumerThreads);

    Sm90Consumer<CT, kD, Cfg> cons(p, w, group, warp, lane);
    uint32_t const myTurn = 1 + uint32_t(group), otherTurn = 2 - uint32_t(group);
    // Tile j has landed (every producer lane's copies and positions), and this thread's view of it is handed to the
    // async proxy its MMAs read through.
    auto waitFull = [&](int32_t j) {
        wgmma::mbarrierWait(sm.full(j % kMmaStages), uint32_t((j / kMmaStages) & 1));
        wgmma::fenceProxyAsync();
    };
    // This thread is done with tile j's stage (K, V, positions). Every thread arrives (release: its own reads of the
    // positions come before the producer's next writes); one arrival per warp after a __syncwarp still left racecheck
    // reporting the other lanes' reads against those writes.
    auto release = [&](int32_t j) { wgmma::mbarrierArrive(sm.empty(j % kMmaStages)); };
    if (numTiles > 0) {
        if (group == 1) wgmma::namedBarrierArrive(1, Cfg::kConsumerThreads);  // warpgroup 0 takes the first turn
        if constexpr (k8Bit) {
            for (int32_t i = 0; i < numTiles; ++i) {
                waitFull(i);
                bool const needMask = tileNeedsMaskAt<kTile>(p, sm.pos(i), qa, qb, lane);
                wgmma::namedBarrierSync(myTurn, Cfg::kConsumerThreads);
                cons.runS(sQ, sm.mmaK(i), [&] {
                    // warpgroup 1's last turn has no turn of warpgroup 0 after it
                    if (group == 0 || i + 1 < numTiles) wgmma::namedBarrierArrive(otherTurn, Cfg::kConsumerThreads);
                });
                cons.softmax(p, sm.pos(i), needMask);
                cons.rescale();
                cons.packP();
                cons.runPV(sm.mmaV(i), [] {});
                release(i);
            }
        } else {
            waitFull(0);
            bool const needMask = tileNeedsMaskAt<kTile>(p, sm.pos(0), qa, qb, lane);
            wgmma::namedBarrierSync(myTurn, Cfg::kConsumerThreads);
            cons.runS(sQ, sm.mmaK(0), [&] { wgmma::namedBarrierArrive(otherTurn, Cfg::kConsumerThreads); });
            cons.softmax(p, sm.pos(0), needMask);
            cons.packP();
            for (int32_t i = 0; i + 1 < numTiles; ++i) {
                waitFull(i + 1);
                // decided while this warpgroup waits for its turn, not between the MMAs' issue and the softmax
                bool const nextMask = tileNeedsMaskAt<kTile>(p, sm.pos(i + 1), qa, qb, lane);
                wgmma::namedBarrierSync(myTurn, Cfg::kConsumerThreads);
                cons.issueSAndPV(sQ, sm.mmaK(i + 1), sm.mmaV(i));
                wgmma::namedBarrierArrive(otherTurn, Cfg::kConsumerThreads);
                cons.softmaxUnderPV(p, sm.pos(i + 1), nextMask);
                release(i);
                cons.rescale();
                cons.packP();
            }
            wgmma::namedBarrierSync(myTurn, Cfg::kConsumerThreads);
            cons.runPV(sm.mmaV(numTiles - 1), [&] {
                // The last turn: warpgroup 1 has no turn after it, so only warpgroup 0 hands one over.
                if (group == 0) wgmma::namedBarrierArrive(otherTurn, Cfg::kConsumerThreads);
            });
        }
    }
    cons.store(p, w, kvHead, z);
#endif
}

template <typename CT, bool k8Bit, int kD, bool kWarpSpecialized>
cudaError_t prepareOrLaunchSm90(int32_t& ctasPerSm, AttentionKernelParams const* kp, dim3 grid, cudaStream_t stream) {
    using Cfg = Sm90MultiConfig<CT, k8Bit, kD, kWarpSpecialized>;
    static KernelSetup setup;
    auto const kernel = [] {
        if constexpr (kWarpSpecialized) return attentionMultiKernelSm90WS<CT, k8Bit, kD>;
        else return attentionMultiKernelSm90<CT, k8Bit, kD>;
    }();
    cudaError_t const err =
        setup.prepare(kernel, Cfg::kSmemBytes, Cfg::kThreads, ctasPerSm, "Hopper multi-token attention kernel", kD);
    if (err != cudaSuccess || kp == nullptr) return err;
    return launchProgrammaticDependent(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, *kp);
}

// The variant: warp-specialized (the default; 1.35x the cooperative one at 4x2048 over 8192, bf16) unless the
// cooperative one is chosen.
cudaError_t dispatchSm90(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice, int32_t& ctasPerSm,
                         AttentionKernelParams const* kp, dim3 grid, cudaStream_t stream) {
    bool const warpSpecialized = choice != MultiKernelChoice::kSm90Cooperative;
    auto byHeadDim = [&](auto ct, auto k8, auto ws) -> cudaError_t {
        using CT = typename decltype(ct)::type;
        constexpr bool k8Bit = decltype(k8)::value;
        constexpr bool kWS = decltype(ws)::value;
        if (headDim == 128) return prepareOrLaunchSm90<CT, k8Bit, 128, kWS>(ctasPerSm, kp, grid, stream);
        if (headDim == 64) return prepareOrLaunchSm90<CT, k8Bit, 64, kWS>(ctasPerSm, kp, grid, stream);
        return invalidArgument("head_dim=" + std::to_string(headDim) +
                               ": expected 64 or 128 (Hopper multi-token kernel)");
    };
    auto byVariant = [&](auto ct, auto k8) -> cudaError_t {
        return warpSpecialized ? byHeadDim(ct, k8, BoolTag<true>{}) : byHeadDim(ct, k8, BoolTag<false>{});
    };
    auto byCache = [&](auto ct) -> cudaError_t {
        return isCache8Bit(cache) ? byVariant(ct, BoolTag<true>{}) : byVariant(ct, BoolTag<false>{});
    };
    return io == IODType::kBF16 ? byCache(TypeTag<__nv_bfloat16>{}) : byCache(TypeTag<__half>{});
}

}  // namespace

bool multiKernelSm90Serves(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice) {
    (void)cache;  // every cache dtype: 8-bit tiles are converted in shared memory
    if (headDim != 64 && headDim != 128) return false;
    if (io != IODType::kBF16 && io != IODType::kFP16) return false;
    if (choice == MultiKernelChoice::kMma) return false;
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
}

cudaError_t multiKernelSm90Occupancy(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice,
                                     int32_t& ctasPerSm) {
    return dispatchSm90(io, cache, headDim, choice, ctasPerSm, nullptr, dim3(), nullptr);
}

cudaError_t launchMultiKernelSm90(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                                  MultiKernelChoice choice, dim3 grid, cudaStream_t stream) {
    int32_t ctasPerSm = 0;
    return dispatchSm90(io, cache, headDim, choice, ctasPerSm, &kp, grid, stream);
}

}  // namespace attn
}  // namespace pagedkv
