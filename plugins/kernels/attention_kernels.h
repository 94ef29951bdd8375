// Internal interface between the attention launcher (attention_launch.cpp) and the kernel files
// (attention_decode.cu, attention_multi.cu, attention_merge.cu): the kernels' parameter struct, built once
// per launch from AttentionParams and the plan, and one launch function per kernel family.
//
// Legend: T tokens, B sequences, H query heads, KVH KV heads, G = H / KVH, D head dim,
//         Z partial chunk slots of the workspace (AttentionPlan::partialChunks).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention_schedule.h"
#include "pagedkv/attention.h"

namespace pagedkv {
namespace attn {

struct AttentionKernelParams {
    // ---- shapes
    int32_t numQHeads;   // H
    int32_t numKVHeads;  // KVH
    int32_t groupSize;   // G
    int32_t numSeqs;     // B
    int32_t numTokens;   // T
    // ---- inputs
    void const* q;              // [T, H * D] compute type, or e4m3 bytes when qFP8
    int32_t qFP8;
    int64_t const* poolDescs;   // [num_pools, kPoolDescFields] (device)
    int32_t poolIndex;
    int32_t const* blockTable;  // [B, MB]
    int32_t maxBlocks;          // MB
    int32_t const* cuQLens;     // [B + 1]
    int32_t const* pastLens;    // [B]
    // ---- pool
    KVLayout layout;
    int32_t layer;
    int32_t cacheIsFp8;         // 8-bit caches: 1 e4m3, 0 int8 (16-bit caches ignore it)
    // ---- attention. raw = q_stored . k_stored in the compute type; the true logit is raw * qScale * kScale *
    // softmaxScale. Logits live in the log2 domain (times log2 e) so that exp is one ex2.
    int32_t window;
    int32_t attentionSinks;
    int32_t useSoftcap;
    float scoreScaleLog2;   // no soft-cap: logit2 = raw * scoreScaleLog2
    float capInScale;       // soft-cap: logit2 = tanh(raw * capInScale) * capOutScaleLog2
    float capOutScaleLog2;
    float outScale;         // multiplies P*V: vScale of a quantized cache, else 1
    // ---- schedule
    SplitPlan split;
    // ---- outputs
    void* out;              // [T, H * D] compute type
    float* partialOut;      // [Z, T, H, D] chunk outputs, already normalized and scaled
    float* partialLse;      // [Z, T, H] chunk log2-sum-exp of the logits (-inf: the chunk saw nothing)

    PKV_HD StepView stepView() const {
        return StepView{cuQLens, pastLens, numSeqs, groupSize, window, attentionSinks};
    }
};

// Resident CTAs per SM of the instantiation serving (ioDType, cacheDType, headDim); sets its dynamic
// shared-memory limit on first use. Errors name the unsupported value.
cudaError_t decodeKernelOccupancy(IODType io, CacheDType cache, int32_t headDim, int32_t& ctasPerSm);
cudaError_t multiKernelOccupancy(IODType io, CacheDType cache, int32_t headDim, int32_t& ctasPerSm);

cudaError_t launchDecodeKernel(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                               dim3 grid, cudaStream_t stream);
cudaError_t launchMultiKernel(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                              dim3 grid, cudaStream_t stream);
cudaError_t launchMergeKernel(AttentionKernelParams const& kp, IODType io, int32_t headDim, dim3 grid,
                              cudaStream_t stream);

}  // namespace attn
}  // namespace pagedkv
