// Split-K merge: for every (token, head) row of a sequence whose span was cut into n > 1 chunks, combine the
// chunks' normalized partial outputs O_z with their log2-sum-exps L_z:
//   out = sum_z 2^(L_z - L_max) O_z / sum_z 2^(L_z - L_max)
// (a chunk that saw nothing has L_z = -inf and weight 0). Rows of unsplit sequences were written by the
// attention kernels and are left alone. The chunk count comes from the same function the attention kernels
// used (seqChunks), so the merge reads exactly the chunks that were written.
//
// One warp per row, lanes over the head dim; grid ceil(T * H / 4) CTAs of 4 warps.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_tile.cuh"

namespace pagedkv {
namespace attn {
namespace {

constexpr int kMergeWarps = 4;

// kN consecutive floats of a partial row (16-byte aligned for kN >= 4: rows are kD floats, kD % 64 == 0).
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
    constexpr int kDimsPerLane = kD / 32;  // 2, 4 or 8
    int32_t const lane = threadIdx.x & 31;
    int64_t const rowIndex = int64_t(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
    if (rowIndex >= int64_t(p.numTokens) * p.numQHeads) return;
    int32_t const token = int32_t(rowIndex / p.numQHeads);
    int32_t const head = int32_t(rowIndex % p.numQHeads);
    SeqInfo const s = makeSeqInfo(p.cuQLens, p.pastLens, seqOfToken(p.cuQLens, p.numSeqs, token));
    int32_t const n = seqChunks(p.split, s, p.groupSize, p.window, p.sinkTokens);
    if (n <= 1) return;

    // Pass 1: the largest LSE, lanes over chunks (n <= kMaxGridChunks).
    float lseMax = negInf();
    for (int32_t z = lane; z < n; z += 32) lseMax = fmaxf(lseMax, p.partialLse[partialRow(p, z, token, head)]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) lseMax = fmaxf(lseMax, __shfl_xor_sync(0xffffffffu, lseMax, off));

    // Pass 2: lane j computes the weight of chunk base + j (its LSE is an L1 hit from pass 1) and the warp
    // broadcasts it while all lanes read that chunk's row. The chunk loop is unrolled kInFlight deep with
    // independent loads, so a long split (1 x 32K: 32-64 chunks) costs a few L2 round trips, not one per chunk.
    constexpr int kInFlight = 8;
    float acc[kDimsPerLane];
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) acc[d] = 0.f;
    float wsum = 0.f;  // lane-partial: the weights of the chunks this lane computed
    if (lseMax != negInf()) {
        for (int32_t base = 0; base < n; base += 32) {
            int32_t const count = n - base < 32 ? n - base : 32;
            float const myWeight =
                lane < count ? fastExp2(p.partialLse[partialRow(p, base + lane, token, head)] - lseMax) : 0.f;
            wsum += myWeight;
            for (int32_t j0 = 0; j0 < count; j0 += kInFlight) {
                float part[kInFlight][kDimsPerLane];
                float wz[kInFlight];
#pragma unroll
                for (int u = 0; u < kInFlight; ++u) {
                    int32_t const j = j0 + u;
                    float const w = __shfl_sync(0xffffffffu, myWeight, j & 31);  // every lane shuffles
                    wz[u] = j < count ? w : 0.f;
                    if (j < count) {
                        float const* src = p.partialOut + partialRow(p, base + j, token, head) * kD + lane * kDimsPerLane;
                        loadPartial<kDimsPerLane>(src, part[u]);
                    } else {
#pragma unroll
                        for (int d = 0; d < kDimsPerLane; ++d) part[u][d] = 0.f;
                    }
                }
#pragma unroll
                for (int u = 0; u < kInFlight; ++u)
#pragma unroll
                    for (int d = 0; d < kDimsPerLane; ++d) acc[d] += wz[u] * part[u][d];
            }
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
    float const inv = wsum > 0.f ? 1.f / wsum : 0.f;
    CT* const dst = static_cast<CT*>(p.out) + (int64_t(token) * p.numQHeads + head) * kD + lane * kDimsPerLane;
#pragma unroll
    for (int d = 0; d < kDimsPerLane; d += 2)
        *reinterpret_cast<uint32_t*>(dst + d) = Mma<CT>::pack(acc[d] * inv, acc[d + 1] * inv);
}

}  // namespace

cudaError_t launchMergeKernel(AttentionKernelParams const& kp, IODType io, int32_t headDim, dim3 grid,
                              cudaStream_t stream) {
    // The merge depends only on the output type and the head dim: dispatch as a 16-bit cache.
    return dispatchAttention(io, false, headDim, [&](auto ct, auto, auto d) -> cudaError_t {
        using CT = typename decltype(ct)::type;
        constexpr int kD = decltype(d)::value;
        attentionMergeKernel<CT, kD><<<grid, kMergeWarps * 32, 0, stream>>>(kp);
        return cudaGetLastError();
    });
}

}  // namespace attn
}  // namespace pagedkv
