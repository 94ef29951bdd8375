// Multi-token attention kernel for sm_90a (H100 / H200): the chunked-prefill / long-prompt / draft rows of
// attention_multi.cu on warpgroup MMAs. Same work split, same loader, same softmax; what changes is the math:
//  * a CTA is 2 warpgroups (256 threads) over kRows = 128 query rows (consecutive tokens x the G heads of one KV
//    head, the planner's row tile), each warpgroup 64 of them;
//  * KV tiles of kTile = 128 tokens stream through a cp.async pipeline into blocked, 128-byte-swizzled tiles
//    (blockedTileChunk), page by page through the block table (copyKVRows: one lookup per row, runs copied whole);
//  * per tile and warpgroup, S = Q K^T is kD / 16 wgmma m64n128k16 reading Q and K straight from shared memory,
//    the online softmax runs on the S registers (softmaxStepFixed: mask, soft-cap, running max and sum), and
//    O += P V is kTile / 16 wgmma m64nDk16 with P from registers and V read MN-major from shared memory;
//  * the two warpgroups run the same loop on different rows, so one's softmax overlaps the other's MMAs.
// Head dims 64 / 128, every cache dtype (8-bit tiles are converted into 16-bit ones in shared memory, as the mma.sync
// kernel does); the other head dims (32, 80, 96, 256) and other GPUs stay on attention_multi.cu's mma.sync kernel
// (multiKernelSm90Serves). Design, byte and FLOP counts, measurements:
// benchmarks/NOTES-attention.md, "Hopper multi-token kernel".
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_tile.cuh"
#include "wgmma.cuh"
#include "wgmma_ops.cuh"

namespace pagedkv {
namespace attn {
namespace {

template <typename CT, bool k8Bit, int kD>
struct Sm90MultiConfig {
    static_assert(kD == 64 || kD == 128, "whole 128-byte column blocks, one wgmma N for O");
    static constexpr int kWarpGroups = 2;
    static constexpr int kThreads = kWarpGroups * 128;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kRows = kWarpGroups * 64;
    static_assert(kRows == multiTileRows(kD), "the planner's row tiles (attention_plan.cpp) are this kernel's");
    static constexpr int kTile = 128;  // KV tokens per pipeline stage = N of S = Q K^T
    static constexpr int kNT = kTile / 8;
    // Three stages (the pipeline below holds tiles i, i + 1 and i + 2): 112 KB at D = 64, 227 KB at D = 128 (the
    // sm_90 per-CTA maximum, 232448 bytes, by 512 bytes). One CTA per SM either way.
    static constexpr int kStages = 3;
    static constexpr int kQBytes = kRows * kD * 2;
    static constexpr int kKVTileBytes = kTile * kD * 2;  // a 16-bit K or V tile as the MMAs read it
    // 8-bit caches: the stages hold the tiles as stored ([token][kD] bytes), converted each iteration into one K
    // tile (S(i + 1) reads it) and two V tiles (PV(i) reads one while the next is written).
    static constexpr int kRawTileBytes = k8Bit ? kTile * kD : kKVTileBytes;
    static constexpr int kConvBytes = k8Bit ? 3 * kKVTileBytes : 0;
    static constexpr int kAlign = 1024;  // the swizzle repeats every 1024 bytes: blocks start on that boundary
    static constexpr int kSmemBytes =
        kAlign + kQBytes + kStages * 2 * kRawTileBytes + kConvBytes + kStages * kTile * 4;
    static constexpr int kWarpRows = kTile / kWarps;  // KV rows each warp loads per tile
    static_assert(kWarpRows % 8 == 0 && 2 * kWarpRows <= 32, "a warp locates two tiles' rows at once");
    static_assert(kQBytes % kAlign == 0 && kRawTileBytes % kAlign == 0 && kKVTileBytes % kAlign == 0,
                  "tiles start on swizzle boundaries");
    static_assert(kSmemBytes <= 232448, "sm_90 opt-in shared memory per CTA");
};

template <typename CT, bool k8Bit, int kD>
__global__ void __launch_bounds__(Sm90MultiConfig<CT, k8Bit, kD>::kThreads, 1)
    attentionMultiKernelSm90(__grid_constant__ AttentionKernelParams const p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cfg = Sm90MultiConfig<CT, k8Bit, kD>;
    constexpr int kElemBytes = k8Bit ? 1 : 2;
    constexpr int kTile = Cfg::kTile;
    constexpr int kNT = Cfg::kNT;
    extern __shared__ __align__(16) unsigned char smemRaw[];

    // ---- prologue: this CTA's rows, chunk and KV tiles (the same decisions as the mma.sync kernel's)
    int32_t const slot = int32_t(gridDim.x) - 1 - int32_t(blockIdx.x);
    int32_t const kvHead = blockIdx.y;
    int32_t const z = blockIdx.z;
    int32_t const tid = threadIdx.x;
    int32_t const warp = tid >> 5;
    int32_t const lane = tid & 31;
    // Values every thread of a warp holds alike, broadcast from lane 0 so that ptxas sees them as warp-uniform: a
    // wgmma under a branch it cannot prove uniform is serialized (each MMA waited for before the next issues).
    auto uniform = [](int32_t v) { return __shfl_sync(0xffffffffu, v, 0); };
    int32_t const group = uniform(tid >> 7);  // warpgroup: rows [64 group, 64 group + 64) of the tile

    CtaWork const w = multiCtaWork(p.split, p.stepView(), Cfg::kRows, kTile, slot, z);
    if (!w.active) return;
    KVSource const src = makeKVSource(p, w, kvHead, kElemBytes);
    int32_t const qa = rowQueryPos(w.seq, w.rowBegin, p.groupSize);
    int32_t const qb = rowQueryPos(w.seq, w.rowEnd - 1, p.groupSize);

    // ---- shared memory (1024-byte aligned): Q tile, stages x (K, V) tiles, stages x positions
    unsigned char* const smem = smemRaw + ((Cfg::kAlign - (smemAddr(smemRaw) & (Cfg::kAlign - 1))) & (Cfg::kAlign - 1));
    unsigned char* const sQ = smem;
    uint32_t const sQAddr = smemAddr(sQ);
    uint32_t const sKVAddr = sQAddr + Cfg::kQBytes;
    unsigned char* const sConv = smem + Cfg::kQBytes + Cfg::kStages * 2 * Cfg::kRawTileBytes;
    int32_t* const sPos = reinterpret_cast<int32_t*>(sConv + Cfg::kConvBytes);
    auto rawKAddr = [&](int stage) { return sKVAddr + uint32_t(stage * 2 * Cfg::kRawTileBytes); };
    auto rawVAddr = [&](int stage) { return rawKAddr(stage) + uint32_t(Cfg::kRawTileBytes); };
    // The tiles the MMAs of tile j read: its stage (16-bit caches) or the converted tiles (8-bit).
    auto mmaKAddr = [&](int32_t j) { return k8Bit ? smemAddr(sConv) : rawKAddr(j % Cfg::kStages); };
    auto mmaVAddr = [&](int32_t j) {
        return k8Bit ? smemAddr(sConv) + uint32_t((1 + (j & 1)) * Cfg::kKVTileBytes) : rawVAddr(j % Cfg::kStages);
    };

    // ---- loader: warp w copies rows [w kWarpRows, (w + 1) kWarpRows) of every KV tile; tiles 2j and 2j + 1 are
    // located together a tile or two ahead (locateKVRowPair), resolved at 2j's copy.
    int32_t const numTiles = uniform(w.tiles.count());
    constexpr int kWarpRows = Cfg::kWarpRows;
    // the warp's first row: inside column block 0 of a blocked 16-bit tile, or of a [token][kD]-byte 8-bit tile
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
                src, rows, (i & 1) * kWarpRows, rawKAddr(stage) + warpRowOffset, rawVAddr(stage) + warpRowOffset,
                sPos + stage * kTile + warp * kWarpRows, lane);
        }
        cpAsyncCommit();
    };
    issue(0);
    issue(1);
    loadQRows<CT, kD, Cfg::kRows, Cfg::kThreads, true>(p, sQ, w.rowBegin, w.rowEnd, kvHead, tid);

    // ---- this thread's two rows: g and g + 8 of its warp's 16 inside the warpgroup's 64
    int32_t const g = lane >> 2;
    int32_t const c = lane & 3;
    int32_t const groupRow0 = group * 64;
    int32_t const warpRow0 = groupRow0 + (warp & 3) * 16;
    int32_t qPos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int32_t const row = w.rowBegin + warpRow0 + g + 8 * h;
        qPos[h] = row < w.rowEnd ? rowQueryPos(w.seq, row, p.groupSize) : -1;
    }

    float o[kD / 8][4];
#pragma unroll
    for (int dn = 0; dn < kD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    float m[2] = {negInf(), negInf()};
    float l[2] = {0.f, 0.f};

    // ---- the per-tile stages. S(j) = Q K_j^T into s; softmax(j) turns s into probabilities (mask, soft-cap, running
    // max / sum; alpha: the factor O must be rescaled by); packP packs them into pa; PV(j) is O += P_j V_j.
    float s[kNT][4];
    uint32_t pa[kTile / 16][4];
    float alpha[2] = {1.f, 1.f};
    // Does tile j need the per-element mask (some row holds no position, or some position is not visible to
    // every query of the CTA)? Each lane reads kTile / 32 positions; every warp reads the same ones.
    auto tileNeedsMaskAt = [&](int32_t j) {
        int32_t const* const tilePos = sPos + (j % Cfg::kStages) * kTile;
        bool allHere = true;
#pragma unroll
        for (int e = 0; e < kTile / 32; ++e) allHere = allHere && tilePos[e * 32 + lane] >= 0;  // conflict-free
        return uniform(tileNeedsMask(__all_sync(0xffffffffu, allHere), tilePos[0], tilePos[kTile - 1], qa, qb,
                                     p.params.window)) != 0;
    };
    auto issueS = [&](int32_t j) {  // async; the caller commits
        uint32_t const kAddr = mmaKAddr(j);
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
            wgmma::Mma<CT, kTile>::ss(s, wgmma::kMajor<Cfg::kRows>(sQAddr, groupRow0, kk),
                                      wgmma::kMajor<kTile>(kAddr, 0, kk), kk > 0);
        }
    };
    auto issuePV = [&](int32_t j) {
        uint32_t const vAddr = mmaVAddr(j);
#pragma unroll
        for (int kt = 0; kt < kTile / 16; ++kt)
            wgmma::Mma<CT, kD>::rs(o, pa[kt], wgmma::mnMajor<kTile>(vAddr, kt), true);
    };
    auto softmax = [&](int32_t j, bool needMask) {
        int32_t const* const tilePos = sPos + (j % Cfg::kStages) * kTile;
        auto step = [&](auto capped, auto masked) {
            softmaxStepFixed<kNT, decltype(capped)::value, decltype(masked)::value>(p, s, tilePos, qPos[0], qPos[1],
                                                                                    lane, m, l, alpha);
        };
        using Yes = std::true_type;
        using No = std::false_type;
        if (p.useSoftcap != 0) {
            if (needMask) step(Yes{}, Yes{});
            else step(Yes{}, No{});
        } else {
            if (needMask) step(No{}, Yes{});
            else step(No{}, No{});
        }
    };
    // P as the A operand of PV, packed only once no MMA reads pa any more (register operands stay live until the
    // MMA completes).
    auto packP = [&]() {
#pragma unroll
        for (int kt = 0; kt < kTile / 16; ++kt) probFragment<CT, kNT>(s, kt, pa[kt]);
    };
    // Tile i becomes visible: this thread's copies of it completed, handed to the async proxy, and the barrier
    // publishes every thread's. `pending` = commit groups allowed to stay in flight (the tiles after i).
    // 8-bit caches: the landed tile is then converted by the whole CTA into the tiles the MMAs read, and published
    // the same way (convK / convV are free: S(j - 1) and PV(j - 2), their last readers, completed before the barrier).
    auto landed = [&](auto pending, int32_t j) {
        cpAsyncWait<decltype(pending)::value>();
        if constexpr (k8Bit) {
            __syncthreads();
            unsigned char* const raw = smem + Cfg::kQBytes + (j % Cfg::kStages) * 2 * Cfg::kRawTileBytes;
            bool const isFp8 = p.cacheIsFp8 != 0;
            convertTile8<CT, kD, kTile, Cfg::kThreads, kTile>(raw, sConv, isFp8, tid);
            convertTile8<CT, kD, kTile, Cfg::kThreads, kTile>(raw + Cfg::kRawTileBytes,
                                                              sConv + (1 + (j & 1)) * Cfg::kKVTileBytes, isFp8, tid);
        }
        wgmma::fenceProxyAsync();
        __syncthreads();
    };

    // ---- pipeline (FlashAttention-3's intra-warpgroup overlap): iteration i issues S(i + 1) and PV(i) back to
    // back, runs softmax(i + 1) on the tensor cores' S(i + 1) while PV(i) is still in flight, then rescales O.
    // Three stages hold tiles i (V still read), i + 1 (K, V) and i + 2 (in flight). Commit groups at iteration
    // i's wait: tiles [0, i + 2), so waiting for all of them lands tile i + 1; the barrier after it also means
    // every warpgroup finished PV(i - 1), which frees tile i - 1's stage for tile i + 2.
    // The MMAs sit in straight-line code under conditions ptxas sees as uniform (the loop bound, broadcast): every
    // warpgroup runs every tile, a tile holding no position or a warpgroup past the rows included (their scores are
    // masked, their rows never stored), since a wgmma on a path ptxas cannot prove uniform is serialized.
    if (numTiles > 0) {
        landed(IntTag<1>{}, 0);  // tile 0 and Q
        bool const needMask = tileNeedsMaskAt(0);
        wgmma::fence();
        issueS(0);
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::pin(s);
        softmax(0, needMask);  // O is still 0: nothing to rescale
        packP();
        for (int32_t i = 0; i + 1 < numTiles; ++i) {
            landed(IntTag<0>{}, i + 1);
            // The MMAs first: the loader's integer work for tile i + 2 and the mask decision then issue while the
            // tensor cores run (issued before them, they would leave the tensor cores idle after every barrier).
            wgmma::fence();  // orders the rescaled O and the packed P before the MMAs read them
            issueS(i + 1);
            wgmma::commit();
            issuePV(i);
            wgmma::commit();
            issue(i + 2);
            bool const nextMask = tileNeedsMaskAt(i + 1);
            wgmma::wait<1>();  // S(i + 1) done; PV(i) may still run
            wgmma::pin(s);
            softmax(i + 1, nextMask);
            wgmma::wait<0>();
            wgmma::pin(o);
            rescaleRows(o, alpha);
            packP();
        }
        wgmma::fence();
        issuePV(numTiles - 1);
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::pin(o);
    }
    cpAsyncWait<0>();

    // ---- epilogue: outputs straight from the accumulators (row g / g + 8; dims 8 dn + 2c, + 1)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float const sum = quadSum(l[h]);
        int32_t const row = w.rowBegin + warpRow0 + g + 8 * h;
        if (row >= w.rowEnd) continue;
        int32_t const token = row / p.groupSize;
        int32_t const head = kvHead * p.groupSize + row % p.groupSize;
        float const scale = sum > 0.f ? p.outScale / sum : 0.f;  // nothing seen -> 0, never 0/0
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
            if (c == 0) p.partialLse[prow] = sum > 0.f ? m[h] + __log2f(sum) : negInf();
        }
    }
#endif
}

template <typename CT, bool k8Bit, int kD>
cudaError_t prepareOrLaunchSm90(int32_t& ctasPerSm, AttentionKernelParams const* kp, dim3 grid, cudaStream_t stream) {
    using Cfg = Sm90MultiConfig<CT, k8Bit, kD>;
    static KernelSetup setup;
    auto kernel = attentionMultiKernelSm90<CT, k8Bit, kD>;
    cudaError_t const err =
        setup.prepare(kernel, Cfg::kSmemBytes, Cfg::kThreads, ctasPerSm, "Hopper multi-token attention kernel", kD);
    if (err != cudaSuccess || kp == nullptr) return err;
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(*kp);
    return cudaGetLastError();
}

cudaError_t dispatchSm90(IODType io, CacheDType cache, int32_t headDim, int32_t& ctasPerSm,
                         AttentionKernelParams const* kp, dim3 grid, cudaStream_t stream) {
    auto byHeadDim = [&](auto ct, auto k8) -> cudaError_t {
        using CT = typename decltype(ct)::type;
        constexpr bool k8Bit = decltype(k8)::value;
        if (headDim == 128) return prepareOrLaunchSm90<CT, k8Bit, 128>(ctasPerSm, kp, grid, stream);
        if (headDim == 64) return prepareOrLaunchSm90<CT, k8Bit, 64>(ctasPerSm, kp, grid, stream);
        return invalidArgument("head_dim=" + std::to_string(headDim) +
                               ": expected 64 or 128 (Hopper multi-token kernel)");
    };
    auto byCache = [&](auto ct) -> cudaError_t {
        return isCache8Bit(cache) ? byHeadDim(ct, BoolTag<true>{}) : byHeadDim(ct, BoolTag<false>{});
    };
    return io == IODType::kBF16 ? byCache(TypeTag<__nv_bfloat16>{}) : byCache(TypeTag<__half>{});
}

}  // namespace

bool multiKernelSm90Serves(IODType io, CacheDType cache, int32_t headDim) {
    (void)cache;  // every cache dtype: 8-bit tiles are converted in shared memory
    if (headDim != 64 && headDim != 128) return false;
    if (io != IODType::kBF16 && io != IODType::kFP16) return false;
    // PAGEDKV_MULTI_KERNEL=mma keeps every GPU on the mma.sync kernel (A/B benchmarks, its tests on an H100/H200).
    char const* const choice = std::getenv("PAGEDKV_MULTI_KERNEL");
    if (choice != nullptr && std::strcmp(choice, "mma") == 0) return false;
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
}

cudaError_t multiKernelSm90Occupancy(IODType io, CacheDType cache, int32_t headDim, int32_t& ctasPerSm) {
    return dispatchSm90(io, cache, headDim, ctasPerSm, nullptr, dim3(), nullptr);
}

cudaError_t launchMultiKernelSm90(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                                  dim3 grid, cudaStream_t stream) {
    int32_t ctasPerSm = 0;
    return dispatchSm90(io, cache, headDim, ctasPerSm, &kp, grid, stream);
}

}  // namespace attn
}  // namespace pagedkv
