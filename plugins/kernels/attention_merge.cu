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

    float lseMax = negInf();
    for (int32_t z = lane; z < n; z += 32) lseMax = fmaxf(lseMax, p.partialLse[partialRow(p, z, token, head)]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) lseMax = fmaxf(lseMax, __shfl_xor_sync(0xffffffffu, lseMax, off));

    float acc[kDimsPerLane];
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) acc[d] = 0.f;
    float wsum = 0.f;
    if (lseMax != negInf()) {
        for (int32_t z = 0; z < n; ++z) {
            int64_t const prow = partialRow(p, z, token, head);
            float const wz = fastExp2(p.partialLse[prow] - lseMax);
            wsum += wz;
            float const* src = p.partialOut + prow * kD + lane * kDimsPerLane;
#pragma unroll
            for (int d = 0; d < kDimsPerLane; d += 2) {
                float2 const v = *reinterpret_cast<float2 const*>(src + d);
                acc[d] += wz * v.x;
                acc[d + 1] += wz * v.y;
            }
        }
    }
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
