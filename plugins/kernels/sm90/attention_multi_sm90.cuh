// Multi-token attention kernel for sm_90a (H100 / H200): the chunked-prefill / long-prompt / draft rows of
// attention_multi.cu on warpgroup MMAs. Same work split, same loader, same softmax; what changes is the math:
//  * a CTA's 2 consumer warpgroups (256 threads) serve kRows = 128 query rows (consecutive tokens x the G heads of
//    one KV head, the planner's row tile), each warpgroup 64 of them; at D = 256 one warpgroup, 64 rows; the
//    warp-specialized kernel over 16-bit caches at D = 32 / 64 has 3, 192 rows (sm90ConsumerGroups);
//  * KV tiles of kTile = 128 tokens (64 at D = 256) stream through a pipeline into blocked, 128-byte-swizzled tiles
//    (blockedTileChunk), page by page through the block table (copyKVRows: one lookup per row, runs copied whole;
//    in the warp-specialized kernel a 16-row run of an HND page by TMA, sm90/kv_row_map.cuh);
//  * per tile and warpgroup, S = Q K^T is kD / 16 wgmma m64n(kTile)k16 reading Q and K straight from shared memory,
//    the online softmax runs on the S registers (softmaxStepFixed: mask, soft-cap, running max and sum), and
//    O += P V is kTile / 16 wgmma m64n(kDP)k16 with P from registers and V read MN-major from shared memory;
//  * each warpgroup overlaps its softmax of tile i + 1 with its own P V of tile i (the pipeline below); in the
//    cooperative variant the two warpgroups also load and run in lockstep (one CTA barrier per tile); in the
//    warp-specialized one (the default) a producer warpgroup loads and the consumer warpgroups take turns on the
//    tensor cores (one warpgroup at D = 256: its softmax overlaps only its own P V).
// Head dims 32, 64, 80, 96, 128 and 256, every cache dtype (8-bit tiles are converted into 16-bit ones in shared
// memory, as the mma.sync kernel does; the warp-specialized kernel's are f16, Sm90MultiConfig::QKType). Tiles hold
// rows of kDP = tileRowElems(kD) elements (64, 128 or 256: whole 128-byte column blocks, the shared tile contract of
// attention_schedule.h): S takes the kD / 16 k-steps of the real dims, so the padding of Q and K is never read; O = P V
// runs at N = kDP, so V's padding columns (never written) only reach O's padding columns, which are never rescaled nor
// stored. Other GPUs stay on attention_multi.cu's mma.sync kernel (multiKernelSm90Serves). Design, byte and FLOP
// counts, measurements: benchmarks/NOTES-attention.md, "the Hopper multi-token kernel".
//
// The kernels and one instance's launch (launchSm90Instance). Each head dim's instances are compiled in a translation
// unit of their own (attention_multi_sm90_d<D>.cu: PKV_SM90_INSTANCES), so that nvcc builds them in parallel; the
// dispatch and the TMA loads' host side are attention_multi_sm90.cu's (attention_multi_sm90_launch.h).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_multi_sm90_launch.h"
#include "attention_plan.h"
#include "attention_tile.cuh"
#include "kv_row_map.cuh"
#include "pdl.cuh"
#include "wgmma.cuh"
#include "wgmma_ops.cuh"

namespace pagedkv {
namespace attn {
namespace {

// ---- shapes. Both kernels: a CTA serves kRows = 128 query rows (the planner's row tile) as 2 consumer warpgroups
// of 64 rows; KV tiles of kTile = 128 tokens in 3 stages (the pipeline holds tiles i, i + 1 and i + 2; the
// warp-specialized 8-bit variant 2 + 2, below). At D = 256, 64 rows (one consumer warpgroup) and 64-token tiles.
// The warp-specialized kernel over 16-bit caches at D = 32 / 64: 192 rows (3 consumer warpgroups), 5 stages
// at D = 32 and 6 at D = 64.
//  * cooperative (PAGEDKV_MULTI_KERNEL=sm90-cooperative): 256 threads; every thread loads its share of each tile
//    and the CTA synchronizes once per tile (8-bit caches: a second time, after converting the tile into 16-bit
//    ones: one K, two V buffers).
//  * warp-specialized (the default): 384 threads (512 with 3 consumer warpgroups); a producer warpgroup loads every
//    tile (8-bit caches: and converts it) into the stage the MMAs read and hands it over through mbarriers, so the
//    consumer warpgroups never wait on a CTA barrier; two take turns issuing their MMAs (named barriers), one's
//    softmax under the other's MMAs, three issue whenever ready.
template <typename CT, bool k8Bit, int kD, bool kWarpSpecialized_ = false>
struct Sm90MultiConfig {
    static_assert(kD % 16 == 0 && (kD <= 128 || kD == 256), "whole k-steps of S; rows of 64, 128 or 256 elements");
    static constexpr int kDP = tileRowElems(kD);  // 64, 128 or 256: the tiles' row and O's N (whole 128-byte blocks)
    static constexpr bool kWarpSpecialized = kWarpSpecialized_;
    // D = 256: the planner's row tile is 64 rows (multiTileRows), so one consumer warpgroup, whose O (64 x 256) takes
    // 128 accumulator registers a thread; its KV tiles are 64 tokens (S is m64n64), so that Q and 3 stages of K and V
    // (32 KB each) fit. No ping-pong: the tensor cores overlap its softmax only with its own P V.
    static constexpr int kConsumerGroups = sm90ConsumerGroups(kWarpSpecialized, k8Bit, kD);
    static constexpr int kGroupThreads = 128;  // a warpgroup
    static constexpr int kConsumerThreads = kConsumerGroups * kGroupThreads;
    static constexpr int kThreads = kConsumerThreads + (kWarpSpecialized ? kGroupThreads : 0);  // + the producer
    static constexpr int kRows = 64 * kConsumerGroups;
    static_assert(kRows == sm90TileRows(kWarpSpecialized, k8Bit, kD),
                  "the planner's row tiles (DeviceFacts::multiTileRows) are this kernel's");
    static constexpr int kTile = kD == 256 ? 64 : 128;  // KV tokens per stage = N of S = Q K^T
    static constexpr int kNT = kTile / 8;
    static constexpr int kQBytes = kRows * kDP * 2;
    static constexpr int kKVTileBytes = kTile * kDP * 2;  // a 16-bit K or V tile as the MMAs read it
    // The type of P and V in O += P V. 8-bit caches: f16 whatever the compute type, as in the decode kernel -- every
    // e4m3 and int8 value is exact in f16, P in [0, 2^kMaxSlack] is more precise there than in bf16, and fp8 V tiles
    // convert with one hardware instruction a pair instead of five bit operations (the producer converts every tile).
    using PVType = std::conditional_t<k8Bit, __half, CT>;
    // Stages of the tiles as loaded (8-bit caches: [token][kD] bytes). The warp-specialized 8-bit variant keeps 2
    // of them and 2 converted (K, V) stages the MMAs read: 3 of each do not fit at D = 128.
    static constexpr bool kWS8 = k8Bit && kWarpSpecialized;
    // The type of Q and K in S = Q K^T. The warp-specialized kernel over an 8-bit cache: f16 too, so that its producer
    // converts fp8 K with the hardware instruction as it does V (5 bit operations a pair into bf16). bf16 queries are
    // then scaled into f16 by a power of two per consumer warp's 16 rows (loadQRowsScaledF16), undone on the logits.
    using QKType = std::conditional_t<kWS8, __half, CT>;
    static constexpr bool kScaledQ = kWS8 && std::is_same_v<CT, __nv_bfloat16>;
    // Three consumer warpgroups (D = 32 / 64, 16-bit) take no turns and drift apart, and a stage is refilled only once
    // the slowest released it: 5 stages (D <= 64's tiles fit) ran 2-6 % faster at D = 64 than 3, 4 about half that;
    // a sixth gained 0-1 % more at D = 64 and lost 0.7-1.2 % at D = 32 (NOTES-attention.md, thirty-first session).
    static constexpr int kStages = kWS8 ? 2 : kWarpSpecialized && kConsumerGroups == 3 ? (kD == 64 ? 6 : 5) : 3;
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
    // The warp-specialized 16-bit variant at D = 64 / 128 loads whole-run half tiles by TMA (sm90/kv_row_map.cuh;
    // its boxes are whole 64-column blocks, which rows of 32 / 80 / 96 elements do not split into): 128 bytes where
    // a producer warp completes the CTA's tensor map, on a 128-byte boundary after the barriers.
    static constexpr bool kTma = kWarpSpecialized && !k8Bit && kD % 64 == 0;  // whole 64-column boxes
    static constexpr int kBodyBytes = kQBytes + kStages * 2 * kRawTileBytes + kConvBytes + kPosBytes + kBarrierBytes;
    static constexpr int kMapScratchOffset = (kBodyBytes + 127) / 128 * 128;
    static constexpr int kSmemBytes = kAlign + (kTma ? kMapScratchOffset + 128 : kBodyBytes);
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
    // The mbarriers: full[kMmaStages], then empty[kMmaStages], 8 bytes each. full / empty give the shared-window
    // addresses the mbarrier PTX takes; fullBar the generic pointer cuda::ptx takes.
    __device__ __forceinline__ uint64_t* fullBar(int stage) const {
        return reinterpret_cast<uint64_t*>(conv() + Cfg::kConvBytes + Cfg::kPosBytes) + stage;
    }
    __device__ __forceinline__ uint32_t full(int stage) const { return smemAddr(fullBar(stage)); }
    __device__ __forceinline__ uint32_t empty(int stage) const { return smemAddr(fullBar(Cfg::kMmaStages + stage)); }
    __device__ __forceinline__ unsigned char* mapScratch() const { return base + Cfg::kMapScratchOffset; }
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
    static constexpr int kDP = Cfg::kDP;
    float o[kDP / 8][4];  // O's columns [kD, kDP) hold padding * P: never rescaled, never stored
    float s[kNT][4];
    uint32_t pa[kTile / 16][4];
    float m[2], l[2], alpha[2];
    // The logits' factor undoing this warp's power-of-two Q scaling (Cfg::kScaledQ; 1 otherwise)
    float qUnscale = 1.f;
    int32_t qPos[2];
    int32_t groupRow0, warpRow0, lane;

    __device__ __forceinline__ Sm90Consumer(AttentionKernelParams const& p, CtaWork const& w, int32_t group,
                                            int32_t warp, int32_t lane_)
        : groupRow0(group * 64), warpRow0(group * 64 + (warp & 3) * 16), lane(lane_) {
#pragma unroll
        for (int dn = 0; dn < kDP / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
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
            wgmma::Mma<typename Cfg::QKType, kTile>::ss(s, wgmma::kMajor<Cfg::kRows>(sQ, groupRow0, kk),
                                      wgmma::kMajor<kTile>(kTileAddr, 0, kk), kk > 0);
    }
    __device__ __forceinline__ void issuePV(uint32_t vTileAddr) {
#pragma unroll
        for (int kt = 0; kt < kTile / 16; ++kt)
            wgmma::Mma<typename Cfg::PVType, kDP>::rs(o, pa[kt], wgmma::mnMajor<kTile>(vTileAddr, kt), true);
    }
    __device__ __forceinline__ void softmax(AttentionKernelParams const& p, int32_t const* tilePos, bool needMask) {
        withSoftmaxVariant(p.useSoftcap != 0, needMask, [&](auto capped, auto masked) {
            softmaxStepFixed<kNT, decltype(capped)::value, decltype(masked)::value, kMaxSlack>(
                p, s, tilePos, qPos[0], qPos[1], lane, m, l, alpha, Cfg::kScaledQ ? qUnscale : 1.f);
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
        for (int kt = 0; kt < kTile / 16; ++kt) probFragment<typename Cfg::PVType, kNT>(s, kt, pa[kt]);
    }
    // O's real columns: its first kD / 8 accumulator tiles
    __device__ __forceinline__ float (&realO())[kD / 8][4] { return reinterpret_cast<float(&)[kD / 8][4]>(o); }
    __device__ __forceinline__ float const (&realO() const)[kD / 8][4] {
        return reinterpret_cast<float const(&)[kD / 8][4]>(o);
    }
    __device__ __forceinline__ void rescale() { rescaleRows(realO(), alpha); }

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
            storeAccumulatorRow<CT, kD>(p, w, realO(), h, sum, m[h], row, kvHead, z, c);
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

// ---- cooperative kernel (PAGEDKV_MULTI_KERNEL=sm90-cooperative). Pipeline (FlashAttention-3's intra-warpgroup
// overlap): iteration i issues S(i + 1) and PV(i) back to back, runs softmax(i + 1) while PV(i) is in flight, then
// rescales O. Commit groups at iteration i's wait: tiles [0, i + 2), so waiting for all of them lands tile i + 1; the
// barrier after it also means every warpgroup finished PV(i - 1), which frees tile i - 1's stage for tile i + 2. The
// MMAs sit in straight-line code under uniform conditions: every warpgroup runs every tile (a tile holding no position,
// or a warpgroup past the rows, is masked / never stored).
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
            // the whole tile at once, or at D = 256 8 rows at a time: O's 128 registers a thread are live here, and
            // a whole tile's 16 loads a thread spilled
            constexpr int kConvRows = kD == 256 ? 8 : kTile;
#pragma unroll 1
            for (int r = 0; r < kTile; r += kConvRows) {
                convertTile8<CT, kD, kConvRows, Cfg::kConsumerThreads, kTile>(sm.rawK(j % Cfg::kStages) + r * kD,
                                                                              conv + r * 128, isFp8, tid);
                convertTile8<typename Cfg::PVType, kD, kConvRows, Cfg::kConsumerThreads, kTile>(
                    sm.rawV(j % Cfg::kStages) + r * kD, conv + (1 + (j & 1)) * Cfg::kKVTileBytes + r * 128, isFp8,
                    tid);
            }
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
// Persistent: each CTA walks the cells persistentDeal gives it (attention_schedule.h), every warp the same cells in
// the same order, and tile numbers run on across them (g: the CTA's tiles so far), so the stages, positions and
// mbarrier phases of one cell continue those of the one before and the producer loads the next cell's first tiles
// while the consumers finish the current one.
//  * 16-bit producer: producer warp q copies rows [32 q, 32 q + 32) of every tile straight into the stage the MMAs
//    read. For tile g it resolves the rows it located during tile g - 1 (their block-table entries have been in flight
//    since), locates tile g + 1's, waits until the stage is empty (every consumer warpgroup released tile g - kStages),
//    issues the copies and arrives on full[g] twice: once through cp.async (counts once this lane's copies have landed)
//    and once now (release: the positions are ordinary stores). It never waits for its own copies, so tile g + 1's
//    lookups and copies issue while tile g's are still in flight. With the CTA's tensor map (HND pool, a workspace
//    slot), a half tile that is one run -- 16 rows of one page, every row holding a position -- is instead one TMA box
//    per 64-column block of K and of V, issued by lane 0 after it raised full[g]'s expected bytes: one instruction per
//    2 KB where cp.async takes 128 lane copies.
//  * 8-bit producer: the same rows into one of 2 staging stages, one tile ahead; for tile g it waits until the
//    converted stage g % 2 is empty (tile g - 2 released), issues tile g + 1's copies, waits for tile g's (its own
//    lanes'), converts its rows into the 16-bit blocked tiles (the exact dequantization of the other kernels),
//    hands them to the async proxy and arrives on full[g % 2].
//  * consumers: the cooperative kernel's pipeline with mbarrier waits instead of CTA barriers; after PV(i) each thread
//    releases tile i's stage. Turns (FlashAttention-3's ping-pong), with two consumer warpgroups: one issues its MMAs
//    only after the other issued its previous ones (named barriers 1 + group), so the tensor cores alternate between
//    them and one warpgroup's softmax runs under the other's MMAs; every cell's turns are balanced (warpgroup 0 takes
//    its first, warpgroup 1 hands none back after its last), so a cell starts with no arrival pending. Three
//    (D = 32 / 64) take no turns: a round of three made each wait for the other two, and without it the D = 64 prefills
//    ran 0.5-1 % faster (NOTES-attention.md, twenty-seventh session). 16-bit: S(i + 1) and PV(i) issued together (the
//    intra-warpgroup overlap: 3 stages; 5 / 6 with three warpgroups); 8-bit: S(i), softmax, PV(i) in turn, so that 2
//    converted stages leave the producer half a tile to convert the next one. Each warpgroup loads its own 64 rows of Q
//    once its MMAs of the previous cell are done (the only reader of those rows), so neither waits for the other
//    between cells.
constexpr uint32_t kQReadyBarrier = 3;  // named barriers 3 + group: a warpgroup's Q stores done (0 is __syncthreads)
constexpr uint32_t kProducerBarrier = 6;  // named barrier: the producer warpgroup, once its CTA's tensor map is out

// Registers: sm_90 allocates them per warpgroup, so the 384 threads start with 65536 / 384 = 168 each; the
// producer warpgroup then gives back down to kProducerRegisters and the consumers grow to kConsumerRegisters
// (setmaxnreg; 128 x 56 + 256 x 224 = 64512). With three consumer warpgroups (512 threads: 128 each at the start)
// the producer keeps 32 and they grow to 160 (128 x 32 + 384 x 160 = 65536: FlashAttention-3's split), which S, P and
// O of a 128-token tile (64 + 32 + 32) need: at 152 (the producer at 56) they spilled and ptxas serialized their
// wgmma. At 32 / 160 ptxas still spills 152 bytes at D = 64 (148 with 5 stages), 156 at D = 32, none on a wgmma.
// At D = 80 / 96 (rows of 10 / 12 16-byte chunks, copied in flat chunk order) the producer's copy loop needs more: it
// spilled 44-128 bytes inside the tile loop at 56, so those head dims split 72 / 216 (128 x 72 + 256 x 216 = 64512);
// the consumers then keep 20 bytes of loop invariants in local memory (3 loads per tile, off the MMA chain).
// At D = 256 (256 threads) nothing is moved: every thread may hold 255 registers from the start.
template <int kD, int kGroups>
constexpr uint32_t kProducerRegisters = kGroups == 3 ? 32 : kD % 64 == 0 || kD == 32 ? 56 : 72;
template <int kD, int kGroups>
constexpr uint32_t kConsumerRegisters =  // all it gives back, in whole 8-register steps
    (65536 / (128 * (kGroups + 1)) / 8 * 8 * 128 * (kGroups + 1) - 128 * kProducerRegisters<kD, kGroups>) /
    (128 * kGroups) / 8 * 8;
static_assert(kConsumerRegisters<64, 2> == 224 && kConsumerRegisters<80, 2> == 216 && kConsumerRegisters<64, 3> == 160,
              "the splits above");

template <typename CT, bool k8Bit, int kD>
__global__ void __launch_bounds__(Sm90MultiConfig<CT, k8Bit, kD, true>::kThreads, 1)
    attentionMultiKernelSm90WS(__grid_constant__ AttentionKernelParams const p,
                               __grid_constant__ CUtensorMap const kvRowMap) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cfg = Sm90MultiConfig<CT, k8Bit, kD, true>;
    constexpr int kElemBytes = k8Bit ? 1 : 2;
    constexpr int kTile = Cfg::kTile;
    constexpr int kStages = Cfg::kStages;
    constexpr int kMmaStages = Cfg::kMmaStages;
    constexpr int kProducerWarps = (Cfg::kThreads - Cfg::kConsumerThreads) / 32;
    constexpr int kWarpRows = kTile / kProducerWarps;  // a producer warp's rows of every tile: 32, or 16 at D = 256
    constexpr int kHalves = kWarpRows / 16;            // its 16-row halves (one lookup per lane for both)
    static_assert(kWarpRows % 16 == 0 && kHalves <= 2, "a locateKVRowPair's one or two 16-row halves");
    constexpr int kConvRows = (8 * (kD / 8)) % 32 == 0 ? 8 : 16;  // rows per 8-bit conversion step
    extern __shared__ __align__(16) unsigned char smemRaw[];

    // ---- prologue (every warp)
    gridDependencyWait();  // launched as a programmatic dependent (pdl.cuh): earlier kernels' writes visible from here
    int32_t const tid = threadIdx.x;
    int32_t const warp = warpUniform(tid >> 5);
    int32_t const lane = tid & 31;
    Sm90Smem<Cfg> const sm(smemRaw);
    // A step without a multi-token sequence (a decode step under the plugin's bound maxQLen = T, which cannot tell)
    // ends here, after one read of cu_q_lens, instead of every CTA walking its dealt cells' metadata lookups one
    // after another (the plugin-bound decodes ran 7-8 us longer than the decode alone at 64 x 4K and 15-17 us at
    // 256 x 1K without this exit, 1.7-2.5 us with it on an H100).
    if (!__syncthreads_or(seesMultiTokenSequence(p.stepView(), tid, Cfg::kThreads))) return;
    if (tid == 0) {
        for (int st = 0; st < kMmaStages; ++st) {
            wgmma::mbarrierInit(sm.full(st), kProducerWarps * 32);          // every producer lane, each tile
            wgmma::mbarrierInit(sm.empty(st), Cfg::kConsumerThreads);       // every consumer thread
        }
        wgmma::fenceBarrierInit();
    }
    __syncthreads();
    PersistentDeal deal = persistentDeal(p.split, p.params.meta.numSeqs, p.params.numKVHeads, int32_t(gridDim.x),
                                         int32_t(blockIdx.x));
    // This CTA's next cell with work (every warp walks the same ones), its decisions in w; false when none is left.
    auto nextActiveCell = [&](MultiCell& cell, CtaWork& w) {
        while (deal.next(cell)) {
            w = multiCtaWork(p.split, p.stepView(), Cfg::kRows, kTile, cell.slot, cell.z);
            if (w.active) return true;
        }
        return false;
    };

    if (warp >= Cfg::kConsumerThreads / 32) {
        // ---- producer warpgroup
        if constexpr (Cfg::kConsumerGroups >= 2)
            wgmma::setMaxRegisters<kProducerRegisters<kD, Cfg::kConsumerGroups>, false>();
        int32_t const row0 = (warp - Cfg::kConsumerThreads / 32) * kWarpRows;  // of each tile
        constexpr int kRowBytes = k8Bit ? kD : 128;  // a row's bytes in a staging tile / in column block 0
        // TMA (16-bit caches; sm90/kv_row_map.cuh): the first producer warp completes this CTA's tensor map in its
        // workspace slot, every producer thread acquires it. Without a slot (the launcher's conditions), with a pool
        // not 16-byte aligned or with more rows than int32 coordinates reach, every half tile goes by cp.async.
        CUtensorMap const* map = nullptr;
        if constexpr (Cfg::kTma) {
            if (p.kvRowMaps != nullptr) {
                PoolView const pool = loadPool(p);
                int64_t const poolRows = pool.numBlocks * p.params.layout.strideBlock / kD;
                if ((reinterpret_cast<uintptr_t>(pool.base) & 15u) == 0 && poolRows >= 1 && poolRows <= INT32_MAX) {
                    auto* const slot = reinterpret_cast<CUtensorMap*>(p.kvRowMaps) + blockIdx.x;
                    if (row0 == 0)
                        tma::publishMap(kvRowMap, sm.mapScratch(), slot, pool.base, uint32_t(poolRows), lane);
                    wgmma::namedBarrierSync(kProducerBarrier, kProducerWarps * 32);
                    tma::acquireMap(slot);
                    map = slot;
                }
            }
        }
        int32_t g = 0;  // this CTA's tiles so far: tile j of the current cell is tile g + j
        MultiCell cell{};
        CtaWork w{};
        while (nextActiveCell(cell, w)) {
            int32_t const numTiles = warpUniform(w.tiles.count());
            KVSource const src = makeKVSource(p, w, cell.kvHead, kElemBytes);
            auto locate = [&](int32_t j) {
                bool const valid = j < numTiles;
                int32_t const r = valid ? w.tiles.tile(j) * kTile + row0 : 0;
                return locateKVRowPair<16>(p, src, valid, r, valid && kHalves == 2, r + 16, lane);
            };
            // tile j's rows (located one tile earlier) into stage (g + j) % kStages, positions into its slot
            KVRow ahead = locate(0);
            auto copyTile = [&](int32_t j) {
                KVRowOffset const rows = resolveKVRowOffset(p, src, ahead, kElemBytes);
                ahead = locate(j + 1);
                uint32_t const kAddr = smemAddr(sm.rawK((g + j) % kStages)) + uint32_t(row0 * kRowBytes);
                uint32_t const vAddr = smemAddr(sm.rawV((g + j) % kStages)) + uint32_t(row0 * kRowBytes);
#pragma unroll
                for (int half = 0; half < kHalves; ++half) {
                    int32_t* const sPos = sm.pos(g + j) + row0 + 16 * half;
                    if constexpr (Cfg::kTma) {
                        // A half that is one run (16 rows of one page, every row holding a position): one box per
                        // 64-column block of K and of V, issued by lane 0 and completing on the stage's full barrier.
                        int64_t runK;
                        if (map != nullptr && kvRowsAreRun<16>(src, rows, 16 * half, lane, runK)) {
                            storeKVPositions<16>(rows, 16 * half, sPos, lane);
                            if (lane == 0) {
                                int32_t const stage = (g + j) % kStages;
                                int32_t const rowK = int32_t(runK / (2 * kD));  // the pool's rows of 2 kD bytes
                                int32_t const rowV = rowK + int32_t(src.vDelta / (2 * kD));
                                uint64_t* const bar = sm.fullBar(stage);
                                tma::expectBytes(bar, 2 * tma::kBoxRows * kD * 2);
                                int32_t const at = (row0 + 16 * half) * 128;
#pragma unroll
                                for (int cb = 0; cb < kD / tma::kBoxCols; ++cb) {
                                    int32_t const block = cb * kTile * 128;  // column block cb of the tile
                                    tma::loadBox(sm.rawK(stage) + block + at, map, cb * tma::kBoxCols, rowK, bar);
                                    tma::loadBox(sm.rawV(stage) + block + at, map, cb * tma::kBoxCols, rowV, bar);
                                }
                            }
                            continue;
                        }
                    }
                    copyKVRows<kD, kElemBytes, 16, false, k8Bit ? 0 : kTile>(
                        src, rows, 16 * half, kAddr + uint32_t(16 * half * kRowBytes),
                        vAddr + uint32_t(16 * half * kRowBytes), sPos, lane);
                }
            };
            if constexpr (!k8Bit) {
                for (int32_t j = 0; j < numTiles; ++j) {
                    int32_t const t = g + j;
                    int32_t const stage = t % kStages;
                    if (t >= kStages) wgmma::mbarrierWait(sm.empty(stage), uint32_t((t / kStages - 1) & 1));
                    copyTile(j);
                    wgmma::cpAsyncMbarrierArrive(sm.full(stage));
                    wgmma::mbarrierArrive(sm.full(stage));
                }
            } else {
                // Tile g's staging stage and position slot were freed before: its staging tile (g - 2's) was
                // converted by this warp, and the previous cell's last iteration waited for tile g - 3's release.
                bool const isFp8 = p.cacheIsFp8 != 0;
                if (numTiles > 0) copyTile(0);
                cpAsyncCommit();
                for (int32_t j = 0; j < numTiles; ++j) {
                    int32_t const t = g + j;
                    int32_t const stage = t % kMmaStages;
                    // tile t - 2 released: its converted stage and its position slot ((t + 1) % 3) are free
                    if (t >= kMmaStages) wgmma::mbarrierWait(sm.empty(stage), uint32_t((t / kMmaStages - 1) & 1));
                    if (j + 1 < numTiles) copyTile(j + 1);  // into the staging stage tile t - 1 was converted from
                    cpAsyncCommit();
                    cpAsyncWait<1>();  // tile t's copies (this lane's) landed
                    __syncwarp();      // ... and every lane's of this warp: its rows
                    // 8 rows of K and V at a time (the swizzle repeats every 8 rows), all their loads issued first:
                    // 56 registers hold one group's; at D = 80 (10 groups of 8 elements a row) 16 rows, so that the
                    // 32 lanes split them evenly
#pragma unroll 1
                    for (int r = row0; r < row0 + kWarpRows; r += kConvRows) {
                        unsigned char* const convK = sm.conv() + stage * 2 * Cfg::kKVTileBytes + r * 128;
                        convertKVRows8<typename Cfg::QKType, typename Cfg::PVType, kD, kConvRows, kTile>(
                            sm.rawK(t % kStages) + r * kD, sm.rawV(t % kStages) + r * kD, convK,
                            convK + Cfg::kKVTileBytes, isFp8, lane);
                    }
                    wgmma::fenceProxyAsync();
                    wgmma::mbarrierArrive(sm.full(stage));
                    __syncwarp();  // the staging reads done before the next copies into this stage
                }
            }
            g += numTiles;
        }
        cpAsyncWait<0>();  // no copy outlives its thread
        return;
    }

    // ---- consumer warpgroups
    if constexpr (Cfg::kConsumerGroups >= 2)
        wgmma::setMaxRegisters<kConsumerRegisters<kD, Cfg::kConsumerGroups>, true>();
    int32_t const group = warpUniform(tid >> 7);
    uint32_t const sQ = smemAddr(sm.q());
    uint32_t const myTurn = 1 + uint32_t(group), otherTurn = 2 - uint32_t(group);
    // The ping-pong turns between two consumer warpgroups; one (D = 256) or three (D = 32 / 64) issue whenever ready.
    constexpr bool kTurns = Cfg::kConsumerGroups == 2;
    auto takeTurn = [&] {
        if constexpr (kTurns) wgmma::namedBarrierSync(myTurn, Cfg::kConsumerThreads);
    };
    auto handTurn = [&] {
        if constexpr (kTurns) wgmma::namedBarrierArrive(otherTurn, Cfg::kConsumerThreads);
    };
    int32_t g = 0;  // this CTA's tiles so far, as the producer counts them
    // Tile t has landed (every producer lane's copies and positions), and this thread's view of it is handed to the
    // async proxy its MMAs read through.
    auto waitFull = [&](int32_t t) {
        wgmma::mbarrierWait(sm.full(t % kMmaStages), uint32_t((t / kMmaStages) & 1));
        wgmma::fenceProxyAsync();
    };
    // This thread is done with tile t's stage (K, V, positions). Every thread arrives (release: its own reads of the
    // positions come before the producer's next writes); one arrival per warp after a __syncwarp still left racecheck
    // reporting the other lanes' reads against those writes.
    auto release = [&](int32_t t) { wgmma::mbarrierArrive(sm.empty(t % kMmaStages)); };
    // This warpgroup's 64 rows of a cell's Q: copied while the previous cell's outputs are stored (16-bit queries),
    // or loaded and converted through registers (8-bit; bf16 into an f16 S: scaled, Cfg::kScaledQ). Returns the
    // logits' factor for this thread's rows.
    auto issueQ = [&](CtaWork const& w, int32_t kvHead) {
        float qUnscale = 1.f;
        if (p.params.qFP8)
            loadQRows<typename Cfg::QKType, kD, Cfg::kRows, Cfg::kGroupThreads, true>(
                p, sm.q(), w.rowBegin, w.rowEnd, kvHead, tid & 127, 64 * group, 64);
        else if constexpr (Cfg::kScaledQ)
            qUnscale = loadQRowsScaledF16<kD, Cfg::kRows>(p, sm.q(), w.rowBegin, w.rowEnd, kvHead, lane,
                                                         64 * group + 16 * (warp & 3));
        else
            copyQRowsAsync<CT, kD, Cfg::kRows, Cfg::kGroupThreads>(p, sQ, w.rowBegin, w.rowEnd, kvHead, tid & 127,
                                                                   64 * group, 64);
        cpAsyncCommit();
        return qUnscale;
    };
    MultiCell cell{};
    CtaWork w{};
    bool haveCell = nextActiveCell(cell, w);
    float qUnscale = haveCell ? issueQ(w, cell.kvHead) : 1.f;
    while (haveCell) {
        int32_t const numTiles = warpUniform(w.tiles.count());
        int32_t const qa = rowQueryPos(w.seq, w.rowBegin, p.groupSize);
        int32_t const qb = rowQueryPos(w.seq, w.rowEnd - 1, p.groupSize);
        cpAsyncWait<0>();  // this thread's Q copies landed
        wgmma::fenceProxyAsync();
        wgmma::namedBarrierSync(kQReadyBarrier + uint32_t(group), Cfg::kGroupThreads);  // ... everyone's

        Sm90Consumer<CT, kD, Cfg> cons(p, w, group, warp, lane);
        cons.qUnscale = qUnscale;
        if (numTiles > 0) {
            if (kTurns && group == 1) handTurn();  // warpgroup 0 takes the first turn
            if constexpr (k8Bit) {
                for (int32_t i = 0; i < numTiles; ++i) {
                    int32_t const t = g + i;
                    waitFull(t);
                    bool const needMask = tileNeedsMaskAt<kTile>(p, sm.pos(t), qa, qb, lane);
                    takeTurn();
                    cons.runS(sQ, sm.mmaK(t), [&] {
                        // warpgroup 1's last turn has no turn of warpgroup 0 after it
                        if (group == 0 || i + 1 < numTiles)
                            handTurn();
                    });
                    cons.softmax(p, sm.pos(t), needMask);
                    cons.rescale();
                    cons.packP();
                    cons.runPV(sm.mmaV(t), [] {});
                    release(t);
                }
            } else {
                waitFull(g);
                bool const needMask = tileNeedsMaskAt<kTile>(p, sm.pos(g), qa, qb, lane);
                takeTurn();
                cons.runS(sQ, sm.mmaK(g), [&] { handTurn(); });
                cons.softmax(p, sm.pos(g), needMask);
                cons.packP();
                for (int32_t i = 0; i + 1 < numTiles; ++i) {
                    int32_t const t = g + i;
                    waitFull(t + 1);
                    // decided while this warpgroup waits for its turn, not between the MMAs' issue and the softmax
                    bool const nextMask = tileNeedsMaskAt<kTile>(p, sm.pos(t + 1), qa, qb, lane);
                    takeTurn();
                    cons.issueSAndPV(sQ, sm.mmaK(t + 1), sm.mmaV(t));
                    handTurn();
                    cons.softmaxUnderPV(p, sm.pos(t + 1), nextMask);
                    release(t);
                    cons.rescale();
                    cons.packP();
                }
                takeTurn();
                cons.runPV(sm.mmaV(g + numTiles - 1), [&] {
                    // The last turn: warpgroup 1 has no turn after it, so only warpgroup 0 hands one over.
                    if (group == 0) handTurn();
                });
                release(g + numTiles - 1);
            }
        }
        // This warpgroup's MMAs of the cell are done (waited for above), so its Q rows are free for the next cell's.
        MultiCell nextCell{};
        CtaWork nextWork{};
        bool const haveNext = nextActiveCell(nextCell, nextWork);
        if (haveNext) qUnscale = issueQ(nextWork, nextCell.kvHead);
        cons.store(p, w, cell.kvHead, cell.z);
        g += numTiles;
        cell = nextCell;
        w = nextWork;
        haveCell = haveNext;
    }
#endif
}

// ---- one instance's launch (or, without kp, its occupancy): the TMA loads' host side is attention_multi_sm90.cu's
template <typename CT, bool k8Bit, int kD, bool kWarpSpecialized>
cudaError_t prepareOrLaunchVariant(int32_t& ctasPerSm, AttentionKernelParams const* kp, dim3 grid,
                                  cudaStream_t stream) {
    using Cfg = Sm90MultiConfig<CT, k8Bit, kD, kWarpSpecialized>;
    static KernelSetup setup;
    auto const kernel = [] {
        if constexpr (kWarpSpecialized) return attentionMultiKernelSm90WS<CT, k8Bit, kD>;
        else return attentionMultiKernelSm90<CT, k8Bit, kD>;
    }();
    cudaError_t const err =
        setup.prepare(kernel, Cfg::kSmemBytes, Cfg::kThreads, ctasPerSm, "Hopper multi-token attention kernel", kD);
    if (err != cudaSuccess || kp == nullptr) return err;
    if constexpr (kWarpSpecialized) {  // persistent: at most one wave of CTAs walks the grid's cells
        int64_t const cells = int64_t(grid.x) * grid.y * grid.z;
        grid = dim3(uint32_t(persistentCtas(cells, smCountOfCurrentDevice(), ctasPerSm)));
        AttentionKernelParams launched = *kp;
        CUtensorMap map{};  // the kernel reads it only with a slot
        if (Cfg::kTma && kvRowMapsServe(launched, kD, grid.x)) {
            cudaError_t const encoded = kvRowMapTemplate(kD, launched.kvRowMaps, map);
            if (encoded != cudaSuccess) return encoded;
        } else {
            launched.kvRowMaps = nullptr;
        }
        return launchProgrammaticDependent(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, launched, map);
    } else {
        return launchProgrammaticDependent(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, *kp);
    }
}

}  // namespace

template <typename CT, bool k8Bit, int kD>
cudaError_t launchSm90Instance(bool warpSpecialized, int32_t& ctasPerSm, AttentionKernelParams const* kp, dim3 grid,
                               cudaStream_t stream) {
    return warpSpecialized ? prepareOrLaunchVariant<CT, k8Bit, kD, true>(ctasPerSm, kp, grid, stream)
                           : prepareOrLaunchVariant<CT, k8Bit, kD, false>(ctasPerSm, kp, grid, stream);
}

}  // namespace attn
}  // namespace pagedkv

// The instances at head dim D, for its translation unit (attention_multi_sm90_d<D>.cu): both compute types, 16-bit
// and 8-bit caches -- what dispatchAttention asks for at every head dim of the capability table.
#define PKV_SM90_INSTANCE(CT, K8, D)                                                                   \
    template cudaError_t pagedkv::attn::launchSm90Instance<CT, K8, D>(                                \
        bool, int32_t&, pagedkv::attn::AttentionKernelParams const*, dim3, cudaStream_t);
#define PKV_SM90_INSTANCES(D)                  \
    PKV_SM90_INSTANCE(__nv_bfloat16, false, D) \
    PKV_SM90_INSTANCE(__nv_bfloat16, true, D)  \
    PKV_SM90_INSTANCE(__half, false, D)        \
    PKV_SM90_INSTANCE(__half, true, D)
