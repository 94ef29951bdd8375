// Split-K merge: for every (token, head) row of a sequence whose span was cut into n > 1 chunks, combine the
// chunks' normalized partial outputs O_z with their log2-sum-exps L_z:
//   out = sum_z 2^(L_z - M) O_z / sum_z 2^(L_z - M)   (any M; a chunk that saw nothing has L_z = -inf, weight 0)
// Rows of unsplit sequences were written by the attention kernels and are left alone. The chunk count comes
// from the same function the attention kernels used (seqChunks), so the merge reads exactly the chunks that
// were written.
//
// One CTA of 4 warps per row (grid T * H); warp w takes chunks w, w + 4, ..., kInFlight of them per batch,
// lanes over the head dim (D / 32 dims each for D = 64, 128, 256; 4 dims on the first D / 4 lanes otherwise).
// A batch loads its chunks' LSEs and partial rows together (all independent) and folds them into a running
// (max, sum, acc) like an online softmax, so a 32-chunk split (1 x 32K) costs ONE L2 round trip per warp after
// the dependency wait, not one for the LSE max plus one per 8 chunks. The 4 warps' states are combined in
// shared memory.
//
// Programmatic dependent launch (sm_90+, pdl.cuh): the launcher may start this kernel while the attention kernel
// before it is still running (attention_launch.cpp); everything before gridDependencyWait() reads only the step
// metadata, which the kernels before the attention kernels produced: an attention kernel lets this one start only
// after every one of its CTAs has passed its own gridDependencyWait(), so those kernels have completed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_tile.cuh"
#include "pdl.cuh"

namespace pagedkv {
namespace attn {
namespace {

constexpr int kMergeWarps = 4;  // per CTA; the plan launches one CTA per (token, head) row

// kN consecutive floats of a partial row (16-byte aligned for kN % 4 == 0: rows are kD floats, kD % 16 == 0).
template <int kN>
__device__ __forceinline__ void loadPartial(float const* src, float (&x)[kN]) {
    if constexpr (kN % 4 == 0) {
#pragma unroll
        for (int d = 0; d < kN; d += 4) {
            float4 const v = *reinterpret_cast<float4 const*>(src + d);
            x[d] = v.x, x[d + 1] = v.y, x[d + 2] = v.z, x[d + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int d = 0; d < kN; d += 2) {
            float2 const v = *reinterpret_cast<float2 const*>(src + d);
            x[d] = v.x, x[d + 1] = v.y;
        }
    }
}

template <typename CT, int kD>
__global__ void __launch_bounds__(kMergeWarps * 32) attentionMergeKernel(__grid_constant__ AttentionKernelParams const p) {
    constexpr int kDimsPerLane = kD % 64 == 0 ? kD / 32 : 4;  // 2, 4 or 8; 4 (D = 32, 80, 96)
    constexpr int kLanes = kD / kDimsPerLane;                  // lanes with dims: 32, or 8, 20, 24
    static_assert(kD % kDimsPerLane == 0 && kLanes <= 32, "a warp covers the head dim");
    constexpr int kInFlight = 8;  // chunks per warp and batch: 32 per CTA
    __shared__ float sAcc[kMergeWarps][kD];
    __shared__ float sMax[kMergeWarps];
    __shared__ float sSum[kMergeWarps];

    int32_t const tid = threadIdx.x;
    int32_t const lane = tid & 31;
    int32_t const warp = tid >> 5;
    bool const laneHasDims = kLanes == 32 || lane < kLanes;
    int64_t const rowIndex = blockIdx.x;
    if (rowIndex >= int64_t(p.params.meta.numTokens) * p.params.numQHeads) return;  // uniform per CTA
    int32_t const token = int32_t(rowIndex / p.params.numQHeads);
    int32_t const head = int32_t(rowIndex % p.params.numQHeads);
    StepMetadata const& meta = p.params.meta;
    SeqInfo const s = makeSeqInfo(meta.cuQLens, meta.pastLens, seqOfToken(meta.cuQLens, meta.numSeqs, token));
    int32_t const n = seqChunks(p.split, s, p.groupSize, p.params.window, p.params.attentionSinks);
    if (n <= 1) return;  // uniform per CTA; exiting before the wait reads nothing the attention kernel writes

    gridDependencyWait();  // the partials are complete and visible from here on

    // This warp's running state over its chunks: m (log2 domain, uniform over the warp), sum of weights
    // relative to m, and acc = sum of weight x partial row (this lane's dims).
    float m = negInf();
    float wsum = 0.f;
    float acc[kDimsPerLane];
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) acc[d] = 0.f;
    for (int32_t base = warp; base < n; base += kMergeWarps * kInFlight) {
        float lse[kInFlight];
        float part[kInFlight][kDimsPerLane];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {  // independent loads: one round trip for the batch
            int32_t const z = base + u * kMergeWarps;
            if (z < n && laneHasDims) {
                int64_t const prow = partialRow(p, z, token, head);
                lse[u] = p.partialLse[prow];
                loadPartial<kDimsPerLane>(p.partialOut + prow * kD + lane * kDimsPerLane, part[u]);
            } else if (z < n) {  // a lane past the head dim: the chunk's LSE only
                lse[u] = p.partialLse[partialRow(p, z, token, head)];
#pragma unroll
                for (int d = 0; d < kDimsPerLane; ++d) part[u][d] = 0.f;
            } else {
                lse[u] = negInf();
#pragma unroll
                for (int d = 0; d < kDimsPerLane; ++d) part[u][d] = 0.f;
            }
        }
        float mNew = m;
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) mNew = fmaxf(mNew, lse[u]);
        float const mUse = mNew == negInf() ? 0.f : mNew;  // nothing seen yet: every weight is exp2(-inf) = 0
        float const alpha = fastExp2(m - mUse);            // 0 while m is -inf
        wsum *= alpha;
#pragma unroll
        for (int d = 0; d < kDimsPerLane; ++d) acc[d] *= alpha;
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
            float const wz = fastExp2(lse[u] - mUse);  // 0 for -inf (an empty chunk or a slot past n)
            wsum += wz;
#pragma unroll
            for (int d = 0; d < kDimsPerLane; ++d) acc[d] = fmaf(wz, part[u][d], acc[d]);
        }
        m = mNew;
    }

    // ---- combine the warps (a warp with no chunk has m = -inf, wsum = 0, acc = 0)
    if (laneHasDims) {
#pragma unroll
        for (int d = 0; d < kDimsPerLane; ++d) sAcc[warp][lane * kDimsPerLane + d] = acc[d];
    }
    if (lane == 0) sMax[warp] = m, sSum[warp] = wsum;
    __syncthreads();
    float mAll = negInf();
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) mAll = fmaxf(mAll, sMax[w]);
    float const mUse = mAll == negInf() ? 0.f : mAll;
    float f[kMergeWarps];
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) {
        f[w] = fastExp2(sMax[w] - mUse);
        total += f[w] * sSum[w];
    }
    float const inv = total > 0.f ? 1.f / total : 0.f;  // every chunk saw nothing: 0, never 0/0
    CT* const dst = static_cast<CT*>(p.params.out) + (int64_t(token) * p.params.numQHeads + head) * kD;
    for (int32_t i = tid; i < kD / 2; i += kMergeWarps * 32) {
        float x0 = 0.f, x1 = 0.f;
#pragma unroll
        for (int w = 0; w < kMergeWarps; ++w) {
            x0 = fmaf(f[w], sAcc[w][2 * i], x0);
            x1 = fmaf(f[w], sAcc[w][2 * i + 1], x1);
        }
        *reinterpret_cast<uint32_t*>(dst + 2 * i) = Mma<CT>::pack(x0 * inv, x1 * inv);
    }
}

}  // namespace

cudaError_t launchMergeKernel(AttentionKernelParams const& kp, IODType io, int32_t headDim, dim3 grid,
                              cudaStream_t stream) {
    // The merge depends only on the output type and the head dim: dispatch as a 16-bit cache.
    return dispatchAttention(io, false, headDim, [&](auto ct, auto, auto d) -> cudaError_t {
        using CT = typename decltype(ct)::type;
        constexpr int kD = decltype(d)::value;
        return launchProgrammaticDependent(attentionMergeKernel<CT, kD>, grid, dim3(kMergeWarps * 32), 0, stream, kp);
    });
}

}  // namespace attn
}  // namespace pagedkv
