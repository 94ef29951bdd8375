// Decode attention kernel: sequences whose rows (qLen x G query heads of one KV head) fit one 16-row MMA
// tile -- decode tokens and short speculative drafts. Memory-bound: every K/V byte of the sequence's span is
// read once per KV head, for all the GQA heads of that KV head at once (they are the rows of the tile).
//
// Grid (B, KVH, Z): one CTA per (sequence, KV head, split-K chunk). The warps of a CTA (2, 4 or 8: the plan's
// width, attention_schedule.h) stream disjoint KV steps of 16 tokens (32 for 8-bit caches at D = 64, 128; warp w
// takes steps w, w + kWarps, ...), each through its own 3-stage cp.async pipeline (16-byte copies, pages resolved
// through the block table), with only warp-level barriers in the loop; at the end the warps' online-softmax states
// are combined in shared memory. A sequence cut into several chunks writes normalized partial outputs and
// log2-sum-exps for the merge kernel; otherwise the CTA writes the final output directly.
//
// 8-bit caches at D = 64, 128, 256 build f16 MMA fragments straight from the staging tiles (decodeTile8,
// Frag8); at the other head dims (32, 80, 96) each warp converts its staged tiles exactly to the compute type
// in shared memory first (convertTile8, as the multi-token kernel does) and runs the 16-bit step.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_tile.cuh"
#include "pdl.cuh"

namespace pagedkv {
namespace attn {
namespace {

template <typename CT, bool k8Bit, int kD, int kWarps_>
struct DecodeConfig {
    static_assert(kD % 16 == 0 && kD <= 256, "head dims are whole MMA k-steps and 16-byte chunks");
    // 8-bit caches: MMA fragments straight from the staging tiles (Frag8's lane permutations need D / 64 whole
    // 64-dim blocks), or, at the other head dims, a per-warp conversion to the compute type and the 16-bit step.
    static constexpr bool kFrag8 = k8Bit && kD % 64 == 0;
    static constexpr bool kConvert8 = k8Bit && !kFrag8;
    // The CTA width, one of those compiled for the instance (attention_schedule.h). 8-bit caches at D <= 128 run 2
    // warps (with their 32-token steps, below): ~52 KB of shared memory, so 4 CTAs share an SM and the kernel fits
    // sm_89's 99 KB (measured on the H200 against 4 warps and 2 CTAs/SM: fp8 64 x 4K 164.4 -> 162.1 us).
    static_assert(decodeWidthCompiled(k8Bit, kD, kWarps_), "a decode width the schedule lists for this instance");
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kRows = kDecodeRows;
    static constexpr int kTile = kDecodeTileTokens;
    static constexpr int kStages = kDecodeStages;
    static constexpr int kElemBytes = k8Bit ? 1 : 2;
    // 16-token tiles per warp step. 8-bit caches at D <= 128 take two (32 tokens: 8 KB of K + V per step at
    // D = 128, like a 16-bit step): twice the independent work per step for about the same dependency chain
    // (profiled: 16-token 8-bit steps at 4 CTAs/SM were latency-bound -- ~7 cycles per instruction, issue
    // slots half idle, warps almost never waiting for data -- so cutting instructions did not help).
    static constexpr int kStepTiles = kFrag8 && kD <= 128 ? 2 : 1;
    static constexpr int kStep = kTile * kStepTiles;  // KV tokens per warp step
    static constexpr int kTileRow = tileRowElems(kD);  // elements per row of the 16-bit tiles (Q, K, V)
    // One stage's K (or V): 16-bit caches as the swizzled tile ldmatrix reads, 8-bit ones as stored (kD bytes a row).
    static constexpr int kRawTileBytes = kStep * (k8Bit ? kD : kTileRow * 2);
    static constexpr int kConvTileBytes = kConvert8 ? kTile * kTileRow * 2 : 0;  // a warp's converted K (and V)
    static constexpr int kPosBytes = kStages * kStep * 4;
    static constexpr int kWarpBytes = kStages * 2 * kRawTileBytes + 2 * kConvTileBytes + kPosBytes;
    static constexpr int kQBytes = kRows * kTileRow * 2;
    // loadQRowsK8's per-warp max |q| (kWarps floats), padded to keep the staging tiles after it 32-byte
    // aligned: a 16-byte cp.async pair whose global sector lands across two shared 32-byte sectors is fetched
    // twice (measured, Nsight Compute: with 16 bytes of scratch here the fp8 decode moved 2x its KV bytes from
    // L2 to the SMs, one L2 sector request per lane instead of per lane pair, and ran at 76 % of the copy
    // ceiling).
    static constexpr int kScratchBytes = kFrag8 ? 128 : 0;
    static constexpr int kPipelineBytes = kQBytes + kScratchBytes + kWarps * kWarpBytes;
    // End-of-CTA combine buffer (aliases the pipeline): per warp and row, D partial outputs (+4 floats of
    // padding against bank conflicts), the running max and the sum.
    static constexpr int kCombineStride = kD + 4;
    static constexpr int kCombineBytes = kWarps * kRows * (kCombineStride + 2) * 4;
    static constexpr int kSmemBytes = kPipelineBytes > kCombineBytes ? kPipelineBytes : kCombineBytes;
    // Q fragments stay in registers for D <= 128; for D = 256 they are re-read from shared memory per step.
    static constexpr bool kQInRegs = kD <= 128;
    static_assert(kRawTileBytes % 32 == 0 && kConvTileBytes % 32 == 0 && kWarpBytes % 32 == 0 &&
                      (kQBytes + kScratchBytes) % 32 == 0,
                  "every staging tile starts on a 32-byte shared-memory sector (see kScratchBytes)");
    static_assert((kStep & (kStep - 1)) == 0 && kStep <= 32, "the step-is-clean vote reads position lane % kStep");
};

// Rows of a sequence that needed the (unlaunched) multi-token kernel: NaN, so a wrong maxQLen bound shows.
template <typename CT, int kD>
__device__ void poisonRows(AttentionKernelParams const& p, CtaWork const& w, int32_t kvHead, int32_t tid,
                           int32_t threads) {
    uint16_t const nan = quietNaNBits<CT>();
    uint16_t* out = static_cast<uint16_t*>(p.params.out);
    int64_t const rows = w.rowEnd - w.rowBegin;
    for (int64_t i = tid; i < rows * kD; i += threads) {
        int32_t const row = w.rowBegin + int32_t(i / kD);
        int32_t const token = row / p.groupSize;
        int32_t const head = kvHead * p.groupSize + row % p.groupSize;
        out[(int64_t(token) * p.params.numQHeads + head) * kD + i % kD] = nan;
    }
}

// What a lane holds across the decode loop: the CTA's Q fragments (in registers for D <= 128, else re-read
// from the shared tile per k-step), its ldmatrix lane offsets (attention_tile.cuh: FragLane) and the query
// positions of its accumulator rows g and g + 8 (-1: padding row, sees nothing).
template <int kD, bool kQInRegs>
struct DecodeLane {
    uint32_t qFrag[kQInRegs ? kD / 16 : 1][4];
    uint32_t sQAddr;
    uint32_t offA, offK, offV;
    int32_t qPos0, qPos1;

    __device__ __forceinline__ DecodeLane(AttentionKernelParams const& p, CtaWork const& w, unsigned char const* sQ,
                                          int32_t lane) {
        using Lane = FragLane<kD>;
        int32_t const g = lane >> 2;
        int32_t const numRows = w.rowEnd - w.rowBegin;  // <= 16
        qPos0 = g < numRows ? rowQueryPos(w.seq, w.rowBegin + g, p.groupSize) : -1;
        qPos1 = g + 8 < numRows ? rowQueryPos(w.seq, w.rowBegin + g + 8, p.groupSize) : -1;
        sQAddr = smemAddr(sQ);
        offA = Lane::offsetA(lane), offK = Lane::offsetK(lane), offV = Lane::offsetV(lane);
        if constexpr (kQInRegs) {
#pragma unroll
            for (int kk = 0; kk < kD / 16; ++kk) ldmatrixX4(qFrag[kk], Lane::at(sQAddr, offA, 0, kk));
        }
    }
    // The A fragment of Q K^T's k-step kk.
    __device__ __forceinline__ void fragA(int kk, uint32_t (&a)[4]) const {
        if constexpr (kQInRegs) {
            a[0] = qFrag[kk][0], a[1] = qFrag[kk][1], a[2] = qFrag[kk][2], a[3] = qFrag[kk][3];
        } else {
            ldmatrixX4(a, FragLane<kD>::at(sQAddr, offA, 0, kk));
        }
    }
};

// The decode kernel's online-softmax step on its 16-row score tile: soft-cap and mask chosen once per tile
// (uniform branches, withSoftmaxVariant), not per score -- the run-time switches cost two branches per score,
// ~1/10 of the fp8 decode loop's instructions (profiled). kPerTile = false keeps the per-score switches (one
// inlined variant instead of four: the 16-bit D = 256 kernel spills with four).
template <int kNT, bool kPerTile, int kDimTiles>
__device__ __forceinline__ void decodeSoftmax(AttentionKernelParams const& p, float (&s)[kNT][4], int32_t const* sPos,
                                              bool needMask, int32_t qPos0, int32_t qPos1, int32_t lane,
                                              SoftmaxRows<kDimTiles>& st, float rawScale) {
    float alpha[2];
    if constexpr (!kPerTile) {
        softmaxStep<kNT>(p, s, sPos, needMask, qPos0, qPos1, lane, st.m, st.l, alpha, rawScale);
    } else {
        withSoftmaxVariant(p.useSoftcap != 0, needMask, [&](auto capped, auto masked) {
            softmaxStepFixed<kNT, decltype(capped)::value, decltype(masked)::value>(p, s, sPos, qPos0, qPos1, lane,
                                                                                    st.m, st.l, alpha, rawScale);
        });
    }
    rescaleRows(st.o, alpha);
}

// One warp step (kNT * 8 tokens: 16 or 32) of an 8-bit cache, straight from the staging tiles into MMA
// fragments (Frag8): S = Q K^T, the online-softmax step, O += P V. Both products run as f16 MMAs whatever the
// compute type: 8-bit values are exact in f16 and convert with one cvt per pair (e4m3), Q was converted by
// loadQRowsK8 (bf16 queries scaled by a power of two, undone by qUnscale on the logits), and P is in [0, 1].
// kFp8: e4m3, else int8 (a uniform choice per launch, hoisted out of the loop by decodeBody's instantiation).
template <typename CT, int kD, int kNT, bool kFp8, bool kQInRegs>
__device__ __forceinline__ void decodeTile8(AttentionKernelParams const& p, uint32_t kRaw, uint32_t vRaw,
                                            int32_t const* tilePos, DecodeLane<kD, kQInRegs> const& q,
                                            float qUnscale, bool needMask, int32_t lane, SoftmaxRows<kD / 8>& st) {
    using F = Frag8<kD>;
    int32_t const g = lane >> 2;
    int32_t const c = lane & 3;

    // S = Q K^T: lane (g, c) reads chunks laneChunkK(c, h) of tokens g + 8 nt; word wi is k-step 4h + wi.
    // Even and odd k-steps accumulate separately (sOdd) and are summed after: 2 kNT independent MMA chains,
    // so consecutive MMAs do not wait on each other's accumulators (profiled: the dependent chains were the
    // largest stall of this loop).
    float s[kNT][4], sOdd[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = sOdd[nt][e] = 0.f;
#pragma unroll
    for (int h = 0; h < F::kKChunksPerLane; ++h) {
        uint32_t wk[kNT][4];  // [n-tile: token g + 8 nt][word]
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            uint4 const k = ldsU32x4(kRaw + F::chunkOffset(g + 8 * nt, F::laneChunkK(c, h)));
            wk[nt][0] = k.x, wk[nt][1] = k.y, wk[nt][2] = k.z, wk[nt][3] = k.w;
        }
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
            int const kk = 4 * h + wi;
            uint32_t a[4];
            q.fragA(kk, a);
            float (&acc)[kNT][4] = (wi & 1) ? sOdd : s;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                uint32_t b0, b1;
                bytes4ToHalfPairs<kFp8>(wk[nt][wi], b0, b1);
                Mma<__half>::run(acc[nt], a, b0, b1);
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += sOdd[nt][e];
    // qUnscale (a power of two, 1 unless the queries are bf16) is folded into the softmax's logit scale.
    decodeSoftmax<kNT, true>(p, s, tilePos, needMask, q.qPos0, q.qPos1, lane, st, qUnscale);

    // O += P V as an f16 MMA (tokenPairsToHalf), 16 tokens per k-step kt: lane (g, c) reads tokens 16 kt +
    // 2c, 2c + 1, 2c + 8, 2c + 9 (the k pairs of its B fragments), the kVRun contiguous dims of each 128-dim
    // block that output column g stands for (Frag8::vDim).
    constexpr int kBlocks = kD >= 128 ? kD / 128 : 1;  // 128-dim blocks; D = 64: one block of 8 bytes per lane
    constexpr int kWords = kD >= 128 ? 4 : 2;          // words per token and block: 4 output tiles each
#pragma unroll
    for (int kt = 0; kt < kNT / 2; ++kt) {
        uint32_t pa[4];
        probFragment<__half, kNT>(s, kt, pa);
#pragma unroll
        for (int hv = 0; hv < kBlocks; ++hv) {
            uint32_t w[4][kWords];  // [token 2c, 2c+1, 2c+8, 2c+9][word]
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                int32_t const tok = 16 * kt + 2 * c + (t & 1) + 8 * (t >> 1);
                if constexpr (kD >= 128) {
                    uint4 const v = ldsU32x4(vRaw + F::chunkOffset(tok, g + 8 * hv));
                    w[t][0] = v.x, w[t][1] = v.y, w[t][2] = v.z, w[t][3] = v.w;
                } else {
                    uint2 const v = ldsU32x2(vRaw + F::chunkOffset(tok, g >> 1) + 8 * (g & 1));
                    w[t][0] = v.x, w[t][1] = v.y;
                }
            }
#pragma unroll
            for (int wd = 0; wd < kWords; ++wd) {
                uint32_t b0[4], b1[4];  // output tiles 4 wd + j: tokens (2c, 2c+1) and (2c+8, 2c+9)
                tokenPairsToHalf<kFp8>(w[0][wd], w[1][wd], b0);
                tokenPairsToHalf<kFp8>(w[2][wd], w[3][wd], b1);
#pragma unroll
                for (int j = 0; j < 4; ++j) Mma<__half>::run(st.o[hv * 16 + wd * 4 + j], pa, b0[j], b1[j]);
            }
        }
    }
}

// One warp step (16 tokens) of 16-bit tiles (16-bit caches, or 8-bit ones converted by the warp): S = Q K^T
// with even and odd k-steps in separate accumulators (as decodeTile8) where registers allow (D <= 128), the
// online-softmax step (per-tile variants where registers allow), O += P V. ldmatrix reads the swizzled tiles.
template <typename CT, int kD, bool kQInRegs>
__device__ __forceinline__ void decodeTile16(AttentionKernelParams const& p, uint32_t kTileAddr, uint32_t vTileAddr,
                                             int32_t const* tilePos, DecodeLane<kD, kQInRegs> const& q,
                                             bool needMask, int32_t lane, SoftmaxRows<kD / 8>& st) {
    using Lane = FragLane<kD>;
    constexpr bool kSplitS = kD <= 128;
    // S = Q K^T for 16 rows x 16 tokens
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float sOdd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[4];
        q.fragA(kk, a);
        uint32_t b[4];
        ldmatrixX4(b, Lane::at(kTileAddr, q.offK, 0, kk));
        float (&acc)[2][4] = (kSplitS && (kk & 1)) ? sOdd : s;
        Mma<CT>::run(acc[0], a, b[0], b[1]);
        Mma<CT>::run(acc[1], a, b[2], b[3]);
    }
    if constexpr (kSplitS) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] += sOdd[nt][e];
    }

    decodeSoftmax<2, kSplitS>(p, s, tilePos, needMask, q.qPos0, q.qPos1, lane, st, 1.f);

    // O += P V
    uint32_t pa[4];
    probFragment<CT, 2>(s, 0, pa);
#pragma unroll
    for (int dp = 0; dp < kD / 16; ++dp) {
        uint32_t b[4];
        ldmatrixX4Trans(b, Lane::at(vTileAddr, q.offV, 0, dp));
        Mma<CT>::run(st.o[2 * dp], pa, b[0], b[1]);
        Mma<CT>::run(st.o[2 * dp + 1], pa, b[2], b[3]);
    }
}

// The end-of-CTA combine buffer (aliases the pipeline): per warp and row, D partial outputs (kCombineStride
// apart), the running max and the sum.
template <class Cfg>
struct DecodeCombine {
    float* cO;  // [kWarps][16][kCombineStride]
    float* cM;  // [kWarps][16]
    float* cL;  // [kWarps][16]
    __device__ __forceinline__ explicit DecodeCombine(unsigned char* smem) {
        cO = reinterpret_cast<float*>(smem);
        cM = cO + Cfg::kWarps * Cfg::kRows * Cfg::kCombineStride;
        cL = cM + Cfg::kWarps * Cfg::kRows;
    }
};

// Epilogue, part 1: a warp's state -> the combine buffer (the caller has synchronized the CTA: the pipeline's
// shared memory is free; the sums are quad-reduced).
template <class Cfg, int kD>
__device__ __forceinline__ void stashWarpState(DecodeCombine<Cfg> const& cb, SoftmaxRows<kD / 8> const& st,
                                               int32_t warp, int32_t lane) {
    int32_t const g = lane >> 2;
    int32_t const c = lane & 3;
    if (c == 0) {
        cb.cM[warp * 16 + g] = st.m[0], cb.cM[warp * 16 + g + 8] = st.m[1];
        cb.cL[warp * 16 + g] = st.l[0], cb.cL[warp * 16 + g + 8] = st.l[1];
    }
#pragma unroll
    for (int dn = 0; dn < kD / 8; ++dn) {
        float* const r0 = cb.cO + (warp * 16 + g) * Cfg::kCombineStride;
        float* const r1 = r0 + 8 * Cfg::kCombineStride;
        // column 2c (+1) of output tile dn is dim dn * 8 + 2c (+1), or Frag8::vDim of it on the Frag8 path
        int32_t const d0 = Cfg::kFrag8 ? Frag8<kD>::vDim(dn, 2 * c) : dn * 8 + 2 * c;
        int32_t const d1 = Cfg::kFrag8 ? Frag8<kD>::vDim(dn, 2 * c + 1) : dn * 8 + 2 * c + 1;
        r0[d0] = st.o[dn][0], r0[d1] = st.o[dn][1];
        r1[d0] = st.o[dn][2], r1[d1] = st.o[dn][3];
    }
}

// Epilogue, part 2 (after a CTA barrier): the warps' states combined per row and written -- the final output
// when the sequence is one chunk, else a normalized partial row and its log2-sum-exp for the merge kernel.
// 8 threads per row (rows tid / 8, + kThreads / 8, ...). Thread j's values d < kDimsPerThread are dims
// dimOf(d): kD / 8 consecutive ones from d0 = j kD / 8 for D = 64, 128, 256; for the other head dims 8-dim
// groups j, j + 8 (dims d0 + 64 (d / 8) + d % 8 from d0 = 8 j; D = 32, 80, 96 have 4, 10, 12 groups, so
// some threads have a group less: hasDim).
template <typename CT, class Cfg, int kD>
__device__ __forceinline__ void writeCombinedRows(AttentionKernelParams const& p, CtaWork const& w,
                                                  DecodeCombine<Cfg> const& cb, int32_t kvHead, int32_t z,
                                                  int32_t tid) {
    constexpr bool kConsecutive = kD % 64 == 0;
    constexpr int kDimsPerThread = kConsecutive ? kD / 8 : 8 * ((kD / 8 + 7) / 8);
    int32_t const d0 = (tid & 7) * (kConsecutive ? kDimsPerThread : 8);
    auto dimOf = [&](int d) { return kConsecutive ? d0 + d : d0 + 64 * (d / 8) + d % 8; };
    auto hasDim = [&](int d) { return kConsecutive || dimOf(d) < kD; };
    int32_t const numRows = w.rowEnd - w.rowBegin;
    for (int32_t row = tid >> 3; row < numRows; row += Cfg::kThreads / 8) {
        float mMax = negInf();
#pragma unroll
        for (int ww = 0; ww < Cfg::kWarps; ++ww) mMax = fmaxf(mMax, cb.cM[ww * 16 + row]);
        float weight[Cfg::kWarps];
        float sum = 0.f;
#pragma unroll
        for (int ww = 0; ww < Cfg::kWarps; ++ww) {
            weight[ww] = mMax == negInf() ? 0.f : fastExp2(cb.cM[ww * 16 + row] - mMax);
            sum += weight[ww] * cb.cL[ww * 16 + row];
        }
        float acc[kDimsPerThread];
#pragma unroll
        for (int d = 0; d < kDimsPerThread; ++d) {
            float x = 0.f;
            if (hasDim(d)) {
#pragma unroll
                for (int ww = 0; ww < Cfg::kWarps; ++ww)
                    x += weight[ww] * cb.cO[(ww * 16 + row) * Cfg::kCombineStride + dimOf(d)];
            }
            acc[d] = x;
        }
        // A row that saw nothing (every visible page absent) outputs 0, never 0/0.
        float const scale = sum > 0.f ? p.outScale / sum : 0.f;
        int32_t const grow = w.rowBegin + row;
        int32_t const token = grow / p.groupSize;
        int32_t const head = kvHead * p.groupSize + grow % p.groupSize;
        if (w.nChunks == 1) {
            CT* const dst = static_cast<CT*>(p.params.out) + (int64_t(token) * p.params.numQHeads + head) * kD + d0;
#pragma unroll
            for (int d = 0; d < kDimsPerThread; d += 8) {
                if (!hasDim(d)) continue;
                uint4 v;
                v.x = Mma<CT>::pack(acc[d] * scale, acc[d + 1] * scale);
                v.y = Mma<CT>::pack(acc[d + 2] * scale, acc[d + 3] * scale);
                v.z = Mma<CT>::pack(acc[d + 4] * scale, acc[d + 5] * scale);
                v.w = Mma<CT>::pack(acc[d + 6] * scale, acc[d + 7] * scale);
                *reinterpret_cast<uint4*>(dst + (dimOf(d) - d0)) = v;
            }
        } else {
            int64_t const prow = partialRow(p, z, token, head);
            float* const dst = p.partialOut + prow * kD + d0;
#pragma unroll
            for (int d = 0; d < kDimsPerThread; d += 4) {
                if (!hasDim(d)) continue;
                *reinterpret_cast<float4*>(dst + (dimOf(d) - d0)) =
                    make_float4(acc[d] * scale, acc[d + 1] * scale, acc[d + 2] * scale, acc[d + 3] * scale);
            }
            if ((tid & 7) == 0) p.partialLse[prow] = sum > 0.f ? mMax + __log2f(sum) : negInf();
        }
    }
}

// The decode CTA: prologue (work, pool, KV source), the warp's loader primed, Q loaded, the step loop
// (wait, refill, [convert], mask decision, step), the epilogue (stash, combine, write).
template <typename CT, bool k8Bit, int kD, int kWarps, bool kFp8>
__device__ __forceinline__ void decodeBody(AttentionKernelParams const& p) {
    using Cfg = DecodeConfig<CT, k8Bit, kD, kWarps>;
    constexpr int kTile = Cfg::kTile;
    constexpr int kStep = Cfg::kStep;
    constexpr int kStages = Cfg::kStages;
    extern __shared__ __align__(16) unsigned char smem[];

    // The grid is (B, KVH, Z) but its CTAs take (sequence, KV head) with the KV head fastest in launch order: the
    // CTAs resident at once then read the same pages' K and V for all the heads (a page's rows of every head are
    // one contiguous span in either layout), not one head's rows of twice as many pages.
    uint32_t const unit = blockIdx.x + gridDim.x * blockIdx.y;
    int32_t const seq = int32_t(unit / gridDim.y);
    int32_t const kvHead = int32_t(unit % gridDim.y);
    int32_t const z = blockIdx.z;
    int32_t const tid = threadIdx.x;
    int32_t const warp = tid >> 5;
    int32_t const lane = tid & 31;

    // ---- prologue
    // Launched as a programmatic dependent (pdl.cuh): the kernel before this one on the stream (the QKV write of
    // the step's Q and K/V, in a model) may still be running; nothing global is read before it has completed.
    gridDependencyWait();
    // The split-K merge (launched as a programmatic dependent, attention_merge.cu) may be scheduled once every
    // CTA of this grid has started: it waits for this grid's completion before reading any partial, so the
    // trigger only hides its launch latency behind this kernel's run.
    // Only when the merge follows (a split plan), so that no other kernel's launch is moved forward.
    if (p.split.decodeGridChunks > 1) gridDependencyLaunchDependents();
    // The pool descriptor does not depend on the step metadata: load it first, so that its round trip
    // overlaps decodeCtaWork's (the prologue is metadata -> block table -> first KV tile; every CTA of a
    // single-sequence split pays it once, unhidden).
    PoolView const pool = loadPool(p);
    CtaWork const w = decodeCtaWork(p.split, p.stepView(), seq, z);
    if (w.poison) poisonRows<CT, kD>(p, w, kvHead, tid, Cfg::kThreads);
    if (!w.active) return;
    KVSource const src = makeKVSourceFromPool(pool, p, w, kvHead, Cfg::kElemBytes);
    // ---- shared memory: the Q tile, loadQRowsK8's scratch (Frag8 path), then this warp's staged KV tiles
    unsigned char* const sQ = smem;
    float* const sWarpMax = reinterpret_cast<float*>(smem + Cfg::kQBytes);
    KVStageTiles<kStages, Cfg::kRawTileBytes, Cfg::kConvTileBytes, kStep> const sm(
        smem + Cfg::kQBytes + Cfg::kScratchBytes + warp * Cfg::kWarpBytes);

    // ---- loader: this warp's steps are w, w + kWarps, ... of the CTA's tile list in steps of kStepTiles tiles.
    // Its tile n (PairedKVTileLoader's numbering) is tile n % kStepTiles of step n / kStepTiles: with 1-tile
    // steps, steps 2j and 2j + 1 are located at step 2j - 2's copy and resolved at 2j's; with 2-tile steps, the
    // step's two tiles are located at the previous step's copy.
    int32_t const numTiles = w.tiles.count();
    int32_t const numSteps = (numTiles + Cfg::kStepTiles - 1) / Cfg::kStepTiles;
    int32_t const mine = numSteps > warp ? (numSteps - warp + Cfg::kWarps - 1) / Cfg::kWarps : 0;
    auto const tileAt = [&](int32_t n) {
        int32_t const step = Cfg::kStepTiles == 2 ? n >> 1 : n;
        int32_t const t = (warp + step * Cfg::kWarps) * Cfg::kStepTiles + (Cfg::kStepTiles == 2 ? (n & 1) : 0);
        bool const valid = step < mine && t < numTiles;
        return KVTileRef{valid, valid ? w.tiles.tile(t) * kTile : 0};
    };
    PairedKVTileLoader<kD, Cfg::kElemBytes, kTile, Cfg::kFrag8> loader;
    loader.start(p, src, tileAt, lane);
    // issue(i): step i's copies into its stage (one commit group per call, empty past the warp's last step).
    auto issue = [&](int32_t i) {
        if (i < mine) {
            int32_t const stage = i % kStages;
            uint32_t const sK = smemAddr(sm.rawK(stage)), sV = smemAddr(sm.rawV(stage));
            if constexpr (Cfg::kStepTiles == 2) {
                constexpr uint32_t kHalf = uint32_t(Cfg::kRawTileBytes / 2);  // rows 16.. of the stage
                loader.copy(p, src, tileAt, 2 * i, sK, sV, sm.pos(stage), lane);
                loader.copy(p, src, tileAt, 2 * i + 1, sK + kHalf, sV + kHalf, sm.pos(stage) + kTile, lane);
            } else {
                loader.copy(p, src, tileAt, i, sK, sV, sm.pos(stage), lane);
            }
        }
        cpAsyncCommit();  // always: keeps the group count uniform for cp.async.wait_group
    };
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(i);

    // ---- queries: the Q tile (under the first copies), the lane's fragments and row positions
    float qUnscale = 1.f;  // Frag8 path: the logits' factor undoing loadQRowsK8's power-of-two Q scaling
    if constexpr (Cfg::kFrag8)
        qUnscale = loadQRowsK8<CT, kD, Cfg::kRows, Cfg::kThreads>(p, sQ, sWarpMax, w.rowBegin, w.rowEnd, kvHead,
                                                                   tid);
    else
        loadQRows<CT, kD, Cfg::kRows, Cfg::kThreads>(p, sQ, w.rowBegin, w.rowEnd, kvHead, tid);
    __syncthreads();
    DecodeLane<kD, Cfg::kQInRegs> const q(p, w, sQ, lane);
    int32_t const qFirst = rowQueryPos(w.seq, w.rowBegin, p.groupSize);   // earliest query of the CTA's rows
    int32_t const qLast = rowQueryPos(w.seq, w.rowEnd - 1, p.groupSize);  // latest

    SoftmaxRows<kD / 8> st;
    st.init();

    // ---- the warp's steps
    for (int32_t i = 0; i < mine; ++i) {
        cpAsyncWait<kStages - 2>();  // this lane's copies of step i have landed ...
        __syncwarp();                // ... and every lane's (and every lane is done with step i - 1)
        issue(i + kStages - 1);      // refills the stage step i - 1 used
        int32_t const stage = i % kStages;
        if constexpr (Cfg::kConvert8) {
            // The step's 8-bit K and V -> the warp's 16-bit tiles of the compute type (exact). The barrier at the
            // top of this iteration ordered the previous step's reads of them before these writes.
            convertTile8<CT, kD, kTile, 32>(sm.rawK(stage), sm.convK(), p.cacheIsFp8 != 0, lane);
            convertTile8<CT, kD, kTile, 32>(sm.rawV(stage), sm.convV(), p.cacheIsFp8 != 0, lane);
            __syncwarp();
        }
        uint32_t const kTileAddr = smemAddr(Cfg::kConvert8 ? sm.convK() : sm.rawK(stage));
        uint32_t const vTileAddr = smemAddr(Cfg::kConvert8 ? sm.convV() : sm.rawV(stage));
        int32_t const* const tilePos = sm.pos(stage);
        // A step whose every row holds a position that all the CTA's queries see needs no per-element mask
        // (tileNeedsMask, the multi-token kernel's rule; positions ascend within a step: its tiles come in
        // list order). Padding rows (qPos -1) then see it too, harmlessly: their Q is zero and they are never
        // written.
        bool const holdsAll = __all_sync(0xffffffffu, tilePos[lane & (kStep - 1)] >= 0);
        bool const needMask = tileNeedsMask(holdsAll, tilePos[0], tilePos[kStep - 1], qFirst, qLast, p.params.window);
        if constexpr (Cfg::kFrag8)
            decodeTile8<CT, kD, kStep / 8, kFp8, Cfg::kQInRegs>(p, kTileAddr, vTileAddr, tilePos, q, qUnscale, needMask,
                                                                lane, st);
        else
            decodeTile16<CT, kD, Cfg::kQInRegs>(p, kTileAddr, vTileAddr, tilePos, q, needMask, lane, st);
    }
    cpAsyncWait<0>();
    st.reduceSums();

    // ---- epilogue: combine the warps' states; the pipeline's shared memory is free once every warp got here
    __syncthreads();
    DecodeCombine<Cfg> const cb(smem);
    stashWarpState<Cfg, kD>(cb, st, warp, lane);
    __syncthreads();
    writeCombinedRows<CT, Cfg, kD>(p, w, cb, kvHead, z, tid);
}

template <typename CT, bool k8Bit, int kD, int kWarps>
__global__ void __launch_bounds__(DecodeConfig<CT, k8Bit, kD, kWarps>::kThreads)
    attentionDecodeKernel(__grid_constant__ AttentionKernelParams const p) {
    if constexpr (DecodeConfig<CT, k8Bit, kD, kWarps>::kFrag8) {  // the Frag8 conversions are compiled per 8-bit dtype
        if (p.cacheIsFp8)
            decodeBody<CT, true, kD, kWarps, true>(p);
        else
            decodeBody<CT, true, kD, kWarps, false>(p);
    } else {  // 16-bit caches, and 8-bit ones converted per step (fp8 vs int8: a uniform branch of convertTile8)
        decodeBody<CT, k8Bit, kD, kWarps, false>(p);
    }
}

template <typename CT, bool k8Bit, int kD, int kWarps>
struct DecodeFamily : DecodeConfig<CT, k8Bit, kD, kWarps> {
    static constexpr char const* kName = "decode attention kernel";
    static auto kernel() { return attentionDecodeKernel<CT, k8Bit, kD, kWarps>; }
};

// What dispatchDecode does with a width the schedule lists but does not compile for the instance
// (decodeWidthCompiled): fail with the field and the value, or succeed without calling f (the queries that report
// such a width as absent).
enum class UncompiledWidth { kFail, kSkip };

// f(DecodeFamily<...>{}) for the instance serving (io, cache, headDim) at `warps` per CTA; a width outside
// kDecodeWidthWarps fails with the field and the value.
template <UncompiledWidth kUncompiled = UncompiledWidth::kFail, typename F>
cudaError_t dispatchDecode(IODType io, CacheDType cache, int32_t headDim, int32_t warps, F&& f) {
    return dispatchAttention(io, isCache8Bit(cache), headDim, [&](auto ct, auto k8, auto d) -> cudaError_t {
        auto at = [&](auto width) -> cudaError_t {
            using CT = typename std::decay_t<decltype(ct)>::type;
            constexpr bool k8Bit = std::decay_t<decltype(k8)>::value;
            constexpr int kD = std::decay_t<decltype(d)>::value;
            constexpr int kWarps = std::decay_t<decltype(width)>::value;
            static_assert(isDecodeWidth(kWarps), "the switch below names the widths of kDecodeWidthWarps");
            if constexpr (decodeWidthCompiled(k8Bit, kD, kWarps)) {
                return f(DecodeFamily<CT, k8Bit, kD, kWarps>{});
            } else if constexpr (kUncompiled == UncompiledWidth::kSkip) {
                return cudaSuccess;
            } else {
                return invalidArgument("decode warps=" + std::to_string(warps) + ": not compiled for cache_dtype=" +
                                       std::to_string(static_cast<int32_t>(cache)) + " head_dim=" +
                                       std::to_string(headDim) + " (attention_schedule.h lists the widths)");
            }
        };
        static_assert(kNumDecodeWidths == 3, "one case per width of kDecodeWidthWarps");
        switch (warps) {
            case kDecodeWidthWarps[0]: return at(IntTag<kDecodeWidthWarps[0]>{});
            case kDecodeWidthWarps[1]: return at(IntTag<kDecodeWidthWarps[1]>{});
            case kDecodeWidthWarps[2]: return at(IntTag<kDecodeWidthWarps[2]>{});
        }
        return invalidArgument("decode warps=" + std::to_string(warps) + ": expected one of " +
                               commaList(kDecodeWidthWarps));
    });
}

}  // namespace

cudaError_t decodeKernelShape(IODType io, CacheDType cache, int32_t headDim, int32_t warps, KernelShape& shape) {
    shape = KernelShape{0, 0};  // stays so for a width not compiled for the instance
    return dispatchDecode<UncompiledWidth::kSkip>(io, cache, headDim, warps, [&](auto family) -> cudaError_t {
        using F = decltype(family);
        shape = KernelShape{F::kThreads, F::kSmemBytes};
        return cudaSuccess;
    });
}

cudaError_t decodeKernelOccupancies(IODType io, CacheDType cache, int32_t headDim,
                                    int32_t (&ctasPerSm)[kNumDecodeWidths]) {
    int32_t const optin = deviceSharedMemoryOptin();
    bool any = false;
    for (int32_t i = 0; i < kNumDecodeWidths; ++i) {
        ctasPerSm[i] = 0;  // stays so for a width not compiled for the instance or not fitting the device
        cudaError_t const err = dispatchDecode<UncompiledWidth::kSkip>(
            io, cache, headDim, kDecodeWidthWarps[i], [&](auto family) -> cudaError_t {
                using F = decltype(family);
                if (optin > 0 && F::kSmemBytes > optin) return cudaSuccess;  // this width does not fit; another may
                any = true;
                return kernelSetup<F>.prepare(F::kernel(), F::kSmemBytes, F::kThreads, ctasPerSm[i], F::kName,
                                              headDim);
            });
        if (err != cudaSuccess) return err;
    }
    if (any) return cudaSuccess;
    // No width fits: the default width's refusal names the sizes and the GPU.
    int32_t unused = 0;
    return dispatchDecode(io, cache, headDim, decodeDefaultWidth(isCache8Bit(cache), headDim), [&](auto family) {
        using F = decltype(family);
        return kernelSetup<F>.prepare(F::kernel(), F::kSmemBytes, F::kThreads, unused, F::kName, headDim);
    });
}

cudaError_t launchDecodeKernel(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                               int32_t warps, dim3 grid, cudaStream_t stream) {
    return dispatchDecode(io, cache, headDim, warps, [&](auto family) -> cudaError_t {
        using F = decltype(family);
        int32_t ctasPerSm = 0;
        cudaError_t const err = kernelSetup<F>.prepare(F::kernel(), F::kSmemBytes, F::kThreads, ctasPerSm, F::kName,
                                                       headDim);
        if (err != cudaSuccess) return err;
        return launchProgrammaticDependent(F::kernel(), grid, dim3(F::kThreads), F::kSmemBytes, stream, kp);
    });
}

}  // namespace attn
}  // namespace pagedkv
